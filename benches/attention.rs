//! Bench of the `attention` family on the device (CUDA, or HIP on a gfx1151): one decode step of
//! a Qwen3.6-35B-A3B full-attention layer (16 query heads over 2 KV heads of 256; prepare,
//! split-K attention, merge + gate) for B sequences at a given context, replayed from a CUDA
//! graph (on HIP: launched back to back), beside the time to read the sequences' K and V once at
//! the device copy bandwidth measured in the same run; every split kernel the target renders
//! ([`DecodeKernel`]: the warp-per-head reference and the mma kernel), so they compare in one run;
//! bf16 and e4m3 caches ([`KvFormat`]: the e4m3 one reads half the bytes).
//!
//! Run: `cargo bench --bench attention` on a CUDA or ROCm host (prints one skip line elsewhere).

mod common;

use common::bench_graph;
use fp4spec::formats::nvfp4::e4m3_encode;
use fp4spec::kernels::attention::reference::AttentionShape;
use fp4spec::kernels::attention::{
    self, DecodeKernel, GatedAttention, KvCache, KvFormat, KvStore, Projections, RopeTable, Rows,
    Workspace,
};
use fp4spec::rng::SplitMix64;
use half::bf16;

const SHAPE: AttentionShape = AttentionShape {
    heads: 16,
    kv_heads: 2,
    head_dim: 256,
};
const BATCHES: [usize; 3] = [1, 8, 64];
const CONTEXTS: [usize; 2] = [512, 20000];

fn main() {
    let Some(backend) = common::device_or_skip("attention") else {
        return;
    };
    common::announce(&backend);
    let mut criterion = common::criterion();
    let copy_gbs = common::copy_bandwidth_gbs(&mut criterion, &backend);
    let mut rng = SplitMix64::new(0x5eed);
    let q_norm = backend.upload(&rng.normal_vec(256, 0.3)).expect("q_norm");
    let k_norm = backend.upload(&rng.normal_vec(256, 0.3)).expect("k_norm");
    let mut rows_out = Vec::new();
    for context in CONTEXTS {
        let capacity = context + 1;
        let rope = RopeTable::new(&backend, 64, 1e7, capacity).expect("rope");
        let layer = GatedAttention {
            shape: SHAPE,
            q_norm: &q_norm,
            k_norm: &k_norm,
            eps: 1e-6,
            rope: &rope,
        };
        for (b, format) in BATCHES
            .into_iter()
            .flat_map(|b| [(b, KvFormat::Bf16), (b, KvFormat::FP8_UNIT_SCALES)])
        {
            // the caches hold random K/V over the context (filled directly: the bench times
            // the decode step, not a prefill)
            let len = b * capacity * SHAPE.kv_heads * SHAPE.head_dim;
            let mut random = || -> KvStore {
                let v = rng.normal_vec(len, 1.0);
                match format {
                    KvFormat::Bf16 => KvStore::Bf16(
                        backend
                            .upload(&v.into_iter().map(bf16::from_f32).collect::<Vec<_>>())
                            .expect("cache"),
                    ),
                    KvFormat::Fp8E4m3 { .. } => KvStore::Fp8(
                        backend
                            .upload(&v.into_iter().map(e4m3_encode).collect::<Vec<_>>())
                            .expect("cache"),
                    ),
                }
            };
            let (keys, values) = (random(), random());
            let mut cache = KvCache::new(&backend, SHAPE, b, capacity, format).expect("cache");
            cache.keys = keys;
            cache.values = values;
            let rows = Rows {
                count: b,
                slot: backend
                    .upload(&(0..b as u32).collect::<Vec<_>>())
                    .expect("slots"),
                position: backend.upload(&vec![context as u32; b]).expect("positions"),
            };
            let bf = |n: usize, rng: &mut SplitMix64| {
                backend
                    .upload(
                        &rng.normal_vec(n, 1.0)
                            .into_iter()
                            .map(bf16::from_f32)
                            .collect::<Vec<_>>(),
                    )
                    .expect("upload")
            };
            // the model's layout: one GEMM's [q_gate | k | v] per row
            let qkv = bf(b * SHAPE.projection_width(), &mut rng);
            let projections = Projections::fused(SHAPE, &qkv);
            let mut q = backend.zeros::<f32>(b * SHAPE.heads * 256).expect("q");
            let mut out = backend.zeros::<bf16>(b * SHAPE.heads * 256).expect("out");
            let mut workspace = Workspace::new(&backend, SHAPE, b, capacity).expect("workspace");
            let bytes = b as u64 * attention::kv_bytes(SHAPE, context + 1, format);
            for decode in [DecodeKernel::Warp, DecodeKernel::Mma] {
                if !backend.target().is_some_and(|t| decode.runs_on(t)) {
                    continue;
                }
                let seconds = bench_graph(
                    &mut criterion,
                    &backend,
                    "attention_decode_step",
                    &format!("{}_{}_B{b}_context{context}", decode.name(), format.name()),
                    bytes,
                    |_| {
                        attention::prepare(
                            &backend,
                            &layer,
                            &projections,
                            &rows,
                            &mut cache,
                            &mut q,
                        )
                        .expect("prepare");
                        attention::attend_with(
                            &backend,
                            decode,
                            SHAPE,
                            &q,
                            projections.q_gate,
                            &cache,
                            &rows,
                            &mut workspace,
                            &mut out,
                        )
                        .expect("attend");
                    },
                );
                rows_out.push((decode.name(), format.name(), b, context, bytes, seconds));
            }
        }
    }
    criterion.final_summary();
    println!("\ndevice-to-device copy: {copy_gbs:.0} GB/s (bytes read + written)");
    println!(
        "one decode step of one full-attention layer (prepare + attend + merge/gate); floor = K/V bytes / copy bandwidth"
    );
    println!(
        "{:<20} {:>4} {:>3} {:>7} {:>12} {:>9} {:>9} {:>7} {:>8}",
        "split kernel", "KV", "B", "context", "KV bytes", "us", "floor us", "GB/s", "of copy"
    );
    for (kernel, kv, b, context, bytes, seconds) in rows_out {
        let gbs = bytes as f64 / seconds / 1e9;
        println!(
            "{kernel:<20} {kv:>4} {b:>3} {context:>7} {bytes:>12} {:>9.2} {:>9.2} {gbs:>7.0} {:>7.1}%",
            seconds * 1e6,
            bytes as f64 / (copy_gbs * 1e9) * 1e6,
            100.0 * gbs / copy_gbs
        );
    }
}
