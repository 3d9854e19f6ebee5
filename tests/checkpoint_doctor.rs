//! `fp4spec doctor` on checkpoints the tests write: a healthy one gives no finding and its
//! summary; every finding of the issue is produced by a checkpoint made to have it, with its
//! code and the tensor, file or field named.

#[path = "checkpoint_fixture/mod.rs"]
mod fixture;

use fixture::{Spec, T};
use fp4spec::checkpoint::doctor::{self, Report};
use fp4spec::checkpoint::quantize::{self, QuantizeOptions};
use indicatif::ProgressBar;
use safetensors::Dtype;
use serde_json::json;
use std::path::{Path, PathBuf};

fn diagnose(dir: &Path) -> Report {
    doctor::diagnose(dir).expect("diagnose")
}

/// Asserts a finding with `code` whose subject contains `subject`.
fn assert_finding(report: &Report, code: &str, subject: &str) {
    let found = report
        .findings
        .iter()
        .any(|f| f.code == code && f.subject.contains(subject));
    assert!(
        found,
        "expected [{code}] about `{subject}`; findings: {:#?}",
        report.findings
    );
}

fn bf16(tmp: &Path, spec: &Spec, shards: usize) -> PathBuf {
    let dir = tmp.join("bf16");
    fixture::write_checkpoint(&dir, spec, shards);
    dir
}

fn nvfp4(tmp: &Path) -> PathBuf {
    let model = bf16(tmp, &Spec::qwen36(), 1);
    let out = tmp.join("nvfp4");
    quantize::quantize(&QuantizeOptions::new(&model, &out), &ProgressBar::hidden())
        .expect("quantize");
    out
}

/// A copy of `from` in `tmp/name` with `edit` applied to its tensors.
fn edited(from: &Path, tmp: &Path, name: &str, edit: impl FnOnce(&mut Vec<T>)) -> PathBuf {
    let to = tmp.join(name);
    fixture::edited_copy(from, &to, edit);
    to
}

fn without(names: &'static [&'static str]) -> impl FnOnce(&mut Vec<T>) {
    move |ts: &mut Vec<T>| ts.retain(|t| !names.contains(&t.name.as_str()))
}

#[test]
fn a_healthy_checkpoint_has_no_findings_and_a_summary() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = bf16(tmp.path(), &Spec::qwen36(), 3);
    let report = diagnose(&dir);
    assert!(report.healthy(), "{:#?}", report.findings);
    let s = &report.summary;
    assert_eq!((s.layers, s.gdn_layers, s.full_attention_layers), (4, 2, 2));
    assert_eq!((s.experts, s.experts_per_token), (4, 2));
    assert_eq!(s.expert_layout, Some("fused"));
    assert_eq!(s.quantization, "bf16");
    assert_eq!(
        (s.family, s.mtp_class),
        (Some("qwen3_5_moe"), Some("qwen3_5_mtp"))
    );
    assert_eq!(s.tensor_layout, Some("qwen3_5_moe"));
    assert!(s.vision_language && s.mtp_present);
    assert_eq!((s.mtp_layers, s.shards), (1, 3));
    let tensors = fixture::tensors(&Spec::qwen36());
    assert_eq!(s.tensors, tensors.len());
    let bytes: usize = tensors.iter().map(|t| t.data.len()).sum();
    assert_eq!(s.tensor_bytes, bytes as u64);
    assert!(s.file_bytes > s.tensor_bytes);

    let d = dir.to_str().expect("utf8");
    let (code, stdout, stderr) = fixture::fp4spec(&["doctor", d]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("ok: no findings") && stdout.contains("qwen3_5_mtp"),
        "{stdout}"
    );
    let (code, stdout, _) = fixture::fp4spec(&["doctor", d, "--json"]);
    assert_eq!(code, 0);
    let json: serde_json::Value = serde_json::from_str(&stdout).expect("json");
    assert_eq!(json["findings"], json!([]));
    assert_eq!(json["summary"]["layers"], 4);
    assert_eq!(json["summary"]["mtp_class"], "qwen3_5_mtp");
}

#[test]
fn mtp_findings() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let t = tmp.path();
    let base = bf16(t, &Spec::qwen36(), 1);

    let r = diagnose(&edited(&base, t, "no-fc", without(&["mtp.fc.weight"])));
    assert_finding(&r, "mtp-fc-missing", "mtp.fc.weight");
    let message = &r
        .findings
        .iter()
        .find(|f| f.code == "mtp-fc-missing")
        .expect("fc")
        .message;
    assert!(message.contains("reject every draft"), "{message}");

    let r = diagnose(&edited(&base, t, "no-norm", without(&["mtp.norm.weight"])));
    assert_finding(&r, "mtp-tensor-missing", "mtp.norm.weight");

    let declared = Spec {
        mtp_tensors: false,
        ..Spec::qwen36()
    };
    let r = diagnose(&bf16(&t.join("declared"), &declared, 1));
    assert_finding(&r, "mtp-config-without-tensors", "mtp.*");

    let undeclared = Spec {
        mtp_config: 0,
        ..Spec::qwen36()
    };
    let r = diagnose(&bf16(&t.join("undeclared"), &undeclared, 1));
    assert_finding(&r, "mtp-tensors-without-config", "mtp.*");

    // a quantised MTP linear, and a quantisation config that does not exclude the head
    let q = nvfp4(&t.join("quantised"));
    let name = "mtp.layers.0.self_attn.q_proj";
    let quantised = edited(&q, t, "mtp-q", |ts| {
        ts.retain(|x| x.name != format!("{name}.weight"));
        ts.push(T {
            name: format!("{name}.weight"),
            dtype: Dtype::U8,
            shape: vec![64, 16],
            data: vec![0; 64 * 16],
        });
        ts.push(T {
            name: format!("{name}.weight_scale"),
            dtype: Dtype::F8_E4M3,
            shape: vec![64, 2],
            data: vec![0x38; 128],
        });
        ts.push(T {
            name: format!("{name}.weight_scale_2"),
            dtype: Dtype::F32,
            shape: vec![],
            data: 1.0f32.to_le_bytes().to_vec(),
        });
    });
    let r = diagnose(&quantised);
    assert_finding(&r, "mtp-quantized", "mtp.layers.0.self_attn.q_proj");

    let not_excluded = edited(&q, t, "mtp-not-excluded", |_| {});
    for (file, pointer) in [
        ("config.json", "/quantization_config/exclude_modules"),
        ("hf_quant_config.json", "/quantization/exclude_modules"),
    ] {
        let path = not_excluded.join(file);
        let mut value: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        value
            .pointer_mut(pointer)
            .and_then(|v| v.as_array_mut())
            .expect("list")
            .retain(|e| e != "mtp.*");
        fixture::write_json(&path, &value);
    }
    let r = diagnose(&not_excluded);
    assert_finding(&r, "mtp-not-excluded", "mtp.*");
}

#[test]
fn nvfp4_scale_findings() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let t = tmp.path();
    let q = nvfp4(t);
    let p = "model.language_model.layers.1.";
    assert!(diagnose(&q).healthy());

    let r = diagnose(&edited(
        &q,
        t,
        "no-input",
        without(&["model.language_model.layers.1.self_attn.k_proj.input_scale"]),
    ));
    assert_finding(
        &r,
        "nvfp4-scale-missing",
        &format!("{p}self_attn.k_proj.input_scale"),
    );

    let r = diagnose(&edited(
        &q,
        t,
        "no-ws2",
        without(&["model.language_model.layers.1.self_attn.k_proj.weight_scale_2"]),
    ));
    assert_finding(
        &r,
        "nvfp4-scale-missing",
        &format!("{p}self_attn.k_proj.weight_scale_2"),
    );

    let r = diagnose(&edited(
        &q,
        t,
        "no-ws",
        without(&["model.language_model.layers.1.mlp.shared_expert.up_proj.weight_scale"]),
    ));
    assert_finding(
        &r,
        "nvfp4-scale-missing",
        &format!("{p}mlp.shared_expert.up_proj.weight_scale"),
    );

    let o = format!("{p}self_attn.o_proj.weight_scale");
    let r = diagnose(&edited(&q, t, "ws-shape", |ts| {
        let x = ts.iter_mut().find(|x| x.name == o).expect("o_proj scale");
        assert_eq!(x.shape, vec![32, 2]);
        x.shape = vec![64, 1];
    }));
    assert_finding(&r, "nvfp4-scale-shape", &o);

    // fused experts without their per-expert scales
    let fused = "model.language_model.layers.2.mlp.experts.gate_up_proj";
    let r = diagnose(&edited(
        &q,
        t,
        "fused-ws2",
        without(&["model.language_model.layers.2.mlp.experts.gate_up_proj_weight_scale_2"]),
    ));
    assert_finding(
        &r,
        "fused-expert-scales-missing",
        &format!("{fused}_weight_scale_2"),
    );
    let r = diagnose(&edited(
        &q,
        t,
        "fused-ws",
        without(&["model.language_model.layers.2.mlp.experts.gate_up_proj_weight_scale"]),
    ));
    assert_finding(
        &r,
        "fused-expert-scales-missing",
        &format!("{fused}_weight_scale"),
    );
    let r = diagnose(&edited(
        &q,
        t,
        "fused-input",
        without(&["model.language_model.layers.2.mlp.experts.gate_up_proj_input_scale"]),
    ));
    assert_finding(
        &r,
        "fused-expert-scales-missing",
        &format!("{fused}_input_scale"),
    );
    let r = diagnose(&edited(&q, t, "fused-scalar", |ts| {
        let x = ts
            .iter_mut()
            .find(|x| x.name == format!("{fused}_weight_scale_2"))
            .expect("ws2");
        x.shape = vec![];
        x.data.truncate(4);
    }));
    assert_finding(&r, "nvfp4-scale-shape", &format!("{fused}_weight_scale_2"));

    // the exclusion list against what is stored
    let o_proj = format!("{p}self_attn.o_proj");
    let r = diagnose(&edited(&q, t, "float-o", |ts| {
        ts.retain(|x| !x.name.starts_with(&format!("{o_proj}.")));
        ts.push(T::bf16(
            format!("{o_proj}.weight"),
            &[32, 32],
            &[0.01; 32 * 32],
        ));
    }));
    assert_finding(&r, "not-quantized", &format!("{o_proj}.weight"));
    let visual = "model.visual.blocks.0.mlp.fc1";
    let r = diagnose(&edited(&q, t, "visual-q", |ts| {
        ts.push(T {
            name: format!("{visual}.weight"),
            dtype: Dtype::U8,
            shape: vec![16, 8],
            data: vec![0; 128],
        });
        ts.push(T {
            name: format!("{visual}.weight_scale"),
            dtype: Dtype::F8_E4M3,
            shape: vec![16, 1],
            data: vec![0x38; 16],
        });
    }));
    assert_finding(&r, "excluded-but-quantized", visual);
}

#[test]
fn quantisation_config_findings() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let t = tmp.path();
    let q = nvfp4(t);

    let missing = edited(&q, t, "no-config", |_| {});
    std::fs::remove_file(missing.join("hf_quant_config.json")).expect("rm");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(missing.join("config.json")).expect("read"))
            .expect("json");
    config
        .as_object_mut()
        .expect("object")
        .remove("quantization_config");
    fixture::write_json(&missing.join("config.json"), &config);
    let r = diagnose(&missing);
    assert_finding(&r, "quant-config-missing", "model.language_model.layers");

    let disagree = edited(&q, t, "disagree", |_| {});
    let path = disagree.join("hf_quant_config.json");
    let mut hf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    hf["quantization"]["exclude_modules"]
        .as_array_mut()
        .expect("list")
        .push(json!("*o_proj"));
    fixture::write_json(&path, &hf);
    let r = diagnose(&disagree);
    assert_finding(&r, "quant-config-disagree", "hf_quant_config.json");

    let invalid = edited(&q, t, "fp8", |_| {});
    let path = invalid.join("hf_quant_config.json");
    let mut hf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    hf["quantization"]["quant_algo"] = json!("FP8");
    fixture::write_json(&path, &hf);
    let r = diagnose(&invalid);
    assert_finding(&r, "quant-config-invalid", "quant_algo");
}

#[test]
fn index_and_shard_findings() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let t = tmp.path();
    let dir = bf16(t, &Spec::qwen36(), 3);
    let index_path = dir.join("model.safetensors.index.json");
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index_path).expect("read")).expect("json");
    let shard = |i: usize| format!("model-{:05}-of-00003.safetensors", i);
    let variant = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| -> Report {
        let to = t.join(name);
        std::fs::create_dir(&to).expect("mkdir");
        for file in fixture::listing(&dir) {
            std::fs::copy(dir.join(&file), to.join(&file)).expect("copy");
        }
        let mut index = index.clone();
        edit(&mut index);
        fixture::write_json(&to.join("model.safetensors.index.json"), &index);
        diagnose(&to)
    };
    let r = variant("missing-shard", &|i| {
        i["weight_map"]["lm_head.weight"] = json!("model-00009-of-00009.safetensors")
    });
    assert_finding(
        &r,
        "index-shard-missing",
        "model-00009-of-00009.safetensors",
    );
    std::fs::write(t.join("outside.safetensors"), b"x").expect("outside");
    let r = variant("escape", &|i| {
        i["weight_map"]["lm_head.weight"] = json!("../outside.safetensors")
    });
    assert_finding(&r, "index-shard-escapes", "../outside.safetensors");
    let r = variant("absent", &|i| {
        i["weight_map"]["model.language_model.ghost.weight"] = json!(shard(1))
    });
    assert_finding(
        &r,
        "index-tensor-absent",
        "model.language_model.ghost.weight",
    );
    let r = variant("unindexed", &|i| {
        i["weight_map"]
            .as_object_mut()
            .expect("map")
            .remove("lm_head.weight");
    });
    assert_finding(&r, "shard-tensor-unindexed", "lm_head.weight");
    assert_finding(&r, "tensor-missing", "lm_head.weight");
    let r = variant("invalid", &|i| *i = json!({"metadata": {}}));
    assert_finding(&r, "index-invalid", "model.safetensors.index.json");
}

/// A folder with the tiny config and a hand-made `model.safetensors`: `header` JSON, then
/// `data_len` bytes (the 8-byte length prefix says `claimed` when given).
fn raw_shard(t: &Path, name: &str, header: &str, data_len: usize, claimed: Option<u64>) -> Report {
    let dir = t.join(name);
    std::fs::create_dir(&dir).expect("mkdir");
    fixture::write_json(
        &dir.join("config.json"),
        &fixture::config_json(&Spec {
            vl: false,
            ..Spec::qwen36()
        }),
    );
    let mut bytes = claimed
        .unwrap_or(header.len() as u64)
        .to_le_bytes()
        .to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend(std::iter::repeat_n(0u8, data_len));
    std::fs::write(dir.join("model.safetensors"), bytes).expect("write");
    diagnose(&dir)
}

#[test]
fn structural_shard_findings() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let t = tmp.path();
    let r = raw_shard(
        t,
        "overlap",
        r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
        12,
        None,
    );
    assert_finding(&r, "shard-offsets-overlap", "model.safetensors: b");
    let r = raw_shard(
        t,
        "bounds",
        r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
        4,
        None,
    );
    assert_finding(&r, "shard-offsets-out-of-bounds", "model.safetensors: a");
    let r = raw_shard(
        t,
        "past-end",
        r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
        8,
        Some(4096),
    );
    assert_finding(&r, "shard-header-past-end", "model.safetensors");
    let r = raw_shard(
        t,
        "size",
        r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
        8,
        None,
    );
    assert_finding(&r, "shard-tensor-size", "model.safetensors: a");
    let r = raw_shard(
        t,
        "gap",
        r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
        16,
        None,
    );
    assert_finding(&r, "shard-offsets-gap", "model.safetensors: a");
    assert_finding(&r, "shard-trailing-bytes", "model.safetensors");
    let r = raw_shard(t, "json", "{not json", 0, None);
    assert_finding(&r, "shard-header-invalid", "model.safetensors");
}

#[test]
fn vision_language_family_and_config_findings() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let t = tmp.path();
    let dir = bf16(t, &Spec::qwen36(), 1);
    std::fs::remove_file(dir.join("processor_config.json")).expect("rm");
    std::fs::remove_file(dir.join("video_preprocessor_config.json")).expect("rm");
    let r = diagnose(&dir);
    assert_finding(&r, "vl-processor-file-missing", "processor_config.json");
    assert_finding(
        &r,
        "vl-processor-file-missing",
        "video_preprocessor_config.json",
    );
    assert_eq!(r.findings.len(), 2, "{:#?}", r.findings);

    // a Qwen3.5-layout checkpoint whose config says Qwen3-Next
    let next = t.join("next");
    let spec = Spec {
        vl: false,
        ..Spec::qwen36()
    };
    fixture::write_checkpoint(&next, &spec, 1);
    let mut config = fixture::config_json(&spec);
    let object = config.as_object_mut().expect("object");
    object.insert("model_type".into(), json!("qwen3_next"));
    object.remove("mtp_num_hidden_layers");
    object.insert("num_nextn_predict_layers".into(), json!(1));
    fixture::write_json(&next.join("config.json"), &config);
    let r = diagnose(&next);
    assert_finding(&r, "family-mismatch", "model_type");
    let message = &r
        .findings
        .iter()
        .find(|f| f.code == "family-mismatch")
        .expect("finding")
        .message;
    assert!(
        message.contains("qwen3_5_mtp") && message.contains("~0%"),
        "{message}"
    );

    std::fs::write(next.join("config.json"), "{\"model_type\": \"llama\"}").expect("write");
    assert_finding(&diagnose(&next), "config-invalid", "model_type");
    std::fs::remove_file(next.join("config.json")).expect("rm");
    assert_finding(&diagnose(&next), "config-missing", "config.json");

    let (code, stdout, _) = fixture::fp4spec(&["doctor", next.to_str().expect("utf8"), "--json"]);
    assert_eq!(code, 1, "findings exit 1");
    let json: serde_json::Value = serde_json::from_str(&stdout).expect("json");
    let first = &json["findings"][0];
    assert!(
        first["code"].is_string() && first["subject"].is_string() && first["message"].is_string(),
        "{first}"
    );
    let (code, _, stderr) =
        fixture::fp4spec(&["doctor", t.join("nowhere").to_str().expect("utf8")]);
    assert_eq!(code, 2, "not a folder: {stderr}");
}
