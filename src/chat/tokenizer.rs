//! The o200k_harmony tokenizer, offline: tiktoken-rs embeds the o200k vocabulary, and the
//! Harmony special tokens have fixed ids. A checkpoint's `tokenizer.json`, when it has one, is
//! checked against them.

use std::path::Path;

use tiktoken_rs::CoreBPE;

use crate::error::{Error, Result};

/// The Harmony special tokens GPT-OSS uses, with their ids in o200k_harmony.
pub const START: u32 = 200006;
pub const END: u32 = 200007;
pub const MESSAGE: u32 = 200008;
pub const CHANNEL: u32 = 200005;
pub const CONSTRAIN: u32 = 200003;
pub const RETURN: u32 = 200002;
pub const CALL: u32 = 200012;
pub const END_OF_TEXT: u32 = 199999;
pub const START_OF_TEXT: u32 = 199998;

/// Tokens in o200k_harmony: ordinary ones, then the specials up to 201087.
pub const HARMONY_VOCAB_SIZE: usize = 201088;

/// Every named special token and its id.
pub const SPECIAL_TOKENS: [(&str, u32); 9] = [
    ("<|start|>", START),
    ("<|end|>", END),
    ("<|message|>", MESSAGE),
    ("<|channel|>", CHANNEL),
    ("<|constrain|>", CONSTRAIN),
    ("<|return|>", RETURN),
    ("<|call|>", CALL),
    ("<|endoftext|>", END_OF_TEXT),
    ("<|startoftext|>", START_OF_TEXT),
];

/// The o200k_harmony tokenizer.
#[derive(Clone, Copy)]
pub struct Tokenizer {
    bpe: &'static CoreBPE,
}

impl Tokenizer {
    /// The tokenizer (built once per process from the embedded vocabulary).
    pub fn o200k_harmony() -> Tokenizer {
        Tokenizer {
            bpe: tiktoken_rs::o200k_harmony_singleton(),
        }
    }

    /// Ids of `text` as plain text: special-token names in it are ordinary characters (user
    /// content can never inject a special token).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    /// Ids of `text`, with special-token names (`<|start|>`, ...) turned into their ids.
    pub fn encode_with_special_tokens(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_with_special_tokens(text)
    }

    /// The bytes of `ids` (a token may end in the middle of a UTF-8 character).
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        self.bpe
            .decode_bytes(ids)
            .map_err(|e| Error::InvalidArgument(format!("cannot decode token ids: {e}")))
    }

    /// The text of `ids`, with invalid UTF-8 replaced.
    pub fn decode_lossy(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }

    /// Checks the special tokens against a checkpoint's `tokenizer.json` (`added_tokens`), when
    /// `dir` has one: a token with another id there is an error naming it.
    pub fn check_checkpoint(dir: &Path) -> Result<()> {
        let path = dir.join("tokenizer.json");
        let Ok(text) = std::fs::read_to_string(&path) else {
            return Ok(());
        };
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Format {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let added = json["added_tokens"].as_array().cloned().unwrap_or_default();
        for (name, id) in SPECIAL_TOKENS {
            let found = added
                .iter()
                .find(|t| t["content"].as_str() == Some(name))
                .and_then(|t| t["id"].as_u64());
            if let Some(found) = found
                && found != id as u64
            {
                return Err(Error::Format {
                    path,
                    message: format!("special token {name} has id {found}, o200k_harmony has {id}"),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_tokens_have_their_harmony_ids() {
        let t = Tokenizer::o200k_harmony();
        for (name, id) in SPECIAL_TOKENS {
            assert_eq!(t.encode_with_special_tokens(name), vec![id], "{name}");
            assert_eq!(t.decode_lossy(&[id]).unwrap(), name);
        }
        // As plain text they are not special.
        assert!(t.encode("<|end|>").len() > 1);
    }

    #[test]
    fn a_tokenizer_json_that_disagrees_is_named() {
        let dir = tempfile::tempdir().unwrap();
        assert!(
            Tokenizer::check_checkpoint(dir.path()).is_ok(),
            "no file: nothing to check"
        );
        let write = |id: u32| {
            let json = serde_json::json!({"added_tokens": [
                {"id": 200006, "content": "<|start|>"}, {"id": id, "content": "<|return|>"}]});
            std::fs::write(dir.path().join("tokenizer.json"), json.to_string()).unwrap();
        };
        write(RETURN);
        assert!(Tokenizer::check_checkpoint(dir.path()).is_ok());
        write(200010);
        let err = Tokenizer::check_checkpoint(dir.path())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("<|return|>") && err.contains("200010"),
            "{err}"
        );
    }

    #[test]
    fn text_round_trips() {
        let t = Tokenizer::o200k_harmony();
        for text in ["Say hi.", "  Ciao, città! 東京 🌸\n\n\ttabs", ""] {
            assert_eq!(t.decode_lossy(&t.encode(text)).unwrap(), text);
        }
    }
}
