// Family `chain`: a kernel that does nothing but chain to the kernel before it (rendered for
// {{ target.name }}): the floor under every kernel boundary of a decode step, which no kernel's
// own speed removes. CPU reference: src/kernels/chain/reference.rs. Launch and the measurement:
// src/kernels/chain/mod.rs.
{% include "common/prelude.cuh" %}

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
