//! CPU reference of the `tokens` family.

use half::bf16;

/// The rows of `table` (`[vocab][hidden]`) that `tokens` name, as f32 `[tokens][hidden]`; a
/// token past the vocabulary gives a zero row (the kernel's guard; callers refuse such tokens).
pub fn embed(tokens: &[u32], table: &[bf16], hidden: usize) -> Vec<f32> {
    let vocab = table.len() / hidden.max(1);
    tokens
        .iter()
        .flat_map(|&t| {
            let t = t as usize;
            (0..hidden).map(move |i| {
                if t < vocab {
                    table[t * hidden + i].to_f32()
                } else {
                    0.0
                }
            })
        })
        .collect()
}

/// The greedy token of one row of logits: the lowest index of the largest value, NaN never
/// chosen; 0 for a row of only NaN.
pub fn argmax(logits: &[bf16]) -> u32 {
    let mut best: Option<(f32, usize)> = None;
    for (i, v) in logits.iter().enumerate() {
        let v = v.to_f32();
        if v.is_nan() {
            continue;
        }
        if best.is_none_or(|(b, _)| v > b) {
            best = Some((v, i));
        }
    }
    best.map_or(0, |(_, i)| i as u32)
}

/// Drafts a sequence accepts under greedy verification: `verify` is its verify rows (the pending
/// token, then the drafts `d_1 .. d_n`), `target` the target's greedy token of each row; draft
/// `d_{r+1}` stands when it equals `target[r]` and every earlier draft stood.
pub fn accepted_drafts(verify: &[u32], target: &[u32]) -> usize {
    verify
        .iter()
        .skip(1)
        .zip(target)
        .take_while(|(draft, target)| draft == target)
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(values: &[f32]) -> Vec<bf16> {
        values.iter().map(|&v| bf16::from_f32(v)).collect()
    }

    #[test]
    fn argmax_takes_the_lowest_index_of_the_largest_and_never_nan() {
        assert_eq!(argmax(&row(&[1.0, 3.0, 3.0, 2.0])), 1);
        assert_eq!(argmax(&row(&[f32::NAN, 1.0, f32::NAN, 0.5])), 1);
        assert_eq!(argmax(&row(&[f32::NAN, f32::NEG_INFINITY])), 1);
        assert_eq!(argmax(&row(&[f32::NAN, f32::NAN])), 0);
        assert_eq!(argmax(&row(&[f32::NEG_INFINITY, f32::NEG_INFINITY])), 0);
    }

    #[test]
    fn accepted_drafts_is_the_prefix_that_matches_the_rows_before() {
        // verify rows [pending, d1, d2, d3]; target of each row
        assert_eq!(accepted_drafts(&[9, 4, 5, 6], &[4, 5, 6, 7]), 3);
        assert_eq!(accepted_drafts(&[9, 4, 0, 6], &[4, 5, 6, 7]), 1);
        assert_eq!(accepted_drafts(&[9, 1, 5, 6], &[4, 5, 6, 7]), 0);
        assert_eq!(accepted_drafts(&[9], &[4]), 0);
    }

    #[test]
    fn embed_reads_rows_and_zeroes_tokens_past_the_vocabulary() {
        let table = row(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert_eq!(
            embed(&[2, 0, 3], &table, 2),
            vec![5.0, 6.0, 1.0, 2.0, 0.0, 0.0]
        );
    }
}
