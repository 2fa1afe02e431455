//! Text to token ids and back for models that have no `tokenizer.json` (the built-in model).
//!
//! The byte-level tokenizer maps each UTF-8 byte of the text to the token id of the same value
//! (0-255); ids from 256 up are the specials: [`ByteLevel::BOS`] and [`ByteLevel::EOS`]. Any
//! vocabulary of at least 258 ids can use it (the built-in model has 1,024; spec section 2 puts
//! no constraint on the tokenizer). Decoding is lossless for ids below 256 and skips specials;
//! ids that are neither are rendered as `<|id|>` so a generated stream stays inspectable.
//!
//! Checkpoints that ship a `tokenizer.json` get their own tokenizer; this one is the fallback,
//! and it is what the appliance and `kvstack run --prompt` use for the built-in model.

use crate::{Error, Result};

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

    #[test]
    fn too_small_vocabulary_is_refused() {
        let e = ByteLevel::new(257).unwrap_err().to_string();
        assert!(e.contains("vocab_size 257"), "{e}");
        assert!(ByteLevel::new(258).is_ok());
    }
}
