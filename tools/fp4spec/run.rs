//! `fp4spec logits`, `fp4spec generate` and `fp4spec demo`: the model runner from the command
//! line.

use crate::Failure;
use clap::Args;
use fp4spec::backend::{Backend, BackendKind};
use fp4spec::kernels::attention::KvFormat;
use fp4spec::kernels::gemm::Nvfp4Mode;
use fp4spec::kernels::verify::reference::SamplingParams;
use fp4spec::model::cache::SequenceCache;
use fp4spec::model::device::{DeviceModel, generate_greedy};
use fp4spec::model::forward::{ForwardInput, Model, MtpInput};
use fp4spec::model::generate::{self, Generation, Request};
use fp4spec::model::tokenizer::ByteTokenizer;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The embedded demo model (tools/reference/train_demo.py), the default of every model command.
const DEMO_MODEL: &str = "models/qwen35-moe-demo";

/// The demo folder beside the manifest when built here, else relative to the working directory.
fn demo_model() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join(DEMO_MODEL);
    if built.exists() {
        built
    } else {
        PathBuf::from(DEMO_MODEL)
    }
}

#[derive(Args)]
pub struct ModelArgs {
    /// Checkpoint folder (config.json + safetensors); default: the embedded demo model.
    #[arg(long)]
    model: Option<PathBuf>,
    /// auto, cpu or cuda. auto and cpu run the CPU runner (the kernel families' references,
    /// MTP speculation and sampling); cuda runs `generate` on the device path (greedy, with
    /// `--spec-tokens` MTP drafts: `fp4spec::model::device`); `logits` and `demo` are CPU only.
    #[arg(long, default_value = "auto")]
    backend: String,
}

/// Where a model command runs.
enum RunOn {
    /// The CPU runner.
    Runner,
    /// The device path on CUDA.
    Cuda,
}

impl ModelArgs {
    fn run_on(&self) -> Result<RunOn, Failure> {
        match self.backend.as_str() {
            "auto" | "cpu" => Ok(RunOn::Runner),
            "cuda" => Ok(RunOn::Cuda),
            other => Err(Failure::Input(format!(
                "--backend `{other}` is not one of auto, cpu, cuda"
            ))),
        }
    }

    /// The model for a command that runs on the CPU runner only.
    fn load(&self) -> Result<(Model, Option<ByteTokenizer>, PathBuf), Failure> {
        if let RunOn::Cuda = self.run_on()? {
            return Err(Failure::Input(
                "--backend cuda: logits and demo run the CPU runner; `generate --backend cuda` \
                 runs the device path"
                    .into(),
            ));
        }
        self.load_checkpoint()
    }

    fn load_checkpoint(&self) -> Result<(Model, Option<ByteTokenizer>, PathBuf), Failure> {
        let dir = self.model.clone().unwrap_or_else(demo_model);
        let model = Model::load(&dir)?;
        let tokenizer = ByteTokenizer::load(&dir, model.config.vocab_size)?;
        Ok((model, tokenizer, dir))
    }
}

fn parse_ids(text: &str) -> Result<Vec<u32>, Failure> {
    text.split(',')
        .map(|s| {
            s.trim()
                .parse::<u32>()
                .map_err(|_| Failure::Input(format!("--ids: `{s}` is not a token id")))
        })
        .collect()
}

#[derive(Args)]
pub struct LogitsArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Input token ids, comma-separated.
    #[arg(long)]
    ids: String,
    /// Also the MTP head's logits: one row per position p < T-1 from (ids[p+1], hidden at p).
    #[arg(long)]
    mtp: bool,
    /// Write the JSON here instead of standard output.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// `fp4spec logits`: `{"vocab_size", "logits": [row per position], "mtp_logits": [...]}`.
pub fn logits(args: LogitsArgs) -> Result<(), Failure> {
    let ids = parse_ids(&args.ids)?;
    if ids.is_empty() {
        return Err(Failure::Input("--ids: at least one token".into()));
    }
    let (model, _, _) = args.model.load()?;
    let (v, h) = (model.config.vocab_size, model.config.hidden_size);
    let mut cache = SequenceCache::new(&model.config);
    let out = model
        .forward(&mut [ForwardInput {
            cache: &mut cache,
            tokens: &ids,
            record: false,
            all_logits: true,
        }])?
        .remove(0);
    let rows = |flat: &[f32]| -> Vec<Vec<f32>> { flat.chunks(v).map(<[f32]>::to_vec).collect() };
    let mut json = serde_json::json!({"vocab_size": v, "logits": rows(&out.logits)});
    if args.mtp {
        let t = ids.len();
        let mtp_rows = if t > 1 {
            let mtp = model
                .mtp_forward(&mut [MtpInput {
                    cache: &mut cache,
                    tokens: &ids[1..],
                    hidden: &out.hidden[..(t - 1) * h],
                    layer: 0,
                }])?
                .remove(0);
            rows(&mtp.logits)
        } else {
            Vec::new()
        };
        json["mtp_logits"] = serde_json::json!(mtp_rows);
    }
    let text = json.to_string();
    match &args.out {
        Some(path) => std::fs::write(path, text + "\n")
            .map_err(|e| Failure::Input(format!("{}: {e}", path.display()))),
        None => {
            println!("{text}");
            Ok(())
        }
    }
}

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt token ids, comma-separated.
    #[arg(long, conflicts_with = "prompt", required_unless_present = "prompt")]
    ids: Option<String>,
    /// Prompt text (needs a checkpoint with a tokenizer).
    #[arg(long)]
    prompt: Option<String>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// MTP draft tokens per step (0: plain decoding).
    #[arg(long, default_value_t = 0)]
    spec_tokens: usize,
    /// How the device path's KV caches store keys and values: bf16, or fp8 (float8_e4m3fn with
    /// unit scales, half the bytes). --backend cuda only (the CPU runner keeps f32 caches).
    #[arg(long, default_value = "bf16")]
    kv_cache: String,
    /// How the device path multiplies the checkpoint's NVFP4 linears: w4a16 (bf16 activations,
    /// every target) or w4a4 (activations quantised with each linear's input_scale, on the
    /// block-scaled FP4 MMA: GB10 only); experts run w4a16 either way. --backend cuda only.
    #[arg(long, default_value = "w4a16")]
    nvfp4: String,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Keep the k most probable tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep the smallest most-probable set of this mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep tokens of at least this times the top probability (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// `ID=BIAS` added to a token's logit (repeatable).
    #[arg(long = "logit-bias", value_name = "ID=BIAS")]
    logit_bias: Vec<String>,
    /// Sampling seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

fn parse_bias(items: &[String]) -> Result<Vec<(u32, f32)>, Failure> {
    items
        .iter()
        .map(|item| {
            let bad = || Failure::Input(format!("--logit-bias `{item}`: expected ID=BIAS"));
            let (id, bias) = item.split_once('=').ok_or_else(bad)?;
            Ok((
                id.trim().parse().map_err(|_| bad())?,
                bias.trim().parse().map_err(|_| bad())?,
            ))
        })
        .collect()
}

/// What one generation reports, in text or JSON.
fn report(
    generation: &Generation,
    tokenizer: Option<&ByteTokenizer>,
    seconds: f64,
    json: bool,
    place: &str,
) -> String {
    let rates = generation.acceptance.rates();
    let tokens_per_s = generation.tokens.len() as f64 / seconds.max(1e-9);
    let text = tokenizer.map(|t| t.decode(&generation.tokens));
    if json {
        return serde_json::json!({
            "ids": generation.tokens,
            "text": text,
            "finish_reason": generation.finish_reason.as_str(),
            "forwards": generation.forwards,
            "drafted": generation.drafted(),
            "accepted": generation.accepted(),
            "acceptance_per_position": rates,
            "tokens_per_forward": generation.tokens_per_forward(),
            "tokens_per_second": tokens_per_s,
        })
        .to_string();
    }
    let mut out = String::new();
    match text {
        Some(text) => out.push_str(&format!("text: {text:?}\n")),
        None => out.push_str(&format!("ids: {:?}\n", generation.tokens)),
    }
    let drafted = generation.drafted();
    out.push_str(&format!(
        "{} tokens, finish_reason {}, {} forwards, {:.2} tokens per forward, {tokens_per_s:.0} tokens/s ({place})",
        generation.tokens.len(),
        generation.finish_reason.as_str(),
        generation.forwards,
        generation.tokens_per_forward(),
    ));
    if drafted > 0 {
        let per_position: Vec<String> = rates
            .iter()
            .enumerate()
            .map(|(i, r)| format!("{}: {:.2}", i + 1, r))
            .collect();
        out.push_str(&format!(
            "\ndrafted {drafted}, accepted {} ({:.1}%), acceptance by draft position: {}",
            generation.accepted(),
            100.0 * generation.accepted() as f64 / drafted as f64,
            per_position.join("  ")
        ));
    }
    out
}

/// `fp4spec generate`.
pub fn generate(args: GenerateArgs) -> Result<(), Failure> {
    let on = args.model.run_on()?;
    let kv_format = KvFormat::parse(&args.kv_cache)?;
    let nvfp4: Nvfp4Mode = args.nvfp4.parse()?;
    if matches!(on, RunOn::Runner) && nvfp4 != Nvfp4Mode::W4a16 {
        return Err(Failure::Input(format!(
            "--nvfp4 {}: the CPU runner multiplies dequantised weights (W4A16); the device path \
             (--backend cuda) takes w4a4",
            args.nvfp4
        )));
    }
    if matches!(on, RunOn::Runner) && kv_format != KvFormat::Bf16 {
        return Err(Failure::Input(format!(
            "--kv-cache {}: the CPU runner keeps f32 caches; the device path (--backend cuda) \
             stores them in e4m3",
            args.kv_cache
        )));
    }
    if matches!(on, RunOn::Cuda) && (args.temperature != 0.0 || !args.logit_bias.is_empty()) {
        return Err(Failure::Input(
            "--backend cuda decodes greedily: --temperature 0 and no --logit-bias (sampling runs \
             on --backend cpu)"
                .into(),
        ));
    }
    let (model, tokenizer, dir) = args.model.load_checkpoint()?;
    let prompt = match (&args.ids, &args.prompt) {
        (Some(ids), _) => parse_ids(ids)?,
        (None, Some(text)) => tokenizer
            .as_ref()
            .ok_or_else(|| {
                Failure::Input(format!(
                    "--prompt: {} has no tokenizer ({}); pass --ids",
                    dir.display(),
                    fp4spec::model::tokenizer::TOKENIZER_FILE
                ))
            })?
            .encode(text),
        (None, None) => return Err(Failure::Input("--ids or --prompt is required".into())),
    };
    let mut stop_tokens = model.config.eos_token_ids.clone();
    stop_tokens.extend(tokenizer.as_ref().and_then(|t| t.eos));
    let request = Request {
        prompt,
        max_new_tokens: args.max_new_tokens,
        params: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            logit_bias: parse_bias(&args.logit_bias)?,
            seed: args.seed,
        },
        stop_tokens,
    };
    let requests = std::slice::from_ref(&request);
    let (generation, seconds, place) = match on {
        RunOn::Runner => {
            let start = Instant::now();
            let generation = generate::generate(&model, requests, args.spec_tokens)?.remove(0);
            (generation, start.elapsed().as_secs_f64(), "CPU")
        }
        RunOn::Cuda => {
            let backend = Backend::new(BackendKind::Cuda)?;
            let mut device = DeviceModel::from_model_with(&backend, &model, nvfp4)?;
            device.set_kv_format(kv_format);
            // timed from the prefill: what the device path does, not the upload
            let start = Instant::now();
            let generation = generate_greedy(&device, requests, args.spec_tokens)?.remove(0);
            (
                generation,
                start.elapsed().as_secs_f64(),
                "CUDA device path",
            )
        }
    };
    println!(
        "{}",
        report(&generation, tokenizer.as_ref(), seconds, args.json, place)
    );
    Ok(())
}

#[derive(Args)]
pub struct DemoArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Tokens to generate per prompt.
    #[arg(long, default_value_t = 160)]
    max_new_tokens: usize,
}

/// The demo prompts: one code-like, one prose-like (the demo model was trained on both kinds).
const DEMO_PROMPTS: [(&str, &str); 2] = [
    ("code", "def update_score(limit, step):\n    total = 0\n"),
    (
        "prose",
        "At dusk, the old sailor crossed the narrow bridge. ",
    ),
];

/// Sampling controls of the demo's sampled runs.
const DEMO_TEMPERATURE: f32 = 0.8;
const DEMO_SEED: u64 = 1;
const DEMO_SAMPLED_DRAFTS: usize = 2;

/// `fp4spec demo`: greedy generation on the demo model's code-like and prose-like prompts
/// without speculation and with 1, 2 and 3 MTP drafts; checks the outputs agree and prints
/// acceptance by draft position and tokens per forward; then one sampled run per prompt with 2
/// drafts.
pub fn demo(args: DemoArgs) -> Result<(), Failure> {
    let (model, tokenizer, dir) = args.model.load()?;
    let tokenizer = tokenizer
        .ok_or_else(|| Failure::Input(format!("{}: the demo needs a tokenizer", dir.display())))?;
    println!("model: {} (CPU reference runner)", dir.display());
    let mut mismatches = 0;
    for (kind, prompt) in DEMO_PROMPTS {
        let request = Request {
            prompt: tokenizer.encode(prompt),
            max_new_tokens: args.max_new_tokens,
            params: SamplingParams {
                temperature: 0.0,
                ..SamplingParams::default()
            },
            stop_tokens: tokenizer.eos.into_iter().collect(),
        };
        println!("\n== {kind} prompt {prompt:?}");
        let mut plain: Option<Vec<u32>> = None;
        for n in [0, 1, 2, 3] {
            let start = Instant::now();
            let generation =
                generate::generate(&model, std::slice::from_ref(&request), n)?.remove(0);
            let seconds = start.elapsed().as_secs_f64();
            println!("-- spec tokens {n}");
            match &plain {
                None => {
                    println!(
                        "{}",
                        report(&generation, Some(&tokenizer), seconds, false, "CPU")
                    );
                    plain = Some(generation.tokens.clone());
                }
                Some(reference) => {
                    let same = *reference == generation.tokens;
                    mismatches += usize::from(!same);
                    let mut line = report(&generation, Some(&tokenizer), seconds, false, "CPU");
                    // the text is the plain run's when equal: print the statistics only
                    if same {
                        line = line.lines().skip(1).collect::<Vec<_>>().join("\n");
                        line.push_str("\noutput identical to plain greedy decoding");
                    } else {
                        line.push_str("\nOUTPUT DIFFERS from plain greedy decoding");
                    }
                    println!("{line}");
                }
            }
        }
    }
    println!(
        "\n== sampled (temperature {DEMO_TEMPERATURE}, seed {DEMO_SEED}), {DEMO_SAMPLED_DRAFTS} drafts: \
         the output follows the model's distribution (token equality holds for greedy only)"
    );
    for (kind, prompt) in DEMO_PROMPTS {
        let request = Request {
            prompt: tokenizer.encode(prompt),
            max_new_tokens: args.max_new_tokens,
            params: SamplingParams {
                temperature: DEMO_TEMPERATURE,
                seed: DEMO_SEED,
                ..SamplingParams::default()
            },
            stop_tokens: tokenizer.eos.into_iter().collect(),
        };
        let start = Instant::now();
        let generation =
            generate::generate(&model, std::slice::from_ref(&request), DEMO_SAMPLED_DRAFTS)?
                .remove(0);
        println!("-- {kind}");
        println!(
            "{}",
            report(
                &generation,
                Some(&tokenizer),
                start.elapsed().as_secs_f64(),
                false,
                "CPU"
            )
        );
    }
    if mismatches > 0 {
        return Err(Failure::Check(format!(
            "{mismatches} speculative runs differ from plain greedy decoding"
        )));
    }
    Ok(())
}
