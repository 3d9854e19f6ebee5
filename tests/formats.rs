//! NVFP4 element formats, block quantisation and safetensors checkpoints (CPU only).

use fp4spec::Error;
use fp4spec::formats::nvfp4::{self, BLOCK, E2M1_VALUES, Nvfp4Matrix};
use fp4spec::formats::safetensors::Checkpoint;
use proptest::prelude::*;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use std::path::Path;

// ---- E2M1 / E4M3 ----

#[test]
fn every_e2m1_nibble_round_trips_exactly() {
    for nibble in 0u8..16 {
        let value = nvfp4::e2m1_decode(nibble);
        assert_eq!(
            nvfp4::e2m1_encode(value),
            nibble,
            "nibble {nibble:#x} = {value}"
        );
        assert_eq!(value.to_bits(), E2M1_VALUES[nibble as usize].to_bits());
    }
}

#[test]
fn every_finite_e4m3_byte_round_trips_exactly() {
    for byte in 0u8..=255 {
        let value = nvfp4::e4m3_decode(byte);
        if byte & 0x7f == 0x7f {
            assert!(value.is_nan(), "{byte:#x} must be NaN");
            continue;
        }
        assert_eq!(nvfp4::e4m3_encode(value), byte, "byte {byte:#x} = {value}");
    }
}

#[test]
fn e4m3_decodes_the_known_anchors() {
    assert_eq!(nvfp4::e4m3_decode(0x38), 1.0);
    assert_eq!(nvfp4::e4m3_decode(0x7e), 448.0);
    assert_eq!(nvfp4::e4m3_decode(0x01), 1.0 / 512.0);
    assert_eq!(nvfp4::e4m3_decode(0x08), 1.0 / 64.0);
    assert_eq!(nvfp4::e4m3_decode(0xb8), -1.0);
    assert_eq!(nvfp4::e4m3_encode(1.0e6), 0x7e, "saturates");
    assert_eq!(nvfp4::e4m3_encode(f32::NAN), 0x7f);
}

/// The nearest representable value by exhaustive search, ties to the even code.
fn nearest_by_search(value: f32, codes: impl Iterator<Item = u8>, decode: fn(u8) -> f32) -> f32 {
    let mut best = (f32::INFINITY, 0.0f32, 0u8);
    for code in codes {
        let v = decode(code);
        if v.is_nan() {
            continue;
        }
        let d = (v - value).abs();
        if d < best.0 || (d == best.0 && code & 1 == 0 && best.2 & 1 == 1) {
            best = (d, v, code);
        }
    }
    best.1
}

/// Every midpoint between two neighbouring representable values (random floats never land on
/// one) encodes to the neighbour whose code is even (its mantissa's last bit clear), with the
/// value's sign; for E2M1 also the values written out.
#[test]
fn midpoints_round_to_the_even_neighbour() {
    let e2m1_expected = [
        (0.25, 0.0),
        (0.75, 1.0),
        (1.25, 1.0),
        (1.75, 2.0),
        (2.5, 2.0),
        (3.5, 4.0),
        (5.0, 4.0),
    ];
    for (midpoint, want) in e2m1_expected {
        for sign in [1.0f32, -1.0] {
            let code = nvfp4::e2m1_encode(sign * midpoint);
            let got = nvfp4::e2m1_decode(code);
            assert_eq!(got, sign * want, "e2m1 {}", sign * midpoint);
            assert_eq!(
                code & 8 != 0,
                sign < 0.0,
                "e2m1 {}: sign bit",
                sign * midpoint
            );
        }
    }
    for code in 0u8..0x7e {
        let (lo, hi) = (nvfp4::e4m3_decode(code), nvfp4::e4m3_decode(code + 1));
        let midpoint = (lo + hi) / 2.0; // exact: both are short binary fractions
        let even = if code % 2 == 0 { code } else { code + 1 };
        for sign in [0u8, 0x80] {
            let value = if sign == 0 { midpoint } else { -midpoint };
            assert_eq!(
                nvfp4::e4m3_encode(value),
                sign | even,
                "e4m3 midpoint {value} between codes {code:#x} and {:#x}",
                code + 1
            );
        }
    }
}

proptest! {
    #[test]
    fn e2m1_encode_is_nearest_with_ties_to_even(value in -7.0f32..7.0) {
        let code = nvfp4::e2m1_encode(value);
        let got = nvfp4::e2m1_decode(code);
        let clamped = value.clamp(-6.0, 6.0);
        let want = nearest_by_search(clamped, 0u8..16, nvfp4::e2m1_decode);
        prop_assert_eq!(got, want);
        prop_assert_eq!(code & 8 != 0, value.is_sign_negative(), "sign of {}", value);
    }

    #[test]
    fn e4m3_encode_is_nearest_with_ties_to_even(value in -460.0f32..460.0) {
        let code = nvfp4::e4m3_encode(value);
        let got = nvfp4::e4m3_decode(code);
        let codes = (0u8..0x7f).chain(0x80..0xff);
        let want = nearest_by_search(value.clamp(-448.0, 448.0), codes, nvfp4::e4m3_decode);
        prop_assert_eq!(got, want);
        prop_assert_eq!(code & 0x80 != 0, value.is_sign_negative(), "sign of {}", value);
    }

    #[test]
    fn packing_puts_the_even_element_in_the_low_nibble(nibbles in prop::collection::vec(0u8..16, 0..64usize).prop_map(|mut v| { if v.len() % 2 == 1 { v.pop(); } v })) {
        let packed = nvfp4::pack_nibbles(&nibbles);
        for (i, byte) in packed.iter().enumerate() {
            prop_assert_eq!(byte & 0xf, nibbles[2 * i]);
            prop_assert_eq!(byte >> 4, nibbles[2 * i + 1]);
        }
        prop_assert_eq!(nvfp4::unpack_nibbles(&packed), nibbles);
    }

    /// Each element's error is at most half the E2M1 step at its magnitude times the block's
    /// scale (the clamped top interval included).
    #[test]
    fn block_quantisation_error_is_bounded(
        rows in 1usize..5,
        blocks in 1usize..5,
        seed in any::<u64>(),
        spread in 0.0f32..6.0,
    ) {
        let cols = blocks * BLOCK;
        let mut rng = fp4spec::rng::SplitMix64::new(seed);
        // per-block magnitudes spread over 2^spread so scales differ between blocks
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| rng.normal() * 2f32.powf(spread * ((i / BLOCK) % 3) as f32 / 2.0))
            .collect();
        let q = Nvfp4Matrix::quantize("w", &values, rows, cols).expect("finite input");
        let view = q.view();
        // the scales ModelOpt's rule gives: the tensor's amax / (6 * 448), and each block's
        // amax / (6 * global) to E4M3's precision (2^-4 relative, or its subnormal step 2^-9),
        // 1.0 where that rounds to zero; a block scale too large would still bound the error
        // below, so the rule is checked on its own
        let amax = values.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        prop_assert_eq!(q.global_scale, amax / (6.0 * 448.0));
        for r in 0..rows {
            for b in 0..blocks {
                let block = &values[r * cols + b * BLOCK..r * cols + (b + 1) * BLOCK];
                let ideal = block.iter().fold(0.0f32, |m, v| m.max(v.abs())) / (6.0 * q.global_scale);
                let got = view.block_scale(r, b) / q.global_scale;
                if ideal <= 1.0 / 1024.0 {
                    prop_assert_eq!(got, 1.0, "[{}, block {}] ideal {} rounds to zero", r, b, ideal);
                } else {
                    prop_assert!(
                        (got - ideal).abs() <= ideal / 16.0 + 1.0 / 1024.0,
                        "[{}, block {}]: scale {} for ideal {}", r, b, got, ideal
                    );
                }
            }
        }
        for r in 0..rows {
            for c in 0..cols {
                let scale = view.block_scale(r, c / BLOCK);
                let v = values[r * cols + c];
                let err = (view.value(r, c) - v).abs();
                let bound = nvfp4::e2m1_half_step((v / scale).abs()) * scale;
                prop_assert!(err <= bound * (1.0 + 1e-6), "[{r},{c}] {v}: err {err} > {bound}");
            }
        }
    }
}

#[test]
fn quantisation_follows_modelopt_scales() {
    let mut values = vec![0.0f32; 32];
    values[3] = -6.0 * 448.0; // amax of the matrix and of block 0
    values[20] = 1.5;
    let q = Nvfp4Matrix::quantize("w", &values, 1, 32).expect("finite");
    assert_eq!(q.global_scale, 1.0, "amax / (6 * 448)");
    assert_eq!(q.scales[0], 0x7e, "block 0 scale = 448");
    assert_eq!(
        nvfp4::e4m3_decode(q.scales[1]),
        0.25,
        "block 1 scale = 1.5 / 6"
    );
    assert_eq!(q.dequantize()[3], -6.0 * 448.0);
    assert_eq!(q.dequantize()[20], 1.5);
}

#[test]
fn all_zero_blocks_get_scale_one() {
    let mut values = vec![0.0f32; 48];
    values[40] = 2.0;
    let q = Nvfp4Matrix::quantize("w", &values, 1, 48).expect("finite");
    assert_eq!(q.scales[0], nvfp4::E4M3_ONE);
    assert_eq!(q.scales[1], nvfp4::E4M3_ONE);
    let zero = Nvfp4Matrix::quantize("zeros", &[0.0; 16], 1, 16).expect("finite");
    assert_eq!(zero.global_scale, 1.0);
    assert!(zero.dequantize().iter().all(|v| *v == 0.0));
}

/// Stacking keeps every row's codes and scales: the stack dequantises to the parts' values one
/// after another. Parts with another global scale, input scale or width do not stack.
#[test]
fn matrices_of_one_scale_stack_by_rows_and_others_do_not() {
    let mut rng = fp4spec::rng::SplitMix64::new(11);
    let amax = 6.0 * 448.0 * 0.01;
    let part = |rng: &mut fp4spec::rng::SplitMix64, rows: usize| {
        Nvfp4Matrix::quantize_with_global_scale(
            "part",
            &rng.normal_vec(rows * 32, 1.0),
            rows,
            32,
            amax / (6.0 * 448.0),
        )
        .expect("finite")
    };
    let (q, k, v) = (part(&mut rng, 5), part(&mut rng, 2), part(&mut rng, 3));
    let stacked = Nvfp4Matrix::stack_rows(&[&q, &k, &v]).expect("one global scale");
    assert_eq!((stacked.rows, stacked.cols), (10, 32));
    let want: Vec<f32> = [&q, &k, &v].iter().flat_map(|m| m.dequantize()).collect();
    assert_eq!(stacked.dequantize(), want);

    let mut other_scale = k.clone();
    other_scale.global_scale *= 2.0;
    assert!(Nvfp4Matrix::stack_rows(&[&q, &other_scale, &v]).is_none());
    let mut other_input = k.clone();
    other_input.input_scale = Some(0.5);
    assert!(Nvfp4Matrix::stack_rows(&[&q, &other_input, &v]).is_none());
    let wider = Nvfp4Matrix::quantize_with_global_scale(
        "wider",
        &rng.normal_vec(64, 1.0),
        1,
        64,
        amax / (6.0 * 448.0),
    )
    .expect("finite");
    assert!(Nvfp4Matrix::stack_rows(&[&q, &wider]).is_none());
    assert!(Nvfp4Matrix::stack_rows(&[]).is_none());
}

#[test]
fn nan_or_inf_in_a_weight_is_an_error_naming_the_element() {
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut values = vec![1.0f32; 64];
        values[37] = bad;
        let err = Nvfp4Matrix::quantize("layers.0.w", &values, 2, 32).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("layers.0.w") && text.contains("[1, 5]"),
            "{text}"
        );
    }
}

#[test]
fn k_not_a_multiple_of_16_is_an_error() {
    let err = Nvfp4Matrix::quantize("w", &[1.0; 40], 2, 20).unwrap_err();
    assert!(err.to_string().contains("K = 20"), "{err}");
}

// ---- safetensors checkpoints ----

struct Tensor {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

fn tensor(name: &str, dtype: Dtype, shape: &[usize], data: Vec<u8>) -> Tensor {
    Tensor {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        data,
    }
}

fn f32_scalar(name: &str, value: f32) -> Tensor {
    tensor(name, Dtype::F32, &[], value.to_le_bytes().to_vec())
}

fn write_file(path: &Path, tensors: &[Tensor]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.data).expect("valid view"),
            )
        })
        .collect();
    std::fs::write(
        path,
        safetensors::serialize(views, None).expect("serialize"),
    )
    .expect("write");
}

fn modelopt_tensors(prefix: &str, q: &Nvfp4Matrix) -> Vec<Tensor> {
    vec![
        tensor(
            &format!("{prefix}.weight"),
            Dtype::U8,
            &[q.rows, q.cols / 2],
            q.packed.clone(),
        ),
        tensor(
            &format!("{prefix}.weight_scale"),
            Dtype::F8_E4M3,
            &[q.rows, q.cols / 16],
            q.scales.clone(),
        ),
        f32_scalar(&format!("{prefix}.weight_scale_2"), q.global_scale),
        f32_scalar(&format!("{prefix}.input_scale"), 0.125),
    ]
}

fn sample_matrix() -> Nvfp4Matrix {
    let mut rng = fp4spec::rng::SplitMix64::new(7);
    Nvfp4Matrix::quantize("sample", &rng.normal_vec(4 * 64, 1.0), 4, 64).expect("finite")
}

#[test]
fn modelopt_and_compressed_tensors_load_to_the_same_matrix() {
    let dir = tempfile::tempdir().expect("tempdir");
    let q = sample_matrix();
    let mut tensors = modelopt_tensors("a", &q);
    tensors.push(tensor(
        "b.weight_packed",
        Dtype::U8,
        &[4, 32],
        q.packed.clone(),
    ));
    tensors.push(tensor(
        "b.weight_scale",
        Dtype::F8_E4M3,
        &[4, 4],
        q.scales.clone(),
    ));
    tensors.push(f32_scalar("b.weight_global_scale", 1.0 / q.global_scale));
    tensors.push(f32_scalar("b.input_global_scale", 8.0));
    let path = dir.path().join("model.safetensors");
    write_file(&path, &tensors);
    let checkpoint = Checkpoint::open(dir.path()).expect("open folder");
    let a = Nvfp4Matrix::load(&checkpoint, "a").expect("modelopt");
    let b = Nvfp4Matrix::load(&checkpoint, "b").expect("compressed-tensors");
    assert_eq!(a.packed, q.packed);
    assert_eq!(a.scales, q.scales);
    assert_eq!(a.global_scale, q.global_scale);
    assert_eq!(a.input_scale, Some(0.125));
    assert_eq!(b.input_scale, Some(0.125));
    assert_eq!(a.dequantize(), b.dequantize());
    assert!((b.global_scale - q.global_scale).abs() <= q.global_scale * 1e-6);
}

#[test]
fn sharded_checkpoints_resolve_tensors_through_the_index() {
    let dir = tempfile::tempdir().expect("tempdir");
    let q = sample_matrix();
    let tensors = modelopt_tensors("layer", &q);
    let (first, second) = tensors.split_at(2);
    write_file(&dir.path().join("model-00001-of-00002.safetensors"), first);
    write_file(&dir.path().join("model-00002-of-00002.safetensors"), second);
    let mut map = serde_json::Map::new();
    for t in first {
        map.insert(t.name.clone(), "model-00001-of-00002.safetensors".into());
    }
    for t in second {
        map.insert(t.name.clone(), "model-00002-of-00002.safetensors".into());
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .expect("write index");
    let checkpoint = Checkpoint::open(dir.path()).expect("open sharded");
    assert_eq!(checkpoint.tensor_names().len(), 4);
    let loaded = Nvfp4Matrix::load(&checkpoint, "layer").expect("load across shards");
    assert_eq!(loaded.dequantize(), q.dequantize());
    let weight = checkpoint.tensor("layer.weight").expect("present");
    assert!(weight.file.ends_with("model-00001-of-00002.safetensors"));
}

fn index_with_shard(dir: &Path, shard: &str) {
    let index = serde_json::json!({"weight_map": {"x": shard}});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string())
        .expect("write index");
}

#[test]
fn shard_names_escaping_the_folder_are_rejected() {
    let outer = tempfile::tempdir().expect("tempdir");
    let model = outer.path().join("model");
    std::fs::create_dir(&model).expect("mkdir");
    write_file(
        &outer.path().join("evil.safetensors"),
        &[f32_scalar("x", 1.0)],
    );
    let absolute = outer.path().join("evil.safetensors").display().to_string();
    for shard in [
        "../evil.safetensors",
        absolute.as_str(),
        "sub/../../evil.safetensors",
    ] {
        index_with_shard(&model, shard);
        let err = Checkpoint::open(&model).err().expect("must be rejected");
        let text = err.to_string();
        assert!(
            matches!(err, Error::Checkpoint { .. }) && text.contains(shard),
            "{shard}: {text}"
        );
    }
    // a symbolic link inside the folder that points outside is rejected too
    std::os::unix::fs::symlink(
        outer.path().join("evil.safetensors"),
        model.join("link.safetensors"),
    )
    .expect("symlink");
    index_with_shard(&model, "link.safetensors");
    let text = Checkpoint::open(&model)
        .err()
        .expect("must be rejected")
        .to_string();
    assert!(text.contains("outside the checkpoint folder"), "{text}");
}

#[test]
fn an_index_entry_missing_from_its_shard_is_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_file(&dir.path().join("a.safetensors"), &[f32_scalar("y", 1.0)]);
    index_with_shard(dir.path(), "a.safetensors");
    let text = Checkpoint::open(dir.path())
        .err()
        .expect("rejected")
        .to_string();
    assert!(
        text.contains("`x`") && text.contains("a.safetensors"),
        "{text}"
    );
}

#[test]
fn truncated_files_are_errors_naming_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("model.safetensors");
    write_file(&path, &modelopt_tensors("w", &sample_matrix()));
    let bytes = std::fs::read(&path).expect("read");
    for cut in [0, 5, 12, bytes.len() - 1] {
        std::fs::write(&path, &bytes[..cut]).expect("truncate");
        let err = Checkpoint::open(&path)
            .err()
            .expect("truncated file must fail");
        assert!(matches!(err, Error::Safetensors { .. }), "cut {cut}: {err}");
        assert!(
            err.to_string().contains("model.safetensors"),
            "cut {cut}: {err}"
        );
    }
}

/// An entry whose span disagrees with its dtype and shape: the safetensors crate's refusal names
/// no tensor, the error does.
#[test]
fn a_header_entry_the_safetensors_checks_refuse_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("model.safetensors");
    let header = r#"{"good":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"bad":{"dtype":"F32","shape":[3],"data_offsets":[8,16]}}"#;
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend(header.as_bytes());
    bytes.extend([0u8; 16]);
    std::fs::write(&path, &bytes).expect("write");
    let err = Checkpoint::open(&path).err().expect("refused").to_string();
    assert!(
        err.contains("model.safetensors") && err.contains("tensor `bad`"),
        "{err}"
    );
}

#[test]
fn wrong_dtype_and_shape_are_errors_naming_the_tensor() {
    let dir = tempfile::tempdir().expect("tempdir");
    let q = sample_matrix();
    let path = dir.path().join("model.safetensors");
    let mut tensors = modelopt_tensors("w", &q);
    tensors[1] = tensor("w.weight_scale", Dtype::U8, &[4, 4], q.scales.clone()); // should be F8_E4M3
    write_file(&path, &tensors);
    let checkpoint = Checkpoint::open(&path).expect("open");
    let err = Nvfp4Matrix::load(&checkpoint, "w").unwrap_err();
    assert!(
        matches!(&err, Error::Dtype { tensor, .. } if tensor == "w.weight_scale"),
        "{err}"
    );

    let mut tensors = modelopt_tensors("w", &q);
    tensors[1] = tensor("w.weight_scale", Dtype::F8_E4M3, &[2, 8], q.scales.clone());
    write_file(&path, &tensors);
    let checkpoint = Checkpoint::open(&path).expect("open");
    let err = Nvfp4Matrix::load(&checkpoint, "w").unwrap_err();
    assert!(
        matches!(&err, Error::Shape { tensor, found, .. } if tensor == "w.weight_scale" && found == &[2, 8]),
        "{err}"
    );

    let err = checkpoint
        .expect("w.weight", &[Dtype::BF16], &[4, 64])
        .unwrap_err();
    assert!(err.to_string().contains("expected BF16"), "{err}");
    let err = checkpoint.tensor("w.missing").unwrap_err();
    assert!(
        matches!(&err, Error::MissingTensor { tensor, .. } if tensor == "w.missing"),
        "{err}"
    );
}

#[test]
fn nvfp4_k_not_a_multiple_of_16_in_a_checkpoint_is_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("model.safetensors");
    write_file(
        &path,
        &[
            tensor("w.weight", Dtype::U8, &[2, 12], vec![0; 24]), // K = 24
            tensor("w.weight_scale", Dtype::F8_E4M3, &[2, 1], vec![0x38; 2]),
            f32_scalar("w.weight_scale_2", 1.0),
        ],
    );
    let checkpoint = Checkpoint::open(&path).expect("open");
    let err = Nvfp4Matrix::load(&checkpoint, "w").unwrap_err();
    assert!(
        err.to_string().contains("w.weight") && err.to_string().contains("K = 24"),
        "{err}"
    );
}

#[test]
fn nan_scales_and_bad_global_scales_are_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("model.safetensors");
    let q = sample_matrix();
    let mut tensors = modelopt_tensors("w", &q);
    tensors[1].data[5] = 0x7f;
    write_file(&path, &tensors);
    let err = Nvfp4Matrix::load(&Checkpoint::open(&path).expect("open"), "w").unwrap_err();
    assert!(
        err.to_string().contains("w.weight_scale") && err.to_string().contains("NaN"),
        "{err}"
    );

    let mut tensors = modelopt_tensors("w", &q);
    tensors[2] = f32_scalar("w.weight_scale_2", f32::INFINITY);
    write_file(&path, &tensors);
    let err = Nvfp4Matrix::load(&Checkpoint::open(&path).expect("open"), "w").unwrap_err();
    assert!(err.to_string().contains("w.weight_scale_2"), "{err}");
}

#[test]
fn a_folder_without_weights_says_what_it_looked_for() {
    let dir = tempfile::tempdir().expect("tempdir");
    let text = Checkpoint::open(dir.path())
        .err()
        .expect("empty folder")
        .to_string();
    assert!(
        text.contains("model.safetensors.index.json") && text.contains("model.safetensors"),
        "{text}"
    );
}
