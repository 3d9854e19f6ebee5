//! Family `tokens`: where a decode step starts and ends (`kernels/templates/tokens.cu`): the
//! embedding gather (bf16 table rows into the f32 residual stream) and the greedy argmax over
//! the vocabulary, which writes the next step's input tokens on the device so a captured decode
//! step can be replayed without a host round trip.
//!
//! Bytes moved: embed reads `2 * hidden` and writes `4 * hidden` per row; argmax reads the row's
//! `2 * vocab` bytes of logits.

pub mod reference;

use super::{check_len, check_u32};
use crate::backend::{Backend, DeviceVec, KernelArg, LaunchDims};
use crate::error::{Error, Result};
use half::bf16;

/// The family name (template and module).
pub const FAMILY: &str = "tokens";
/// Embedding rows into the residual stream, one block per row.
pub const KERNEL_EMBED: &str = "tokens_embed";
/// Greedy argmax of each row of logits, grid (splits, rows).
pub const KERNEL_ARGMAX: &str = "tokens_argmax";

/// `residual` (`[rows][hidden]` f32) = the rows of `table` (`[vocab][hidden]` bf16) that
/// `tokens` (`[rows]`) name. A token past the vocabulary is an error on the CPU; on a device the
/// tokens are device data (written by [`argmax`] or checked by the caller when it wrote them)
/// and such a row comes out zero.
///
/// # Errors
/// [`Error::Invalid`] when the buffers disagree with `rows` and `hidden`, or (CPU) a token is
/// past the vocabulary; [`Error::BackendMismatch`], [`Error::Compile`] / [`Error::Cuda`] /
/// [`Error::Hip`] from the backends.
pub fn embed(
    backend: &Backend,
    tokens: &DeviceVec<u32>,
    table: &DeviceVec<bf16>,
    hidden: usize,
    residual: &mut DeviceVec<f32>,
) -> Result<()> {
    let rows = tokens.len();
    if hidden == 0 || table.len() % hidden != 0 {
        return Err(Error::invalid(
            "embedding table",
            format!(
                "{} values is not a whole number of rows of {hidden}",
                table.len()
            ),
        ));
    }
    let vocab = table.len() / hidden;
    check_len(
        "embedding output",
        residual,
        rows * hidden,
        &format!("[{rows}, {hidden}]"),
    )?;
    if rows == 0 {
        return Ok(());
    }
    match backend {
        Backend::Cpu => {
            let (DeviceVec::Host(t), DeviceVec::Host(w), DeviceVec::Host(r)) =
                (tokens, table, &mut *residual)
            else {
                return Err(backend.mismatch("embedding buffers", residual));
            };
            if let Some(bad) = t.iter().find(|&&t| t as usize >= vocab) {
                return Err(Error::invalid(
                    "token id",
                    format!("{bad} is outside the vocabulary of {vocab}"),
                ));
            }
            *r = reference::embed(t, w, hidden);
            Ok(())
        }
        Backend::Cuda(_) | Backend::Hip(_) => {
            let target = backend
                .target()
                .ok_or_else(|| backend.mismatch("embedding", residual))?;
            let dims = LaunchDims::linear(
                check_u32("embedding rows", rows)?,
                target.tokens.threads_per_block,
            );
            let args = [
                KernelArg::input(tokens),
                KernelArg::input(table),
                KernelArg::u32(check_u32("vocabulary", vocab)?),
                KernelArg::u32(check_u32("hidden size", hidden)?),
                KernelArg::output(residual),
            ];
            // SAFETY: tokens.cu's tokens_embed parameters in order; one block per token, rows of
            // `hidden` values in the residual (checked above), table rows read only for tokens
            // below `vocab` (the kernel tests it).
            unsafe { backend.launch(FAMILY, KERNEL_EMBED, &dims, &args) }
        }
    }
}

/// Scratch of [`argmax`] for up to `rows` rows of `vocab` logits: per row the partial results
/// of its blocks and an arrival counter (zero between launches; the last block resets it).
pub struct ArgmaxWorkspace {
    rows: usize,
    vocab: usize,
    splits: usize,
    partial_values: DeviceVec<f32>,
    partial_indices: DeviceVec<u32>,
    counters: DeviceVec<u32>,
}

impl ArgmaxWorkspace {
    /// Scratch for `rows` rows of `vocab` logits on `backend`.
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when an allocation fails.
    pub fn new(backend: &Backend, rows: usize, vocab: usize) -> Result<Self> {
        let splits = backend
            .target()
            .map_or(1, |t| vocab.div_ceil(t.tokens.argmax_chunk as usize).max(1));
        Ok(Self {
            rows,
            vocab,
            splits,
            partial_values: backend.zeros(rows.max(1) * splits)?,
            partial_indices: backend.zeros(rows.max(1) * splits)?,
            counters: backend.zeros(rows.max(1))?,
        })
    }
}

/// For each of the `tokens.len()` rows of `logits` (`[rows][vocab]` bf16): `tokens[row]` = the
/// lowest index of the row's largest value (NaN never chosen, 0 for a row of only NaN) and, when
/// given, `positions[row] += 1`. One launch on a device.
///
/// # Errors
/// [`Error::Invalid`] when the buffers disagree with the rows and the workspace's vocabulary, or
/// the workspace holds fewer rows; [`Error::BackendMismatch`], [`Error::Compile`] /
/// [`Error::Cuda`] / [`Error::Hip`] from the backends.
pub fn argmax(
    backend: &Backend,
    logits: &DeviceVec<bf16>,
    workspace: &mut ArgmaxWorkspace,
    tokens: &mut DeviceVec<u32>,
    positions: Option<&mut DeviceVec<u32>>,
) -> Result<()> {
    let (rows, vocab) = (tokens.len(), workspace.vocab);
    check_len(
        "argmax logits",
        logits,
        rows * vocab,
        &format!("[{rows}, {vocab}]"),
    )?;
    if let Some(p) = &positions {
        check_len("argmax positions", p, rows, &format!("[{rows}]"))?;
    }
    if rows > workspace.rows {
        return Err(Error::invalid(
            "argmax workspace",
            format!("made for {} rows, {rows} asked", workspace.rows),
        ));
    }
    if rows == 0 {
        return Ok(());
    }
    match backend {
        Backend::Cpu => {
            let (DeviceVec::Host(l), DeviceVec::Host(t)) = (logits, &mut *tokens) else {
                return Err(backend.mismatch("argmax buffers", logits));
            };
            for (row, token) in t.iter_mut().enumerate() {
                *token = reference::argmax(&l[row * vocab..(row + 1) * vocab]);
            }
            match positions {
                None => Ok(()),
                Some(DeviceVec::Host(p)) => {
                    p.iter_mut().for_each(|p| *p = p.wrapping_add(1));
                    Ok(())
                }
                Some(p) => Err(backend.mismatch("argmax positions", p)),
            }
        }
        Backend::Cuda(_) | Backend::Hip(_) => {
            let target = backend
                .target()
                .ok_or_else(|| backend.mismatch("argmax", logits))?;
            let dims = LaunchDims {
                grid: (
                    check_u32("argmax splits", workspace.splits)?,
                    check_u32("argmax rows", rows)?,
                    1,
                ),
                block: (target.tokens.threads_per_block, 1, 1),
                shared_bytes: 0,
            };
            let args = [
                KernelArg::input(logits),
                KernelArg::u32(check_u32("vocabulary", vocab)?),
                KernelArg::u32(target.tokens.argmax_chunk),
                KernelArg::output(&mut workspace.partial_values),
                KernelArg::output(&mut workspace.partial_indices),
                KernelArg::output(&mut workspace.counters),
                KernelArg::output(tokens),
                KernelArg::optional_output(positions),
            ];
            // SAFETY: tokens.cu's tokens_argmax parameters in order; `splits` blocks of
            // `argmax_chunk` logits cover each row's `vocab` (the workspace's split count), the
            // partials and counters hold `rows` (checked above) rows of `splits`.
            unsafe { backend.launch(FAMILY, KERNEL_ARGMAX, &dims, &args) }
        }
    }
}
