//! Greedy speculative decoding on the device with the checkpoint's MTP head as the drafter:
//! every step verifies each sequence's pending token and its `n` drafts in one target forward,
//! keeps the longest matching prefix of drafts plus the target's own next token, and drafts the
//! next `n` tokens, all on the device and captured as one CUDA graph (no host round trip: the
//! accept decision, the positions and the emitted tokens live on the device).
//!
//! One step, for B sequences of R = B (n + 1) verify rows `[pending, d_1 .. d_n]` at positions
//! `p .. p + n`:
//! 1. the target forward over the R rows (Gated DeltaNet in verify mode: the pre-verify state is
//!    kept and the accepted tokens are replayed at the start of the next step; attention writes
//!    the rows' keys and values, rejected ones are overwritten by the next step before any row
//!    reads them), the final norm, the lm_head and the greedy token `t_r` of every row;
//! 2. the MTP catch-up over the same R rows, row r pairing `t_r` (the token at position
//!    `p + r + 1` if the drafts before it stand) with the target's hidden at `p + r`: its rows at
//!    or below the accepted length are exactly the rows the MTP head must see, the others are
//!    overwritten later like the target's;
//! 3. [`tokens::accept_greedy`]: the accepted length `a`, the emitted tokens `t_0 .. t_a` into the
//!    history, the next pending token `t_a`, positions advanced by `a + 1`, and the catch-up row
//!    `a` as the hidden the next drafts chain from; then the Gated DeltaNet commit of `a + 1`;
//! 4. the drafts: `d_1` from that row's logits (target lm_head), then `d_2 .. d_n` each from one
//!    MTP row on the previous draft and the MTP's own previous hidden, at positions `p' ..`
//!    (`p' = p + a + 1`).
//!
//! Greedy with speculation emits exactly the tokens of greedy without it (each emitted token is
//! the target's argmax after exactly the tokens before it); the drafts only decide how many a
//! step emits. The MTP head is `fc([norm_e(embed(t)); norm_h(hidden)])`, its decoder layers and
//! its norm, as [`Model::mtp_forward`](crate::model::forward::Model::mtp_forward) on the CPU.

use super::{
    Activations, Caches, DeviceModel, DeviceMtp, GdnForward, LayerCache, MAX_POSITIONS,
    SharedCaches, attention_shape, check_prompts, distinct_first_tokens, prefill_moe_workspace,
    prefill_rows, run_layer, target_logits,
};
use crate::backend::{Backend, DeviceEvent, DeviceVec, Graph};
use crate::error::{Error, Result};
use crate::kernels::attention::{KvCache, RopeTable};
use crate::kernels::gdn::{self, Sequences, StepMode};
use crate::kernels::gemm::{Epilogue, linear};
use crate::kernels::moe::MoeWorkspace;
use crate::kernels::norm::{ResidualWriter, rms_norm_residual};
use crate::kernels::tokens::{self, AcceptBuffers, ArgmaxWorkspace, TokenColumn};
use crate::kernels::verify::AcceptanceStats;
use half::bf16;

/// Most drafts per step on `backend`: a sequence's verify rows (its drafts and the token
/// before them) go through the Gated DeltaNet step kernel in one launch, which takes
/// [`gdn::step_max_tokens`] tokens (`gdn.step_max_tokens`: 8 on every device target today, so 7
/// drafts; 15 on the CPU backend, which takes the most a target may declare).
pub fn max_drafts(backend: &Backend) -> usize {
    gdn::step_max_tokens(backend) - 1
}

/// The MTP head's scratch for a forward over some rows.
struct MtpScratch {
    /// `norm_h(hidden)`, bf16 `[rows][H]`.
    hidden_normed: DeviceVec<bf16>,
    /// `fc[:, :H] norm_e(embed(t))`, bf16 `[rows][H]`.
    fc_embedding: DeviceVec<bf16>,
}

impl MtpScratch {
    fn new(model: &DeviceModel, rows: usize) -> Result<Self> {
        let h = model.config.hidden_size;
        Ok(Self {
            hidden_normed: model.backend.zeros(rows * h)?,
            fc_embedding: model.backend.zeros(rows * h)?,
        })
    }
}

/// One MTP forward over `act`'s rows (their attention rows give the positions): row `i` pairs
/// the token `column` names in `tokens` with row `i` of `hidden` (bf16 `[rows][H]`), and its
/// output (after `mtp.norm`) replaces that row of `hidden`. Uses `act`'s buffers, so `act` must
/// be free (its forward done).
#[allow(clippy::too_many_arguments)]
fn mtp_forward(
    model: &DeviceModel,
    mtp: &DeviceMtp,
    layer: usize,
    act: &mut Activations,
    tokens: &DeviceVec<u32>,
    column: TokenColumn,
    hidden: &mut DeviceVec<bf16>,
    scratch: &mut MtpScratch,
    kv: &mut KvCache,
    moe_workspace: &mut MoeWorkspace,
    rope: &RopeTable,
    sequences: &Sequences,
) -> Result<()> {
    let (backend, config) = (&model.backend, &model.config);
    let (rows, h, eps) = (act.rows, config.hidden_size, config.rms_norm_eps as f32);
    // norm_h(hidden): the norm kernel reads an f32 residual plus a bf16 delta, so the residual
    // is zeroed and the hidden comes in as the delta
    backend.fill_zeros(&mut act.residual)?;
    rms_norm_residual(
        backend,
        &mut act.residual,
        ResidualWriter::Earlier,
        Some(&*hidden),
        &mtp.pre_fc_norm_hidden,
        eps,
        &mut scratch.hidden_normed,
        rows,
    )?;
    tokens::embed(backend, tokens, column, &model.embed, h, &mut act.residual)?;
    rms_norm_residual(
        backend,
        &mut act.residual,
        ResidualWriter::PreviousKernel,
        None,
        &mtp.pre_fc_norm_embedding,
        eps,
        &mut act.normed,
        rows,
    )?;
    linear(
        backend,
        &act.normed,
        rows,
        &mtp.fc_embedding,
        Epilogue::None,
        &mut scratch.fc_embedding,
    )?;
    linear(
        backend,
        &scratch.hidden_normed,
        rows,
        &mtp.fc_hidden,
        Epilogue::Residual(&scratch.fc_embedding),
        &mut act.delta,
    )?;
    // the layer's input is fc's output: residual = 0 + delta
    backend.fill_zeros(&mut act.residual)?;
    let shared = SharedCaches { sequences, rope };
    run_layer(
        model,
        &mtp.layers[layer],
        act,
        LayerCache::Kv(kv),
        shared,
        moe_workspace,
        &mut GdnForward::Step {
            tokens: 1,
            mode: StepMode::Decode,
        },
        true,
        None,
    )?;
    rms_norm_residual(
        backend,
        &mut act.residual,
        ResidualWriter::Earlier,
        Some(&act.delta),
        &mtp.norm,
        eps,
        hidden,
        rows,
    )
}

/// A batch of sequences decoding greedily with `n` MTP drafts per step on a [`DeviceModel`]
/// that has an MTP head: the caches, every buffer of a step, and on CUDA the captured step.
pub struct SpecDecoder<'m> {
    model: &'m DeviceModel,
    mtp: &'m DeviceMtp,
    batch: usize,
    drafts: usize,
    capacity: usize,
    /// Each sequence's prompt length (its first generated token's position).
    prompt_lengths: Vec<usize>,
    /// Host upper bound of the furthest pending position (a step advances a sequence by 1 to
    /// n + 1 tokens; the exact positions live on the device).
    furthest: usize,
    /// `[B][n + 1]`: each sequence's pending token and drafts.
    verify_tokens: DeviceVec<u32>,
    verify: Activations,
    /// `[R][H]`: the target's hidden (after the final norm), then the MTP catch-up's rows.
    verify_hidden: DeviceVec<bf16>,
    logits: DeviceVec<bf16>,
    target_tokens: DeviceVec<u32>,
    verify_argmax: ArgmaxWorkspace,
    caches: Caches,
    moe_workspace: MoeWorkspace,
    /// Per MTP layer its keys and values, per sequence.
    mtp_kv: Vec<KvCache>,
    mtp_moe_workspace: MoeWorkspace,
    verify_scratch: MtpScratch,
    /// The chained drafts' rows: one per sequence.
    chain: Activations,
    /// `[B][H]`: the hidden each sequence's next draft comes from.
    chain_hidden: DeviceVec<bf16>,
    chain_scratch: MtpScratch,
    chain_logits: DeviceVec<bf16>,
    chain_argmax: ArgmaxWorkspace,
    accepted: DeviceVec<u32>,
    /// `[B][capacity]`: every sequence's tokens at their positions (generated ones).
    history: DeviceVec<u32>,
    /// `[B][n + 1]`: verify steps, then accepted drafts per depth.
    stats: DeviceVec<u32>,
    /// On CUDA the step's two halves, captured: the verification (target forward, MTP
    /// catch-up, acceptance, commit) and the drafting, launched back to back (the bench times
    /// each).
    graphs: Option<[Graph; 2]>,
}

/// Events around the two halves of one step ([`SpecDecoder::step_with_events`]).
pub struct StepEvents {
    /// Before the verification.
    pub start: DeviceEvent,
    /// After the verification, before the drafting.
    pub verified: DeviceEvent,
    /// After the drafting.
    pub drafted: DeviceEvent,
}

impl<'m> SpecDecoder<'m> {
    /// `batch` sequences of up to `capacity` tokens each, `drafts` drafts per step, on `model`'s
    /// backend. Runs one step to load every kernel and grow every scratch buffer, then (on
    /// CUDA) captures the step as a graph; start the sequences with [`SpecDecoder::prefill`].
    ///
    /// # Errors
    /// [`Error::Invalid`] for a model without an MTP head, an empty batch, drafts outside
    /// `1..=`[`max_drafts`] or a capacity with no room for a step; [`Error::Cuda`] /
    /// [`Error::Hip`] when an allocation, the warm-up step or the capture fails.
    pub fn new(
        model: &'m DeviceModel,
        batch: usize,
        capacity: usize,
        drafts: usize,
    ) -> Result<Self> {
        let mtp = model.mtp.as_ref().ok_or_else(|| {
            Error::invalid(
                "speculative decoder",
                "the model has no MTP head (mtp.* tensors) to draft with",
            )
        })?;
        let most_drafts = max_drafts(&model.backend);
        if batch == 0
            || !(1..=most_drafts).contains(&drafts)
            || !(2 * drafts + 2..=MAX_POSITIONS).contains(&capacity)
        {
            return Err(Error::invalid(
                "speculative decoder",
                format!(
                    "{batch} sequences of {capacity} tokens with {drafts} drafts: needs at least \
                     one sequence, 1 ..= {most_drafts} drafts and room for 2 n + 2 tokens, at \
                     most {MAX_POSITIONS}"
                ),
            ));
        }
        let (backend, config) = (&model.backend, &model.config);
        let (h, vocab) = (config.hidden_size, config.vocab_size);
        let width = drafts + 1;
        let rows = batch * width;
        let att = attention_shape(config);
        let slots: Vec<u32> = (0..batch as u32).collect();
        let row_slots: Vec<u32> = (0..rows as u32).map(|r| r / width as u32).collect();
        let zeros = vec![0u32; batch];
        let mtp_kv = mtp
            .layers
            .iter()
            .map(|_| KvCache::new(backend, att, batch, capacity, model.kv_format()))
            .collect::<Result<Vec<_>>>()?;
        let mut decoder = Self {
            model,
            mtp,
            batch,
            drafts,
            capacity,
            prompt_lengths: vec![1; batch],
            furthest: 0,
            verify_tokens: backend.zeros(rows)?,
            verify: Activations::new(model, capacity, &row_slots, &vec![0; rows])?,
            verify_hidden: backend.zeros(rows * h)?,
            logits: backend.zeros(rows * vocab)?,
            target_tokens: backend.zeros(rows)?,
            verify_argmax: ArgmaxWorkspace::new(backend, rows, vocab)?,
            caches: Caches::new(model, batch, capacity, width)?,
            moe_workspace: MoeWorkspace::new(backend, &model.layers[0].moe, rows)?,
            mtp_kv,
            mtp_moe_workspace: MoeWorkspace::new(backend, &mtp.layers[0].moe, rows)?,
            verify_scratch: MtpScratch::new(model, rows)?,
            chain: Activations::new(model, capacity, &slots, &zeros)?,
            chain_hidden: backend.zeros(batch * h)?,
            chain_scratch: MtpScratch::new(model, batch)?,
            chain_logits: backend.zeros(batch * vocab)?,
            chain_argmax: ArgmaxWorkspace::new(backend, batch, vocab)?,
            accepted: backend.zeros(batch)?,
            history: backend.zeros(batch * capacity)?,
            stats: backend.zeros(rows)?,
            graphs: None,
        };
        decoder.queue_verify()?;
        decoder.queue_drafts()?;
        decoder.restart(&vec![0; batch])?;
        if matches!(backend, crate::backend::Backend::Cuda(_)) {
            let verify = {
                let this = &mut decoder;
                backend.capture(|| this.queue_verify())?
            };
            let drafts = {
                let this = &mut decoder;
                backend.capture(|| this.queue_drafts())?
            };
            decoder.graphs = Some([verify, drafts]);
        }
        Ok(decoder)
    }

    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Drafts per step (n).
    pub fn drafts(&self) -> usize {
        self.drafts
    }

    /// Whether steps replay captured graphs (CUDA) or are launched one call at a time.
    pub fn replays_graph(&self) -> bool {
        self.graphs.is_some()
    }

    /// Every sequence's pending token at `pending[b]` (nothing generated yet), drafts zero,
    /// statistics zero, nothing pending in the Gated DeltaNet state.
    fn restart(&mut self, pending: &[usize]) -> Result<()> {
        let backend = &self.model.backend;
        let width = self.drafts + 1;
        let device: Vec<u32> = pending.iter().map(|&p| p as u32).collect();
        self.caches.sequences.restart(backend, &device)?;
        let rows: Vec<u32> = device
            .iter()
            .flat_map(|&p| (0..width as u32).map(move |r| p + r))
            .collect();
        backend.write(&mut self.verify.attention_rows.position, 0, &rows)?;
        backend.write(&mut self.chain.attention_rows.position, 0, &device)?;
        backend.fill_zeros(&mut self.stats)?;
        backend.fill_zeros(&mut self.history)?;
        self.furthest = pending.iter().copied().max().unwrap_or(0);
        Ok(())
    }

    /// Empties every sequence and runs its prompt: all but the last token through the target in
    /// one forward and through the MTP head (its rows pair each prompt token with the target's
    /// hidden before it), then the first drafts from the last prompt row. The last tokens are
    /// pending: the next [`SpecDecoder::step`] verifies them with the drafts. A sequence whose
    /// prompt is one token starts with drafts from an empty hidden (valid tokens, unlikely to be
    /// accepted). Allocates the prompt rows' buffers for the call (not captured in the graph).
    ///
    /// # Errors
    /// [`Error::Invalid`] for a prompt count other than the batch, an empty prompt, a token
    /// outside the vocabulary or a prompt with no room for a step; errors of the launches.
    pub fn prefill(&mut self, prompts: &[&[u32]]) -> Result<()> {
        check_prompts(prompts, self.batch, self.capacity)?;
        let room = self.capacity - 2 * self.drafts - 1;
        if let Some(p) = prompts.iter().find(|p| p.len() > room) {
            return Err(Error::invalid(
                "decoder prompts",
                format!(
                    "a prompt of {} tokens leaves no room for a step of {} drafts in {} positions",
                    p.len(),
                    self.drafts,
                    self.capacity
                ),
            ));
        }
        let model = self.model;
        let (backend, config) = (&model.backend, &model.config);
        let vocab = config.vocab_size;
        if let Some(bad) = prompts
            .iter()
            .flat_map(|p| p.iter())
            .find(|&&t| t as usize >= vocab)
        {
            return Err(Error::invalid(
                "token id",
                format!("{bad} is outside the vocabulary of {vocab}"),
            ));
        }
        let h = config.hidden_size;
        let width = self.drafts + 1;
        let pending: Vec<usize> = prompts.iter().map(|p| p.len() - 1).collect();
        self.restart(&vec![0; self.batch])?;
        backend.fill_zeros(&mut self.chain_hidden)?;
        if let Some(mut rows) = prefill_rows(model, &mut self.caches, self.capacity, prompts)? {
            let count = rows.act.rows;
            let mut hidden = backend.zeros(count * h)?;
            rms_norm_residual(
                backend,
                &mut rows.act.residual,
                ResidualWriter::Earlier,
                Some(&rows.act.delta),
                &model.final_norm,
                config.rms_norm_eps as f32,
                &mut hidden,
                count,
            )?;
            // row q of a prompt pairs its token q + 1 with the target's hidden at q
            let shifted: Vec<u32> = prompts
                .iter()
                .filter(|p| p.len() > 1)
                .flat_map(|p| p[1..].iter().copied())
                .collect();
            mtp_forward(
                model,
                self.mtp,
                0,
                &mut rows.act,
                &backend.upload(&shifted)?,
                TokenColumn::packed(count),
                &mut hidden,
                &mut MtpScratch::new(model, count)?,
                &mut self.mtp_kv[0],
                &mut prefill_moe_workspace(model, &self.mtp.layers[0].moe, count)?,
                &self.caches.rope,
                &self.caches.sequences,
            )?;
            // each sequence's last prompt row predicts its first draft
            let mut end = 0;
            for (b, &len) in rows.lengths.iter().enumerate() {
                end += len;
                if len > 0 {
                    let row = backend.read(&hidden, (end - 1) * h..end * h)?;
                    backend.write(&mut self.chain_hidden, b * h, &row)?;
                }
            }
        }
        // positions: the pending token of each sequence at its prompt length - 1
        self.restart(&pending)?;
        let mut table = vec![0u32; self.batch * width];
        for (b, p) in prompts.iter().enumerate() {
            table[b * width] = p[p.len() - 1];
        }
        backend.write(&mut self.verify_tokens, 0, &table)?;
        let history: Vec<u32> = prompts
            .iter()
            .flat_map(|p| {
                let mut row = p.to_vec();
                row.resize(self.capacity, 0);
                row
            })
            .collect();
        backend.write(&mut self.history, 0, &history)?;
        self.prompt_lengths = prompts.iter().map(|p| p.len()).collect();
        self.queue_drafts()
    }

    /// For benchmarks: empties every sequence and starts each from its own one-token prompt
    /// (spread over the vocabulary), as [`super::Decoder::start_distinct`] does.
    ///
    /// # Errors
    /// As [`SpecDecoder::prefill`].
    pub fn start_distinct(&mut self) -> Result<()> {
        let firsts = distinct_first_tokens(self.batch, self.model.config.vocab_size);
        let prompts: Vec<&[u32]> = firsts.iter().map(std::slice::from_ref).collect();
        self.prefill(&prompts)
    }

    /// Queues one step (graph replays on CUDA): verify, accept, draft. Every sequence emits 1
    /// to n + 1 tokens.
    ///
    /// # Errors
    /// [`Error::Invalid`] when a sequence may lack room for the step; errors of the launches.
    pub fn step(&mut self) -> Result<()> {
        self.check_room()?;
        self.queue_half(0)?;
        self.queue_half(1)?;
        self.furthest += self.drafts + 1;
        Ok(())
    }

    /// [`SpecDecoder::step`] with events recorded before, between and after its two halves
    /// (verification, drafting), for timing each.
    ///
    /// # Errors
    /// As [`SpecDecoder::step`]; [`Error::Cuda`] / [`Error::Hip`] when an event fails.
    pub fn step_with_events(&mut self) -> Result<StepEvents> {
        self.check_room()?;
        let backend = &self.model.backend;
        let start = backend.record_event()?;
        self.queue_half(0)?;
        let verified = backend.record_event()?;
        self.queue_half(1)?;
        let drafted = backend.record_event()?;
        self.furthest += self.drafts + 1;
        Ok(StepEvents {
            start,
            verified,
            drafted,
        })
    }

    /// [`SpecDecoder::step`] launch by launch, without the graphs.
    ///
    /// # Errors
    /// As [`SpecDecoder::step`].
    pub fn step_without_graph(&mut self) -> Result<()> {
        self.check_room()?;
        self.queue_verify()?;
        self.queue_drafts()?;
        self.furthest += self.drafts + 1;
        Ok(())
    }

    /// Half 0 (verification) or 1 (drafting) of a step: its graph, or its launches.
    fn queue_half(&mut self, half: usize) -> Result<()> {
        match (&self.graphs, half) {
            (Some(graphs), _) => graphs[half].launch(),
            (None, 0) => self.queue_verify(),
            (None, _) => self.queue_drafts(),
        }
    }

    /// The host's upper bound of the furthest sequence's pending position (no wait; each step
    /// adds n + 1 to it, [`SpecDecoder::positions`] tightens it).
    pub fn position_bound(&self) -> usize {
        self.furthest
    }

    /// Each sequence's pending position (waits for the device); tightens the host's bound.
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when the copy fails.
    pub fn positions(&mut self) -> Result<Vec<usize>> {
        // each sequence's first verify row sits at its pending position
        let rows = self
            .model
            .backend
            .download(&self.verify.attention_rows.position)?;
        let positions: Vec<usize> = rows
            .iter()
            .step_by(self.drafts + 1)
            .map(|&p| p as usize)
            .collect();
        self.furthest = positions.iter().copied().max().unwrap_or(0);
        Ok(positions)
    }

    /// Every sequence's generated tokens so far (waits for the device): the tokens after its
    /// prompt, up to and including its pending token.
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when a copy fails.
    pub fn generated(&mut self) -> Result<Vec<Vec<u32>>> {
        let positions = self.positions()?;
        let history = self.model.backend.download(&self.history)?;
        Ok(positions
            .iter()
            .enumerate()
            .map(|(b, &p)| {
                let row = &history[b * self.capacity..(b + 1) * self.capacity];
                let last = p.min(self.capacity - 1);
                row[self.prompt_lengths[b].min(last + 1)..=last].to_vec()
            })
            .collect())
    }

    /// The drafts the next step verifies, `[B][n]` (waits for the device).
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when the copy fails.
    pub fn next_drafts(&self) -> Result<Vec<Vec<u32>>> {
        let table = self.model.backend.download(&self.verify_tokens)?;
        Ok(table
            .chunks_exact(self.drafts + 1)
            .map(|row| row[1..].to_vec())
            .collect())
    }

    /// Drafted and accepted counts per draft depth since the last prefill, all sequences
    /// together (waits for the device).
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when the copy fails.
    pub fn acceptance(&self) -> Result<AcceptanceStats> {
        let mut total = AcceptanceStats {
            drafted: vec![0; self.drafts],
            accepted: vec![0; self.drafts],
        };
        for s in self.acceptance_by_sequence()? {
            total
                .drafted
                .iter_mut()
                .zip(&s.drafted)
                .for_each(|(t, d)| *t += d);
            total
                .accepted
                .iter_mut()
                .zip(&s.accepted)
                .for_each(|(t, a)| *t += a);
        }
        Ok(total)
    }

    /// [`SpecDecoder::acceptance`] of each sequence.
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when the copy fails.
    pub fn acceptance_by_sequence(&self) -> Result<Vec<AcceptanceStats>> {
        let stats = self.model.backend.download(&self.stats)?;
        Ok(stats
            .chunks_exact(self.drafts + 1)
            .map(|row| AcceptanceStats {
                drafted: vec![u64::from(row[0]); self.drafts],
                accepted: row[1..].iter().map(|&a| u64::from(a)).collect(),
            })
            .collect())
    }

    /// For benchmarks: every sequence continues as if `position` tokens were behind it, with
    /// whatever its caches hold; the drafts stay as they are.
    ///
    /// # Errors
    /// [`Error::Invalid`] when a step no longer fits at `position`; [`Error::Cuda`] /
    /// [`Error::Hip`] when a copy fails.
    pub fn skip_to(&mut self, position: usize) -> Result<()> {
        if position + 2 * self.drafts + 1 >= self.capacity {
            return Err(Error::invalid(
                "decoder position",
                format!(
                    "{position} leaves no room for a step of {} drafts in {}",
                    self.drafts, self.capacity
                ),
            ));
        }
        self.restart(&vec![position; self.batch])
    }

    /// An error when a step may not fit: a step writes keys up to n positions past the pending
    /// one, and its chained drafts up to 2 n - 1.
    fn check_room(&mut self) -> Result<()> {
        if self.furthest + 2 * self.drafts + 1 >= self.capacity {
            // the bound grows by n + 1 per step; the device knows the real positions
            self.positions()?;
        }
        if self.furthest + 2 * self.drafts + 1 >= self.capacity {
            return Err(Error::invalid(
                "decoder",
                format!(
                    "a sequence is at position {} of {}: no room for a step of {} drafts",
                    self.furthest, self.capacity, self.drafts
                ),
            ));
        }
        Ok(())
    }

    /// The verification: the target forward over the verify rows, the MTP catch-up over them,
    /// the acceptance and the Gated DeltaNet commit.
    fn queue_verify(&mut self) -> Result<()> {
        let model = self.model;
        let (backend, config) = (&model.backend, &model.config);
        let h = config.hidden_size;
        let width = self.drafts + 1;
        let rows = self.batch * width;
        target_logits(
            model,
            &self.verify_tokens,
            TokenColumn::packed(rows),
            &mut self.verify,
            &mut self.caches,
            &mut self.moe_workspace,
            GdnForward::Step {
                tokens: width,
                mode: StepMode::Verify,
            },
            &mut self.verify_hidden,
            &mut self.logits,
        )?;
        tokens::argmax(
            backend,
            &self.logits,
            &mut self.verify_argmax,
            &mut self.target_tokens,
            TokenColumn::packed(rows),
            None,
        )?;
        mtp_forward(
            model,
            self.mtp,
            0,
            &mut self.verify,
            &self.target_tokens,
            TokenColumn::packed(rows),
            &mut self.verify_hidden,
            &mut self.verify_scratch,
            &mut self.mtp_kv[0],
            &mut self.mtp_moe_workspace,
            &self.caches.rope,
            &self.caches.sequences,
        )?;
        tokens::accept_greedy(
            backend,
            self.batch,
            self.drafts,
            h,
            AcceptBuffers {
                verify_tokens: &mut self.verify_tokens,
                target: &self.target_tokens,
                mtp_hidden: &self.verify_hidden,
                chain_hidden: &mut self.chain_hidden,
                accepted: &mut self.accepted,
                row_positions: &mut self.verify.attention_rows.position,
                chain_positions: &mut self.chain.attention_rows.position,
                history: &mut self.history,
                stats: &mut self.stats,
            },
        )?;
        self.caches.sequences.commit(
            backend,
            gdn::Accepted::PerSequence(&self.accepted),
            StepMode::Verify,
        )
    }

    /// The n drafts of every sequence from its chain hidden: the first from the target lm_head
    /// on it, each next one from one MTP row on the previous draft.
    fn queue_drafts(&mut self) -> Result<()> {
        let model = self.model;
        let backend = &model.backend;
        let (b, width) = (self.batch, self.drafts + 1);
        let depth = self.mtp.layers.len();
        for d in 1..=self.drafts {
            if d > 1 {
                mtp_forward(
                    model,
                    self.mtp,
                    (d - 1) % depth,
                    &mut self.chain,
                    &self.verify_tokens,
                    TokenColumn::of_table(b, width, d - 1),
                    &mut self.chain_hidden,
                    &mut self.chain_scratch,
                    &mut self.mtp_kv[(d - 1) % depth],
                    &mut self.mtp_moe_workspace,
                    &self.caches.rope,
                    &self.caches.sequences,
                )?;
            }
            linear(
                backend,
                &self.chain_hidden,
                b,
                &model.lm_head,
                Epilogue::None,
                &mut self.chain_logits,
            )?;
            // after a chained row, the next one sits one position further
            tokens::argmax(
                backend,
                &self.chain_logits,
                &mut self.chain_argmax,
                &mut self.verify_tokens,
                TokenColumn::of_table(b, width, d),
                (d > 1).then_some(&mut self.chain.attention_rows.position),
            )?;
        }
        Ok(())
    }
}
