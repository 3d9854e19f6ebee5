//! Small Qwen3.5-MoE checkpoints the checkpoint tests write themselves: hidden 32, 4 layers
//! (layers 1 and 3 full attention), 4 experts of width 16, vocabulary 64, optionally the
//! vision-language wrapper (`model.language_model.` prefix, a vision tensor, processor files)
//! and an MTP layer; random BF16 weights from a seed. Plus helpers to read every tensor back,
//! write an edited copy, and run the `fp4spec` program.

#![allow(dead_code)]

use fp4spec::formats::safetensors::{Checkpoint, PlannedTensor, ShardWriter, TensorHeaders};
use fp4spec::rng::SplitMix64;
use half::bf16;
use safetensors::Dtype;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;

pub const HIDDEN: usize = 32;
pub const VOCAB: usize = 64;
pub const EXPERTS: usize = 4;
pub const MOE: usize = 16;
pub const LAYERS: usize = 4;

/// One tensor with its bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct T {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl T {
    pub fn bf16(name: impl Into<String>, shape: &[usize], values: &[f32]) -> Self {
        Self {
            name: name.into(),
            dtype: Dtype::BF16,
            shape: shape.to_vec(),
            data: values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
        }
    }

    pub fn f32_values(&self) -> Vec<f32> {
        match self.dtype {
            Dtype::BF16 => self
                .data
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::F32 => self
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            other => panic!("{}: {other} is not float", self.name),
        }
    }
}

/// What the fixture holds.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    /// The vision-language wrapper (prefix, text_config, a vision tensor, processor files).
    pub vl: bool,
    /// Fused 3-D experts in the main layers (else per expert).
    pub fused: bool,
    /// `mtp.*` tensors present.
    pub mtp_tensors: bool,
    /// MTP layers the config declares.
    pub mtp_config: usize,
    /// Random seed of the weights.
    pub seed: u64,
}

impl Spec {
    /// The Qwen3.6 layout: VL wrapper, fused experts, one MTP layer.
    pub fn qwen36() -> Self {
        Self {
            vl: true,
            fused: true,
            mtp_tensors: true,
            mtp_config: 1,
            seed: 1,
        }
    }

    pub fn prefix(&self) -> &'static str {
        if self.vl {
            "model.language_model."
        } else {
            "model."
        }
    }
}

pub fn text_config(spec: &Spec) -> serde_json::Value {
    json!({
        "model_type": "qwen3_5_moe_text",
        "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "full_attention_interval": 2,
        "num_experts": EXPERTS, "num_experts_per_tok": 2,
        "moe_intermediate_size": MOE, "shared_expert_intermediate_size": MOE,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6, "mtp_num_hidden_layers": spec.mtp_config
    })
}

pub fn config_json(spec: &Spec) -> serde_json::Value {
    if spec.vl {
        json!({
            "model_type": "qwen3_5_moe",
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "tie_word_embeddings": false,
            "text_config": text_config(spec),
            "vision_config": {"depth": 1, "hidden_size": 16},
        })
    } else {
        text_config(spec)
    }
}

/// Appends one random tensor (name, shape) to the list.
type WeightMaker<'a> = dyn FnMut(&mut Vec<T>, String, &[usize]) + 'a;

/// Every tensor of the fixture, random N(0, 0.05) weights (norms around 1).
pub fn tensors(spec: &Spec) -> Vec<T> {
    let mut rng = SplitMix64::new(spec.seed);
    let mut v = Vec::new();
    let p = spec.prefix();
    let mut w = |v: &mut Vec<T>, name: String, shape: &[usize]| {
        let n: usize = shape.iter().product();
        let values = rng.normal_vec(n, 0.05);
        v.push(T::bf16(name, shape, &values));
    };
    let h = HIDDEN;
    w(&mut v, format!("{p}embed_tokens.weight"), &[VOCAB, h]);
    w(&mut v, format!("{p}norm.weight"), &[h]);
    w(&mut v, "lm_head.weight".into(), &[VOCAB, h]);
    let layer = |v: &mut Vec<T>, w: &mut WeightMaker<'_>, p: String, full: bool, fused: bool| {
        w(v, format!("{p}input_layernorm.weight"), &[h]);
        w(v, format!("{p}post_attention_layernorm.weight"), &[h]);
        if full {
            w(v, format!("{p}self_attn.q_proj.weight"), &[64, h]);
            w(v, format!("{p}self_attn.k_proj.weight"), &[16, h]);
            w(v, format!("{p}self_attn.v_proj.weight"), &[16, h]);
            w(v, format!("{p}self_attn.o_proj.weight"), &[h, 32]);
            w(v, format!("{p}self_attn.q_norm.weight"), &[16]);
            w(v, format!("{p}self_attn.k_norm.weight"), &[16]);
        } else {
            let a = format!("{p}linear_attn.");
            for (name, shape) in [
                ("in_proj_qkv.weight", vec![64, h]),
                ("in_proj_z.weight", vec![32, h]),
                ("in_proj_b.weight", vec![2, h]),
                ("in_proj_a.weight", vec![2, h]),
                ("conv1d.weight", vec![64, 1, 4]),
                ("dt_bias", vec![2]),
                ("A_log", vec![2]),
                ("norm.weight", vec![16]),
                ("out_proj.weight", vec![h, 32]),
            ] {
                w(v, format!("{a}{name}"), &shape);
            }
        }
        let m = format!("{p}mlp.");
        w(v, format!("{m}gate.weight"), &[EXPERTS, h]);
        if fused {
            w(
                v,
                format!("{m}experts.gate_up_proj"),
                &[EXPERTS, 2 * MOE, h],
            );
            w(v, format!("{m}experts.down_proj"), &[EXPERTS, h, MOE]);
        } else {
            for e in 0..EXPERTS {
                w(v, format!("{m}experts.{e}.gate_proj.weight"), &[MOE, h]);
                w(v, format!("{m}experts.{e}.up_proj.weight"), &[MOE, h]);
                w(v, format!("{m}experts.{e}.down_proj.weight"), &[h, MOE]);
            }
        }
        w(v, format!("{m}shared_expert.gate_proj.weight"), &[MOE, h]);
        w(v, format!("{m}shared_expert.up_proj.weight"), &[MOE, h]);
        w(v, format!("{m}shared_expert.down_proj.weight"), &[h, MOE]);
        w(v, format!("{m}shared_expert_gate.weight"), &[1, h]);
    };
    for i in 0..LAYERS {
        layer(
            &mut v,
            &mut w,
            format!("{p}layers.{i}."),
            i % 2 == 1,
            spec.fused,
        );
    }
    if spec.mtp_tensors {
        w(&mut v, "mtp.fc.weight".into(), &[h, 2 * h]);
        for norm in [
            "mtp.pre_fc_norm_embedding.weight",
            "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight",
        ] {
            w(&mut v, norm.into(), &[h]);
        }
        layer(&mut v, &mut w, "mtp.layers.0.".into(), true, false);
    }
    if spec.vl {
        w(
            &mut v,
            "model.visual.patch_embed.proj.weight".into(),
            &[16, 3, 2, 2],
        );
        w(
            &mut v,
            "model.visual.blocks.0.attn.qkv.weight".into(),
            &[48, 16],
        );
    }
    v
}

/// Writes `tensors` into `dir`: `model.safetensors` for one shard, else `shards` shards named
/// as Hugging Face names them and an index.
pub fn write_tensors(dir: &Path, tensors: &[T], shards: usize) {
    let per = tensors.len().div_ceil(shards.max(1));
    let mut weight_map = BTreeMap::new();
    let mut total = 0usize;
    for (i, chunk) in tensors.chunks(per.max(1)).enumerate() {
        let name = if shards <= 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, shards)
        };
        let planned: Vec<PlannedTensor> = chunk
            .iter()
            .map(|t| PlannedTensor::new(&t.name, t.dtype, t.shape.clone()))
            .collect();
        let mut writer =
            ShardWriter::create(dir.join(&name), &planned, None).expect("create shard");
        for t in chunk {
            writer.write(&t.name, &t.data).expect("write tensor");
            weight_map.insert(t.name.clone(), name.clone());
            total += t.data.len();
        }
        writer.finish().expect("finish shard");
    }
    if shards > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index).expect("json"),
        )
        .expect("write index");
    }
}

pub fn write_json(path: &Path, value: &serde_json::Value) {
    std::fs::write(path, serde_json::to_string_pretty(value).expect("json")).expect("write json");
}

/// A complete fixture checkpoint in `dir` (created): config, weights in `shards` shards, a
/// tokenizer file, and for the VL wrapper the processor files.
pub fn write_checkpoint(dir: &Path, spec: &Spec, shards: usize) -> Vec<T> {
    std::fs::create_dir_all(dir).expect("mkdir");
    write_json(&dir.join("config.json"), &config_json(spec));
    std::fs::write(dir.join("tokenizer.json"), "{\"fixture\": true}").expect("tokenizer");
    if spec.vl {
        for file in [
            "preprocessor_config.json",
            "processor_config.json",
            "video_preprocessor_config.json",
        ] {
            std::fs::write(dir.join(file), "{}").expect("processor file");
        }
    }
    let tensors = tensors(spec);
    write_tensors(dir, &tensors, shards);
    tensors
}

/// Every tensor of the checkpoint in `dir`, in name order.
pub fn read_all(dir: &Path) -> Vec<T> {
    let checkpoint = Checkpoint::open(dir).expect("open checkpoint");
    checkpoint
        .tensor_names()
        .into_iter()
        .map(|name| {
            let t = checkpoint.tensor(name).expect("tensor");
            T {
                name: name.to_string(),
                dtype: t.dtype,
                shape: t.shape.to_vec(),
                data: t.data.to_vec(),
            }
        })
        .collect()
}

/// A copy of checkpoint `from` in `to` with its tensors replaced by `edit(tensors)`, in one
/// shard; the config and quantisation files are copied.
pub fn edited_copy(from: &Path, to: &Path, edit: impl FnOnce(&mut Vec<T>)) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("list") {
        let entry = entry.expect("entry");
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".json") && name != "model.safetensors.index.json" {
            std::fs::copy(entry.path(), to.join(&name)).expect("copy");
        }
    }
    let mut tensors = read_all(from);
    edit(&mut tensors);
    write_tensors(to, &tensors, 1);
}

/// Runs the `fp4spec` program: (exit code, stdout, stderr).
pub fn fp4spec(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fp4spec"))
        .args(args)
        .output()
        .expect("run fp4spec");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The files in `dir`, sorted.
pub fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Whether the checkpoint in `dir` has tensor `name`.
pub fn has(dir: &Path, name: &str) -> bool {
    Checkpoint::open(dir).expect("open").contains(name)
}

/// The header of `name` in `dir`: (dtype, shape).
pub fn header(dir: &Path, name: &str) -> (Dtype, Vec<usize>) {
    let c = Checkpoint::open(dir).expect("open");
    let h = c.expect_header(name).expect("header");
    (h.dtype, h.shape.to_vec())
}
