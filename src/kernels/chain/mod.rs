//! Family `chain`: a kernel that does nothing but chain to the one before it
//! (`kernels/templates/chain.cu`), and [`dependent_launch_seconds`], what one such launch adds
//! to a sequence of them. A decode step is a sequence of dependent launches (some 420 at B = 1
//! for Qwen3.6-35B-A3B), each chained to the previous one as these are, so this is the part of
//! every kernel boundary that no kernel's own speed removes: the decode bench reports it beside
//! the copy bandwidth, as the other ceiling a step runs against.

pub mod reference;

use crate::backend::{Backend, DeviceVec, KernelArg, LaunchDims};
use crate::error::{Error, Result};

/// The family name (template and module).
pub const FAMILY: &str = "chain";
/// `values[index] = values[index - 1] + 1` after the previous kernel.
pub const KERNEL_LINK: &str = "chain_link";
/// The most threads per block of a link (`CHAIN_MAX_THREADS` in the template).
pub const MAX_THREADS: u32 = 1024;

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
    if index == 0 || index >= values.len() {
        return Err(Error::invalid(
            "chain link",
            format!(
                "index {index} of {} values: a link writes 1..{}",
                values.len(),
                values.len()
            ),
        ));
    }
    if blocks == 0 || threads == 0 || threads > MAX_THREADS {
        return Err(Error::invalid(
            "chain link",
            format!(
                "{blocks} blocks of {threads} threads: at least one block of 1..={MAX_THREADS}"
            ),
        ));
    }
    match backend {
        Backend::Cpu => {
            let DeviceVec::Host(v) = values else {
                return Err(backend.mismatch("chain values", values));
            };
            reference::link(v, index);
            Ok(())
        }
        Backend::Cuda(_) | Backend::Hip(_) => {
            let index32 = super::check_u32("chain index", index)?;
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

/// Seconds one dependent launch adds to a sequence of them: `links` links of `blocks` blocks of
/// `threads` threads queued one after another (captured as one graph and replayed where the
/// backend captures graphs, as a decode step is; launched back to back elsewhere), the median
/// over `repeats` runs of the run's time over `links`. Checks afterwards that every link ran, in
/// order.
///
/// # Errors
/// [`Error::Invalid`] on the CPU backend (it runs no kernels), for no links or repeats, a grid
/// [`link`] refuses, or a chain that did not count 1..=links; errors of the launches, the
/// capture and the timing events.
pub fn dependent_launch_seconds(
    backend: &Backend,
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
    let queue = |values: &mut DeviceVec<u32>| -> Result<()> {
        (1..=links).try_for_each(|i| link(backend, values, i, blocks, threads))
    };
    queue(&mut values)?; // loads the module: a capture cannot
    let graph = match backend {
        Backend::Cuda(_) => Some(backend.capture(|| queue(&mut values))?),
        _ => None,
    };
    let run = |values: &mut DeviceVec<u32>| match &graph {
        Some(g) => g.launch(),
        None => queue(values),
    };
    run(&mut values)?; // warm: the first replay
    let mut seconds = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let start = backend.record_event()?;
        run(&mut values)?;
        let end = backend.record_event()?;
        backend.synchronize()?;
        seconds.push(f64::from(start.elapsed_ms(&end)?) / 1e3 / links as f64);
    }
    let counted = backend.download(&values)?;
    if let Some(i) = (0..=links).find(|&i| counted[i] != i as u32) {
        return Err(Error::invalid(
            "dependent launch chain",
            format!(
                "value {i} is {} after the runs: a link ran out of order",
                counted[i]
            ),
        ));
    }
    seconds.sort_by(f64::total_cmp);
    Ok(seconds[repeats / 2])
}
