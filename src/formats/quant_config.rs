//! The quantisation config of an NVFP4 checkpoint, as ModelOpt and llm-compressor write it:
//! `hf_quant_config.json` (`{"producer", "quantization": {"quant_algo", "group_size",
//! "exclude_modules"}}`) and `config.json`'s `quantization_config` (`quant_method` `modelopt`
//! with the same fields, or `compressed-tensors` with format `nvfp4-pack-quantized`,
//! `config_groups` and `ignore`).
//!
//! The exclusion list decides which linears are NVFP4 and which stay float: a module is
//! excluded when a pattern matches its name or the name of a module containing it (so
//! `model.layers.0.linear_attn` excludes that layer's projections). Patterns are fnmatch
//! wildcards (`*`, `?`, `[seq]`, `[!seq]`; `*` also crosses dots), as ModelOpt writes them;
//! compressed-tensors' `re:` entries are regular expressions anchored at the start of the name,
//! as compressed-tensors matches them.

use crate::error::{Error, Result};
use serde_json::{Value, json};
use std::path::Path;

/// File name of ModelOpt's quantisation config.
pub const HF_QUANT_CONFIG: &str = "hf_quant_config.json";

/// NVFP4 block size (elements per E4M3 scale).
pub const GROUP_SIZE: usize = 16;

/// Which tensor names an NVFP4 linear uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Convention {
    /// NVIDIA ModelOpt: `weight`, `weight_scale`, `weight_scale_2`, `input_scale`; fused 3-D
    /// experts `P`, `P_weight_scale`, `P_weight_scale_2`, `P_input_scale`.
    ModelOpt,
    /// compressed-tensors `nvfp4-pack-quantized`: `weight_packed`, `weight_scale`,
    /// `weight_global_scale`, `input_global_scale` (global scales inverted).
    CompressedTensors,
}

impl Convention {
    /// The name written in messages and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Convention::ModelOpt => "modelopt",
            Convention::CompressedTensors => "compressed-tensors",
        }
    }
}

/// One exclusion entry.
#[derive(Debug, Clone)]
enum Pattern {
    Glob(String),
    Regex(regex::Regex),
}

/// An NVFP4 checkpoint's quantisation config.
#[derive(Debug, Clone)]
pub struct QuantConfig {
    /// Tensor naming convention.
    pub convention: Convention,
    /// `NVFP4` (weights and activations: every quantised linear stores its activation scale)
    /// or `W4A16_NVFP4` (weights only).
    pub quant_algo: String,
    /// Elements per block scale (16).
    pub group_size: usize,
    /// Whether quantised linears store an activation scale (`input_scale` /
    /// `input_global_scale`).
    pub activation_scales: bool,
    /// The exclusion entries as written.
    pub exclude: Vec<String>,
    /// The file (and key) this was read from.
    pub source: String,
    patterns: Vec<Pattern>,
}

impl PartialEq for QuantConfig {
    fn eq(&self, other: &Self) -> bool {
        self.convention == other.convention
            && self.quant_algo == other.quant_algo
            && self.group_size == other.group_size
            && self.activation_scales == other.activation_scales
            && self.exclude == other.exclude
    }
}

/// Python's `fnmatch.fnmatchcase`: `*` any run (dots included), `?` one character, `[seq]` one
/// of seq (ranges `a-z`), `[!seq]` none of seq; everything else literal. An unclosed `[` is a
/// literal `[`.
pub fn fnmatch(pattern: &str, name: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    // iterative matcher with single-star backtracking, as glob matchers do
    let (mut pi, mut ni) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        let step = match p.get(pi) {
            Some('*') => {
                star = Some((pi, ni));
                pi += 1;
                continue;
            }
            Some('?') => Some(pi + 1),
            Some('[') => match class(&p[pi..], n[ni]) {
                Some((true, len)) => Some(pi + len),
                Some((false, _)) => None,
                None if n[ni] == '[' => Some(pi + 1),
                None => None,
            },
            Some(&c) if c == n[ni] => Some(pi + 1),
            _ => None,
        };
        match (step, star) {
            (Some(next), _) => {
                pi = next;
                ni += 1;
            }
            (None, Some((star_p, star_n))) => {
                pi = star_p + 1;
                ni = star_n + 1;
                star = Some((star_p, star_n + 1));
            }
            (None, None) => return false,
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// Matches `c` against the class at the start of `p` (`[...]`): (matched, class length), or
/// None when the class is not closed.
fn class(p: &[char], c: char) -> Option<(bool, usize)> {
    let mut i = 1;
    let negate = matches!(p.get(i), Some('!'));
    if negate {
        i += 1;
    }
    let mut matched = false;
    let mut first = true;
    while let Some(&x) = p.get(i) {
        if x == ']' && !first {
            return Some((matched != negate, i + 1));
        }
        first = false;
        if p.get(i + 1) == Some(&'-') && p.get(i + 2).is_some_and(|&y| y != ']') {
            let y = p[i + 2];
            matched |= x <= c && c <= y;
            i += 3;
        } else {
            matched |= x == c;
            i += 1;
        }
    }
    None
}

impl QuantConfig {
    /// A config for `convention` and `quant_algo` (`NVFP4` or `W4A16_NVFP4`) with the
    /// exclusion entries `exclude`.
    ///
    /// # Errors
    /// [`Error::Invalid`] for another algorithm or an entry that does not compile.
    pub fn new(
        convention: Convention,
        quant_algo: &str,
        exclude: Vec<String>,
        source: &str,
    ) -> Result<Self> {
        let activation_scales = match quant_algo {
            "NVFP4" => true,
            "W4A16_NVFP4" => false,
            other => {
                return Err(Error::invalid(
                    format!("{source}: quant_algo"),
                    format!("`{other}` is not NVFP4 or W4A16_NVFP4, the formats this crate runs"),
                ));
            }
        };
        let patterns = exclude
            .iter()
            .map(|entry| match entry.strip_prefix("re:") {
                Some(re) => regex::Regex::new(&format!("^(?:{re})"))
                    .map(Pattern::Regex)
                    .map_err(|e| {
                        Error::invalid(
                            format!("{source}: exclusion `{entry}`"),
                            format!("not a regular expression: {e}"),
                        )
                    }),
                None => Ok(Pattern::Glob(entry.clone())),
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            convention,
            quant_algo: quant_algo.to_string(),
            group_size: GROUP_SIZE,
            activation_scales,
            exclude,
            source: source.to_string(),
            patterns,
        })
    }

    /// The quantisation config of the checkpoint folder `dir`: `config.json`'s
    /// `quantization_config` when present (what engines read first), else
    /// `hf_quant_config.json`; `None` for a float checkpoint.
    ///
    /// # Errors
    /// As [`QuantConfig::load_both`], and [`Error::Invalid`] naming both files when both exist
    /// and disagree on the convention, algorithm or exclusion list.
    pub fn load(dir: &Path) -> Result<Option<Self>> {
        let (from_config, from_hf) = Self::load_both(dir)?;
        match (from_config, from_hf) {
            (Some(a), Some(b)) => {
                a.agrees_with(&b)?;
                Ok(Some(a))
            }
            (a, b) => Ok(a.or(b)),
        }
    }

    /// Both sources as found: (`config.json` `quantization_config`, `hf_quant_config.json`).
    ///
    /// # Errors
    /// [`Error::Io`] for an unreadable file, [`Error::Invalid`] naming file and field for
    /// malformed JSON, a quantisation method other than NVFP4 (ModelOpt or
    /// compressed-tensors `nvfp4-pack-quantized`), a group size other than 16, or an exclusion
    /// entry that does not compile.
    pub fn load_both(dir: &Path) -> Result<(Option<Self>, Option<Self>)> {
        let config_path = dir.join("config.json");
        let from_config = match read_json(&config_path)? {
            Some(config) => match config.get("quantization_config") {
                Some(Value::Null) | None => None,
                Some(q) => Some(Self::from_json(
                    q,
                    &format!("{}: quantization_config", config_path.display()),
                )?),
            },
            None => None,
        };
        let hf_path = dir.join(HF_QUANT_CONFIG);
        let from_hf = match read_json(&hf_path)? {
            Some(hf) => {
                let source = hf_path.display().to_string();
                let quantization = hf.get("quantization").ok_or_else(|| {
                    Error::invalid(&source, "has no `quantization` object".to_string())
                })?;
                Some(Self::from_json(
                    quantization,
                    &format!("{source}: quantization"),
                )?)
            }
            None => None,
        };
        Ok((from_config, from_hf))
    }

    /// Checks two configs of one checkpoint say the same.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming both sources and what differs.
    pub fn agrees_with(&self, other: &Self) -> Result<()> {
        let mut differences = Vec::new();
        if self.convention != other.convention {
            differences.push(format!(
                "convention {} vs {}",
                self.convention.name(),
                other.convention.name()
            ));
        }
        if self.quant_algo != other.quant_algo {
            differences.push(format!(
                "quant_algo {} vs {}",
                self.quant_algo, other.quant_algo
            ));
        }
        let mut a = self.exclude.clone();
        let mut b = other.exclude.clone();
        a.sort();
        b.sort();
        if a != b {
            let only_a: Vec<&String> = a.iter().filter(|x| !b.contains(x)).collect();
            let only_b: Vec<&String> = b.iter().filter(|x| !a.contains(x)).collect();
            differences.push(format!(
                "exclusions only in the first: {only_a:?}, only in the second: {only_b:?}"
            ));
        }
        if differences.is_empty() {
            return Ok(());
        }
        Err(Error::invalid(
            format!("{} and {}", self.source, other.source),
            format!(
                "disagree ({}); engines read one or the other",
                differences.join("; ")
            ),
        ))
    }

    /// Parses a `quantization_config` object (ModelOpt flat or nested under `quantization`,
    /// or compressed-tensors) or the `quantization` object of `hf_quant_config.json`; `source`
    /// names it in errors.
    ///
    /// # Errors
    /// As [`QuantConfig::load_both`].
    pub fn from_json(value: &Value, source: &str) -> Result<Self> {
        let field = |name: &str| format!("{source}.{name}");
        let object = value
            .as_object()
            .ok_or_else(|| Error::invalid(source, "is not a JSON object"))?;
        if let Some(inner) = object.get("quantization").filter(|v| v.is_object()) {
            return Self::from_json(inner, &field("quantization"));
        }
        let method = object.get("quant_method").and_then(Value::as_str);
        let config = if method == Some("compressed-tensors") {
            Self::compressed_tensors(object, source)?
        } else {
            if let Some(other) = method.filter(|m| *m != "modelopt") {
                return Err(Error::invalid(
                    field("quant_method"),
                    format!(
                        "`{other}` is not an NVFP4 method this crate runs (modelopt, compressed-tensors)"
                    ),
                ));
            }
            let algo = object
                .get("quant_algo")
                .and_then(Value::as_str)
                .ok_or_else(|| Error::invalid(field("quant_algo"), "missing or not a string"))?;
            let exclude = string_list(object.get("exclude_modules"), &field("exclude_modules"))?
                .or(string_list(object.get("ignore"), &field("ignore"))?)
                .unwrap_or_default();
            let config = Self::new(Convention::ModelOpt, algo, exclude, source)?;
            check_group_size(object.get("group_size"), &field("group_size"))?;
            config
        };
        Ok(config)
    }

    fn compressed_tensors(object: &serde_json::Map<String, Value>, source: &str) -> Result<Self> {
        let field = |name: &str| format!("{source}.{name}");
        let groups = object
            .get("config_groups")
            .and_then(Value::as_object)
            .filter(|g| !g.is_empty())
            .ok_or_else(|| Error::invalid(field("config_groups"), "missing or empty"))?;
        let top_format = object.get("format").and_then(Value::as_str);
        let mut activations = None;
        for (name, group) in groups {
            let g = |key: &str| format!("{source}.config_groups.{name}.{key}");
            let format = group
                .get("format")
                .and_then(Value::as_str)
                .or(top_format)
                .unwrap_or("");
            if format != "nvfp4-pack-quantized" {
                return Err(Error::invalid(
                    g("format"),
                    format!(
                        "`{format}` is not nvfp4-pack-quantized, the only compressed-tensors format this crate runs"
                    ),
                ));
            }
            let weights = group
                .get("weights")
                .and_then(Value::as_object)
                .ok_or_else(|| Error::invalid(g("weights"), "missing"))?;
            let bits = weights.get("num_bits").and_then(Value::as_u64);
            let kind = weights.get("type").and_then(Value::as_str);
            if bits != Some(4) || kind != Some("float") {
                return Err(Error::invalid(
                    g("weights"),
                    format!(
                        "num_bits {bits:?} type {kind:?} is not NVFP4 (4-bit float); mixed groups are not supported"
                    ),
                ));
            }
            check_group_size(weights.get("group_size"), &g("weights.group_size"))?;
            let has_activations = group.get("input_activations").is_some_and(|a| !a.is_null());
            if activations.is_some_and(|a| a != has_activations) {
                return Err(Error::invalid(
                    g("input_activations"),
                    "groups disagree on whether activations are quantised",
                ));
            }
            activations = Some(has_activations);
        }
        let exclude = string_list(object.get("ignore"), &field("ignore"))?.unwrap_or_default();
        let algo = if activations == Some(true) {
            "NVFP4"
        } else {
            "W4A16_NVFP4"
        };
        Self::new(Convention::CompressedTensors, algo, exclude, source)
    }

    /// Whether module `module` (a linear's name without `.weight`, or a fused expert tensor's
    /// name) is excluded: an entry matches it or a module containing it.
    pub fn excludes(&self, module: &str) -> bool {
        self.excluding_entry(module).is_some()
    }

    /// The first exclusion entry that excludes `module`, as written.
    pub fn excluding_entry(&self, module: &str) -> Option<&str> {
        let mut candidates = vec![module];
        let mut rest = module;
        while let Some((parent, _)) = rest.rsplit_once('.') {
            candidates.push(parent);
            rest = parent;
        }
        self.patterns
            .iter()
            .zip(&self.exclude)
            .find(|(pattern, _)| {
                candidates.iter().any(|name| match pattern {
                    Pattern::Glob(glob) => fnmatch(glob, name),
                    Pattern::Regex(re) => re.is_match(name),
                })
            })
            .map(|(_, entry)| entry.as_str())
    }

    /// The `quantization_config` object for `config.json`.
    pub fn quantization_config_json(&self) -> Value {
        match self.convention {
            Convention::ModelOpt => json!({
                "quant_method": "modelopt",
                "quant_algo": self.quant_algo,
                "kv_cache_quant_algo": null,
                "group_size": self.group_size,
                "exclude_modules": self.exclude,
                "producer": producer(),
            }),
            Convention::CompressedTensors => {
                let scheme = json!({
                    "num_bits": 4, "type": "float", "strategy": "tensor_group",
                    "group_size": self.group_size, "symmetric": true, "dynamic": false,
                    "observer": "minmax",
                });
                let activations = if self.activation_scales {
                    json!({
                        "num_bits": 4, "type": "float", "strategy": "tensor_group",
                        "group_size": self.group_size, "symmetric": true, "dynamic": "local",
                        "observer": "minmax",
                    })
                } else {
                    Value::Null
                };
                json!({
                    "quant_method": "compressed-tensors",
                    "format": "nvfp4-pack-quantized",
                    "quantization_status": "compressed",
                    "config_groups": {"group_0": {
                        "targets": ["Linear"],
                        "weights": scheme,
                        "input_activations": activations,
                        "output_activations": null,
                        "format": "nvfp4-pack-quantized",
                    }},
                    "ignore": self.exclude,
                    "kv_cache_scheme": null,
                    "producer": producer(),
                })
            }
        }
    }

    /// The content of `hf_quant_config.json` (ModelOpt only).
    pub fn hf_quant_config_json(&self) -> Value {
        json!({
            "producer": producer(),
            "quantization": {
                "quant_algo": self.quant_algo,
                "kv_cache_quant_algo": null,
                "group_size": self.group_size,
                "exclude_modules": self.exclude,
            }
        })
    }

    /// This config with `entry` added to its exclusion list.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `entry` does not compile.
    pub fn with_exclusion(&self, entry: &str) -> Result<Self> {
        let mut exclude = self.exclude.clone();
        exclude.push(entry.to_string());
        let mut config = Self::new(self.convention, &self.quant_algo, exclude, &self.source)?;
        config.group_size = self.group_size;
        Ok(config)
    }
}

/// Adds `entry` to the exclusion list of a quantisation config object as it sits in a JSON file
/// (`exclude_modules` for ModelOpt, `ignore` for compressed-tensors; nested `quantization`
/// followed), leaving every other field as it is.
pub fn add_exclusion_json(value: &mut Value, convention: Convention, entry: &str) {
    if let Some(inner) = value.get_mut("quantization").filter(|v| v.is_object()) {
        add_exclusion_json(inner, convention, entry);
        return;
    }
    let Some(object) = value.as_object_mut() else {
        return;
    };
    let key = match convention {
        Convention::ModelOpt if object.contains_key("ignore") => "ignore",
        Convention::ModelOpt => "exclude_modules",
        Convention::CompressedTensors => "ignore",
    };
    let list = object.entry(key).or_insert_with(|| json!([]));
    if let Some(list) = list.as_array_mut() {
        list.push(Value::String(entry.to_string()));
    }
}

fn producer() -> Value {
    json!({"name": "fp4spec", "version": env!("CARGO_PKG_VERSION")})
}

fn check_group_size(value: Option<&Value>, field: &str) -> Result<()> {
    match value {
        None | Some(Value::Null) => Ok(()),
        Some(v) if v.as_u64() == Some(GROUP_SIZE as u64) => Ok(()),
        Some(v) => Err(Error::invalid(
            field,
            format!("{v}: NVFP4 blocks are {GROUP_SIZE} elements"),
        )),
    }
}

fn string_list(value: Option<&Value>, field: &str) -> Result<Option<Vec<String>>> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| Error::invalid(field, format!("entry {v} is not a string")))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some),
        Some(other) => Err(Error::invalid(
            field,
            format!("must be a list of strings, found {other}"),
        )),
    }
}

/// The JSON in `path`, or None when there is no such file.
fn read_json(path: &Path) -> Result<Option<Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(path, e)),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| Error::invalid(path.display().to_string(), format!("not valid JSON: {e}")))
}
