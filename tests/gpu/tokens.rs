//! The `tokens` family on the GPU against its CPU reference: the embedding gather and the greedy
//! argmax at the lm_head's vocabulary (248320, 31 blocks per row) and awkward ones, with ties,
//! NaN, -inf and rows of only NaN.

use crate::common::{cuda, random_bf16, rng};
use fp4spec::kernels::tokens::{self, ArgmaxWorkspace, reference};
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
        let ids_d = backend.upload(&ids).expect("upload ids");
        let mut out = backend
            .upload(&vec![f32::NAN; rows * hidden])
            .expect("poisoned output");
        tokens::embed(backend, &ids_d, &table_d, hidden, &mut out).expect("embed");
        let got = backend.download(&out).expect("download");
        assert_eq!(
            got,
            reference::embed(&ids, &table, hidden),
            "V {vocab} H {hidden}"
        );
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
        let mut ids = backend.upload(&vec![u32::MAX; rows]).expect("ids");
        let start: Vec<u32> = (0..rows as u32).map(|r| 10 * r).collect();
        let mut positions = backend.upload(&start).expect("positions");
        // twice: the counters must be back to zero after a launch
        for round in 0..2 {
            tokens::argmax(
                backend,
                &logits_d,
                &mut workspace,
                &mut ids,
                Some(&mut positions),
            )
            .expect("argmax");
            let got = backend.download(&ids).expect("download");
            let want: Vec<u32> = logits.chunks_exact(vocab).map(reference::argmax).collect();
            assert_eq!(got, want, "V {vocab} rows {rows} round {round}");
        }
        let advanced = backend.download(&positions).expect("positions");
        assert_eq!(advanced, start.iter().map(|p| p + 2).collect::<Vec<_>>());
    }
}
