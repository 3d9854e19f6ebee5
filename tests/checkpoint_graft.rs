//! `fp4spec graft-mtp` on checkpoints the tests write: the head arrives byte for byte, the
//! fine-tune's tensors are untouched, the result passes doctor and the runner's check, the
//! drift is what it should be, BASE and FINETUNE are not modified, and every refusal of the
//! issue refuses with nothing written.

#[path = "checkpoint_fixture/mod.rs"]
mod fixture;

use fixture::{Spec, T};
use fp4spec::checkpoint::atomic::Placed;
use fp4spec::checkpoint::doctor;
use fp4spec::checkpoint::graft::{self, GraftOptions};
use fp4spec::checkpoint::quantize::{self, QuantizeOptions};
use fp4spec::formats::quant_config::QuantConfig;
use fp4spec::formats::safetensors::Checkpoint;
use fp4spec::model::config::ModelConfig;
use fp4spec::model::weights;
use indicatif::ProgressBar;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A fine-tune of the fixture: no MTP tensors, config without MTP, and every float weight
/// moved by `relative` of its own size (deterministic).
fn finetune(dir: &Path, spec: &Spec, relative: f32, shards: usize) -> Vec<T> {
    let tuned = Spec {
        mtp_tensors: false,
        mtp_config: 0,
        ..*spec
    };
    let mut tensors = fixture::tensors(&tuned);
    for (i, t) in tensors.iter_mut().enumerate() {
        let values: Vec<f32> = t
            .f32_values()
            .iter()
            .enumerate()
            .map(|(j, v)| v * (1.0 + relative * if (i + j) % 2 == 0 { 1.0 } else { -1.0 }))
            .collect();
        *t = T::bf16(t.name.clone(), &t.shape.clone(), &values);
    }
    std::fs::create_dir_all(dir).expect("mkdir");
    fixture::write_json(&dir.join("config.json"), &fixture::config_json(&tuned));
    std::fs::write(dir.join("tokenizer.json"), "{\"tuned\": true}").expect("tokenizer");
    if spec.vl {
        for file in doctor::VL_PROCESSOR_FILES {
            std::fs::write(dir.join(file), "{}").expect("processor file");
        }
    }
    fixture::write_tensors(dir, &tensors, shards);
    tensors
}

/// SHA-256 of every file in `dir`, by name.
fn hashes(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    fixture::listing(dir)
        .into_iter()
        .map(|name| {
            let bytes = std::fs::read(dir.join(&name)).expect("read");
            (name, Sha256::digest(&bytes).to_vec())
        })
        .collect()
}

fn options(base: &Path, into: &Path, out: &Path) -> GraftOptions {
    GraftOptions {
        base: base.to_path_buf(),
        into: into.to_path_buf(),
        out: out.to_path_buf(),
        copy: false,
    }
}

fn graft(opts: &GraftOptions) -> fp4spec::Result<graft::GraftReport> {
    graft::graft_mtp(opts, &ProgressBar::hidden())
}

fn relative_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut d, mut n) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().zip(b) {
        d += ((y - x) as f64).powi(2);
        n += (*x as f64).powi(2);
    }
    (d / n).sqrt()
}

#[test]
fn the_head_is_grafted_byte_for_byte_and_the_result_passes_doctor() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (base, into, out) = (
        tmp.path().join("base"),
        tmp.path().join("tuned"),
        tmp.path().join("grafted"),
    );
    let spec = Spec::qwen36();
    let base_tensors = fixture::write_checkpoint(&base, &spec, 2);
    let tuned_tensors = finetune(&into, &spec, 0.02, 3);
    let (base_before, into_before) = (hashes(&base), hashes(&into));
    assert!(
        !doctor::diagnose(&into)
            .expect("diagnose")
            .summary
            .mtp_present
    );

    let report = graft(&options(&base, &into, &out)).expect("graft");
    assert_eq!(hashes(&base), base_before, "BASE unchanged");
    assert_eq!(hashes(&into), into_before, "FINETUNE unchanged");

    let findings = doctor::diagnose(&out).expect("diagnose");
    assert!(findings.healthy(), "{:#?}", findings.findings);
    assert!(findings.summary.mtp_present);
    let config = ModelConfig::load(&out).expect("config");
    assert_eq!(
        config.mtp_num_hidden_layers, 1,
        "FINETUNE's config made to agree"
    );
    let check = weights::check(&Checkpoint::open(&out).expect("open"), &config).expect("check");
    assert!(check.mtp);

    let written: BTreeMap<String, T> = fixture::read_all(&out)
        .into_iter()
        .map(|t| (t.name.clone(), t))
        .collect();
    let mtp: Vec<&T> = base_tensors
        .iter()
        .filter(|t| t.name.starts_with("mtp."))
        .collect();
    assert_eq!(report.mtp_tensors, mtp.len());
    for t in mtp {
        assert_eq!(&written[&t.name], t, "{} copied byte for byte", t.name);
    }
    for t in &tuned_tensors {
        assert_eq!(&written[&t.name], t, "{} is FINETUNE's", t.name);
    }
    assert_eq!(written.len(), tuned_tensors.len() + report.mtp_tensors);
    assert_eq!(report.shards.len(), 3);
    assert!(
        report.shards.iter().all(|(_, p)| *p == Placed::Linked),
        "same file system: hard links"
    );
    assert!(out.join("tokenizer.json").is_file() && out.join("preprocessor_config.json").is_file());
    assert_eq!(
        std::fs::read_to_string(out.join("tokenizer.json")).expect("read"),
        "{\"tuned\": true}"
    );

    // drift: what the head reads from the backbone, recomputed
    let by_name = |ts: &[T], n: &str| {
        ts.iter()
            .find(|t| t.name == n)
            .expect("tensor")
            .f32_values()
    };
    for (part, name) in [
        ("embed_tokens", "model.language_model.embed_tokens.weight"),
        ("lm_head", "lm_head.weight"),
        ("norm", "model.language_model.norm.weight"),
    ] {
        let want = relative_l2(
            &by_name(&base_tensors, name),
            &by_name(&tuned_tensors, name),
        );
        let got = report
            .drift
            .iter()
            .find(|d| d.part == part)
            .expect("drift part");
        assert!(
            (got.relative_l2 - want).abs() < 1e-9,
            "{part}: {} vs {want}",
            got.relative_l2
        );
    }
    assert_eq!(report.drift.len(), 3);
}

#[test]
fn a_quantised_finetune_gets_mtp_excluded_and_copies_work() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let t = tmp.path();
    let spec = Spec::qwen36();
    let base = t.join("base");
    fixture::write_checkpoint(&base, &spec, 1);
    let tuned = t.join("tuned");
    finetune(&tuned, &spec, 0.01, 1);
    let quantised = t.join("tuned-nvfp4");
    quantize::quantize(
        &QuantizeOptions::new(&tuned, &quantised),
        &ProgressBar::hidden(),
    )
    .expect("quantize");
    // an exclusion list without mtp.* (as a quantiser that never saw the head writes it)
    for (file, pointer) in [
        ("config.json", "/quantization_config/exclude_modules"),
        ("hf_quant_config.json", "/quantization/exclude_modules"),
    ] {
        let path = quantised.join(file);
        let mut value: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
        value
            .pointer_mut(pointer)
            .and_then(|v| v.as_array_mut())
            .expect("list")
            .retain(|e| e != "mtp.*");
        fixture::write_json(&path, &value);
    }
    assert!(doctor::diagnose(&quantised).expect("diagnose").healthy());
    let out = t.join("grafted");
    let report = graft(&GraftOptions {
        copy: true,
        ..options(&base, &quantised, &out)
    })
    .expect("graft");
    assert_eq!(report.exclusion_added.as_deref(), Some("mtp.*"));
    assert!(report.shards.iter().all(|(_, p)| *p == Placed::Copied));
    let findings = doctor::diagnose(&out).expect("diagnose");
    assert!(findings.healthy(), "{:#?}", findings.findings);
    let quant = QuantConfig::load(&out).expect("load").expect("present");
    assert!(quant.excludes("mtp.fc"));
}

#[test]
fn every_refusal_refuses_and_writes_nothing() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let t = tmp.path();
    let spec = Spec::qwen36();
    let base = t.join("base");
    fixture::write_checkpoint(&base, &spec, 1);
    let tuned = t.join("tuned");
    finetune(&tuned, &spec, 0.01, 1);
    let out = t.join("out");
    let refused = |opts: &GraftOptions, needle: &str| {
        let err = graft(opts).expect_err(needle);
        assert!(
            err.to_string().contains(needle),
            "wanted `{needle}` in: {err}"
        );
        assert!(!opts.out.exists(), "nothing at OUT after: {err}");
        let leftovers: Vec<String> = fixture::listing(t)
            .into_iter()
            .filter(|n| n.contains("partial"))
            .collect();
        assert!(leftovers.is_empty(), "staging left: {leftovers:?}");
    };

    // BASE without a head
    refused(&options(&tuned, &tuned, &out), "has no mtp.* tensors");

    // OUT exists
    std::fs::create_dir(&out).expect("mkdir");
    let err = graft(&options(&base, &tuned, &out)).expect_err("exists");
    assert!(err.to_string().contains("already exists"), "{err}");
    std::fs::remove_dir(&out).expect("rmdir");

    // shared parts disagree: vocabulary and hidden size
    let other = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| -> PathBuf {
        let dir = t.join(name);
        finetune(&dir, &spec, 0.01, 1);
        let mut config = fixture::config_json(&Spec {
            mtp_tensors: false,
            mtp_config: 0,
            ..spec
        });
        edit(&mut config["text_config"]);
        fixture::write_json(&dir.join("config.json"), &config);
        dir
    };
    let vocab = other("vocab", &|c| c["vocab_size"] = serde_json::json!(128));
    refused(&options(&base, &vocab, &out), "vocab_size");
    let experts = other("experts", &|c| c["num_experts"] = serde_json::json!(8));
    refused(&options(&base, &experts, &out), "num_experts");
    let embed = t.join("embed");
    fixture::edited_copy(&tuned, &embed, |ts| {
        let e = ts
            .iter_mut()
            .find(|x| x.name == "model.language_model.embed_tokens.weight")
            .expect("embed");
        e.shape = vec![32, 64];
    });
    refused(&options(&base, &embed, &out), "embed_tokens");

    // FINETUNE already has a head
    refused(&options(&base, &base, &out), "already has");

    // BASE's head incomplete
    let broken = t.join("broken");
    fixture::edited_copy(&base, &broken, |ts| {
        ts.retain(|x| x.name != "mtp.fc.weight")
    });
    refused(&options(&broken, &tuned, &out), "mtp.fc.weight");

    // the command: refusals exit 2, success 0 with the drift report
    let (b, f, o) = (
        base.to_str().expect("utf8"),
        tuned.to_str().expect("utf8"),
        out.to_str().expect("utf8"),
    );
    let (code, _, stderr) = fixture::fp4spec(&["graft-mtp", "--base", f, "--into", f, "--out", o]);
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("no mtp.* tensors"), "{stderr}");
    let (code, stdout, stderr) =
        fixture::fp4spec(&["graft-mtp", "--base", b, "--into", f, "--out", o]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stdout.contains("embed_tokens") && stdout.contains("relative L2"),
        "{stdout}"
    );
    let (code, _, stderr) =
        fixture::fp4spec(&["graft-mtp", "--base", b, "--into", f, "--out", o, "--json"]);
    assert_eq!(code, 2, "OUT exists now: {stderr}");
}
