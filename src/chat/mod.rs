//! Chat: the o200k_harmony tokenizer and the Harmony format GPT-OSS is trained on; for other
//! families, the checkpoint's own tokenizer and Jinja chat template.

pub mod format;
pub mod harmony;
pub mod hf_tokenizer;
pub mod lines;
pub mod parser;
pub mod stdio;
pub mod tagged;
pub mod template;
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
