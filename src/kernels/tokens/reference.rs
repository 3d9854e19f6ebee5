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
