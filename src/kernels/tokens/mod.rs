//! Family `tokens`: where a decode step starts and ends (`kernels/templates/tokens.cu`): the
//! embedding gather (bf16 table rows into the f32 residual stream) and the greedy argmax over
//! the vocabulary, which writes the next step's input tokens on the device so a captured decode
//! step can be replayed without a host round trip; and the greedy verification of a speculative
//! step with its bookkeeping ([`accept_greedy`]), so a captured speculative step needs no host
//! round trip either.
//!
//! Bytes moved: embed reads `2 * hidden` and writes `4 * hidden` per row; argmax reads the row's
//! `2 * vocab` bytes of logits; accept_greedy copies one `2 * hidden` row per sequence.

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
/// Greedy verification of a speculative step, one block per sequence.
pub const KERNEL_ACCEPT_GREEDY: &str = "tokens_accept_greedy";

/// Where a batch's tokens sit in a buffer: row `r`'s token is element `offset + r * stride`. A
/// packed list is [`TokenColumn::packed`]; one column of a `[rows][width]` table (the drafts at
/// one depth of a speculative step's verify rows) is [`TokenColumn::of_table`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenColumn {
    /// Tokens (rows of the embedding or of the logits).
    pub rows: usize,
    /// Element of row 0.
    pub offset: usize,
    /// Elements from one row's token to the next (at least 1).
    pub stride: usize,
}

impl TokenColumn {
    /// `rows` tokens one after another from element 0.
    pub fn packed(rows: usize) -> Self {
        Self {
            rows,
            offset: 0,
            stride: 1,
        }
    }

    /// Column `column` of a row-major `[rows][width]` table.
    pub fn of_table(rows: usize, width: usize, column: usize) -> Self {
        Self {
            rows,
            offset: column,
            stride: width,
        }
    }

    /// Element index of row `row`.
    fn at(&self, row: usize) -> usize {
        self.offset + row * self.stride
    }

    /// Checks the column fits a buffer of `len` elements; the element range it spans.
    fn check(&self, what: &str, len: usize) -> Result<std::ops::Range<usize>> {
        if self.stride == 0 || self.rows == 0 {
            return Err(Error::invalid(
                what,
                format!(
                    "{} rows of stride {}: needs rows and a stride of at least 1",
                    self.rows, self.stride
                ),
            ));
        }
        let end = self
            .offset
            .checked_add((self.rows - 1).saturating_mul(self.stride))
            .and_then(|last| last.checked_add(1))
            .filter(|&end| end <= len)
            .ok_or_else(|| {
                Error::invalid(
                    what,
                    format!(
                        "{} rows from element {} every {} do not fit {len} tokens",
                        self.rows, self.offset, self.stride
                    ),
                )
            })?;
        Ok(self.offset..end)
    }
}

/// `residual` (`[rows][hidden]` f32) = the rows of `table` (`[vocab][hidden]` bf16) that the
/// `column` of `tokens` names. A token past the vocabulary is an error on the CPU; on a device
/// the tokens are device data (written by [`argmax`] or checked by the caller when it wrote
/// them) and such a row comes out zero.
///
/// # Errors
/// [`Error::Invalid`] when the buffers disagree with the column and `hidden`, or (CPU) a token
/// is past the vocabulary; [`Error::BackendMismatch`], [`Error::Compile`] / [`Error::Cuda`] /
/// [`Error::Hip`] from the backends.
pub fn embed(
    backend: &Backend,
    tokens: &DeviceVec<u32>,
    column: TokenColumn,
    table: &DeviceVec<bf16>,
    hidden: usize,
    residual: &mut DeviceVec<f32>,
) -> Result<()> {
    let rows = column.rows;
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
    let span = column.check("embedding tokens", tokens.len())?;
    match backend {
        Backend::Cpu => {
            let (DeviceVec::Host(t), DeviceVec::Host(w), DeviceVec::Host(r)) =
                (tokens, table, &mut *residual)
            else {
                return Err(backend.mismatch("embedding buffers", residual));
            };
            let picked: Vec<u32> = (0..rows).map(|row| t[column.at(row)]).collect();
            if let Some(bad) = picked.iter().find(|&&t| t as usize >= vocab) {
                return Err(Error::invalid(
                    "token id",
                    format!("{bad} is outside the vocabulary of {vocab}"),
                ));
            }
            *r = reference::embed(&picked, w, hidden);
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
            let args = embed_arguments(
                KernelArg::input_range(tokens, span)?,
                table,
                residual,
                [
                    check_u32("embedding token stride", column.stride)?,
                    check_u32("vocabulary", vocab)?,
                    check_u32("hidden size", hidden)?,
                ],
            );
            // SAFETY: tokens.cu's tokens_embed parameters in order; one block per token, its
            // token at `row * stride` inside the range passed (checked above), rows of `hidden`
            // values in the residual (checked above), table rows read only for tokens below
            // `vocab` (the kernel tests it).
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

/// For each of the `column.rows` rows of `logits` (`[rows][vocab]` bf16): the column's token
/// of that row in `tokens` = the lowest index of the row's largest value (NaN never chosen, 0
/// for a row of only NaN) and, when given, `positions[row] += 1`. One launch on a device.
///
/// # Errors
/// [`Error::Invalid`] when the buffers disagree with the column and the workspace's vocabulary,
/// or the workspace holds fewer rows; [`Error::BackendMismatch`], [`Error::Compile`] /
/// [`Error::Cuda`] / [`Error::Hip`] from the backends.
pub fn argmax(
    backend: &Backend,
    logits: &DeviceVec<bf16>,
    workspace: &mut ArgmaxWorkspace,
    tokens: &mut DeviceVec<u32>,
    column: TokenColumn,
    positions: Option<&mut DeviceVec<u32>>,
) -> Result<()> {
    let (rows, vocab) = (column.rows, workspace.vocab);
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
    let span = column.check("argmax tokens", tokens.len())?;
    match backend {
        Backend::Cpu => {
            let (DeviceVec::Host(l), DeviceVec::Host(t)) = (logits, &mut *tokens) else {
                return Err(backend.mismatch("argmax buffers", logits));
            };
            for row in 0..rows {
                t[column.at(row)] = reference::argmax(&l[row * vocab..(row + 1) * vocab]);
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
                cluster: (1, 1, 1),
            };
            let args = argmax_arguments(
                logits,
                workspace,
                KernelArg::output_range(tokens, span)?,
                KernelArg::optional_output(positions),
                [
                    check_u32("vocabulary", vocab)?,
                    target.tokens.argmax_chunk,
                    check_u32("argmax token stride", column.stride)?,
                ],
            );
            // SAFETY: tokens.cu's tokens_argmax parameters in order; `splits` blocks of
            // `argmax_chunk` logits cover each row's `vocab` (the workspace's split count), the
            // partials and counters hold `rows` (checked above) rows of `splits`, row `row`'s
            // token is at `row * stride` inside the range passed (checked above).
            unsafe { backend.launch(FAMILY, KERNEL_ARGMAX, &dims, &args) }
        }
    }
}

/// The buffers of a speculative step that [`accept_greedy`] reads and updates, for `B`
/// sequences of `n` drafts each and a hidden size `H`.
pub struct AcceptBuffers<'a> {
    /// `[B][n + 1]`: each sequence's verify rows, its pending token then its `n` drafts; the
    /// pending token is replaced by the target's next token.
    pub verify_tokens: &'a mut DeviceVec<u32>,
    /// `[B][n + 1]`: the target's greedy token of every verify row.
    pub target: &'a DeviceVec<u32>,
    /// `[B][n + 1][H]` bf16: the MTP head's output rows over the verify rows.
    pub mtp_hidden: &'a DeviceVec<bf16>,
    /// `[B][H]`: set to the MTP row of each sequence's last accepted position.
    pub chain_hidden: &'a mut DeviceVec<bf16>,
    /// `[B]`: set to the tokens each sequence keeps (accepted drafts + 1).
    pub accepted: &'a mut DeviceVec<u32>,
    /// `[B][n + 1]`: the verify rows' positions, advanced past the kept tokens.
    pub row_positions: &'a mut DeviceVec<u32>,
    /// `[B]`: set to each sequence's new pending position (where the first chained draft sits).
    pub chain_positions: &'a mut DeviceVec<u32>,
    /// `[B][capacity]`: every kept token at its position (positions past the capacity dropped).
    pub history: &'a mut DeviceVec<u32>,
    /// `[B][n + 1]`: per sequence the verify steps, then per draft depth the accepted drafts.
    pub stats: &'a mut DeviceVec<u32>,
}

/// Greedy verification of a speculative step for `sequences` sequences of `drafts` drafts each:
/// a sequence accepts the longest prefix of its drafts that equals the target's greedy tokens
/// of the rows before them, keeps those drafts and the target's token after them, and every
/// buffer of [`AcceptBuffers`] is updated as its fields say. Greedy decoding with speculation
/// then emits exactly the tokens decoding without it does. One launch on a device, nothing read
/// back.
///
/// # Errors
/// [`Error::Invalid`] for no drafts or buffers that disagree with the shapes;
/// [`Error::BackendMismatch`], [`Error::Compile`] / [`Error::Cuda`] / [`Error::Hip`] from the
/// backends.
pub fn accept_greedy(
    backend: &Backend,
    sequences: usize,
    drafts: usize,
    hidden: usize,
    buffers: AcceptBuffers<'_>,
) -> Result<()> {
    if drafts == 0 || sequences == 0 || hidden == 0 {
        return Err(Error::invalid(
            "greedy acceptance",
            format!(
                "{sequences} sequences of {drafts} drafts, hidden {hidden}: all must be positive"
            ),
        ));
    }
    let width = drafts + 1;
    let rows = sequences * width;
    let b = buffers;
    let table = format!("[{sequences}, {width}]");
    check_len("acceptance verify tokens", b.verify_tokens, rows, &table)?;
    check_len("acceptance target tokens", b.target, rows, &table)?;
    check_len("acceptance row positions", b.row_positions, rows, &table)?;
    check_len("acceptance statistics", b.stats, rows, &table)?;
    check_len(
        "acceptance MTP rows",
        b.mtp_hidden,
        rows * hidden,
        &format!("[{rows}, {hidden}]"),
    )?;
    check_len(
        "acceptance chain hidden",
        b.chain_hidden,
        sequences * hidden,
        &format!("[{sequences}, {hidden}]"),
    )?;
    let per_sequence = format!("[{sequences}]");
    check_len("acceptance counts", b.accepted, sequences, &per_sequence)?;
    check_len(
        "acceptance chain positions",
        b.chain_positions,
        sequences,
        &per_sequence,
    )?;
    if b.history.is_empty() || b.history.len() % sequences != 0 {
        return Err(Error::invalid(
            "acceptance history",
            format!("{} tokens is not [{sequences}, capacity]", b.history.len()),
        ));
    }
    let capacity = b.history.len() / sequences;
    match backend {
        Backend::Cpu => {
            let (
                DeviceVec::Host(verify),
                DeviceVec::Host(target),
                DeviceVec::Host(mtp),
                DeviceVec::Host(chain),
                DeviceVec::Host(accepted),
                DeviceVec::Host(positions),
                DeviceVec::Host(chain_positions),
                DeviceVec::Host(history),
                DeviceVec::Host(stats),
            ) = (
                &mut *b.verify_tokens,
                b.target,
                b.mtp_hidden,
                &mut *b.chain_hidden,
                &mut *b.accepted,
                &mut *b.row_positions,
                &mut *b.chain_positions,
                &mut *b.history,
                &mut *b.stats,
            )
            else {
                return Err(backend.mismatch("acceptance buffers", b.target));
            };
            for s in 0..sequences {
                let first = s * width;
                let rows = first..first + width;
                let a = reference::accepted_drafts(&verify[rows.clone()], &target[rows.clone()]);
                let p = positions[first] as usize;
                for i in 0..=a {
                    if p + 1 + i < capacity {
                        history[s * capacity + p + 1 + i] = target[first + i];
                    }
                }
                verify[first] = target[first + a];
                accepted[s] = (a + 1) as u32;
                chain_positions[s] = (p + a + 1) as u32;
                for (r, position) in positions[rows].iter_mut().enumerate() {
                    *position = (p + r + a + 1) as u32;
                }
                chain[s * hidden..(s + 1) * hidden]
                    .copy_from_slice(&mtp[(first + a) * hidden..(first + a + 1) * hidden]);
                stats[first] += 1;
                stats[first + 1..=first + a]
                    .iter_mut()
                    .for_each(|c| *c += 1);
            }
            Ok(())
        }
        Backend::Cuda(_) | Backend::Hip(_) => {
            let target = backend
                .target()
                .ok_or_else(|| backend.mismatch("greedy acceptance", b.target))?;
            let dims = LaunchDims::linear(
                check_u32("acceptance sequences", sequences)?,
                target.tokens.threads_per_block,
            );
            let args = accept_arguments(
                b,
                [
                    check_u32("drafts", drafts)?,
                    check_u32("hidden size", hidden)?,
                    check_u32("history capacity", capacity)?,
                ],
            );
            // SAFETY: tokens.cu's tokens_accept_greedy parameters in order; one block per
            // sequence, every buffer holds the rows the kernel indexes for `sequences` sequences
            // of `drafts + 1` rows (checked above), history writes stay below `capacity`.
            unsafe { backend.launch(FAMILY, KERNEL_ACCEPT_GREEDY, &dims, &args) }
        }
    }
}

/// `tokens_embed`'s arguments: the tokens (from the column's first), the table, the residual,
/// `[token stride, vocabulary, hidden]`.
fn embed_arguments<'a>(
    tokens: KernelArg<'a>,
    table: &'a DeviceVec<bf16>,
    residual: &'a mut DeviceVec<f32>,
    [stride, vocab, hidden]: [u32; 3],
) -> [KernelArg<'a>; 6] {
    [
        tokens,
        KernelArg::u32(stride),
        KernelArg::input(table),
        KernelArg::u32(vocab),
        KernelArg::u32(hidden),
        KernelArg::output(residual),
    ]
}

/// `tokens_argmax`'s arguments: the logits, the workspace's partials and counters, the tokens
/// (from the column's first), the optional positions, `[vocabulary, chunk, token stride]`.
fn argmax_arguments<'a>(
    logits: &'a DeviceVec<bf16>,
    workspace: &'a mut ArgmaxWorkspace,
    tokens: KernelArg<'a>,
    positions: KernelArg<'a>,
    [vocab, chunk, stride]: [u32; 3],
) -> [KernelArg<'a>; 9] {
    [
        KernelArg::input(logits),
        KernelArg::u32(vocab),
        KernelArg::u32(chunk),
        KernelArg::output(&mut workspace.partial_values),
        KernelArg::output(&mut workspace.partial_indices),
        KernelArg::output(&mut workspace.counters),
        tokens,
        KernelArg::u32(stride),
        positions,
    ]
}

/// `tokens_accept_greedy`'s arguments: the buffers in the order of [`AcceptBuffers`], then
/// `[drafts, hidden, history capacity]`.
fn accept_arguments<'a>(b: AcceptBuffers<'a>, scalars: [u32; 3]) -> [KernelArg<'a>; 12] {
    let [drafts, hidden, capacity] = scalars;
    [
        KernelArg::output(b.verify_tokens),
        KernelArg::input(b.target),
        KernelArg::input(b.mtp_hidden),
        KernelArg::output(b.chain_hidden),
        KernelArg::output(b.accepted),
        KernelArg::output(b.row_positions),
        KernelArg::output(b.chain_positions),
        KernelArg::output(b.history),
        KernelArg::output(b.stats),
        KernelArg::u32(drafts),
        KernelArg::u32(hidden),
        KernelArg::u32(capacity),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::launch_check;
    use crate::target;

    /// Every launch's argument list (built by [`embed_arguments`], [`argmax_arguments`] and
    /// [`accept_arguments`]) meets every target's compiled kernels: count, kinds and scalar
    /// widths, with and without argmax positions.
    #[test]
    fn the_argument_lists_meet_the_compiled_kernels_parameters() {
        let cpu = Backend::Cpu;
        let words = |n: usize| DeviceVec::Host(vec![0u32; n]);
        let halves = |n: usize| DeviceVec::Host(vec![bf16::ZERO; n]);
        let mut checks = launch_check::ArgumentChecks::new(FAMILY);
        for t in target::all() {
            let name = t.name.as_str();
            let tokens = words(4);
            let table = halves(8);
            let mut residual = DeviceVec::Host(vec![0.0f32; 8]);
            checks.check(
                name,
                KERNEL_EMBED,
                &embed_arguments(KernelArg::input(&tokens), &table, &mut residual, [1, 4, 2]),
            );
            let logits = halves(8);
            let mut workspace = ArgmaxWorkspace::new(&cpu, 2, 4).expect("workspace");
            for with_positions in [false, true] {
                let (mut out, mut positions) = (words(2), words(2));
                let positions =
                    KernelArg::optional_output(with_positions.then_some(&mut positions));
                let args = argmax_arguments(
                    &logits,
                    &mut workspace,
                    KernelArg::output(&mut out),
                    positions,
                    [4, 4, 1],
                );
                checks.check(name, KERNEL_ARGMAX, &args);
            }
            let (target_tokens, mtp) = (words(2), halves(4));
            let (mut verify, mut chain, mut accepted) = (words(2), halves(2), words(1));
            let (mut rows, mut chain_positions) = (words(2), words(1));
            let (mut history, mut stats) = (words(4), words(2));
            let args = accept_arguments(
                AcceptBuffers {
                    verify_tokens: &mut verify,
                    target: &target_tokens,
                    mtp_hidden: &mtp,
                    chain_hidden: &mut chain,
                    accepted: &mut accepted,
                    row_positions: &mut rows,
                    chain_positions: &mut chain_positions,
                    history: &mut history,
                    stats: &mut stats,
                },
                [1, 2, 4],
            );
            checks.check(name, KERNEL_ACCEPT_GREEDY, &args);
        }
        checks.assert_all_match();
    }
}
