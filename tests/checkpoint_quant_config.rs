//! The quantisation config: fnmatch as Python has it, both files and both conventions parsed,
//! disagreement between them an error, compressed-tensors `re:` entries.

use fp4spec::formats::quant_config::{Convention, QuantConfig, fnmatch};
use serde_json::json;

#[test]
fn fnmatch_is_pythons_fnmatchcase() {
    for (pattern, name, want) in [
        (
            "*linear_attn*",
            "model.layers.0.linear_attn.in_proj_qkv",
            true,
        ),
        ("*mlp.gate", "model.layers.0.mlp.gate", true),
        ("*mlp.gate", "model.layers.0.mlp.gate_proj", false),
        ("mtp.*", "mtp.layers.0.mlp.experts.3.up_proj", true),
        ("mtp.*", "model.mtp", false),
        ("lm_head", "lm_head", true),
        ("lm_head", "lm_head2", false),
        ("layers.?.x", "layers.7.x", true),
        ("layers.?.x", "layers.17.x", false),
        ("layers.[0-3].x", "layers.2.x", true),
        ("layers.[!0-3].x", "layers.2.x", false),
        ("layers.[!0-3].x", "layers.5.x", true),
        ("a[]]b", "a]b", true),
        ("a[b", "a[b", true),
        ("**a*b*", "xxaxxbxx", true),
        ("*a*b", "xxaxxbxxc", false),
        ("", "", true),
        ("*", "", true),
    ] {
        assert_eq!(
            fnmatch(pattern, name),
            want,
            "fnmatch({pattern:?}, {name:?})"
        );
    }
}

#[test]
fn both_files_parse_and_must_agree() {
    let dir = tempfile::tempdir().expect("tempdir");
    let hf = json!({"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head", "*linear_attn*"]}});
    std::fs::write(dir.path().join("hf_quant_config.json"), hf.to_string()).expect("write");
    let q = QuantConfig::load(dir.path())
        .expect("load")
        .expect("present");
    assert_eq!(
        (q.convention, q.quant_algo.as_str(), q.activation_scales),
        (Convention::ModelOpt, "NVFP4", true)
    );
    assert!(
        q.excludes("model.layers.4.linear_attn.out_proj")
            && !q.excludes("model.layers.3.self_attn.q_proj")
    );

    let config = json!({"model_type": "x", "quantization_config": q.quantization_config_json()});
    std::fs::write(dir.path().join("config.json"), config.to_string()).expect("write");
    QuantConfig::load(dir.path()).expect("agree");
    let config = json!({"model_type": "x", "quantization_config": {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}});
    std::fs::write(dir.path().join("config.json"), config.to_string()).expect("write");
    let err = QuantConfig::load(dir.path()).expect_err("disagree");
    assert!(err.to_string().contains("*linear_attn*"), "{err}");

    let bad = json!({"quantization": {"quant_algo": "NVFP4", "group_size": 32}});
    std::fs::write(dir.path().join("hf_quant_config.json"), bad.to_string()).expect("write");
    let err = QuantConfig::load(dir.path()).expect_err("group 32");
    assert!(err.to_string().contains("group_size"), "{err}");
}

#[test]
fn compressed_tensors_with_regular_expressions() {
    let value = json!({
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "group_size": 16},
            "input_activations": null}},
        "ignore": ["lm_head", "re:.*mlp\\.gate$", "re:model\\.visual.*"]});
    let q = QuantConfig::from_json(&value, "config.json: quantization_config").expect("parse");
    assert_eq!(
        (q.convention, q.quant_algo.as_str()),
        (Convention::CompressedTensors, "W4A16_NVFP4")
    );
    assert!(q.excludes("model.layers.0.mlp.gate"));
    assert!(!q.excludes("model.layers.0.mlp.gate_proj"));
    assert!(q.excludes("model.visual.blocks.0.attn.qkv"));
    let round =
        QuantConfig::from_json(&q.quantization_config_json(), "round trip").expect("round trip");
    assert_eq!(round, q);
    let int4 = json!({"quant_method": "compressed-tensors", "config_groups": {"g": {
        "format": "pack-quantized", "weights": {"num_bits": 4, "type": "int"}}}});
    assert!(QuantConfig::from_json(&int4, "c").is_err());
}
