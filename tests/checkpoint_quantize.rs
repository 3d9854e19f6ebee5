//! `fp4spec quantize` on checkpoints the tests write: the output passes doctor and the runner's
//! tensor check, every quantised tensor dequantises to the error the report gives, fused experts
//! keep per-expert scales, exclusions stay byte-identical, fused linears share one global scale,
//! calibration sets input_scale, and bad input leaves nothing behind.

#[path = "checkpoint_fixture/mod.rs"]
mod fixture;

use fixture::{EXPERTS, HIDDEN, MOE, Spec, T};
use fp4spec::checkpoint::doctor;
use fp4spec::checkpoint::quantize::{self, Calibration, QuantizeOptions};
use fp4spec::formats::nvfp4::{Nvfp4Matrix, e2m1_decode, e4m3_decode};
use fp4spec::formats::quant_config::{Convention, QuantConfig};
use fp4spec::formats::safetensors::Checkpoint;
use fp4spec::model::config::ModelConfig;
use fp4spec::model::weights::{self, ExpertLayout};
use indicatif::ProgressBar;
use safetensors::Dtype;
use std::collections::BTreeMap;
use std::path::Path;

fn quantize(
    model: &Path,
    out: &Path,
    edit: impl FnOnce(&mut QuantizeOptions),
) -> quantize::QuantizeReport {
    let mut options = QuantizeOptions::new(model, out);
    edit(&mut options);
    quantize::quantize(&options, &ProgressBar::hidden()).expect("quantize")
}

fn by_name(tensors: Vec<T>) -> BTreeMap<String, T> {
    tensors.into_iter().map(|t| (t.name.clone(), t)).collect()
}

/// Asserts two value lists are identical, naming the first difference.
fn assert_same(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_bits() != want[i].to_bits()) {
        let count = (0..got.len())
            .filter(|&i| got[i].to_bits() != want[i].to_bits())
            .count();
        panic!(
            "{what}: {count} values differ, first at {i}: got {} want {}",
            got[i], want[i]
        );
    }
}

fn relative_rms(want: &[f32], got: &[f32]) -> f64 {
    let (mut e, mut n) = (0.0f64, 0.0f64);
    for (w, g) in want.iter().zip(got) {
        e += ((w - g) as f64).powi(2);
        n += (*w as f64).powi(2);
    }
    (e / n).sqrt()
}

/// Dequantises expert `e` of a fused ModelOpt tensor `name` of `dir` ([rows, cols] per expert).
fn fused_expert(dir: &Path, name: &str, e: usize, rows: usize, cols: usize) -> Vec<f32> {
    let c = Checkpoint::open(dir).expect("open");
    let packed = c.tensor(name).expect("packed");
    let scales = c.tensor(&format!("{name}_weight_scale")).expect("scales");
    let globals = c
        .tensor(&format!("{name}_weight_scale_2"))
        .expect("globals")
        .to_f32()
        .expect("f32");
    let (p, s) = (rows * cols / 2, rows * cols / 16);
    let packed = &packed.data[e * p..(e + 1) * p];
    let scales = &scales.data[e * s..(e + 1) * s];
    (0..rows * cols)
        .map(|i| {
            let byte = packed[i / 2];
            let nibble = if i % 2 == 0 { byte & 0xf } else { byte >> 4 };
            e2m1_decode(nibble) * (e4m3_decode(scales[i / 16]) * globals[e])
        })
        .collect()
}

#[test]
fn a_bf16_checkpoint_quantises_passes_doctor_and_the_tensor_check() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (model, out) = (tmp.path().join("bf16"), tmp.path().join("nvfp4"));
    let spec = Spec::qwen36();
    let original = by_name(fixture::write_checkpoint(&model, &spec, 3));
    let report = quantize(&model, &out, |_| {});

    let findings = doctor::diagnose(&out).expect("diagnose");
    assert!(
        findings.healthy(),
        "doctor on the quantised checkpoint: {:#?}",
        findings.findings
    );
    assert_eq!(findings.summary.quantization, "NVFP4 (modelopt)");
    let config = ModelConfig::load(&out).expect("config");
    let checkpoint = Checkpoint::open(&out).expect("open");
    let check = weights::check(&checkpoint, &config).expect("the runner's check accepts it");
    assert_eq!(check.experts, ExpertLayout::Fused);
    assert_eq!(
        check.nvfp4_fused_experts,
        2 * 4,
        "gate_up and down of 4 layers"
    );
    // q, k, v, o of 2 full-attention layers + 3 shared-expert linears of 4 layers
    assert_eq!(check.nvfp4_linears, 2 * 4 + 4 * 3);
    assert!(check.mtp);

    // the quantisation config as written
    let quant = QuantConfig::load(&out).expect("load").expect("present");
    assert_eq!(quant.convention, Convention::ModelOpt);
    assert_eq!(quant.quant_algo, "NVFP4");
    for module in [
        "lm_head",
        "mtp.fc",
        "model.language_model.layers.0.linear_attn.in_proj_qkv",
    ] {
        assert!(quant.excludes(module), "{module} must be excluded");
    }
    assert!(!quant.excludes("model.language_model.layers.1.self_attn.q_proj"));
    assert!(out.join("hf_quant_config.json").is_file());
    for side in [
        "tokenizer.json",
        "preprocessor_config.json",
        "processor_config.json",
    ] {
        assert!(out.join(side).is_file(), "{side} copied");
    }

    // excluded tensors are byte-identical
    let written = by_name(fixture::read_all(&out));
    for name in [
        "lm_head.weight",
        "model.language_model.embed_tokens.weight",
        "model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
        "model.language_model.layers.0.mlp.gate.weight",
        "model.language_model.layers.0.mlp.shared_expert_gate.weight",
        "mtp.fc.weight",
        "mtp.layers.0.mlp.experts.2.up_proj.weight",
        "model.visual.blocks.0.attn.qkv.weight",
        "model.language_model.layers.0.linear_attn.conv1d.weight",
    ] {
        assert_eq!(
            written[name], original[name],
            "{name} must be copied unchanged"
        );
    }

    // a 2-D linear dequantises to the error the report gives
    let q = "model.language_model.layers.1.self_attn.q_proj";
    let m = Nvfp4Matrix::load(&checkpoint, q).expect("load q_proj");
    let want = original[&format!("{q}.weight")].f32_values();
    let got = m.dequantize();
    let err = relative_rms(&want, &got);
    let reported = report
        .quantized
        .iter()
        .find(|t| t.tensor == q)
        .expect("reported");
    assert!(
        (err - reported.relative_rms).abs() < 1e-9,
        "q_proj: recomputed {err}, reported {}",
        reported.relative_rms
    );
    assert!(
        err > 0.0 && err < 0.15,
        "NVFP4 error of a Gaussian matrix is about 0.1, got {err}"
    );
    assert_eq!(
        m.input_scale,
        Some(1.0),
        "default input amax 2688 -> input_scale 1.0"
    );

    // fused experts: per-expert global scales, each expert's error as recomputed
    let name = "model.language_model.layers.2.mlp.experts.gate_up_proj";
    let globals = checkpoint
        .tensor(&format!("{name}_weight_scale_2"))
        .expect("ws2")
        .to_f32()
        .expect("f32");
    assert_eq!(globals.len(), EXPERTS);
    let values = original[name].f32_values();
    let per = 2 * MOE * HIDDEN;
    let (mut e2, mut n2) = (0.0f64, 0.0f64);
    for e in 0..EXPERTS {
        let slice = &values[e * per..(e + 1) * per];
        let amax = slice.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_eq!(
            globals[e],
            amax / 2688.0,
            "expert {e}: weight_scale_2 = amax / (6 * 448)"
        );
        let got = fused_expert(&out, name, e, 2 * MOE, HIDDEN);
        let want = Nvfp4Matrix::quantize("expert", slice, 2 * MOE, HIDDEN)
            .expect("reference")
            .dequantize();
        assert_same(
            &got,
            &want,
            &format!("expert {e} vs ModelOpt's quantisation of its slice"),
        );
        for (w, g) in slice.iter().zip(&got) {
            e2 += ((w - g) as f64).powi(2);
            n2 += (*w as f64).powi(2);
        }
    }
    let fused = report
        .quantized
        .iter()
        .find(|t| t.tensor == name)
        .expect("reported");
    assert!(((e2 / n2).sqrt() - fused.relative_rms).abs() < 1e-9);
    assert!(fused.worst_expert.is_some_and(|(e, _)| e < EXPERTS));
    let input = checkpoint
        .tensor(&format!("{name}_input_scale"))
        .expect("input")
        .to_f32()
        .expect("f32");
    assert_eq!(input, vec![1.0; EXPERTS]);
}

#[test]
fn linears_engines_fuse_share_one_global_scale() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (model, out) = (tmp.path().join("bf16"), tmp.path().join("nvfp4"));
    let original = by_name(fixture::write_checkpoint(
        &model,
        &Spec {
            fused: false,
            ..Spec::qwen36()
        },
        1,
    ));
    quantize(&model, &out, |_| {});
    let c = Checkpoint::open(&out).expect("open");
    let amax = |names: &[String]| {
        names
            .iter()
            .flat_map(|n| original[&format!("{n}.weight")].f32_values())
            .fold(0.0f32, |m, v| m.max(v.abs()))
    };
    let p = "model.language_model.layers.1.";
    let groups: Vec<Vec<String>> = vec![
        ["q_proj", "k_proj", "v_proj"]
            .iter()
            .map(|l| format!("{p}self_attn.{l}"))
            .collect(),
        ["gate_proj", "up_proj"]
            .iter()
            .map(|l| format!("{p}mlp.shared_expert.{l}"))
            .collect(),
        ["gate_proj", "up_proj"]
            .iter()
            .map(|l| format!("{p}mlp.experts.3.{l}"))
            .collect(),
    ];
    for group in groups {
        let want = amax(&group) / 2688.0;
        for member in &group {
            let got = c
                .scalar_f32(&format!("{member}.weight_scale_2"))
                .expect("ws2");
            assert_eq!(got, want, "{member}: the group's amax / (6 * 448)");
        }
    }
    let o = format!("{p}self_attn.o_proj");
    assert_eq!(
        c.scalar_f32(&format!("{o}.weight_scale_2")).expect("ws2"),
        amax(std::slice::from_ref(&o)) / 2688.0,
        "o_proj has its own"
    );
    assert!(doctor::diagnose(&out).expect("diagnose").healthy());
}

#[test]
fn compressed_tensors_and_split_experts_pass_doctor_and_match_modelopt() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("bf16");
    fixture::write_checkpoint(&model, &Spec::qwen36(), 2);
    let (ct, split, fused) = (
        tmp.path().join("ct"),
        tmp.path().join("split"),
        tmp.path().join("fused"),
    );
    quantize(&model, &ct, |o| {
        o.convention = Convention::CompressedTensors
    });
    quantize(&model, &split, |o| o.split_experts = true);
    quantize(&model, &fused, |_| {});
    for dir in [&ct, &split] {
        let report = doctor::diagnose(dir).expect("diagnose");
        assert!(
            report.healthy(),
            "{}: {:#?}",
            dir.display(),
            report.findings
        );
        assert_eq!(report.summary.expert_layout, Some("per-expert"));
    }
    assert!(
        !ct.join("hf_quant_config.json").exists(),
        "compressed-tensors has no hf_quant_config.json"
    );
    let quant = QuantConfig::load(&ct).expect("load").expect("present");
    assert_eq!(quant.convention, Convention::CompressedTensors);
    let expert = "model.language_model.layers.0.mlp.experts.1.up_proj";
    let (dtype, shape) = fixture::header(&ct, &format!("{expert}.weight_packed"));
    assert_eq!((dtype, shape), (Dtype::U8, vec![MOE, HIDDEN / 2]));
    let c = Checkpoint::open(&ct).expect("open");
    let ct_values = Nvfp4Matrix::load(&c, expert).expect("load ct").dequantize();
    let s = Checkpoint::open(&split).expect("open");
    let split_values = Nvfp4Matrix::load(&s, expert)
        .expect("load split")
        .dequantize();
    // the up half of expert 1 of the fused tensor
    let fused_values = fused_expert(
        &fused,
        "model.language_model.layers.0.mlp.experts.gate_up_proj",
        1,
        2 * MOE,
        HIDDEN,
    );
    let up = &fused_values[MOE * HIDDEN..];
    assert_same(
        &split_values,
        up,
        "split experts vs the fused quantisation, sliced",
    );
    let close = ct_values
        .iter()
        .zip(up)
        .all(|(a, b)| (a - b).abs() <= 1e-6 * b.abs().max(1e-3));
    assert!(
        close,
        "compressed-tensors dequantises as ModelOpt (its global is stored inverted)"
    );
}

#[test]
fn calibration_values_outside_f32_or_not_positive_are_refused_by_name() {
    for (value, shown) in [
        ("1e39", "1e+39"),
        ("1e-50", "e-51"),
        ("[2.0, -1.0]", "-1"),
        ("0", "0"),
    ] {
        let text = format!(r#"{{"*.o_proj": {value}}}"#);
        let err = Calibration::parse(&text, "calibration.json")
            .err()
            .unwrap_or_else(|| panic!("{value} accepted"))
            .to_string();
        assert!(
            err.contains("calibration.json: `*.o_proj`") && err.contains(shown),
            "{value}: {err}"
        );
    }
}

#[test]
fn calibration_sets_input_scale_and_weights_only_writes_none() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("bf16");
    fixture::write_checkpoint(&model, &Spec::qwen36(), 1);
    let calibration = Calibration::parse(
        r#"{"model.language_model.layers.1.self_attn.k_proj": 12.0,
            "*experts.gate_up_proj": [1.0, 2.0, 3.0, 4.0],
            "*.o_proj": 5.5}"#,
        "calibration.json",
    )
    .expect("parse");
    let out = tmp.path().join("calibrated");
    let report = quantize(&model, &out, |o| o.calibration = Some(calibration));
    let c = Checkpoint::open(&out).expect("open");
    let p = "model.language_model.layers.1.self_attn.";
    for member in ["q_proj", "k_proj", "v_proj"] {
        let got = c
            .scalar_f32(&format!("{p}{member}.input_scale"))
            .expect("input_scale");
        assert_eq!(
            got,
            12.0 / 2688.0,
            "{member}: q/k/v read one input, so share k's calibration"
        );
    }
    assert_eq!(
        c.scalar_f32(&format!("{p}o_proj.input_scale")).expect("o"),
        5.5 / 2688.0
    );
    let experts = c
        .tensor("model.language_model.layers.0.mlp.experts.gate_up_proj_input_scale")
        .expect("fused input")
        .to_f32()
        .expect("f32");
    assert_eq!(
        experts,
        vec![1.0 / 2688.0, 2.0 / 2688.0, 3.0 / 2688.0, 4.0 / 2688.0]
    );
    assert!(report.quantized.iter().any(|t| t.calibrated));
    assert!(doctor::diagnose(&out).expect("diagnose").healthy());

    let w4a16 = tmp.path().join("w4a16");
    quantize(&model, &w4a16, |o| o.weights_only = true);
    assert!(!fixture::has(&w4a16, &format!("{p}q_proj.input_scale")));
    assert_eq!(
        QuantConfig::load(&w4a16)
            .expect("load")
            .expect("present")
            .quant_algo,
        "W4A16_NVFP4"
    );
    assert!(doctor::diagnose(&w4a16).expect("diagnose").healthy());
}

#[test]
fn a_linear_whose_width_is_not_a_multiple_of_16_stays_float_and_is_excluded_by_name() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (model, out) = (tmp.path().join("bf16"), tmp.path().join("nvfp4"));
    fixture::write_checkpoint(&model, &Spec::qwen36(), 1);
    let odd = tmp.path().join("odd");
    let extra = "model.language_model.layers.0.mlp.odd_proj.weight";
    fixture::edited_copy(&model, &odd, |t| {
        t.push(T::bf16(extra, &[8, 24], &[0.5; 8 * 24]))
    });
    let report = quantize(&odd, &out, |_| {});
    assert_eq!(
        report.auto_excluded,
        vec!["model.language_model.layers.0.mlp.odd_proj".to_string()]
    );
    assert_eq!(fixture::header(&out, extra).0, Dtype::BF16);
    assert!(
        QuantConfig::load(&out)
            .expect("load")
            .expect("present")
            .excludes("model.language_model.layers.0.mlp.odd_proj")
    );
    assert!(doctor::diagnose(&out).expect("diagnose").healthy());
}

#[test]
fn bad_input_is_refused_and_leaves_nothing_behind() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("bf16");
    fixture::write_checkpoint(&model, &Spec::qwen36(), 1);

    // a NaN weight: the error names the tensor, no output folder, no staging left
    let nan = tmp.path().join("nan");
    let name = "model.language_model.layers.3.self_attn.v_proj.weight";
    fixture::edited_copy(&model, &nan, |ts| {
        let t = ts.iter_mut().find(|t| t.name == name).expect("v_proj");
        t.data[10..12].copy_from_slice(&half::bf16::NAN.to_le_bytes());
    });
    let out = tmp.path().join("out");
    let err = quantize::quantize(&QuantizeOptions::new(&nan, &out), &ProgressBar::hidden())
        .expect_err("NaN");
    assert!(
        err.to_string().contains("v_proj") && err.to_string().contains("NaN"),
        "{err}"
    );
    assert!(!out.exists());
    let leftovers: Vec<String> = fixture::listing(tmp.path())
        .into_iter()
        .filter(|n| n.contains("partial"))
        .collect();
    assert!(leftovers.is_empty(), "staging folders left: {leftovers:?}");

    // an output that exists
    std::fs::create_dir(&out).expect("mkdir");
    let err = quantize::quantize(&QuantizeOptions::new(&model, &out), &ProgressBar::hidden())
        .expect_err("exists");
    assert!(err.to_string().contains("already exists"), "{err}");
    std::fs::remove_dir(&out).expect("rmdir");

    // an input that is already quantised
    let q = tmp.path().join("q");
    quantize(&model, &q, |_| {});
    let err = quantize::quantize(&QuantizeOptions::new(&q, &out), &ProgressBar::hidden())
        .expect_err("already quantised");
    assert!(err.to_string().contains("already quantised"), "{err}");
    assert!(!out.exists());
}

#[test]
fn the_command_reports_errors_as_json_and_uses_exit_codes() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let model = tmp.path().join("bf16");
    fixture::write_checkpoint(&model, &Spec::qwen36(), 1);
    let out = tmp.path().join("out");
    let (m, o) = (model.to_str().expect("utf8"), out.to_str().expect("utf8"));
    let (code, stdout, stderr) =
        fixture::fp4spec(&["quantize", "--model", m, "--out", o, "--json"]);
    assert_eq!(code, 0, "{stderr}");
    let json: serde_json::Value = serde_json::from_str(&stdout).expect("json");
    assert_eq!(json["quant_algo"], "NVFP4");
    let tensors = json["quantized"].as_array().expect("quantized list");
    assert!(tensors.iter().all(|t| {
        t["relative_rms"]
            .as_f64()
            .is_some_and(|r| r > 0.0 && r < 0.2)
    }));
    let (code, _, stderr) = fixture::fp4spec(&["doctor", o]);
    assert_eq!(code, 0, "{stderr}");
    let (code, _, stderr) = fixture::fp4spec(&["quantize", "--model", m, "--out", o]);
    assert_eq!(code, 2, "existing output: {stderr}");
    let other = tmp.path().join("other");
    let (code, _, stderr) = fixture::fp4spec(&[
        "quantize",
        "--model",
        m,
        "--out",
        other.to_str().expect("utf8"),
        "--format",
        "gguf",
    ]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--format"), "{stderr}");
    let (code, stdout, stderr) = fixture::fp4spec(&[
        "quantize",
        "--model",
        m,
        "--out",
        other.to_str().expect("utf8"),
        "--split-experts",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("relative RMS"), "{stdout}");
}
