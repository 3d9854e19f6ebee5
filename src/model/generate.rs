//! Generation with the MTP head as speculative drafter, for a batch of sequences.
//!
//! Each step, for every live sequence with `n` draft tokens:
//! 1. the MTP head catches up on the target hidden states it has not consumed (row `p` pairs
//!    token `t_{p+1}` with the target's post-norm hidden `H_p`; at the first step that is the
//!    whole prompt), and its last row's logits give draft 1; drafts 2..n chain on the MTP's own
//!    post-`mtp.norm` output;
//! 2. ONE target forward verifies the pending token plus the `n` drafts (`n + 1` rows), recording
//!    GDN snapshots;
//! 3. the verifier (greedy, or Leviathan sampling on the processed distributions with every
//!    control) accepts `a` drafts and emits `a + 1` tokens;
//! 4. the target caches commit the `a + 1` processed tokens that were accepted, and the MTP
//!    caches drop the rows computed from drafts.
//!
//! With `n = 0` this is plain decoding through the same verifier (which then samples the bonus
//! token exactly as plain sampling does), so greedy output with any `n` equals greedy output
//! without speculation, token for token.

use crate::error::{Error, Result};
use crate::kernels::verify::reference::{self as verify, AcceptanceStats, Drafts, SamplingParams};
use crate::model::cache::SequenceCache;
use crate::model::forward::{ForwardInput, ForwardOutput, Model, MtpInput};

/// Random-stream separation of draft sampling from the verifier's own draws: drafts are drawn
/// with the sequence seed XOR this constant, so they are independent of the acceptance and
/// residual draws keyed on the sequence seed itself.
const DRAFT_SEED_SALT: u64 = 0x6d74_705f_6472_6166; // "mtp_draf"

/// One sequence to generate.
#[derive(Debug, Clone)]
pub struct Request {
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// Sampling controls (temperature 0 = greedy).
    pub params: SamplingParams,
    /// Generation stops after any of these tokens (which is kept in the output). The model's
    /// own end-of-sequence ids (`ModelConfig::eos_token_ids`) are not added: a caller that
    /// wants generation to end there puts them in (as `fp4spec generate` does).
    pub stop_tokens: Vec<u32>,
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_new_tokens` reached.
    Length,
    /// A stop token was generated.
    Stop,
}

impl FinishReason {
    /// `length` or `stop`, as OpenAI-style servers spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
        }
    }
}

/// One sequence's result.
#[derive(Debug, Clone)]
pub struct Generation {
    /// The generated token ids (the prompt excluded).
    pub tokens: Vec<u32>,
    /// Why it stopped.
    pub finish_reason: FinishReason,
    /// Target forwards this sequence took part in (the prefill included).
    pub forwards: usize,
    /// Drafts proposed and accepted, by draft position.
    pub acceptance: AcceptanceStats,
}

impl Generation {
    /// Drafts proposed in all.
    pub fn drafted(&self) -> u64 {
        self.acceptance.drafted.iter().sum()
    }

    /// Drafts accepted in all.
    pub fn accepted(&self) -> u64 {
        self.acceptance.accepted.iter().sum()
    }

    /// Generated tokens per target forward after the prefill (1 without speculation).
    pub fn tokens_per_forward(&self) -> f64 {
        let decode_forwards = self.forwards.saturating_sub(1).max(1);
        // the prefill forward emits the first token; every later forward emits the rest
        self.tokens.len().saturating_sub(1) as f64 / decode_forwards as f64
    }
}

/// The state of one live sequence between steps.
struct Live {
    index: usize,
    cache: SequenceCache,
    /// All tokens so far: prompt, then generated; the last one is pending (not yet fed to the
    /// target).
    tokens: Vec<u32>,
    /// Target post-norm hidden states of positions `cache.mtp_len() ..= cache.len - 1` that
    /// the MTP head has not consumed yet, `[rows][H]`.
    unconsumed: Vec<f32>,
    generated: Vec<u32>,
    forwards: usize,
    acceptance: AcceptanceStats,
    finished: Option<FinishReason>,
}

fn row_error(index: usize, e: verify::RowError) -> Error {
    Error::invalid(format!("sequence {index}"), e.to_string())
}

impl Live {
    /// Appends emitted tokens within the request's budget, stopping at a stop token.
    fn emit(&mut self, request: &Request, emitted: &[u32]) {
        for &token in emitted {
            if self.finished.is_some() {
                break;
            }
            self.tokens.push(token);
            self.generated.push(token);
            if request.stop_tokens.contains(&token) {
                self.finished = Some(FinishReason::Stop);
            } else if self.generated.len() >= request.max_new_tokens {
                self.finished = Some(FinishReason::Length);
            }
        }
    }
}

/// Generates for every request with `spec_tokens` MTP drafts per step (0 = plain decoding).
///
/// # Errors
/// [`Error::Invalid`] for an empty prompt, a token outside the vocabulary, speculation asked of a
/// model without an MTP head, or a sequence whose logits or controls the verifier rejects (NaN
/// logits, bad controls, an empty support), naming the sequence.
pub fn generate(
    model: &Model,
    requests: &[Request],
    spec_tokens: usize,
) -> Result<Vec<Generation>> {
    if spec_tokens > 0 && !model.has_mtp() {
        return Err(Error::invalid(
            "spec tokens",
            format!("{spec_tokens} drafts asked for, but the checkpoint has no MTP head"),
        ));
    }
    let h = model.config.hidden_size;
    let vocab = model.config.vocab_size;
    let mut live: Vec<Live> = Vec::with_capacity(requests.len());
    for (index, request) in requests.iter().enumerate() {
        if request.prompt.is_empty() {
            return Err(Error::invalid(
                format!("sequence {index}"),
                "empty prompt: at least one token is needed",
            ));
        }
        live.push(Live {
            index,
            cache: SequenceCache::new(&model.config),
            tokens: request.prompt.clone(),
            unconsumed: Vec::new(),
            generated: Vec::new(),
            forwards: 0,
            acceptance: AcceptanceStats::default(),
            finished: (request.max_new_tokens == 0).then_some(FinishReason::Length),
        });
    }

    // prefill: the whole prompt, then the first token sampled from the last row
    {
        let mut active: Vec<&mut Live> = live.iter_mut().filter(|l| l.finished.is_none()).collect();
        let prompts: Vec<Vec<u32>> = active.iter().map(|l| l.tokens.clone()).collect();
        let outputs = target_forward(model, &mut active, &prompts, false)?;
        for (l, out) in active.iter_mut().zip(outputs) {
            let request = &requests[l.index];
            let position = l.tokens.len() as u64;
            let token = verify::sample(&out.logits, &request.params, position)
                .map_err(|e| row_error(l.index, e))?;
            l.forwards += 1;
            if spec_tokens > 0 {
                l.unconsumed = out.hidden;
            }
            l.emit(request, &[token]);
        }
    }

    while live.iter().any(|l| l.finished.is_none()) {
        let mut active: Vec<&mut Live> = live.iter_mut().filter(|l| l.finished.is_none()).collect();
        // drafts per sequence: never more than the budget left after the pending token's
        // successor (the verifier always emits one token beyond the accepted drafts)
        let n_of: Vec<usize> = active
            .iter()
            .map(|l| {
                let left = requests[l.index].max_new_tokens - l.generated.len();
                spec_tokens.min(left.saturating_sub(1))
            })
            .collect();
        let mut drafts: Vec<Vec<u32>> = vec![Vec::new(); active.len()];
        let mut draft_logits: Vec<Vec<f32>> = vec![Vec::new(); active.len()];
        if n_of.iter().any(|&n| n > 0) {
            draft_step(
                model,
                requests,
                &mut active,
                &n_of,
                &mut drafts,
                &mut draft_logits,
            )?;
        }
        // one target forward: the pending token plus the drafts
        let rows: Vec<Vec<u32>> = active
            .iter()
            .zip(&drafts)
            .map(|(l, d)| {
                let mut r = vec![
                    *l.tokens
                        .last()
                        .expect("a live sequence has a pending token"),
                ];
                r.extend_from_slice(d);
                r
            })
            .collect();
        let outputs = target_forward(model, &mut active, &rows, true)?;
        for (((l, out), d), q) in active
            .iter_mut()
            .zip(outputs)
            .zip(&drafts)
            .zip(&draft_logits)
        {
            let request = &requests[l.index];
            let position = l.tokens.len() as u64;
            let drafted = if request.params.temperature == 0.0 {
                Drafts::PointMass(d)
            } else {
                Drafts::Sampled {
                    tokens: d,
                    logits: q,
                }
            };
            let outcome = verify::verify(&out.logits, vocab, &drafted, &request.params, position)
                .map_err(|e| row_error(l.index, e))?;
            l.forwards += 1;
            if !d.is_empty() {
                l.acceptance.record(d.len(), &outcome);
            }
            l.cache.commit(outcome.accepted + 1)?;
            if spec_tokens > 0 {
                l.unconsumed
                    .extend_from_slice(&out.hidden[..(outcome.accepted + 1) * h]);
            }
            l.emit(request, &outcome.emitted);
        }
    }

    Ok(live
        .into_iter()
        .map(|l| Generation {
            tokens: l.generated,
            finish_reason: l.finished.unwrap_or(FinishReason::Length),
            forwards: l.forwards,
            acceptance: l.acceptance,
        })
        .collect())
}

/// One target forward over the active sequences: `rows[i]` continues sequence `i`. A verify
/// forward records GDN snapshots and returns every row's logits; a prefill only the last row's.
fn target_forward(
    model: &Model,
    active: &mut [&mut Live],
    rows: &[Vec<u32>],
    verify: bool,
) -> Result<Vec<ForwardOutput>> {
    let mut inputs: Vec<ForwardInput<'_>> = active
        .iter_mut()
        .zip(rows)
        .map(|(l, r)| ForwardInput {
            cache: &mut l.cache,
            tokens: r,
            record: verify,
            all_logits: verify,
        })
        .collect();
    model.forward(&mut inputs)
}

/// Drafts `n_of[i]` tokens for every active sequence with the MTP head: one catch-up forward
/// over the unconsumed target rows (its last row gives draft 1), then chained single rows.
fn draft_step(
    model: &Model,
    requests: &[Request],
    active: &mut [&mut Live],
    n_of: &[usize],
    drafts: &mut [Vec<u32>],
    draft_logits: &mut [Vec<f32>],
) -> Result<()> {
    let h = model.config.hidden_size;
    let depth = model.config.mtp_num_hidden_layers.max(1);
    // rows computed from drafts in the previous step are stale: keep the target-fed ones
    let drafting: Vec<usize> = (0..active.len()).filter(|&i| n_of[i] > 0).collect();
    let mut catch_up_tokens: Vec<Vec<u32>> = Vec::with_capacity(drafting.len());
    for &i in &drafting {
        let l = &mut *active[i];
        let consumed = l.cache.len - l.unconsumed.len() / h;
        l.cache.truncate_mtp(consumed);
        // row p pairs t_{p+1} with H_p, for p = consumed ..= len - 1
        catch_up_tokens.push(l.tokens[consumed + 1..=l.cache.len].to_vec());
    }
    let mut last_hidden: Vec<Vec<f32>> = Vec::with_capacity(drafting.len());
    {
        let hidden: Vec<Vec<f32>> = drafting
            .iter()
            .map(|&i| std::mem::take(&mut active[i].unconsumed))
            .collect();
        let mut inputs: Vec<MtpInput<'_>> = Vec::with_capacity(drafting.len());
        let mut refs: Vec<&mut Live> = Vec::new();
        for (k, l) in active.iter_mut().enumerate() {
            if n_of[k] > 0 {
                refs.push(l);
            }
        }
        for ((l, tokens), hidden) in refs.into_iter().zip(&catch_up_tokens).zip(&hidden) {
            inputs.push(MtpInput {
                cache: &mut l.cache,
                tokens,
                hidden,
                layer: 0,
            });
        }
        let outputs = model.mtp_forward(&mut inputs)?;
        drop(inputs);
        for (&i, out) in drafting.iter().zip(outputs) {
            let rows = out.hidden.len() / h;
            let logits = &out.logits[(rows - 1) * model.config.vocab_size..];
            push_draft(requests, active, i, logits, drafts, draft_logits)?;
            last_hidden.push(out.hidden[(rows - 1) * h..].to_vec());
        }
    }
    // chained drafts 2..n: one row each, on the MTP's own post-norm output
    for step in 1..n_of.iter().copied().max().unwrap_or(0) {
        let chain: Vec<usize> = (0..drafting.len())
            .filter(|&k| n_of[drafting[k]] > step)
            .collect();
        let tokens: Vec<[u32; 1]> = chain
            .iter()
            .map(|&k| [*drafts[drafting[k]].last().expect("draft 1 exists")])
            .collect();
        let mut inputs: Vec<MtpInput<'_>> = Vec::with_capacity(chain.len());
        let mut refs: Vec<Option<&mut Live>> = active.iter_mut().map(|l| Some(&mut **l)).collect();
        for (&k, token) in chain.iter().zip(&tokens) {
            let l = refs[drafting[k]].take().expect("each sequence once");
            inputs.push(MtpInput {
                cache: &mut l.cache,
                tokens: token,
                hidden: &last_hidden[k],
                layer: step % depth,
            });
        }
        let outputs = model.mtp_forward(&mut inputs)?;
        drop(inputs);
        for (&k, out) in chain.iter().zip(outputs) {
            push_draft(
                requests,
                active,
                drafting[k],
                &out.logits,
                drafts,
                draft_logits,
            )?;
            last_hidden[k] = out.hidden;
        }
    }
    Ok(())
}

/// Picks the next draft of sequence `i` from MTP logits: greedy (argmax under the controls) or
/// sampled from the processed draft distribution, whose logits the verifier needs too.
fn push_draft(
    requests: &[Request],
    active: &[&mut Live],
    i: usize,
    logits: &[f32],
    drafts: &mut [Vec<u32>],
    draft_logits: &mut [Vec<f32>],
) -> Result<()> {
    let l = &active[i];
    let params = &requests[l.index].params;
    let position = (l.tokens.len() + drafts[i].len()) as u64;
    let token = if params.temperature == 0.0 {
        verify::greedy_token(logits, params, drafts[i].len())
    } else {
        let draft_params = SamplingParams {
            seed: params.seed ^ DRAFT_SEED_SALT,
            ..params.clone()
        };
        draft_logits[i].extend_from_slice(logits);
        verify::sample(logits, &draft_params, position)
    }
    .map_err(|e| row_error(l.index, e))?;
    drafts[i].push(token);
    Ok(())
}
