//! The model commands from the outside: `fp4spec logits` and `generate` on a fixture, and bad
//! checkpoints (a missing tensor, a wrong shape, `mtp.fc.weight` missing beside `mtp.layers.*`,
//! an unknown model_type) refused with exit status 2 and a message naming the problem.

use safetensors::tensor::TensorView;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn fp4spec(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fp4spec"))
        .args(args)
        .output()
        .expect("run fp4spec");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A copy of the text fixture in `dir` with its tensors passed through `edit` (return `None` to
/// drop a tensor, or new bytes and shape) and its config through `config`.
fn broken_copy(
    dir: &Path,
    edit: impl Fn(&str, &[usize]) -> Option<Option<Vec<usize>>>,
    config: impl Fn(String) -> String,
) {
    let src = fixture("qwen35_text");
    let bytes = std::fs::read(src.join("model.safetensors")).expect("fixture shard");
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("fixture parses");
    let mut owned: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in file.tensors() {
        match edit(&name, view.shape()) {
            None => {}
            Some(None) => owned.push((
                name,
                view.dtype(),
                view.shape().to_vec(),
                view.data().to_vec(),
            )),
            Some(Some(shape)) => {
                let len = shape.iter().product::<usize>() * view.dtype().bitsize() / 8;
                owned.push((name, view.dtype(), shape, vec![0u8; len]));
            }
        }
    }
    let views: Vec<(String, TensorView<'_>)> = owned
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).expect("view")))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).expect("write");
    let text = std::fs::read_to_string(src.join("config.json")).expect("config");
    std::fs::write(dir.join("config.json"), config(text)).expect("write config");
}

#[test]
fn logits_and_generate_run_on_a_fixture() {
    let dir = fixture("qwen35_text");
    let dir = dir.to_str().expect("utf-8 path");
    let (code, stdout, stderr) = fp4spec(&["logits", "--model", dir, "--ids", "1,2,3", "--mtp"]);
    assert_eq!(code, 0, "{stderr}");
    let json: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(json["vocab_size"], 320);
    assert_eq!(json["logits"].as_array().map(Vec::len), Some(3));
    assert_eq!(json["mtp_logits"].as_array().map(Vec::len), Some(2));
    let (code, stdout, stderr) = fp4spec(&[
        "generate",
        "--model",
        dir,
        "--ids",
        "5,6,7",
        "--max-new-tokens",
        "8",
        "--spec-tokens",
        "2",
        "--temperature",
        "0.7",
        "--top-k",
        "50",
        "--min-p",
        "0.01",
        "--logit-bias",
        "3=2.5",
        "--seed",
        "9",
        "--json",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let json: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    let generated = json["ids"].as_array().map_or(0, Vec::len);
    assert!((1..=8).contains(&generated), "{stdout}");
    assert!(json["acceptance_per_position"].is_array(), "{stdout}");
}

#[test]
fn bad_checkpoints_and_inputs_exit_2_naming_the_problem() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let case = |name: &str| {
        let d = tmp.path().join(name);
        std::fs::create_dir(&d).expect("mkdir");
        d
    };
    let run = |dir: &Path| {
        fp4spec(&[
            "generate",
            "--model",
            dir.to_str().expect("utf-8"),
            "--ids",
            "1",
        ])
    };

    let d = case("no_fc");
    broken_copy(&d, |n, _| (n != "mtp.fc.weight").then_some(None), |c| c);
    let (code, _, err) = run(&d);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("mtp.fc.weight") && err.contains("missing"),
        "{err}"
    );

    let d = case("no_norm");
    broken_copy(
        &d,
        |n, _| (n != "model.layers.2.input_layernorm.weight").then_some(None),
        |c| c,
    );
    let (code, _, err) = run(&d);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("model.layers.2.input_layernorm.weight"),
        "{err}"
    );

    let d = case("bad_shape");
    broken_copy(
        &d,
        |n, s| Some((n == "model.layers.1.self_attn.k_proj.weight").then(|| vec![s[0] + 1, s[1]])),
        |c| c,
    );
    let (code, _, err) = run(&d);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("model.layers.1.self_attn.k_proj.weight") && err.contains("shape"),
        "{err}"
    );

    let d = case("unknown_type");
    broken_copy(
        &d,
        |_, _| Some(None),
        |c| c.replace("qwen3_5_moe_text", "llama"),
    );
    let (code, _, err) = run(&d);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("model_type") && err.contains("llama"), "{err}");

    let good = fixture("qwen35_text");
    let good = good.to_str().expect("utf-8");
    for (args, needle) in [
        (
            vec!["logits", "--model", good, "--ids", "1,x"],
            "`x` is not a token id",
        ),
        (
            vec!["logits", "--model", good, "--ids", "1,320"],
            "outside the vocabulary",
        ),
        (
            vec!["generate", "--model", good, "--prompt", "hi"],
            "no tokenizer",
        ),
        (
            vec!["generate", "--model", good, "--ids", "1", "--nvfp4", "w4a8"],
            "`w4a8` is not one of w4a16, w4a4",
        ),
        (
            vec!["generate", "--model", good, "--ids", "1", "--nvfp4", "w4a4"],
            "the CPU runner multiplies dequantised weights",
        ),
        (
            vec![
                "generate",
                "--model",
                good,
                "--ids",
                "1",
                "--logit-bias",
                "7",
            ],
            "ID=BIAS",
        ),
        (
            vec![
                "generate",
                "--model",
                good,
                "--ids",
                "1",
                "--temperature",
                "-1",
            ],
            "temperature",
        ),
        (
            vec!["logits", "--model", good, "--ids", "1", "--backend", "cuda"],
            "logits and demo run the CPU runner",
        ),
        (
            vec![
                "generate",
                "--model",
                good,
                "--ids",
                "1",
                "--backend",
                "cuda",
                "--temperature",
                "0.8",
            ],
            "--backend cuda decodes greedily",
        ),
        (
            vec![
                "generate",
                "--model",
                good,
                "--ids",
                "1",
                "--kv-cache",
                "fp8",
            ],
            "the CPU runner keeps f32 caches",
        ),
        (
            vec![
                "generate",
                "--model",
                good,
                "--ids",
                "1",
                "--backend",
                "cuda",
                "--kv-cache",
                "fp16",
            ],
            "KV cache format",
        ),
    ] {
        let (code, _, err) = fp4spec(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// `fp4spec bench decode` on the CPU backend with the demo model's shapes: every (batch, context)
/// case measured (with and without drafts), the JSON written with positive times, the halves of
/// a speculative step timed apart, the roofline's bytes, the routing's distinct experts within
/// 1..=min(E, B k), the verify-cost fit and the projected speed-ups, both charts drawn with a line
/// per n; bad arguments exit 2 naming the argument.
/// `fp4spec bench decode` on the CPU backend with the demo model's shapes and bf16 weights, one
/// timed run per case, the JSON to `json`, and `args`.
fn bench_decode_demo(json: &Path, args: &[&str]) -> (i32, String, String) {
    let demo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/qwen35-moe-demo");
    let mut all = vec![
        "bench",
        "decode",
        "--backend",
        "cpu",
        "--model",
        demo.to_str().expect("utf-8 path"),
        "--weights",
        "bf16",
        "--repeats",
        "1",
        "--copy-bytes",
        "1048576",
        "--json",
        json.to_str().expect("utf-8 path"),
    ];
    all.extend_from_slice(args);
    fp4spec(&all)
}

#[test]
fn bench_decode_measures_every_case_and_writes_json() {
    let dir = tempfile::tempdir().expect("temp dir");
    let json = dir.path().join("decode.json");
    let chart = dir.path().join("decode");
    let (code, stdout, stderr) = bench_decode_demo(
        &json,
        &[
            "--batch",
            "1,3",
            "--drafts",
            "0,2",
            "--context",
            "0,40",
            "--steps",
            "3",
            "--chart",
            chart.to_str().expect("utf-8 path"),
        ],
    );
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    assert!(stdout.contains("projections"), "{stdout}");
    assert!(stdout.contains("speed-up over n = 0"), "{stdout}");
    for chart in [
        "decode-tokens-ctx0.svg",
        "decode-verify-ms-ctx0.svg",
        "decode-tokens-ctx40.svg",
        "decode-verify-ms-ctx40.svg",
    ] {
        let svg = std::fs::read_to_string(dir.path().join(chart)).expect("chart written");
        assert!(
            svg.starts_with("<svg") && svg.contains("n = 0") && svg.contains("n = 2"),
            "{chart}"
        );
    }
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("JSON written"))
            .expect("JSON parses");
    let cases = report["cases"].as_array().expect("cases");
    assert_eq!(cases.len(), 8);
    let order = [1, 3].into_iter().flat_map(|b| {
        [0, 2]
            .into_iter()
            .flat_map(move |n| [(b, n, 0), (b, n, 40)])
    });
    for (case, (batch, drafts, context)) in cases.iter().zip(order) {
        assert_eq!(case["batch"], batch);
        assert_eq!(case["drafts"], drafts);
        assert_eq!(case["context"], context);
        let ms = |field: &str| case[field].as_f64().unwrap_or(f64::NAN);
        assert!(ms("ms_per_step") > 0.0 && ms("verify_ms") > 0.0, "{case}");
        // the halves are timed apart, each within the whole step
        assert!(
            ms("verify_ms") + ms("draft_ms") <= 1.5 * ms("ms_per_step"),
            "{case}"
        );
        assert_eq!(drafts == 0, ms("draft_ms") == 0.0, "{case}");
        assert!(
            case["bytes_per_step"].as_f64().is_some_and(|v| v > 0.0),
            "{case}"
        );
        // the CPU backend runs no kernels: no launches counted, no chain floor
        assert_eq!(case["launches"], 0, "{case}");
        assert!(case["launch_floor_fraction"].is_null(), "{case}");
        if drafts == 0 {
            let experts = case["distinct_experts"].as_u64().expect("experts");
            assert!((1..=(batch * 2).min(8)).contains(&experts), "{case}");
        }
    }
    assert!(report["dependent_launch_us"].is_null(), "{report}");
    for speculation in report["speculation"].as_array().expect("speculation") {
        assert!(
            speculation["fit"]["per_row_ms"].is_number(),
            "{speculation}"
        );
        let speedups = &speculation["speedups"][0];
        assert_eq!(speedups[0], 2, "{speculation}");
        assert_eq!(
            speedups[1].as_array().map(Vec::len),
            Some(5),
            "{speculation}"
        );
    }
    // --kernel-costs was not asked for (and needs a device backend: refused below)
    assert_eq!(
        report["kernel_costs"].as_array().map(Vec::len),
        Some(0),
        "{report}"
    );
    assert_eq!(report["kv_cache"], "bf16");
    assert_eq!(report["nvfp4"], "w4a16");
    let (code, _, stderr) = bench_decode_demo(&json, &["--nvfp4", "w4a4"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("it needs --weights nvfp4"), "{stderr}");
    // an e4m3 KV cache: the same case reads half the cache's bytes, nothing else changes
    let fp8_json = dir.path().join("decode-fp8.json");
    let (code, stdout, stderr) = bench_decode_demo(
        &fp8_json,
        &[
            "--batch",
            "1",
            "--drafts",
            "0",
            "--context",
            "40",
            "--steps",
            "2",
            "--kv-cache",
            "fp8",
        ],
    );
    assert_eq!(code, 0, "{stdout}\n{stderr}");
    let fp8: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&fp8_json).expect("JSON written"))
            .expect("JSON parses");
    assert_eq!(fp8["kv_cache"], "fp8");
    let bytes = |case: &serde_json::Value| case["bytes_per_step"].as_f64().expect("bytes");
    let (bf16_bytes, fp8_bytes) = (bytes(&cases[1]), bytes(&fp8["cases"][0]));
    assert_eq!(
        (cases[1]["batch"].clone(), cases[1]["context"].clone()),
        (1.into(), 40.into())
    );
    assert!(
        fp8_bytes < bf16_bytes && fp8_bytes > 0.5 * bf16_bytes,
        "e4m3 {fp8_bytes} bf16 {bf16_bytes}"
    );
    // the CPU takes a step of up to 16 tokens (the most a target may declare): 15 drafts
    let (code, _, stderr) = fp4spec(&["bench", "decode", "--backend", "cpu", "--drafts", "16"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("--drafts 16: at most 15"), "{stderr}");
    let (code, _, stderr) = fp4spec(&["bench", "decode", "--backend", "cpu", "--weights", "fp8"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("--weights `fp8`"), "{stderr}");
    let (code, _, stderr) = fp4spec(&["bench", "decode", "--backend", "cpu", "--kernel-costs"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("--kernel-costs needs a device"), "{stderr}");
}

/// Output piped into a reader that stops early (`fp4spec kernels | head -1`): the program ends
/// (by SIGPIPE on Unix, or having written everything before the reader left), it never panics in
/// println!.
#[test]
fn output_into_a_closed_pipe_does_not_panic() {
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_fp4spec"))
        .arg("kernels")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run fp4spec");
    // the read end closes before the program writes its first line (it starts a process first)
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait for fp4spec");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "fp4spec panicked: {stderr}");
    assert_ne!(out.status.code(), Some(101), "{stderr}");
}
