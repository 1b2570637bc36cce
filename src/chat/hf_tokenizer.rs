//! A checkpoint's own tokenizer (`tokenizer.json`, read with the `tokenizers` crate), for the
//! families whose vocabulary is not o200k_harmony's (Qwen3-MoE's byte-level BPE).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The tokenizer a checkpoint ships.
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl HfTokenizer {
    /// `DIR/tokenizer.json`, or None where the directory has none.
    pub fn load(dir: &Path) -> Result<Option<HfTokenizer>> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Ok(None);
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| Error::Format {
            path: path.clone(),
            message: e.to_string(),
        })?;
        Ok(Some(HfTokenizer { inner, path }))
    }

    fn fail(&self, what: &str, e: impl std::fmt::Display) -> Error {
        Error::Format {
            path: self.path.clone(),
            message: format!("{what}: {e}"),
        }
    }

    /// Ids of `text` as transformers encodes a rendered chat (`add_special_tokens=False`): the
    /// added tokens' names in it (`<|im_start|>`, `<think>`) become their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = (self.inner)
            .encode(text, false)
            .map_err(|e| self.fail("cannot encode", e))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens included (`<|im_end|>`), as transformers' `decode`.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        (self.inner)
            .decode(ids, false)
            .map_err(|e| self.fail("cannot decode", e))
    }
}
