//! The device decode path on the CPU backend (the families' references in the kernels' order
//! of calls) against the CPU runner: the wiring of every layer, the caches and the argmax.

mod device_model;

use fp4spec::backend::Backend;
use fp4spec::checkpoint::quantize::{QuantizeOptions, quantize};
use fp4spec::model::device::DeviceModel;
use fp4spec::model::forward::Model;

#[test]
fn device_decode_on_the_cpu_backend_matches_the_runner() {
    device_model::decode_matches_runner(&Backend::Cpu, 12, 12);
}

#[test]
fn device_prefill_on_the_cpu_backend_matches_the_runner() {
    device_model::prefill_matches_runner(&Backend::Cpu, 8);
}

#[test]
fn device_speculation_on_the_cpu_backend_equals_decoding_without_it() {
    for drafts in [1, 3] {
        device_model::speculation_matches_plain_decoding(&Backend::Cpu, drafts, 24);
    }
}

#[test]
fn device_mtp_drafts_on_the_cpu_backend_match_the_runner() {
    device_model::mtp_drafts_match_runner(&Backend::Cpu, 5);
}

/// The demo model quantised to ModelOpt NVFP4 (per-expert experts): the device path runs the
/// stored codes and scales (its weights stream fewer bytes than the bf16 model's) and matches the
/// runner, which computes with the same codes dequantised.
#[test]
fn device_decode_runs_an_nvfp4_checkpoint_on_its_codes() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("demo-nvfp4");
    let mut options = QuantizeOptions::new(device_model::demo_dir(), &out);
    options.split_experts = true;
    quantize(&options, &indicatif::ProgressBar::hidden()).expect("quantize the demo model");
    let bf16 = DeviceModel::from_model(
        &Backend::Cpu,
        &Model::load(device_model::demo_dir()).expect("demo model"),
    )
    .expect("bf16 device model");
    let nvfp4 = DeviceModel::from_model(&Backend::Cpu, &Model::load(&out).expect("NVFP4 model"))
        .expect("NVFP4 device model");
    let (k, e) = (bf16.config().num_experts_per_tok, 1);
    assert!(
        nvfp4.weight_bytes(e, k) < bf16.weight_bytes(e, k),
        "NVFP4 {} bytes per step, bf16 {}",
        nvfp4.weight_bytes(e, k),
        bf16.weight_bytes(e, k)
    );
    device_model::decode_matches_runner_on(&Backend::Cpu, &out, 12, 12);
}
