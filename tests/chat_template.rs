//! A checkpoint's own tokenizer and Jinja chat template against transformers'
//! `apply_chat_template` (text and token ids) on the conversations each chat fixture commits:
//! system prompts, thinking on and off, reasoning in earlier turns, tools, tool calls with
//! arguments as objects and as strings, tool results, non-ASCII text.

mod common;

use common::*;
use picchio::chat::hf_tokenizer::HfTokenizer;
use picchio::chat::template::{ChatTemplate, TemplateInput};
use serde::Deserialize;
use serde_json::{Map, Value};

#[derive(Deserialize)]
struct Case {
    name: String,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    add_generation_prompt: bool,
    template_arguments: Map<String, Value>,
    text: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct ChatReference {
    cases: Vec<Case>,
}

/// The fixtures that chat (a `chat_reference.json` beside the checkpoint).
fn chat_fixtures() -> Vec<std::path::PathBuf> {
    let dirs: Vec<_> = qwen3_fixture_dirs()
        .into_iter()
        .filter(|d| d.join("chat_reference.json").is_file())
        .collect();
    assert!(!dirs.is_empty(), "no chat fixture");
    dirs
}

#[test]
fn templates_render_the_ids_transformers_renders() {
    for dir in chat_fixtures() {
        let text = std::fs::read_to_string(dir.join("chat_reference.json")).unwrap();
        let reference: ChatReference = serde_json::from_str(&text).unwrap();
        let template = ChatTemplate::load(&dir).unwrap().expect("a chat template");
        let tokenizer = HfTokenizer::load(&dir).unwrap().expect("a tokenizer.json");
        for case in &reference.cases {
            let what = format!("{} {}", dir.display(), case.name);
            let rendered = template
                .render(&TemplateInput {
                    messages: &case.messages,
                    tools: case.tools.as_deref(),
                    add_generation_prompt: case.add_generation_prompt,
                    arguments: &case.template_arguments,
                })
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(rendered, case.text, "{what}: text");
            assert_eq!(
                tokenizer.encode(&rendered).unwrap(),
                case.ids,
                "{what}: ids"
            );
            assert_eq!(
                tokenizer.decode(&case.ids).unwrap(),
                case.text,
                "{what}: decode"
            );
        }
    }
}

#[test]
fn a_template_error_names_the_file_and_the_reason() {
    let dir = &chat_fixtures()[0];
    let template = ChatTemplate::load(dir).unwrap().unwrap();
    let messages = [serde_json::json!({"role": "wizard", "content": "hi"})];
    let error = template
        .render(&TemplateInput {
            messages: &messages,
            tools: None,
            add_generation_prompt: true,
            arguments: &Map::new(),
        })
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("tokenizer_config.json") && error.contains("unknown role wizard"),
        "{error}"
    );
}
