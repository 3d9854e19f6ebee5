//! Greedy generation on the device path: the requests' prompts in one prefill, then steps of a
//! [`Decoder`] (no drafts) or a [`SpecDecoder`] (`n` MTP drafts per step) until every request
//! has its tokens or a stop token. It takes and returns the CPU runner's [`Request`] and
//! [`Generation`] ([`crate::model::generate::generate`]), so a caller switches paths without
//! changing types; sampling stays on the CPU runner for now.

use super::{Decoder, DeviceModel, MAX_POSITIONS, SpecDecoder, decoder_capacity};
use crate::error::{Error, Result};
use crate::kernels::verify::AcceptanceStats;
use crate::model::generate::{FinishReason, Generation, Request};

/// Steps between two looks at the generated tokens (a look waits for the device): a sequence
/// that meets a stop token runs at most this many steps past it.
const STEPS_BETWEEN_CHECKS: usize = 16;

/// Generates greedily for every request on `model`'s backend with `drafts` MTP drafts per step
/// (0: plain decoding). Every request decodes in the same batch; the output equals greedy
/// decoding without drafts token for token (the drafts only change how many tokens a step
/// emits). `forwards` counts the prefill and the steps up to the look at the generated tokens
/// (one every 16 steps, or fewer near the budget) that found the sequence finished: a sequence
/// that meets a stop token between two looks counts up to 15 steps more than it needed (the CPU
/// runner counts exactly, and 0 for `max_new_tokens` 0, where this path counts the prefill), and
/// `acceptance` counts every step of the batch until its last sequence finished. The tokens are
/// exact either way.
///
/// # Errors
/// [`Error::Invalid`] for no requests, an empty prompt, a token outside the vocabulary, sampling
/// asked for (temperature above 0, or a logit bias, which changes the greedy token), drafts asked
/// of a model without an MTP head or beyond [`super::max_drafts`]; errors of the launches.
pub fn generate_greedy(
    model: &DeviceModel,
    requests: &[Request],
    drafts: usize,
) -> Result<Vec<Generation>> {
    if requests.is_empty() {
        return Err(Error::invalid("requests", "nothing to generate"));
    }
    for (i, r) in requests.iter().enumerate() {
        if r.params.temperature != 0.0 || !r.params.logit_bias.is_empty() {
            return Err(Error::invalid(
                format!("sequence {i}"),
                "the device path decodes greedily: temperature 0 and no logit bias (sampling \
                 runs on the CPU runner)",
            ));
        }
    }
    let batch = requests.len();
    let longest = requests.iter().map(|r| r.prompt.len()).max().unwrap_or(0);
    let most_new = requests.iter().map(|r| r.max_new_tokens).max().unwrap_or(0);
    // every sequence steps until the last one finishes: at most `most_new` steps (each emits a
    // token at least) of at most n + 1 tokens, and a step's drafts look 2 n ahead
    let capacity = decoder_capacity(longest, most_new, drafts).ok_or_else(|| {
        Error::invalid(
            "requests",
            format!(
                "a prompt of {longest} tokens and max_new_tokens {most_new} at {drafts} \
                 drafts per step need more than the {MAX_POSITIONS} positions a decoder holds"
            ),
        )
    })?;
    let prompts: Vec<&[u32]> = requests.iter().map(|r| r.prompt.as_slice()).collect();
    let mut stepper = if drafts == 0 {
        let mut decoder = Decoder::new(model, batch, capacity)?;
        decoder.prefill(&prompts)?;
        Stepper::Plain {
            decoder: Box::new(decoder),
            generated: vec![Vec::new(); batch],
        }
    } else {
        let mut decoder = SpecDecoder::new(model, batch, capacity, drafts)?;
        decoder.prefill(&prompts)?;
        Stepper::Speculative(Box::new(decoder))
    };
    let mut finished: Vec<Option<Finished>> = requests
        .iter()
        .map(|r| {
            (r.max_new_tokens == 0).then_some(Finished {
                reason: FinishReason::Length,
                tokens: 0,
                forwards: 1,
            })
        })
        .collect();
    let mut steps = 0;
    let mut generated = vec![Vec::new(); batch];
    while finished.iter().any(Option::is_none) {
        // every unfinished sequence emits 1 to n + 1 tokens per step: steps that cannot take
        // any of them past its budget by more than n
        let needed = requests
            .iter()
            .zip(&finished)
            .zip(&generated)
            .filter(|((_, f), _)| f.is_none())
            .map(|((r, _), g)| r.max_new_tokens.saturating_sub(g.len()))
            .min()
            .unwrap_or(1);
        let run = (needed / (drafts + 1)).clamp(1, STEPS_BETWEEN_CHECKS);
        stepper.steps(run)?;
        steps += run;
        generated = stepper.generated()?;
        for ((request, done), tokens) in requests.iter().zip(&mut finished).zip(&generated) {
            if done.is_some() {
                continue;
            }
            let limit = tokens.len().min(request.max_new_tokens);
            // the forwards: the prefill and the steps until this look
            let stop = tokens[..limit]
                .iter()
                .position(|t| request.stop_tokens.contains(t));
            *done = match stop {
                Some(stop) => Some(Finished {
                    reason: FinishReason::Stop,
                    tokens: stop + 1,
                    forwards: steps + 1,
                }),
                None if tokens.len() >= request.max_new_tokens => Some(Finished {
                    reason: FinishReason::Length,
                    tokens: request.max_new_tokens,
                    forwards: steps + 1,
                }),
                None => None,
            };
        }
    }
    let acceptance = stepper.acceptance(batch, drafts)?;
    Ok(generated
        .into_iter()
        .zip(finished)
        .zip(acceptance)
        .filter_map(|((mut tokens, done), acceptance)| {
            let done = done?;
            tokens.truncate(done.tokens);
            Some(Generation {
                tokens,
                finish_reason: done.reason,
                forwards: done.forwards,
                acceptance,
            })
        })
        .collect())
}

/// How and when a sequence finished.
#[derive(Clone, Copy)]
struct Finished {
    reason: FinishReason,
    /// Generated tokens it keeps.
    tokens: usize,
    /// Target forwards it took part in, the prefill included.
    forwards: usize,
}

/// The decoder a generation steps.
enum Stepper<'m> {
    /// Without drafts: the decoder exposes each step's tokens, collected here.
    Plain {
        decoder: Box<Decoder<'m>>,
        generated: Vec<Vec<u32>>,
    },
    Speculative(Box<SpecDecoder<'m>>),
}

impl Stepper<'_> {
    fn steps(&mut self, count: usize) -> Result<()> {
        for _ in 0..count {
            match self {
                Self::Plain { decoder, generated } => {
                    decoder.step()?;
                    for (g, t) in generated.iter_mut().zip(decoder.tokens()?) {
                        g.push(t);
                    }
                }
                Self::Speculative(decoder) => decoder.step()?,
            }
        }
        Ok(())
    }

    fn generated(&mut self) -> Result<Vec<Vec<u32>>> {
        match self {
            Self::Plain { generated, .. } => Ok(generated.clone()),
            Self::Speculative(decoder) => decoder.generated(),
        }
    }

    fn acceptance(&self, batch: usize, drafts: usize) -> Result<Vec<AcceptanceStats>> {
        match self {
            Self::Plain { .. } => Ok(vec![
                AcceptanceStats {
                    drafted: vec![0; drafts],
                    accepted: vec![0; drafts],
                };
                batch
            ]),
            Self::Speculative(decoder) => decoder.acceptance_by_sequence(),
        }
    }
}
