//! Harmony rendering against the official openai-harmony package: the conversations in
//! `fixtures/harmony/conversations.json` (made by `tools/make_harmony_fixtures.py`) must render
//! to exactly the ids it wrote.

mod common;

use picchio::chat::harmony::Conversation;
use picchio::chat::tokenizer::{SPECIAL_TOKENS, Tokenizer};

fn fixture() -> serde_json::Value {
    let path = common::fixtures_dir().join("harmony/conversations.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

#[test]
fn conversations_render_to_the_official_ids() {
    let fixture = fixture();
    let tokenizer = Tokenizer::o200k_harmony();
    let conversations = fixture["conversations"].as_array().unwrap();
    assert!(conversations.len() >= 8);
    for c in conversations {
        let name = c["name"].as_str().unwrap();
        let conversation: Conversation = serde_json::from_value(c.clone()).unwrap();
        let want: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
        let got = conversation.render_for_completion(&tokenizer);
        if got != want {
            let first = got.iter().zip(&want).position(|(a, b)| a != b);
            panic!(
                "{name}: ids differ (first at {first:?}, {} vs {} ids)\n got: {}\nwant: {}",
                got.len(),
                want.len(),
                tokenizer.decode_lossy(&got).unwrap(),
                c["text"].as_str().unwrap()
            );
        }
    }
}

#[test]
fn special_token_ids_match_the_official_encoding() {
    let fixture = fixture();
    for (name, id) in SPECIAL_TOKENS {
        assert_eq!(fixture["special_tokens"][name], id, "{name}");
    }
}
