//! Checking a checkpoint's tensors against its config: the real layouts pass, and every missing,
//! mis-shaped or mistyped tensor and every inconsistent MTP head is an error naming it.

use fp4spec::Error;
use fp4spec::formats::safetensors::Checkpoint;
use fp4spec::model::config::ModelConfig;
use fp4spec::model::weights::{self, ExpertLayout};
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use std::path::Path;

/// A tiny Qwen3.5-MoE: hidden 32, 4 layers (1 and 3 full attention), 4 experts, one MTP layer.
fn tiny_config(mtp: usize) -> ModelConfig {
    let text = format!(
        r#"{{"model_type": "qwen3_5_moe_text", "hidden_size": 32, "num_hidden_layers": 4,
        "full_attention_interval": 2, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "rope_parameters": {{"rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
        "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "vocab_size": 64,
        "rms_norm_eps": 1e-6, "mtp_num_hidden_layers": {mtp}}}"#
    );
    ModelConfig::parse(&text, Path::new("config.json")).expect("tiny config")
}

struct Tensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
}

fn t(name: String, shape: &[usize]) -> Tensor {
    Tensor {
        name,
        dtype: Dtype::BF16,
        shape: shape.to_vec(),
    }
}

/// A linear `[out, in]`: bf16, or NVFP4 in ModelOpt's three tensors.
fn linear(out: &mut Vec<Tensor>, name: &str, rows: usize, cols: usize, nvfp4: bool) {
    if nvfp4 {
        out.push(Tensor {
            name: format!("{name}.weight"),
            dtype: Dtype::U8,
            shape: vec![rows, cols / 2],
        });
        out.push(Tensor {
            name: format!("{name}.weight_scale"),
            dtype: Dtype::F8_E4M3,
            shape: vec![rows, cols / 16],
        });
        out.push(Tensor {
            name: format!("{name}.weight_scale_2"),
            dtype: Dtype::F32,
            shape: vec![],
        });
    } else {
        out.push(t(format!("{name}.weight"), &[rows, cols]));
    }
}

/// The tensors of ../shared/reference/qwen3_5_moe.md for the tiny config.
fn tiny_tensors(prefix: &str, fused: bool, mtp: bool, nvfp4_attention: bool) -> Vec<Tensor> {
    let mut v = vec![
        t(format!("{prefix}embed_tokens.weight"), &[64, 32]),
        t(format!("{prefix}norm.weight"), &[32]),
        t("lm_head.weight".into(), &[64, 32]),
    ];
    let layer = |v: &mut Vec<Tensor>, p: String, full: bool, fused: bool| {
        v.push(t(format!("{p}input_layernorm.weight"), &[32]));
        v.push(t(format!("{p}post_attention_layernorm.weight"), &[32]));
        if full {
            linear(v, &format!("{p}self_attn.q_proj"), 64, 32, nvfp4_attention);
            linear(v, &format!("{p}self_attn.k_proj"), 16, 32, nvfp4_attention);
            linear(v, &format!("{p}self_attn.v_proj"), 16, 32, nvfp4_attention);
            linear(v, &format!("{p}self_attn.o_proj"), 32, 32, nvfp4_attention);
            v.push(t(format!("{p}self_attn.q_norm.weight"), &[16]));
            v.push(t(format!("{p}self_attn.k_norm.weight"), &[16]));
        } else {
            let a = format!("{p}linear_attn.");
            for (name, shape) in [
                ("in_proj_qkv.weight", vec![64, 32]),
                ("in_proj_z.weight", vec![32, 32]),
                ("in_proj_b.weight", vec![2, 32]),
                ("in_proj_a.weight", vec![2, 32]),
                ("conv1d.weight", vec![64, 1, 4]),
                ("dt_bias", vec![2]),
                ("A_log", vec![2]),
                ("norm.weight", vec![16]),
                ("out_proj.weight", vec![32, 32]),
            ] {
                v.push(t(format!("{a}{name}"), &shape));
            }
        }
        let m = format!("{p}mlp.");
        v.push(t(format!("{m}gate.weight"), &[4, 32]));
        if fused {
            v.push(t(format!("{m}experts.gate_up_proj"), &[4, 32, 32]));
            v.push(t(format!("{m}experts.down_proj"), &[4, 32, 16]));
        } else {
            for e in 0..4 {
                v.push(t(format!("{m}experts.{e}.gate_proj.weight"), &[16, 32]));
                v.push(t(format!("{m}experts.{e}.up_proj.weight"), &[16, 32]));
                v.push(t(format!("{m}experts.{e}.down_proj.weight"), &[32, 16]));
            }
        }
        v.push(t(format!("{m}shared_expert.gate_proj.weight"), &[16, 32]));
        v.push(t(format!("{m}shared_expert.up_proj.weight"), &[16, 32]));
        v.push(t(format!("{m}shared_expert.down_proj.weight"), &[32, 16]));
        v.push(t(format!("{m}shared_expert_gate.weight"), &[1, 32]));
    };
    for i in 0..4 {
        layer(&mut v, format!("{prefix}layers.{i}."), i % 2 == 1, fused);
    }
    if mtp {
        v.push(t("mtp.fc.weight".into(), &[32, 64]));
        for norm in [
            "mtp.pre_fc_norm_embedding.weight",
            "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight",
        ] {
            v.push(t(norm.into(), &[32]));
        }
        layer(&mut v, "mtp.layers.0.".into(), true, false);
    }
    v
}

fn write(dir: &Path, tensors: &[Tensor]) -> Checkpoint {
    let data: Vec<Vec<u8>> = tensors
        .iter()
        .map(|t| {
            let bits = match t.dtype {
                Dtype::BF16 => 16,
                Dtype::F32 => 32,
                _ => 8,
            };
            let mut bytes = vec![0u8; t.shape.iter().product::<usize>().max(1) * bits / 8];
            if t.dtype == Dtype::F32 && t.shape.is_empty() {
                bytes = 1.0f32.to_le_bytes().to_vec();
            }
            bytes
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .zip(&data)
        .map(|(t, d)| {
            (
                t.name.clone(),
                TensorView::new(t.dtype, t.shape.clone(), d).expect("view"),
            )
        })
        .collect();
    let path = dir.join("model.safetensors");
    std::fs::write(
        &path,
        safetensors::serialize(views, None).expect("serialize"),
    )
    .expect("write");
    Checkpoint::open(dir).expect("open")
}

#[test]
fn the_vision_language_layout_with_fused_experts_and_an_mtp_head_passes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let checkpoint = write(
        dir.path(),
        &tiny_tensors("model.language_model.", true, true, false),
    );
    let report = weights::check(&checkpoint, &tiny_config(1)).expect("complete");
    assert_eq!(report.prefix, "model.language_model.");
    assert_eq!(report.experts, ExpertLayout::Fused);
    assert!(report.mtp);
    assert_eq!(report.nvfp4_linears, 0);
    assert_eq!(
        report.tensors,
        tiny_tensors("model.language_model.", true, true, false).len()
    );
}

#[test]
fn the_text_layout_with_per_expert_tensors_and_nvfp4_attention_passes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let checkpoint = write(dir.path(), &tiny_tensors("model.", false, false, true));
    let report = weights::check(&checkpoint, &tiny_config(0)).expect("complete");
    assert_eq!(
        (report.prefix.as_str(), report.experts, report.mtp),
        ("model.", ExpertLayout::PerExpert, false)
    );
    assert_eq!(
        report.nvfp4_linears,
        2 * 4,
        "q, k, v, o of the two full-attention layers"
    );
}

#[test]
fn mtp_layers_without_mtp_fc_is_the_loud_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tensors: Vec<Tensor> = tiny_tensors("model.", true, true, false)
        .into_iter()
        .filter(|t| t.name != "mtp.fc.weight")
        .collect();
    let err =
        weights::check(&write(dir.path(), &tensors), &tiny_config(1)).expect_err("incomplete MTP");
    let text = err.to_string();
    assert!(
        text.contains("mtp.fc.weight") && text.contains("reject every draft"),
        "{text}"
    );
}

#[test]
fn config_and_tensors_must_agree_on_the_mtp_head() {
    let dir = tempfile::tempdir().expect("tempdir");
    let err = weights::check(
        &write(dir.path(), &tiny_tensors("model.", true, false, false)),
        &tiny_config(1),
    )
    .expect_err("no mtp");
    assert!(err.to_string().contains("declares 1 MTP layer"), "{err}");
    let dir = tempfile::tempdir().expect("tempdir");
    let err = weights::check(
        &write(dir.path(), &tiny_tensors("model.", true, true, false)),
        &tiny_config(0),
    )
    .expect_err("unexpected mtp");
    assert!(err.to_string().contains("declares no MTP layers"), "{err}");
}

#[test]
fn a_missing_misshaped_or_mistyped_tensor_is_named() {
    let name = "model.layers.2.linear_attn.in_proj_z.weight";
    let dir = tempfile::tempdir().expect("tempdir");
    let tensors: Vec<Tensor> = tiny_tensors("model.", true, false, false)
        .into_iter()
        .filter(|t| t.name != name)
        .collect();
    let err = weights::check(&write(dir.path(), &tensors), &tiny_config(0)).expect_err("missing");
    assert!(
        matches!(&err, Error::MissingTensor { tensor, .. } if tensor == name),
        "{err}"
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let mut tensors = tiny_tensors("model.", true, false, false);
    tensors
        .iter_mut()
        .filter(|t| t.name == name)
        .for_each(|t| t.shape = vec![31, 32]);
    let err = weights::check(&write(dir.path(), &tensors), &tiny_config(0)).expect_err("shape");
    assert!(
        matches!(&err, Error::Shape { tensor, .. } if tensor == name),
        "{err}"
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let mut tensors = tiny_tensors("model.", true, false, false);
    tensors
        .iter_mut()
        .filter(|t| t.name == name)
        .for_each(|t| t.dtype = Dtype::I8);
    let err = weights::check(&write(dir.path(), &tensors), &tiny_config(0)).expect_err("dtype");
    assert!(
        matches!(&err, Error::Dtype { tensor, .. } if tensor == name),
        "{err}"
    );
}

// ---- NVFP4 checkpoints as ModelOpt / compressed-tensors write them ----

use fp4spec::formats::quant_config::{Convention, QuantConfig};
use fp4spec::formats::safetensors::{HeaderCatalog, TensorHeaders};
use fp4spec::model::weights::ProblemKind;

/// The tiny layout as a header catalogue with the main layers' fused experts in ModelOpt's
/// fused NVFP4 form (per-expert scales) and the attention linears NVFP4 with input scales.
fn fused_nvfp4_catalog(drop: &[&str]) -> HeaderCatalog {
    let file = Path::new("model.safetensors");
    let mut catalog = HeaderCatalog::new("fixture");
    for t in tiny_tensors("model.", true, false, true) {
        let (dtype, shape) = if t.name.ends_with("experts.gate_up_proj") {
            (Dtype::U8, vec![4, 32, 16])
        } else if t.name.ends_with("experts.down_proj") {
            (Dtype::U8, vec![4, 32, 8])
        } else {
            (t.dtype, t.shape.clone())
        };
        catalog.insert(&t.name, file, dtype, shape);
        if t.name.ends_with("_proj.weight_scale_2") {
            let input = t.name.replace("weight_scale_2", "input_scale");
            catalog.insert(&input, file, Dtype::F32, vec![]);
        }
    }
    for layer in 0..4 {
        for (proj, rows, cols) in [("gate_up_proj", 32, 32), ("down_proj", 32, 16)] {
            let p = format!("model.layers.{layer}.mlp.experts.{proj}");
            catalog.insert(
                &format!("{p}_weight_scale"),
                file,
                Dtype::F8_E4M3,
                vec![4, rows, cols / 16],
            );
            catalog.insert(&format!("{p}_weight_scale_2"), file, Dtype::F32, vec![4]);
            catalog.insert(&format!("{p}_input_scale"), file, Dtype::F32, vec![4]);
        }
    }
    let names: Vec<String> = drop.iter().map(|s| s.to_string()).collect();
    let mut kept = HeaderCatalog::new("fixture");
    for name in catalog.names() {
        if !names.iter().any(|d| d == name) {
            let h = catalog.header(name).expect("header");
            kept.insert(name, file, h.dtype, h.shape.to_vec());
        }
    }
    kept
}

fn modelopt(exclude: &[&str]) -> QuantConfig {
    QuantConfig::new(
        Convention::ModelOpt,
        "NVFP4",
        exclude.iter().map(|s| s.to_string()).collect(),
        "test",
    )
    .expect("config")
}

const EXCLUDE: [&str; 5] = [
    "lm_head",
    "*linear_attn*",
    "*mlp.gate",
    "*shared_expert*",
    "mtp.*",
];

#[test]
fn fused_nvfp4_experts_with_per_expert_scales_pass() {
    let catalog = fused_nvfp4_catalog(&[]);
    let report = weights::check_with(&catalog, &tiny_config(0), Some(&modelopt(&EXCLUDE)))
        .expect("ModelOpt's fused NVFP4 form");
    assert_eq!(report.nvfp4_fused_experts, 8);
    assert_eq!(report.nvfp4_linears, 8, "q, k, v, o of two layers");
    assert_eq!(report.experts, ExpertLayout::Fused);
}

#[test]
fn a_missing_per_expert_scale_is_an_error_naming_the_tensor() {
    for scale in ["_weight_scale", "_weight_scale_2", "_input_scale"] {
        let name = format!("model.layers.2.mlp.experts.down_proj{scale}");
        let catalog = fused_nvfp4_catalog(&[&name]);
        let err = weights::check_with(&catalog, &tiny_config(0), Some(&modelopt(&EXCLUDE)))
            .expect_err("missing scale");
        assert!(
            matches!(&err, Error::MissingTensor { tensor, .. } if *tensor == name),
            "{scale}: {err}"
        );
        let (_, problems) = weights::problems(&catalog, &tiny_config(0), Some(&modelopt(&EXCLUDE)));
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(problems[0].kind, ProblemKind::FusedExpertScaleMissing);
    }
    // W4A16 needs no activation scale
    let catalog = fused_nvfp4_catalog(&["model.layers.2.mlp.experts.down_proj_input_scale"]);
    let w4a16 = QuantConfig::new(
        Convention::ModelOpt,
        "W4A16_NVFP4",
        EXCLUDE.iter().map(|s| s.to_string()).collect(),
        "test",
    )
    .expect("config");
    weights::check_with(&catalog, &tiny_config(0), Some(&w4a16)).expect("W4A16");
}

#[test]
fn the_exclusion_list_decides_which_linears_are_nvfp4() {
    let catalog = fused_nvfp4_catalog(&[]);
    // excluding attention makes its NVFP4 linears wrong
    let err = weights::check_with(
        &catalog,
        &tiny_config(0),
        Some(&modelopt(&[&EXCLUDE[..], &["*self_attn*"]].concat())),
    )
    .expect_err("excluded but quantised");
    assert!(err.to_string().contains("excludes"), "{err}");
    // not excluding the shared experts makes their BF16 linears wrong
    let (_, problems) = weights::problems(
        &catalog,
        &tiny_config(0),
        Some(&modelopt(&[
            "lm_head",
            "*linear_attn*",
            "*mlp.gate",
            "mtp.*",
        ])),
    );
    assert!(!problems.is_empty());
    assert!(
        problems
            .iter()
            .all(|p| p.kind == ProblemKind::NotQuantized && p.tensor.contains("shared_expert")),
        "{problems:?}"
    );
    // a parent module excludes its children; without a config each linear is taken as stored
    let parent = modelopt(&[
        "lm_head",
        "*linear_attn*",
        "*mlp.gate",
        "*shared_expert",
        "mtp.*",
    ]);
    assert!(parent.excludes("model.layers.0.mlp.shared_expert.up_proj"));
    weights::check_with(&catalog, &tiny_config(0), Some(&parent)).expect("parent exclusion");
    weights::check_with(&catalog, &tiny_config(0), None).expect("no config: as stored");
}
