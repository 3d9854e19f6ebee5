//! `config.json` parsing: the real layouts and every rejection naming its field.

use fp4spec::model::config::{Family, LayerKind, ModelConfig};
use serde_json::{Value, json};
use std::path::Path;

/// The language fields of Qwen3.6-35B-A3B (../shared/reference/qwen3_5_moe.md).
fn qwen36_text() -> Value {
    json!({
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "full_attention_interval": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "rope_parameters": {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10], "mrope_interleaved": true},
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "vocab_size": 248320,
        "rms_norm_eps": 1e-6,
        "attn_output_gate": true,
        "mtp_num_hidden_layers": 1,
        "model_type": "qwen3_5_moe_text"
    })
}

fn vl_wrapper(text: Value) -> Value {
    json!({"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"], "tie_word_embeddings": false, "text_config": text})
}

fn parse(value: &Value) -> fp4spec::Result<ModelConfig> {
    ModelConfig::parse(&value.to_string(), Path::new("config.json"))
}

fn error_of(value: &Value) -> String {
    parse(value).expect_err("must be rejected").to_string()
}

#[test]
fn the_vision_language_wrapper_of_qwen36_35b_a3b() {
    let config = parse(&vl_wrapper(qwen36_text())).expect("parses");
    assert_eq!(config.family, Family::Qwen35Moe);
    assert!(config.vision_language);
    assert_eq!(config.num_hidden_layers(), 40);
    assert_eq!(config.layer_counts(), (30, 10));
    for (i, kind) in config.layer_types.iter().enumerate() {
        let full = (i + 1) % 4 == 0;
        assert_eq!(
            *kind,
            if full {
                LayerKind::FullAttention
            } else {
                LayerKind::LinearAttention
            },
            "layer {i}"
        );
    }
    assert_eq!(config.rotary_dim(), 64);
    assert_eq!(config.linear_conv_dim(), 8192);
    assert_eq!(config.rope_theta, 1e7);
    assert_eq!(config.mtp_num_hidden_layers, 1);
    assert_eq!(
        (
            config.num_experts,
            config.num_experts_per_tok,
            config.vocab_size
        ),
        (256, 8, 248320)
    );
    assert!(!config.tie_word_embeddings);
    assert_eq!(config.family.mtp_class(), "qwen3_5_mtp");
    assert_eq!(
        ModelConfig::qwen36_35b_a3b(),
        config,
        "the embedded preset is the same model"
    );
}

#[test]
fn a_text_only_config_with_explicit_layer_types() {
    let mut text = qwen36_text();
    let types: Vec<&str> = (0..40)
        .map(|i| {
            if i % 2 == 0 {
                "linear_attention"
            } else {
                "full_attention"
            }
        })
        .collect();
    text["layer_types"] = json!(types);
    let config = parse(&text).expect("parses");
    assert!(!config.vision_language);
    assert_eq!(config.layer_counts(), (20, 20));
    assert_eq!(config.layer_types[1], LayerKind::FullAttention);
}

#[test]
fn qwen3_next_is_flat_and_counts_mtp_in_num_nextn_predict_layers() {
    let mut text = qwen36_text();
    let map = text.as_object_mut().expect("object");
    map.remove("mtp_num_hidden_layers");
    map.insert("model_type".into(), json!("qwen3_next"));
    map.insert("num_hidden_layers".into(), json!(48));
    map.insert("num_experts".into(), json!(512));
    map.insert("num_experts_per_tok".into(), json!(10));
    map.insert("vocab_size".into(), json!(151936));
    map.insert("num_nextn_predict_layers".into(), json!(1));
    map.remove("rope_parameters");
    map.insert("rope_theta".into(), json!(10000000.0));
    map.insert("partial_rotary_factor".into(), json!(0.25));
    let config = parse(&text).expect("parses");
    assert_eq!(config.family, Family::Qwen3Next);
    assert_eq!(config.family.mtp_class(), "qwen3_next_mtp");
    assert_eq!(
        (
            config.num_hidden_layers(),
            config.num_experts_per_tok,
            config.mtp_num_hidden_layers
        ),
        (48, 10, 1)
    );
    assert_eq!(config.layer_counts(), (36, 12));
}

#[test]
fn no_mtp_field_means_no_mtp_head() {
    let mut text = qwen36_text();
    text.as_object_mut()
        .expect("object")
        .remove("mtp_num_hidden_layers");
    assert_eq!(parse(&text).expect("parses").mtp_num_hidden_layers, 0);
}

#[test]
fn unknown_model_types_are_errors_naming_the_field_and_the_known_ones() {
    let mut text = qwen36_text();
    text["model_type"] = json!("llama");
    let err = error_of(&text);
    assert!(
        err.contains("model_type") && err.contains("llama") && err.contains("qwen3_5_moe"),
        "{err}"
    );
    text.as_object_mut().expect("object").remove("model_type");
    assert!(error_of(&text).contains("model_type"));
}

#[test]
fn missing_and_mistyped_fields_are_named_with_their_path() {
    let mut text = qwen36_text();
    text.as_object_mut().expect("object").remove("hidden_size");
    let err = error_of(&vl_wrapper(text));
    assert!(
        err.contains("config.json: text_config.hidden_size") && err.contains("missing"),
        "{err}"
    );

    let mut text = qwen36_text();
    text["num_experts"] = json!("256");
    let err = error_of(&text);
    assert!(
        err.contains("num_experts") && err.contains("positive integer"),
        "{err}"
    );

    let mut text = qwen36_text();
    text["rope_parameters"]["rope_theta"] = json!(-1.0);
    let err = error_of(&vl_wrapper(text));
    assert!(
        err.contains("text_config.rope_parameters.rope_theta"),
        "{err}"
    );

    let err = ModelConfig::parse("{not json", Path::new("config.json"))
        .expect_err("rejected")
        .to_string();
    assert!(err.contains("not valid JSON"), "{err}");
}

#[test]
fn inconsistent_fields_are_errors_naming_the_field() {
    let cases: [(&str, Value, &str); 5] = [
        (
            "layer_types",
            json!(vec!["linear_attention"; 39]),
            "39 entries",
        ),
        (
            "layer_types",
            json!(
                (0..40)
                    .map(|i| if i == 7 { "sliding" } else { "full_attention" })
                    .collect::<Vec<_>>()
            ),
            "layer_types[7]",
        ),
        ("num_key_value_heads", json!(3), "does not divide"),
        ("num_experts_per_tok", json!(300), "more than num_experts"),
        ("linear_num_key_heads", json!(12), "does not divide"),
    ];
    for (field, value, expected) in cases {
        let mut text = qwen36_text();
        text[field] = value;
        let err = error_of(&text);
        assert!(
            err.contains(field) && err.contains(expected),
            "{field}: {err}"
        );
    }
    let mut text = qwen36_text();
    text["rope_parameters"]["partial_rotary_factor"] = json!(0.3);
    let err = error_of(&text);
    assert!(err.contains("partial_rotary_factor"), "{err}");
    let mut text = qwen36_text();
    text.as_object_mut()
        .expect("object")
        .remove("full_attention_interval");
    let err = error_of(&text);
    assert!(
        err.contains("layer_types") && err.contains("full_attention_interval"),
        "{err}"
    );
}

/// Sizes past what any model of the family has are refused before anything is sized from them
/// (a corrupt count would otherwise overflow a product or ask for terabytes), naming the field.
#[test]
fn sizes_past_the_limits_and_an_ungated_attention_are_refused() {
    let huge = json!(u64::MAX / 2);
    for field in [
        "num_hidden_layers",
        "hidden_size",
        "vocab_size",
        "num_experts",
        "linear_key_head_dim",
        "linear_num_value_heads",
        "mtp_num_hidden_layers",
    ] {
        let mut text = qwen36_text();
        text[field] = huge.clone();
        let err = error_of(&text);
        assert!(
            err.contains(field) && err.contains("more than this crate accepts"),
            "{field}: {err}"
        );
    }
    let mut text = qwen36_text();
    text["attn_output_gate"] = json!(false);
    let err = error_of(&text);
    assert!(
        err.contains("attn_output_gate") && err.contains("gated attention"),
        "{err}"
    );
}

#[test]
fn load_reads_config_json_from_a_folder_and_names_a_missing_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let err = ModelConfig::load(dir.path())
        .expect_err("no file")
        .to_string();
    assert!(err.contains("config.json"), "{err}");
    std::fs::write(
        dir.path().join("config.json"),
        vl_wrapper(qwen36_text()).to_string(),
    )
    .expect("write");
    assert_eq!(
        ModelConfig::load(dir.path()).expect("loads").hidden_size,
        2048
    );
}
