//! Chat: the o200k_harmony tokenizer and the Harmony format GPT-OSS is trained on.

pub mod harmony;
pub mod parser;
pub mod stdio;
pub mod terminal;
pub mod tokenizer;
