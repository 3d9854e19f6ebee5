//! Speculative-decoding acceptance from a vLLM Prometheus metrics page:
//! `vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
//! `..._num_accepted_tokens_total` and `..._num_accepted_tokens_per_pos_total{position=...}`,
//! each summed over its label sets (engines, models). Two snapshots give the rates over the
//! interval between them.

use crate::error::{Error, Result};
use std::collections::BTreeMap;

const DRAFTS: &str = "vllm:spec_decode_num_drafts_total";
const DRAFT_TOKENS: &str = "vllm:spec_decode_num_draft_tokens_total";
const ACCEPTED: &str = "vllm:spec_decode_num_accepted_tokens_total";
const ACCEPTED_PER_POSITION: &str = "vllm:spec_decode_num_accepted_tokens_per_pos_total";
/// Draft positions a page may report: far past any speculative length in use (vLLM's MTP runs 1
/// to a few), so a corrupt label cannot size the summary's per-position list.
pub const MAX_POSITIONS: u32 = 1024;

/// The acceptance regimes measured in the seeds: a block drafter pays on edit-like text, not on
/// prose-like text.
pub const PROSE_LIKE_ACCEPTANCE: f64 = 0.06;
/// See [`PROSE_LIKE_ACCEPTANCE`].
pub const EDIT_LIKE_ACCEPTANCE: f64 = 0.83;

/// The speculative-decoding counters of one metrics page.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SpecCounters {
    /// Draft steps (`num_drafts`).
    pub drafts: f64,
    /// Draft tokens proposed.
    pub draft_tokens: f64,
    /// Draft tokens accepted.
    pub accepted_tokens: f64,
    /// Accepted tokens by draft position (0 = first draft token).
    pub accepted_per_position: BTreeMap<u32, f64>,
}

/// What the counters say.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SpecSummary {
    /// Accepted draft tokens / proposed draft tokens.
    pub acceptance_rate: f64,
    /// Tokens per target forward: 1 + accepted / drafts (vLLM's "mean acceptance length").
    pub mean_accepted_length: f64,
    /// For each draft position, the share of draft steps whose token at that position was
    /// accepted.
    pub per_position: Vec<f64>,
    /// `prose-like` or `edit-like`: the nearer of the seeds' two regimes.
    pub regime: &'static str,
}

impl SpecCounters {
    /// Parses a Prometheus text exposition page.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming `source:line` for a malformed metric line, a per-position
    /// sample without a numeric `position` label or with one of [`MAX_POSITIONS`] or more, or a
    /// missing speculative-decoding metric.
    pub fn parse(text: &str, source: &str) -> Result<Self> {
        let mut counters = Self::default();
        let mut seen = [false; 3];
        for (i, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = || format!("{source}:{}", i + 1);
            let (name, labels, value) = parse_sample(line).ok_or_else(|| {
                Error::invalid(at(), format!("`{raw}` is not a Prometheus sample line"))
            })?;
            let total = match name {
                DRAFTS => Some((&mut counters.drafts, 0)),
                DRAFT_TOKENS => Some((&mut counters.draft_tokens, 1)),
                ACCEPTED => Some((&mut counters.accepted_tokens, 2)),
                _ => None,
            };
            if let Some((sum, index)) = total {
                *sum += value;
                seen[index] = true;
                continue;
            }
            if name == ACCEPTED_PER_POSITION {
                let position = label(labels, "position")
                    .and_then(|p| p.parse::<u32>().ok())
                    .ok_or_else(|| {
                        Error::invalid(
                            at(),
                            format!(
                                "{ACCEPTED_PER_POSITION} without a numeric position label: `{raw}`"
                            ),
                        )
                    })?;
                if position >= MAX_POSITIONS {
                    return Err(Error::invalid(
                        at(),
                        format!(
                            "position {position} is past the {MAX_POSITIONS} draft positions a \
                             summary covers: `{raw}`"
                        ),
                    ));
                }
                *counters
                    .accepted_per_position
                    .entry(position)
                    .or_insert(0.0) += value;
            }
        }
        for (found, metric) in seen.iter().zip([DRAFTS, DRAFT_TOKENS, ACCEPTED]) {
            if !found {
                return Err(Error::invalid(
                    source,
                    format!(
                        "{metric} is missing: not a vLLM metrics page with speculative decoding"
                    ),
                ));
            }
        }
        Ok(counters)
    }

    /// The counts between an `earlier` snapshot and this one.
    ///
    /// # Errors
    /// [`Error::Invalid`] when a counter went down (the server restarted between snapshots).
    pub fn since(&self, earlier: &SpecCounters) -> Result<SpecCounters> {
        let delta = |name: &str, now: f64, then: f64| {
            if now < then {
                Err(Error::invalid(
                    name.to_string(),
                    format!(
                        "went down from {then} to {now}: the server restarted between the snapshots"
                    ),
                ))
            } else {
                Ok(now - then)
            }
        };
        let mut per_position = BTreeMap::new();
        for (position, now) in &self.accepted_per_position {
            let then = earlier
                .accepted_per_position
                .get(position)
                .copied()
                .unwrap_or(0.0);
            per_position.insert(
                *position,
                delta(
                    &format!("{ACCEPTED_PER_POSITION}{{position=\"{position}\"}}"),
                    *now,
                    then,
                )?,
            );
        }
        Ok(SpecCounters {
            drafts: delta(DRAFTS, self.drafts, earlier.drafts)?,
            draft_tokens: delta(DRAFT_TOKENS, self.draft_tokens, earlier.draft_tokens)?,
            accepted_tokens: delta(ACCEPTED, self.accepted_tokens, earlier.accepted_tokens)?,
            accepted_per_position: per_position,
        })
    }

    /// Acceptance rate, mean accepted length, per-position acceptance and regime.
    ///
    /// # Errors
    /// [`Error::Invalid`] when no drafts were made (nothing to measure).
    pub fn summary(&self) -> Result<SpecSummary> {
        if self.drafts <= 0.0 || self.draft_tokens <= 0.0 {
            return Err(Error::invalid(
                DRAFTS,
                "no drafts counted: nothing to measure",
            ));
        }
        let acceptance_rate = self.accepted_tokens / self.draft_tokens;
        let positions = self
            .accepted_per_position
            .keys()
            .next_back()
            .map_or(0, |p| p + 1);
        let per_position = (0..positions)
            .map(|p| self.accepted_per_position.get(&p).copied().unwrap_or(0.0) / self.drafts)
            .collect();
        let regime = if (acceptance_rate - PROSE_LIKE_ACCEPTANCE).abs()
            <= (acceptance_rate - EDIT_LIKE_ACCEPTANCE).abs()
        {
            "prose-like"
        } else {
            "edit-like"
        };
        Ok(SpecSummary {
            acceptance_rate,
            mean_accepted_length: 1.0 + self.accepted_tokens / self.drafts,
            per_position,
            regime,
        })
    }
}

/// `name{labels} value [timestamp]` -> (name, labels text, value).
fn parse_sample(line: &str) -> Option<(&str, &str, f64)> {
    let (name, rest) = match line.find(['{', ' ', '\t']) {
        Some(i) => line.split_at(i),
        None => return None,
    };
    let (labels, rest) = if let Some(after) = rest.strip_prefix('{') {
        let end = closing_brace(after)?;
        (&after[..end], &after[end + 1..])
    } else {
        ("", rest)
    };
    let mut fields = rest.split_whitespace();
    let value = match fields.next()? {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    if let Some(timestamp) = fields.next() {
        timestamp.parse::<i64>().ok()?;
    }
    if fields.next().is_some()
        || name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_:".contains(c))
    {
        return None;
    }
    Some((name, labels, value))
}

/// The index of the `}` closing a label set, skipping quoted values.
fn closing_brace(labels: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in labels.char_indices() {
        match (quoted, escaped, c) {
            (true, false, '\\') => escaped = true,
            (true, true, _) => escaped = false,
            (true, false, '"') => quoted = false,
            (false, _, '"') => quoted = true,
            (false, _, '}') => return Some(i),
            _ => {}
        }
    }
    None
}

/// The value of label `key` in a label set (`a="1",position="2"`).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

/// Fetches `url` (plain `http://host[:port]/path`) with an HTTP/1.0 GET and returns the body.
///
/// # Errors
/// [`Error::Invalid`] for another scheme or a non-200 answer, [`Error::Io`] when the connection
/// fails.
pub fn fetch(url: &str) -> Result<String> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").ok_or_else(|| {
        Error::invalid("--url", format!("`{url}`: only plain http:// is supported"))
    })?;
    let (authority, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_string()), |(a, p)| (a, format!("/{p}")));
    let address = if authority.contains(':') {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    let mut stream = std::net::TcpStream::connect(&address).map_err(|e| Error::io(url, e))?;
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .map_err(|e| Error::io(url, e))?;
    // one write: a test server (and some real ones) read the request with a single recv
    let request = format!("GET {path} HTTP/1.0\r\nHost: {authority}\r\nAccept: text/plain\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .map_err(|e| Error::io(url, e))?;
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .map_err(|e| Error::io(url, e))?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| Error::invalid(url.to_string(), "the answer is not an HTTP response"))?;
    let status = head.lines().next().unwrap_or_default();
    if status.split_whitespace().nth(1) != Some("200") {
        return Err(Error::invalid(
            url.to_string(),
            format!("answered `{status}`"),
        ));
    }
    Ok(body.to_string())
}
