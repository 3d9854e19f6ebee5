//! The byte-level tokenizer of the embedded demo model (and of any checkpoint that declares one):
//! token `i < 256` is byte `i`; ids from 256 on are special tokens named in the file.
//!
//! File `fp4spec_tokenizer.json` in the checkpoint folder:
//! `{"type": "bytes", "special": {"<|endoftext|>": 256}, "eos": 256}`.

use crate::error::{Error, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// File name of the tokenizer in a checkpoint folder.
pub const TOKENIZER_FILE: &str = "fp4spec_tokenizer.json";

/// A byte-level tokenizer with named special tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ByteTokenizer {
    /// Special tokens by name (ids >= 256).
    pub special: BTreeMap<String, u32>,
    /// The end-of-sequence token, if any.
    pub eos: Option<u32>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizerFile {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    special: BTreeMap<String, u32>,
    #[serde(default)]
    eos: Option<u32>,
}

impl ByteTokenizer {
    /// Reads `dir/fp4spec_tokenizer.json`; `Ok(None)` when the folder has none.
    ///
    /// # Errors
    /// [`Error::Io`] when the file exists but cannot be read; [`Error::Invalid`] naming the file
    /// for malformed JSON, an unknown `type`, special ids below 256 or not below `vocab_size`,
    /// an `eos` outside the vocabulary, or a `vocab_size` below 256 (a byte tokenizer's).
    pub fn load(dir: &Path, vocab_size: usize) -> Result<Option<Self>> {
        let path = dir.join(TOKENIZER_FILE);
        if !path.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let what = path.display().to_string();
        let file: TokenizerFile =
            serde_json::from_str(&text).map_err(|e| Error::invalid(&what, e.to_string()))?;
        if file.kind != "bytes" {
            return Err(Error::invalid(
                format!("{what}: type"),
                format!("`{}`: only `bytes` is supported", file.kind),
            ));
        }
        let vocab = vocab_size as u64;
        for (name, &id) in &file.special {
            if id < 256 || u64::from(id) >= vocab {
                return Err(Error::invalid(
                    format!("{what}: special.{name}"),
                    format!("id {id} must be in 256 .. {vocab_size}"),
                ));
            }
        }
        if let Some(eos) = file.eos {
            if u64::from(eos) >= vocab {
                return Err(Error::invalid(
                    format!("{what}: eos"),
                    format!("id {eos} is outside the vocabulary of {vocab_size}"),
                ));
            }
        }
        if vocab_size < 256 {
            return Err(Error::invalid(
                what,
                format!("a byte tokenizer needs vocab_size >= 256, the model has {vocab_size}"),
            ));
        }
        Ok(Some(Self {
            special: file.special,
            eos: file.eos,
        }))
    }

    /// The bytes of `text` as token ids.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    /// The text of `tokens`: bytes decoded as UTF-8 (invalid sequences replaced), special tokens
    /// by name.
    pub fn decode(&self, tokens: &[u32]) -> String {
        let mut out = String::new();
        let mut bytes = Vec::new();
        for &t in tokens {
            if t < 256 {
                bytes.push(t as u8);
                continue;
            }
            out.push_str(&String::from_utf8_lossy(&bytes));
            bytes.clear();
            match self.special.iter().find(|(_, id)| **id == t) {
                Some((name, _)) => out.push_str(name),
                None => out.push_str(&format!("<{t}>")),
            }
        }
        out.push_str(&String::from_utf8_lossy(&bytes));
        out
    }
}
