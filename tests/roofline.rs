//! The roofline model against the reference's figures, the speculation model and the fit.

use fp4spec::model::config::ModelConfig;
use fp4spec::roofline::{self, Precision, RowFit, Step};

fn qwen36() -> ModelConfig {
    ModelConfig::qwen36_35b_a3b()
}

const GIB: f64 = 1073741824.0;

#[test]
fn bf16_weights_per_token_match_the_seeds_5_488_gib() {
    let bytes = roofline::step_bytes(
        &qwen36(),
        Precision::Bf16,
        Step {
            batch: 1,
            rows: 1,
            context: 0,
            kv_element_bytes: 2,
        },
    );
    let weights = bytes.total() - bytes.gdn_state - bytes.kv_cache;
    println!("{bytes:?}\nweights {:.3} GiB", weights / GIB);
    // the seeds measured 5.488 GiB read per token for the bf16 35B-A3B
    assert!(
        (weights / GIB - 5.488).abs() < 0.03,
        "{:.3} GiB",
        weights / GIB
    );
}

#[test]
fn state_and_cache_follow_the_reference_sizes() {
    let config = qwen36();
    let at = |batch, context| {
        roofline::step_bytes(
            &config,
            Precision::Nvfp4,
            Step {
                batch,
                rows: 1,
                context,
                kv_element_bytes: 2,
            },
        )
    };
    // GDN: per layer and sequence 2 MiB of fp32 state and a 3 x 8192 bf16 conv window, read and
    // written, 30 layers
    assert_eq!(
        at(1, 0).gdn_state,
        30.0 * 2.0 * (2.0 * 1048576.0 + 3.0 * 8192.0 * 2.0)
    );
    // KV: 20 KiB per context token over the 10 full layers
    assert_eq!(at(1, 20000).kv_cache, 20000.0 * 20.0 * 1024.0);
    assert_eq!(at(4, 20000).kv_cache, 4.0 * at(1, 20000).kv_cache);
    // an e4m3 cache: half of it, nothing else changes
    let fp8 = roofline::step_bytes(
        &config,
        Precision::Nvfp4,
        Step {
            batch: 4,
            rows: 1,
            context: 20000,
            kv_element_bytes: 1,
        },
    );
    assert_eq!(fp8.kv_cache, 0.5 * at(4, 20000).kv_cache);
    assert_eq!(
        fp8.total() - fp8.kv_cache,
        at(4, 20000).total() - at(4, 20000).kv_cache
    );
    // NVFP4 reads less than bf16, but the bf16 GDN projections and lm_head stay the larger part
    // (the GEMM issue: "about 2/3 of the bytes read per token")
    let bf16 = roofline::step_bytes(
        &config,
        Precision::Bf16,
        Step {
            batch: 1,
            rows: 1,
            context: 0,
            kv_element_bytes: 2,
        },
    )
    .total();
    let nvfp4 = at(1, 0);
    assert!(nvfp4.total() < 0.75 * bf16, "{} vs {bf16}", nvfp4.total());
    let bf16_share = (nvfp4.gdn_projections + nvfp4.lm_head_and_embeddings) / nvfp4.total();
    assert!((0.6..0.8).contains(&bf16_share), "{bf16_share}");
    // batch shares the weights but not the state
    assert!(at(8, 0).experts > at(1, 0).experts && at(8, 0).experts < 8.0 * at(1, 0).experts);
}

#[test]
fn distinct_experts_saturate_at_the_expert_count() {
    assert_eq!(roofline::expected_distinct_experts(256, 8, 1), 8.0);
    assert!((roofline::expected_distinct_experts(256, 8, 10_000) - 256.0).abs() < 1e-6);
}

#[test]
fn the_speculation_model_gives_the_reference_figures() {
    for (a, n, want) in [
        (0.7, 1, 1.70),
        (0.7, 3, 2.533),
        (0.8, 1, 1.80),
        (0.8, 3, 2.952),
    ] {
        let got = roofline::tokens_per_forward(n, a);
        assert!((got - want).abs() < 1e-3, "a={a} n={n}: {got}");
    }
    assert_eq!(roofline::tokens_per_forward(4, 1.0), 5.0);
    assert_eq!(roofline::tokens_per_forward(0, 0.5), 1.0);
}

#[test]
fn the_seeds_strix_halo_fit() {
    let fit = RowFit::from_csv("rows,ms\n1,35.98\n3,62.35\n5,87.50\n", "points.csv").expect("fits");
    assert!(
        (fit.fixed_ms - 23.3).abs() < 0.05 && (fit.per_row_ms - 12.9).abs() < 0.05,
        "{fit:?}"
    );
    let err = RowFit::from_csv("rows,ms\n1,35.98\n3,sixty\n", "points.csv").expect_err("malformed");
    assert!(err.to_string().contains("points.csv:3"), "{err}");
    let err = RowFit::from_csv("n,t\n1,2\n", "points.csv").expect_err("bad header");
    assert!(err.to_string().contains("points.csv:1"), "{err}");
    assert!(
        RowFit::from_csv("rows,ms\n1,2\n1,3\n", "p.csv").is_err(),
        "one row count cannot fit a slope"
    );
}

#[test]
fn units_parse_as_written() {
    assert_eq!(
        roofline::parse_bytes("x", "5.488GiB").expect("ok"),
        5.488 * GIB
    );
    assert_eq!(
        roofline::parse_bytes("x", "224.2GiB/s").expect("ok"),
        224.2 * GIB
    );
    assert_eq!(roofline::parse_bytes("x", "273 GB/s").expect("ok"), 273e9);
    assert_eq!(
        roofline::parse_bytes("x", "4.8e12 B/s").expect("ok"),
        4.8e12
    );
    assert_eq!(roofline::parse_bytes("x", "1e9").expect("ok"), 1e9);
    assert_eq!(roofline::parse_bytes("x", "2.5E+3kB").expect("ok"), 2.5e6);
    assert!(roofline::parse_bytes("x", "12 parsecs").is_err());
    assert!(roofline::parse_bytes("x", "-3GB").is_err());
    // the seeds: 5.488 GiB per token at 224.2 GiB/s caps plain decode at 40.9 tok/s
    let tps = roofline::parse_bytes("b", "224.2GiB/s").expect("ok")
        / roofline::parse_bytes("t", "5.488GiB").expect("ok");
    assert!((tps - 40.85).abs() < 0.01, "{tps}");
}

#[test]
fn the_mtp_draft_is_a_small_fraction_of_a_target_forward() {
    let config = qwen36();
    let target = roofline::step_bytes(
        &config,
        Precision::Nvfp4,
        Step {
            batch: 1,
            rows: 1,
            context: 0,
            kv_element_bytes: 2,
        },
    )
    .total();
    let draft = roofline::draft_bytes(
        &config,
        Step {
            batch: 1,
            rows: 1,
            context: 0,
            kv_element_bytes: 2,
        },
    );
    // one bf16 layer + fc + lm_head against 40 layers: between 10% and 60% of an NVFP4 forward
    assert!(
        draft > 0.1 * target && draft < 0.6 * target,
        "draft {draft} target {target}"
    );
}

// ---- the command ----

fn fp4spec(args: &[&str]) -> (i32, String, String) {
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

#[test]
fn the_command_gives_the_seeds_ceiling_and_fit_as_json() {
    let (code, stdout, stderr) = fp4spec(&[
        "roofline",
        "--bytes-per-token",
        "5.488GiB",
        "--bandwidth",
        "224.2GiB/s",
        "--json",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    let ceiling = report["ceiling_tokens_per_s"].as_f64().expect("ceiling");
    assert!((ceiling - 40.9).abs() < 0.05, "{ceiling}");
    assert_eq!(report["bytes_per_token"].as_f64(), Some(5.488 * GIB));

    let dir = tempfile::tempdir().expect("tempdir");
    let points = dir.path().join("points.csv");
    std::fs::write(&points, "rows,ms\n1,35.98\n3,62.35\n5,87.50\n").expect("write");
    let points = points.display().to_string();
    let (code, stdout, stderr) = fp4spec(&[
        "roofline",
        "--precision",
        "bf16",
        "--device",
        "strix-halo",
        "--spec-tokens",
        "2",
        "--acceptance",
        "0.7",
        "--fit",
        &points,
        "--draft-ms",
        "0",
        "--json",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    assert!((report["fixed_ms"].as_f64().expect("fixed") - 23.3).abs() < 0.05);
    assert!((report["per_row_ms"].as_f64().expect("per row") - 12.9).abs() < 0.05);
    let tokens = report["tokens_per_forward"].as_f64().expect("tokens");
    assert!((tokens - 2.19).abs() < 1e-9, "{tokens}");
    let projected = report["projected_tokens_per_s"]
        .as_f64()
        .expect("projected");
    let want = tokens / (23.3 + 12.88 * 3.0) * 1e3;
    assert!(
        (projected - want).abs() / want < 0.01,
        "{projected} vs {want}"
    );
    assert!(
        report["bytes_per_step_by_part"]["gdn_state"]
            .as_f64()
            .expect("part")
            > 0.0
    );
}

#[test]
fn the_command_rejects_bad_input_with_exit_2() {
    for args in [
        &["roofline", "--device", "tpu"][..],
        &["roofline", "--bandwidth", "fast"][..],
        &["roofline", "--spec-tokens", "2"][..],
        &["roofline", "--spec-tokens", "2", "--acceptance", "1.5"][..],
        &["roofline", "--precision", "int3"][..],
        &["roofline", "--model", "/nonexistent/model"][..],
        &["roofline", "--fit", "/nonexistent/points.csv"][..],
        &["roofline", "--batch", "0"][..],
        &["roofline", "--batch", "18446744073709551615"][..],
        &[
            "roofline",
            "--spec-tokens",
            "4294967295",
            "--acceptance",
            "0.5",
        ][..],
    ] {
        let (code, _, stderr) = fp4spec(args);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(stderr.contains("error"), "{args:?}: {stderr}");
    }
}

#[test]
fn a_model_folder_s_quantisation_config_decides_the_precision() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let bytes = |name: &str, extra: &[&str]| -> f64 {
        let dir = fixtures.join(name).display().to_string();
        let mut args = vec!["roofline", "--model", &dir, "--json"];
        args.extend_from_slice(extra);
        let (code, stdout, stderr) = fp4spec(&args);
        assert_eq!(code, 0, "{stderr}");
        let report: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
        report["bytes_per_token"].as_f64().expect("bytes")
    };
    let quantised = bytes("qwen35_nvfp4", &[]);
    let float = bytes("qwen35_text", &[]);
    assert!(quantised < float, "{quantised} vs {float}");
    assert_eq!(quantised, bytes("qwen35_text", &["--precision", "nvfp4"]));
}

#[test]
fn a_speculative_step_reads_its_verify_rows_and_one_draft_step_per_draft() {
    let config = qwen36();
    for (batch, context) in [(1, 0), (16, 20000)] {
        let step = |rows| Step {
            batch,
            rows,
            context,
            kv_element_bytes: 2,
        };
        let plain = roofline::step_bytes(&config, Precision::Nvfp4, step(1)).total();
        assert_eq!(
            roofline::speculative_step_bytes(&config, Precision::Nvfp4, step(1)),
            plain
        );
        let verify = roofline::step_bytes(&config, Precision::Nvfp4, step(4)).total();
        let draft = roofline::draft_bytes(&config, step(1));
        assert!(draft > 0.0);
        assert_eq!(
            roofline::speculative_step_bytes(&config, Precision::Nvfp4, step(4)),
            verify + 3.0 * draft
        );
    }
}
