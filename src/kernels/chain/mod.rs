//! Family `chain`: kernels that do nothing but chain to the one before them
//! (`kernels/templates/chain.cu`), and [`dependent_launch_seconds`], what one such launch adds
//! to a sequence of them. A decode step is a sequence of dependent launches (345 at B = 1 for
//! Qwen3.6-35B-A3B, as `bench decode` counts them), each waiting for the previous one as these do, so this is the part of
//! every kernel boundary that no kernel's own speed removes: the decode bench reports it beside
//! the copy bandwidth, as the other ceiling a step runs against. Two hand-overs are measured:
//! the grid dependency every kernel uses now ([`Handover::GridDependency`]: programmatic
//! dependent launch, the wait returns when the previous grid has finished), and arrival
//! counters in global memory ([`Handover::Counter`]: a block starts when every block of the
//! previous kernel has released its arrival), which a kernel could use instead.

pub mod reference;

use crate::backend::{Backend, DeviceVec, KernelArg, LaunchDims};
use crate::error::{Error, Result};

/// The family name (template and module).
pub const FAMILY: &str = "chain";
/// `values[index] = values[index - 1] + 1` after the previous kernel has finished.
pub const KERNEL_LINK: &str = "chain_link";
/// The same after every block of the previous link has arrived on its counter.
pub const KERNEL_LINK_POLLED: &str = "chain_link_polled";
/// The most threads per block of a link (`CHAIN_MAX_THREADS` in the template).
pub const MAX_THREADS: u32 = 1024;
/// The fewest links of a polled chain: its counters rearm two links on.
pub const MIN_POLLED_LINKS: usize = 3;

/// How a link waits for the link before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handover {
    /// The grid dependency (programmatic dependent launch where the target has it).
    GridDependency,
    /// An arrival counter per link in global memory, polled with acquire loads.
    Counter,
}

fn check_grid(blocks: u32, threads: u32) -> Result<()> {
    if blocks == 0 || threads == 0 || threads > MAX_THREADS {
        return Err(Error::invalid(
            "chain link",
            format!(
                "{blocks} blocks of {threads} threads: at least one block of 1..={MAX_THREADS}"
            ),
        ));
    }
    Ok(())
}

fn check_index(index: usize, len: usize) -> Result<u32> {
    if index == 0 || index >= len {
        return Err(Error::invalid(
            "chain link",
            format!("index {index} of {len} values: a link writes 1..{len}"),
        ));
    }
    super::check_u32("chain index", index)
}

/// Queues one link: after the previous kernel, `values[index] = values[index - 1] + 1`, on
/// `blocks` blocks of `threads` threads (every block waits for the previous kernel and lets the
/// next one in; block 0 writes).
///
/// # Errors
/// [`Error::Invalid`] for `index` 0 or past `values`, no blocks, or threads outside
/// 1..=[`MAX_THREADS`]; [`Error::BackendMismatch`] for a buffer of another backend,
/// [`Error::Compile`] / [`Error::Cuda`] / [`Error::Hip`] from the device backends.
pub fn link(
    backend: &Backend,
    values: &mut DeviceVec<u32>,
    index: usize,
    blocks: u32,
    threads: u32,
) -> Result<()> {
    let index32 = check_index(index, values.len())?;
    check_grid(blocks, threads)?;
    match backend {
        Backend::Cpu => {
            let DeviceVec::Host(v) = values else {
                return Err(backend.mismatch("chain values", values));
            };
            reference::link(v, index);
            Ok(())
        }
        Backend::Cuda(_) | Backend::Hip(_) => {
            let args = [KernelArg::output(values), KernelArg::u32(index32)];
            // SAFETY: chain.cu's chain_link parameters in order; index is in 1..values.len()
            // (checked above), the only elements it reads and writes.
            unsafe {
                backend.launch(
                    FAMILY,
                    KERNEL_LINK,
                    &LaunchDims::linear(blocks, threads),
                    &args,
                )
            }
        }
    }
}

/// Queues link `index` of a polled chain of `links` links, each of `blocks` blocks of `threads`
/// threads: once every block of link `index - 1` has arrived on `counters[index - 1]` (for link 1,
/// once `counters[0]` holds `blocks`: the caller's), `values[index] = values[index - 1] + 1`,
/// the counters of two links back lowered (link 1: the chain's last two), then every block's
/// arrival on `counters[index]`. `values` and `counters` hold `links + 1` entries.
///
/// # Errors
/// [`Error::Invalid`] for fewer than [`MIN_POLLED_LINKS`] links, buffers of another length,
/// `index` outside 1..=links, or a grid [`link`] refuses; [`Error::BackendMismatch`],
/// [`Error::Compile`] / [`Error::Cuda`] / [`Error::Hip`] as [`link`].
pub fn link_polled(
    backend: &Backend,
    values: &mut DeviceVec<u32>,
    counters: &mut DeviceVec<u32>,
    index: usize,
    links: usize,
    blocks: u32,
    threads: u32,
) -> Result<()> {
    if links < MIN_POLLED_LINKS || values.len() != links + 1 || counters.len() != links + 1 {
        return Err(Error::invalid(
            "polled chain",
            format!(
                "{links} links with {} values and {} counters: at least {MIN_POLLED_LINKS} links, \
                 links + 1 of each",
                values.len(),
                counters.len()
            ),
        ));
    }
    let index32 = check_index(index, values.len())?;
    let links32 = super::check_u32("chain links", links)?;
    check_grid(blocks, threads)?;
    match backend {
        Backend::Cpu => {
            let (DeviceVec::Host(v), DeviceVec::Host(c)) = (&mut *values, &mut *counters) else {
                return Err(backend.mismatch("chain buffers", values));
            };
            reference::link_polled(v, c, index, links, blocks);
            Ok(())
        }
        Backend::Cuda(_) | Backend::Hip(_) => {
            let args = [
                KernelArg::output(values),
                KernelArg::output(counters),
                KernelArg::u32(index32),
                KernelArg::u32(links32),
                KernelArg::u32(blocks),
            ];
            // SAFETY: chain.cu's chain_link_polled parameters in order; both buffers hold
            // links + 1 entries (checked above) and the kernel indexes 0..=links only.
            unsafe {
                backend.launch(
                    FAMILY,
                    KERNEL_LINK_POLLED,
                    &LaunchDims::linear(blocks, threads),
                    &args,
                )
            }
        }
    }
}

/// Seconds one dependent launch adds to a sequence of them: `links` links of `blocks` blocks of
/// `threads` threads handing over by `handover`, queued one after another (captured as one graph
/// and replayed where the backend captures graphs, as a decode step is; launched back to back
/// elsewhere), the median over `repeats` runs of the run's time over `links`. Checks afterwards
/// that every link ran, in order.
///
/// # Errors
/// [`Error::Invalid`] on the CPU backend (it runs no kernels), for no repeats, fewer than one
/// link (three polled), a grid [`link`] refuses, or a chain that did not count 1..=links;
/// errors of the launches, the capture and the timing events.
pub fn dependent_launch_seconds(
    backend: &Backend,
    handover: Handover,
    links: usize,
    blocks: u32,
    threads: u32,
    repeats: usize,
) -> Result<f64> {
    if matches!(backend, Backend::Cpu) {
        return Err(Error::invalid(
            "dependent launch time",
            "the CPU backend runs no kernels",
        ));
    }
    if links == 0 || repeats == 0 {
        return Err(Error::invalid(
            "dependent launch time",
            format!("{links} links, {repeats} repeats: both must be positive"),
        ));
    }
    let mut values = backend.zeros::<u32>(links + 1)?;
    let mut first_counters = vec![0u32; links + 1];
    first_counters[0] = blocks;
    let mut counters = backend.upload(&first_counters)?;
    let queue = |values: &mut DeviceVec<u32>, counters: &mut DeviceVec<u32>| -> Result<()> {
        (1..=links).try_for_each(|i| match handover {
            Handover::GridDependency => link(backend, values, i, blocks, threads),
            Handover::Counter => link_polled(backend, values, counters, i, links, blocks, threads),
        })
    };
    queue(&mut values, &mut counters)?; // loads the module: a capture cannot
    let graph = match backend {
        Backend::Cuda(_) => Some(backend.capture(|| queue(&mut values, &mut counters))?),
        _ => None,
    };
    let run = |values: &mut DeviceVec<u32>, counters: &mut DeviceVec<u32>| match &graph {
        Some(g) => g.launch(),
        None => queue(values, counters),
    };
    run(&mut values, &mut counters)?; // warm: the first replay
    let mut seconds = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let start = backend.record_event()?;
        run(&mut values, &mut counters)?;
        let end = backend.record_event()?;
        backend.synchronize()?;
        seconds.push(f64::from(start.elapsed_ms(&end)?) / 1e3 / links as f64);
    }
    let counted = backend.download(&values)?;
    if let Some(i) = (0..=links).find(|&i| counted[i] != i as u32) {
        return Err(Error::invalid(
            "dependent launch chain",
            format!(
                "value {i} is {} after the runs ({handover:?}): a link ran out of order",
                counted[i]
            ),
        ));
    }
    seconds.sort_by(f64::total_cmp);
    Ok(seconds[repeats / 2])
}
