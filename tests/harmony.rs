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

#[test]
fn tokenize_command_encodes_and_decodes() {
    let fixture = fixture();
    let c = &fixture["conversations"][0];
    let text = c["text"].as_str().unwrap();
    let run = common::picchio_stdout;
    let ids: Vec<u32> = run(&["tokenize", "--text", text])
        .split_whitespace()
        .map(|w| w.parse().unwrap())
        .collect();
    let want: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
    assert_eq!(ids, want);
    let joined: Vec<String> = want.iter().map(u32::to_string).collect();
    assert_eq!(run(&["tokenize", "--decode", &joined.join(",")]), text);
    // --no-special: the names are plain text.
    assert!(
        run(&["tokenize", "--text", "<|end|>", "--no-special"])
            .split_whitespace()
            .count()
            > 1
    );
}

#[test]
fn text_prompts_out_of_a_small_vocabulary_are_clear_errors() {
    let dir = common::fixtures_dir().join("tiny-single");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_picchio"))
        .args([
            "generate",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            "hello",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && out.stdout.is_empty());
    assert!(
        stderr.contains("out of range") && stderr.contains("vocab_size is 256"),
        "{stderr}"
    );
}
