//! Chat: the o200k_harmony tokenizer and the Harmony format GPT-OSS is trained on.

pub mod harmony;
pub mod lines;
pub mod parser;
pub mod stdio;
pub mod terminal;
pub mod tokenizer;

/// The tokens that end a reply: the model's EOS ids and, for a Harmony vocabulary, `<|return|>`
/// and `<|call|>` (`<|end|>` ends a message, not the reply).
pub fn stop_ids(config: &crate::config::Config) -> Vec<u32> {
    let mut stops = config.eos_token_ids.clone();
    if config.vocab_size >= tokenizer::HARMONY_VOCAB_SIZE {
        stops.extend([tokenizer::RETURN, tokenizer::CALL]);
    }
    stops.sort_unstable();
    stops.dedup();
    stops
}
