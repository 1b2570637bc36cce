//! The library's error type: every failure names what it is about (a file, a tensor, a token).

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {cause}")]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },

    #[error("{path}: invalid config: {msg}")]
    Config { path: PathBuf, msg: String },

    #[error("{file}: not a valid safetensors file: {msg}")]
    Safetensors { file: PathBuf, msg: String },

    #[error("{file}: invalid shard index: {msg}")]
    ShardIndex { file: PathBuf, msg: String },

    #[error("tensor `{name}` is missing from the checkpoint in {dir}")]
    MissingTensor { name: String, dir: PathBuf },

    #[error("tensor `{name}` in {file} has dtype {found}, expected {expected}")]
    TensorDtype {
        name: String,
        file: PathBuf,
        found: String,
        expected: String,
    },

    #[error("tensor `{name}` in {file} has shape {found:?}, but config.json implies {expected:?}")]
    TensorShape {
        name: String,
        file: PathBuf,
        found: Vec<usize>,
        expected: Vec<usize>,
    },

    #[error(
        "token id {id} at prompt position {position} is out of range (vocab_size is {vocab_size})"
    )]
    TokenOutOfRange {
        id: u32,
        position: usize,
        vocab_size: usize,
    },

    #[error("the prompt is empty: give at least one token id")]
    EmptyPrompt,

    #[error(
        "the prompt has {prompt_len} tokens, more than the context of {context} tokens (raise --context)"
    )]
    PromptTooLong { prompt_len: usize, context: usize },

    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    #[error("GPU: {0}")]
    Gpu(String),

    #[error("unsupported checkpoint: {0}")]
    Unsupported(String),

    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },

    #[error(
        "the logits after {positions} positions are not finite (NaN or infinity), first in {origin}: the checkpoint's weights or config.json produce them"
    )]
    NonFinite { positions: usize, origin: String },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, cause: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            cause,
        }
    }
}
