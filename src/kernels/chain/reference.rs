//! CPU reference of the `chain` family.

/// What one link writes: `values[index] = values[index - 1] + 1` (wrapping). `index` is at
/// least 1 and inside `values`.
pub fn link(values: &mut [u32], index: usize) {
    values[index] = values[index - 1].wrapping_add(1);
}

/// What one polled link of a chain of `links` writes (`chain_link_polled`, `blocks` blocks):
/// [`link`], the rearming of the counters two links back (link 1: of the chain's last two,
/// for a chain of at least 3), and every block's arrival on `counters[index]`. `counters` has
/// `links + 1` entries; `index` is in 1..=links.
pub fn link_polled(
    values: &mut [u32],
    counters: &mut [u32],
    index: usize,
    links: usize,
    blocks: u32,
) {
    link(values, index);
    if index >= 3 {
        counters[index - 2] = 0;
    }
    if index == 1 && links >= 3 {
        counters[links - 1] = 0;
        counters[links] = 0;
    }
    counters[index] = counters[index].wrapping_add(blocks);
}
