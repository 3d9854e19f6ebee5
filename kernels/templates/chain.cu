// Family `chain`: kernels that do nothing but chain to the kernel before them (rendered for
// {{ target.name }}): the floor under every kernel boundary of a decode step, which no kernel's
// own speed removes, for the two ways a kernel can wait for the one before it. CPU reference:
// src/kernels/chain/reference.rs. Launch and the measurement: src/kernels/chain/mod.rs.
{% include "common/prelude.cuh" %}
{% include "common/sync.cuh" %}

// The most threads per block a link takes (the measurement picks its grid at launch).
#define CHAIN_MAX_THREADS 1024

// chain_link: values[index] = values[index - 1] + 1, after the wait for the previous kernel (the
// link before, which wrote values[index - 1]). Every block waits and lets the next kernel in, as
// every kernel of a step does (chain_after_previous_grid), so a grid of one block per SM has the
// boundary of a kernel that fills the device; block 0's first thread writes.
FP4_KERNEL void FP4_LAUNCH_BOUNDS(CHAIN_MAX_THREADS) chain_link(u32* values, u32 index) {
    chain_after_previous_grid();
    if (block_x() == 0 && thread_x() == 0) values[index] = values[index - 1] + 1u;
}

// chain_link_polled: the same link, but a block starts when every block of the previous link has
// arrived on counters[index - 1] (thread 0 polls with acquire loads; the previous link had
// `blocks_before` blocks), not when the previous grid has finished: the hand-over a kernel could
// use instead of the grid dependency. It lets the next link in at once, and arrives on
// counters[index] after its work (release). Counters rearm without a pass of their own: link i
// lowers counters[i - 2] (every block of link i - 1 polled it before letting link i in), link 1
// the last two of the chain (the launch before it, the whole chain of the previous run, has
// finished); counters[0] is the host's, never lowered.
FP4_KERNEL void FP4_LAUNCH_BOUNDS(CHAIN_MAX_THREADS) chain_link_polled(u32* values, u32* counters, u32 index, u32 links,
                                                                      u32 blocks_before) {
    block_wait_at_least(counters + index - 1, blocks_before, "the previous link's arrivals");
    allow_next_grid();
    if (block_x() == 0 && thread_x() == 0) {
        values[index] = values[index - 1] + 1u;
        if (index >= 3) counters[index - 2] = 0u;
        if (index == 1 && links >= 3) counters[links - 1] = counters[links] = 0u;
    }
    block_signal(counters + index);
}
