//! Text to token ids and back: a checkpoint's own `tokenizer.json` through the `tokenizers`
//! crate ([`Tokenizer::Json`]), or for models that have none (the built-in model) the
//! byte-level [`ByteLevel`].
//!
//! The byte-level tokenizer maps each UTF-8 byte of the text to the token id of the same value
//! (0-255); ids from 256 up are the specials: [`ByteLevel::BOS`] and [`ByteLevel::EOS`]. Any
//! vocabulary of at least 258 ids can use it (the built-in model has 1,024; spec section 2 puts
//! no constraint on the tokenizer). Decoding is lossless for ids below 256 and skips specials;
//! ids that are neither are rendered as `<|id|>` so a generated stream stays inspectable.
//!
//! Checkpoints that ship a `tokenizer.json` get their own tokenizer ([`Tokenizer::for_weights`]
//! finds it beside the weights); the byte-level one is the fallback, and it is what the
//! appliance and `kvstack run --prompt` use for the built-in model.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// The largest `tokenizer.json` read (the V4.1 release's is about 8 MiB).
const MAX_TOKENIZER_BYTES: u64 = 128 << 20;

/// A model's tokenizer.
#[derive(Clone)]
pub enum Tokenizer {
    /// The byte-level fallback.
    Bytes(ByteLevel),
    /// A `tokenizer.json` (boxed: the `tokenizers` model is large).
    Json {
        /// Where it was read from.
        path: PathBuf,
        /// The tokenizer.
        inner: Box<tokenizers::Tokenizer>,
        /// The end-of-sequence id (the model config's `eos_token_id`), if known.
        eos: Option<u32>,
    },
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tokenizer::Bytes(b) => f.debug_tuple("Bytes").field(b).finish(),
            Tokenizer::Json { path, eos, .. } => f
                .debug_struct("Json")
                .field("path", path)
                .field("eos", eos)
                .finish(),
        }
    }
}

fn tokenizer_err(path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::Format {
        path: path.to_path_buf(),
        reason: format!("tokenizer: {reason}"),
    }
}

impl Tokenizer {
    /// Reads `tokenizer.json` at `path` for a model of `vocab_size` ids whose end of sequence
    /// is `eos`.
    ///
    /// # Errors
    /// [`Error::Open`] when it cannot be read; [`Error::Format`] when it is not a tokenizer,
    /// or its vocabulary (added tokens included) exceeds the model's, or `eos` is outside it.
    pub fn from_file(path: &Path, vocab_size: u32, eos: Option<u32>) -> Result<Tokenizer> {
        let bytes =
            kvstack_spec::files::read_regular(path, MAX_TOKENIZER_BYTES).map_err(|e| match e {
                kvstack_spec::files::FileError::Io(source) => Error::Open {
                    path: path.to_path_buf(),
                    source,
                },
                other => tokenizer_err(path, other),
            })?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| tokenizer_err(path, e))?;
        let n = inner.get_vocab_size(true);
        if n > vocab_size as usize {
            return Err(tokenizer_err(
                path,
                format!(
                    "{n} tokens (added tokens included), more than the model's vocab_size {vocab_size}"
                ),
            ));
        }
        if let Some(e) = eos
            && e >= vocab_size
        {
            return Err(tokenizer_err(
                path,
                format!("eos_token_id {e} is outside the model's vocab_size {vocab_size}"),
            ));
        }
        Ok(Tokenizer::Json {
            path: path.to_path_buf(),
            inner: Box::new(inner),
            eos,
        })
    }

    /// The tokenizer of a checkpoint whose weights are at `weights` (a file, a shard index or a
    /// sharded directory): its `tokenizer.json` when one lies in that directory, else the
    /// byte-level one.
    ///
    /// # Errors
    /// As [`Tokenizer::from_file`] for a `tokenizer.json` that is there but bad (it is never
    /// silently replaced by the fallback), and [`ByteLevel::new`]'s when there is none.
    pub fn for_weights(weights: &Path, vocab_size: u32, eos: Option<u32>) -> Result<Tokenizer> {
        let dir = if weights.is_dir() {
            weights
        } else {
            weights.parent().unwrap_or(Path::new("."))
        };
        let json = dir.join("tokenizer.json");
        if json.exists() {
            Tokenizer::from_file(&json, vocab_size, eos)
        } else {
            Ok(Tokenizer::Bytes(ByteLevel::new(vocab_size)?))
        }
    }

    /// What it is, for logs and summaries: `byte-level` or the file's path.
    pub fn describe(&self) -> String {
        match self {
            Tokenizer::Bytes(_) => "byte-level".into(),
            Tokenizer::Json { path, .. } => path.display().to_string(),
        }
    }

    /// The token ids of `text` (no specials added).
    ///
    /// # Errors
    /// [`Error::ModelInput`] when `tokenizer.json` cannot encode it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Bytes(b) => Ok(b.encode(text)),
            Tokenizer::Json { inner, .. } => inner
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| Error::ModelInput(format!("tokenizer: {e}"))),
        }
    }

    /// The text of `ids`, specials skipped (a `tokenizer.json` that cannot decode them yields
    /// their ids as `<|id|>`, as the byte-level one does for ids it does not know).
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Tokenizer::Bytes(b) => b.decode(ids),
            Tokenizer::Json { inner, .. } => inner
                .decode(ids, true)
                .unwrap_or_else(|_| ids.iter().map(|i| format!("<|{i}|>")).collect()),
        }
    }

    /// The end-of-sequence id: a completion stops when the model samples it.
    pub fn eos(&self) -> Option<u32> {
        match self {
            Tokenizer::Bytes(_) => Some(ByteLevel::EOS),
            Tokenizer::Json { eos, .. } => *eos,
        }
    }
}

/// A byte-level tokenizer over a vocabulary of `vocab_size` ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ByteLevel {
    vocab_size: u32,
}

impl ByteLevel {
    /// Beginning of sequence.
    pub const BOS: u32 = 256;
    /// End of sequence: a completion stops when the model samples it.
    pub const EOS: u32 = 257;
    /// The smallest vocabulary that holds every byte and both specials.
    pub const MIN_VOCAB: u32 = 258;

    /// A tokenizer for a model with `vocab_size` ids.
    ///
    /// # Errors
    /// [`Error::ModelInput`] when the vocabulary cannot hold every byte and the specials.
    pub fn new(vocab_size: u32) -> Result<Self> {
        if vocab_size < Self::MIN_VOCAB {
            return Err(Error::ModelInput(format!(
                "byte-level tokenizer: vocab_size {vocab_size} is below {} (256 bytes + BOS + EOS)",
                Self::MIN_VOCAB
            )));
        }
        Ok(Self { vocab_size })
    }

    /// The vocabulary size this tokenizer was made for.
    pub fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    /// The token ids of `text`: one per UTF-8 byte, no specials added.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    /// The text of `ids`: bytes below 256 decoded as UTF-8 (invalid sequences become U+FFFD,
    /// as a streamed token may end mid-character), specials skipped, other ids as `<|id|>`.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut out = String::new();
        let mut bytes = Vec::new();
        for &id in ids {
            if let Ok(b) = u8::try_from(id) {
                bytes.push(b);
                continue;
            }
            out.push_str(&String::from_utf8_lossy(&bytes));
            bytes.clear();
            if id != Self::BOS && id != Self::EOS {
                out.push_str(&format!("<|{id}|>"));
            }
        }
        out.push_str(&String::from_utf8_lossy(&bytes));
        out
    }

    /// The raw bytes of one token (empty for specials and ids above 255): what a streaming
    /// client concatenates before decoding UTF-8 itself.
    pub fn token_bytes(&self, id: u32) -> Option<u8> {
        u8::try_from(id).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_utf8_and_skips_specials() {
        let t = ByteLevel::new(1024).unwrap();
        let text = "naïve 🦀 kv";
        let ids = t.encode(text);
        assert_eq!(ids.len(), text.len());
        assert!(ids.iter().all(|&i| i < 256));
        let mut with_specials = vec![ByteLevel::BOS];
        with_specials.extend(&ids);
        with_specials.push(ByteLevel::EOS);
        assert_eq!(t.decode(&with_specials), text);
    }

    #[test]
    fn other_ids_are_visible_and_split_bytes_are_replaced() {
        let t = ByteLevel::new(1024).unwrap();
        assert_eq!(t.decode(&[104, 500, 105]), "h<|500|>i");
        // The first byte of a 4-byte character alone is not valid UTF-8.
        assert_eq!(t.decode(&[0xF0]), "\u{FFFD}");
    }

    /// A word-level `tokenizer.json` written here (the format is the `tokenizers` crate's).
    fn word_level(dir: &Path) -> PathBuf {
        let json = r#"{"version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 0, "content": "[EOS]", "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"[EOS]": 0, "[UNK]": 1, "hello": 2,
                "kv": 3, "cache": 4}, "unk_token": "[UNK]"}}"#;
        let p = dir.join("tokenizer.json");
        std::fs::write(&p, json).unwrap();
        p
    }

    #[test]
    fn a_tokenizer_json_beside_the_weights_is_used_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let weights = dir.path().join("model.safetensors");
        // None there: the byte-level fallback.
        let t = Tokenizer::for_weights(&weights, 1024, None).unwrap();
        assert_eq!(t.encode("hi").unwrap(), vec![104, 105]);
        assert_eq!(t.eos(), Some(ByteLevel::EOS));
        let json = word_level(dir.path());
        let t = Tokenizer::for_weights(&weights, 1024, Some(0)).unwrap();
        assert_eq!(t.describe(), json.display().to_string());
        assert_eq!(t.encode("hello kv cache nope").unwrap(), vec![2, 3, 4, 1]);
        assert_eq!(t.decode(&[2, 0, 4]), "hello cache");
        assert_eq!(t.eos(), Some(0));
        // A vocabulary larger than the model's, or an eos outside it, is refused by name.
        let e = Tokenizer::for_weights(&weights, 4, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("vocab_size 4") && e.contains("tokenizer.json"),
            "{e}"
        );
        let e = Tokenizer::from_file(&json, 1024, Some(2000))
            .unwrap_err()
            .to_string();
        assert!(e.contains("eos_token_id 2000"), "{e}");
        // A broken file is an error, never the fallback.
        std::fs::write(&json, b"{not json").unwrap();
        let e = Tokenizer::for_weights(&weights, 1024, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("tokenizer"), "{e}");
    }

    #[test]
    fn too_small_vocabulary_is_refused() {
        let e = ByteLevel::new(257).unwrap_err().to_string();
        assert!(e.contains("vocab_size 257"), "{e}");
        assert!(ByteLevel::new(258).is_ok());
    }
}
