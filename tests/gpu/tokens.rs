//! The `tokens` family on the GPU against its CPU reference: the embedding gather and the greedy
//! argmax at the lm_head's vocabulary (248320, 31 blocks per row) and awkward ones, with ties,
//! NaN, -inf and rows of only NaN, reading and writing packed tokens and columns of a table;
//! the greedy acceptance of a speculative step against the CPU backend's.

use crate::common::{cuda, random_bf16, rng};
use fp4spec::backend::{Backend, DeviceVec};
use fp4spec::kernels::tokens::{self, AcceptBuffers, ArgmaxWorkspace, TokenColumn, reference};
use half::bf16;

#[test]
fn embed_gathers_the_named_rows() {
    let Some(backend) = cuda("embed_gathers_the_named_rows") else {
        return;
    };
    let mut rng = rng("embed");
    for (vocab, hidden, rows) in [(248320, 2048, 3), (260, 128, 64), (17, 40, 1)] {
        let table = random_bf16(&mut rng, vocab * hidden);
        let ids: Vec<u32> = (0..rows)
            .map(|r| {
                if r == 0 {
                    vocab as u32 - 1
                } else {
                    (rng.next_u64() % vocab as u64) as u32
                }
            })
            .collect();
        let table_d = backend.upload(&table).expect("upload table");
        // packed, then as column 2 of a [rows][3] table
        let mut wide = vec![u32::MAX; rows * 3];
        for (r, &id) in ids.iter().enumerate() {
            wide[r * 3 + 2] = id;
        }
        for (list, column) in [
            (ids.clone(), TokenColumn::packed(rows)),
            (wide, TokenColumn::of_table(rows, 3, 2)),
        ] {
            let ids_d = backend.upload(&list).expect("upload ids");
            let mut out = backend
                .upload(&vec![f32::NAN; rows * hidden])
                .expect("poisoned output");
            tokens::embed(backend, &ids_d, column, &table_d, hidden, &mut out).expect("embed");
            let got = backend.download(&out).expect("download");
            assert_eq!(
                got,
                reference::embed(&ids, &table, hidden),
                "V {vocab} H {hidden} {column:?}"
            );
        }
    }
}

#[test]
fn argmax_picks_the_lowest_index_of_the_largest_logit() {
    let Some(backend) = cuda("argmax_picks_the_lowest_index_of_the_largest_logit") else {
        return;
    };
    let mut rng = rng("argmax");
    for (vocab, rows) in [
        (248320, 5),
        (248320, 64),
        (260, 3),
        // whole 16-byte units but not a whole round of them per thread
        (264, 3),
        (8193, 2),
        (1, 2),
        (31, 7),
    ] {
        let mut logits = random_bf16(&mut rng, vocab * rows);
        for r in 0..rows {
            let row = &mut logits[r * vocab..(r + 1) * vocab];
            match r % 5 {
                // a tie of the maximum across two blocks of the row: the lower index wins
                1 => {
                    let (a, b) = (vocab / 3, vocab - 1);
                    row[a] = bf16::from_f32(40.0);
                    row[b] = bf16::from_f32(40.0);
                }
                // NaN everywhere but one -inf: never NaN, the -inf is the answer
                2 => {
                    row.fill(bf16::NAN);
                    row[vocab / 2] = bf16::NEG_INFINITY;
                }
                // only NaN: 0
                3 => row.fill(bf16::NAN),
                // a NaN beside the true maximum
                4 => {
                    row[0] = bf16::NAN;
                    row[vocab - 1] = bf16::from_f32(50.0);
                }
                _ => {}
            }
        }
        let logits_d = backend.upload(&logits).expect("upload logits");
        let mut workspace = ArgmaxWorkspace::new(backend, rows, vocab).expect("workspace");
        // packed, then into column 1 of a [rows][4] table (the rest untouched)
        let mut ids = backend.upload(&vec![u32::MAX; rows]).expect("ids");
        let mut table = backend.upload(&vec![u32::MAX; rows * 4]).expect("ids");
        let start: Vec<u32> = (0..rows as u32).map(|r| 10 * r).collect();
        let mut positions = backend.upload(&start).expect("positions");
        let want: Vec<u32> = logits.chunks_exact(vocab).map(reference::argmax).collect();
        // twice: the counters must be back to zero after a launch
        for round in 0..2 {
            tokens::argmax(
                backend,
                &logits_d,
                &mut workspace,
                &mut ids,
                TokenColumn::packed(rows),
                Some(&mut positions),
            )
            .expect("argmax");
            let got = backend.download(&ids).expect("download");
            assert_eq!(got, want, "V {vocab} rows {rows} round {round}");
        }
        let advanced = backend.download(&positions).expect("positions");
        assert_eq!(advanced, start.iter().map(|p| p + 2).collect::<Vec<_>>());
        tokens::argmax(
            backend,
            &logits_d,
            &mut workspace,
            &mut table,
            TokenColumn::of_table(rows, 4, 1),
            None,
        )
        .expect("argmax into a column");
        let got = backend.download(&table).expect("download");
        for r in 0..rows {
            assert_eq!(got[r * 4 + 1], want[r], "V {vocab} row {r} in a column");
            for c in [0, 2, 3] {
                assert_eq!(
                    got[r * 4 + c],
                    u32::MAX,
                    "V {vocab} row {r} column {c} written"
                );
            }
        }
    }
}

/// Every buffer [`tokens::accept_greedy`] writes, downloaded, in the order of [`AcceptBuffers`]:
/// verify tokens, chain hidden, accepted counts, row positions, chain positions, history,
/// statistics.
type Accepted = (
    Vec<u32>,
    Vec<bf16>,
    Vec<u32>,
    Vec<u32>,
    Vec<u32>,
    Vec<u32>,
    Vec<u32>,
);

/// Runs [`tokens::accept_greedy`] on `backend` from the given inputs.
#[allow(clippy::too_many_arguments)]
fn accept_on(
    backend: &Backend,
    sequences: usize,
    drafts: usize,
    hidden: usize,
    capacity: usize,
    verify: &[u32],
    target: &[u32],
    mtp: &[bf16],
    positions: &[u32],
) -> Accepted {
    let up = |v: &[u32]| backend.upload(v).expect("upload");
    let mut verify_d = up(verify);
    let target_d = up(target);
    let mtp_d: DeviceVec<bf16> = backend.upload(mtp).expect("upload");
    let mut chain = backend.zeros(sequences * hidden).expect("chain");
    let mut accepted = backend.zeros(sequences).expect("accepted");
    let mut positions_d = up(positions);
    let mut chain_positions = backend.zeros(sequences).expect("chain positions");
    let mut history = backend.zeros(sequences * capacity).expect("history");
    let mut stats = backend.zeros(sequences * (drafts + 1)).expect("stats");
    tokens::accept_greedy(
        backend,
        sequences,
        drafts,
        hidden,
        AcceptBuffers {
            verify_tokens: &mut verify_d,
            target: &target_d,
            mtp_hidden: &mtp_d,
            chain_hidden: &mut chain,
            accepted: &mut accepted,
            row_positions: &mut positions_d,
            chain_positions: &mut chain_positions,
            history: &mut history,
            stats: &mut stats,
        },
    )
    .expect("accept");
    let down = |v: &DeviceVec<u32>| backend.download(v).expect("download");
    (
        down(&verify_d),
        backend.download(&chain).expect("download"),
        down(&accepted),
        down(&positions_d),
        down(&chain_positions),
        down(&history),
        down(&stats),
    )
}

#[test]
fn greedy_acceptance_matches_the_cpu_backend() {
    let Some(backend) = cuda("greedy_acceptance_matches_the_cpu_backend") else {
        return;
    };
    let mut rng = rng("accept");
    for (sequences, drafts, hidden, capacity) in
        [(1, 1, 2048, 64), (5, 3, 2048, 40), (64, 4, 130, 30)]
    {
        let width = drafts + 1;
        let rows = sequences * width;
        // drafts that follow the target's tokens for a random number of positions, then differ
        let target: Vec<u32> = (0..rows).map(|_| (rng.next_u64() % 1000) as u32).collect();
        let mut verify = vec![0u32; rows];
        for s in 0..sequences {
            let keep = (rng.next_u64() % (drafts as u64 + 1)) as usize;
            verify[s * width] = 7;
            for d in 0..drafts {
                let t = target[s * width + d];
                verify[s * width + 1 + d] = if d < keep { t } else { t + 1 };
            }
        }
        let mtp = random_bf16(&mut rng, rows * hidden);
        // near the end of the history for some sequences: writes past it are dropped
        let positions: Vec<u32> = (0..sequences)
            .flat_map(|s| {
                let p = (s * 7 % (capacity - 2)) as u32;
                (0..width as u32).map(move |r| p + r)
            })
            .collect();
        let run = |b: &Backend| {
            accept_on(
                b, sequences, drafts, hidden, capacity, &verify, &target, &mtp, &positions,
            )
        };
        let (cpu, gpu) = (run(&Backend::Cpu), run(backend));
        assert_eq!(cpu, gpu, "B {sequences} n {drafts} H {hidden}");
        assert!(cpu.2.iter().all(|&a| (1..=width as u32).contains(&a)));
    }
}
