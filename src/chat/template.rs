//! A checkpoint's Jinja chat template (`chat_template.jinja`, or `chat_template` in
//! `tokenizer_config.json`), rendered as transformers' `apply_chat_template` renders it: blocks
//! trimmed and left-stripped, Python's string methods, transformers' `tojson` (`json.dumps`
//! with `", "` and `": "`, non-ASCII kept) and `raise_exception`. GPT-OSS's Harmony is rendered by
//! `harmony.rs` instead.

use std::path::{Path, PathBuf};

use minijinja::value::{Kwargs, Serde};
use minijinja::{Environment, ErrorKind, Value};
use serde_json::{Map, Value as Json};

use crate::error::{Error, Result};

/// A chat template with the special tokens transformers passes to it.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, `pad_token`, `unk_token` as `tokenizer_config.json` names them.
    special_tokens: Map<String, Json>,
    path: PathBuf,
}

/// What a template renders: the conversation, the tools, and the caller's extra arguments
/// (`enable_thinking`).
pub struct TemplateInput<'a> {
    pub messages: &'a [Json],
    pub tools: Option<&'a [Json]>,
    pub add_generation_prompt: bool,
    pub arguments: &'a Map<String, Json>,
}

const NAME: &str = "chat_template";

impl ChatTemplate {
    /// The template of `dir`: `chat_template.jinja` where present (transformers 5 writes it),
    /// else `tokenizer_config.json`'s `chat_template` (a string, or named templates of which
    /// `default` is used). None where the checkpoint has neither.
    pub fn load(dir: &Path) -> Result<Option<ChatTemplate>> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Map<String, Json> = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| Error::Format {
                path: config_path.clone(),
                message: e.to_string(),
            })?,
            Err(_) => Map::new(),
        };
        let jinja = dir.join("chat_template.jinja");
        let (source, path) = match std::fs::read_to_string(&jinja) {
            Ok(source) => (source, jinja),
            Err(_) => match template_in_config(&config, &config_path)? {
                Some(source) => (source, config_path.clone()),
                None => return Ok(None),
            },
        };
        let special_tokens = ["bos_token", "eos_token", "pad_token", "unk_token"]
            .into_iter()
            .map(|key| (key.to_string(), token_text(config.get(key))))
            .collect();
        ChatTemplate::new(source, special_tokens, path).map(Some)
    }

    /// A template from its source (tests, tools).
    pub fn new(
        source: String,
        special_tokens: Map<String, Json>,
        path: PathBuf,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| template_error(&path, e))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(NAME, source)
            .map_err(|e| template_error(&path, e))?;
        Ok(ChatTemplate {
            env,
            special_tokens,
            path,
        })
    }

    /// The conversation as the model reads it.
    pub fn render(&self, input: &TemplateInput) -> Result<String> {
        let mut context = self.special_tokens.clone();
        context.insert("messages".into(), Json::from(input.messages.to_vec()));
        if let Some(tools) = input.tools {
            context.insert("tools".into(), Json::from(tools.to_vec()));
        }
        context.insert(
            "add_generation_prompt".into(),
            Json::from(input.add_generation_prompt),
        );
        for (key, value) in input.arguments {
            context.insert(key.clone(), value.clone());
        }
        let template = self
            .env
            .get_template(NAME)
            .map_err(|e| template_error(&self.path, e))?;
        template
            .render(Value::from(Serde(&context)))
            .map_err(|e| template_error(&self.path, e))
    }
}

/// `tokenizer_config.json`'s template: a string, or a list of `{name, template}` of which the
/// one named `default` is the chat template.
fn template_in_config(config: &Map<String, Json>, path: &Path) -> Result<Option<String>> {
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(source)) => Ok(Some(source.clone())),
        Some(Json::Array(named)) => Ok(named
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(str::to_owned)),
        Some(other) => Err(Error::Format {
            path: path.to_path_buf(),
            message: format!("chat_template is neither a string nor a list: {other}"),
        }),
    }
}

/// A special token's text: written as a string, or as an added-token object with `content`.
fn token_text(value: Option<&Json>) -> Json {
    match value {
        Some(Json::String(text)) => Json::from(text.as_str()),
        Some(Json::Object(token)) => token.get("content").cloned().unwrap_or(Json::Null),
        _ => Json::Null,
    }
}

fn template_error(path: &Path, e: minijinja::Error) -> Error {
    // The chain names the line and what failed (an undefined method, a raise_exception).
    let mut message = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(cause) = source {
        message.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    Error::Format {
        path: path.to_path_buf(),
        message: format!("chat template: {message}"),
    }
}

/// The template's own error (`raise_exception('...')`), as a render error with its message.
fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// transformers' `tojson`: `json.dumps(value, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`, not Jinja's HTML-safe one.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    python_json(&json, indent, sort_keys.unwrap_or(false), 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// `json.dumps` formatting: `", "` and `": "` between items without an indent, `","` and newlines
/// with one.
fn python_json(value: &Json, indent: Option<usize>, sort: bool, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * depth));
        }
    };
    let separator = if indent.is_some() { "," } else { ", " };
    match value {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                python_json(item, indent, sort, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            let mut entries: Vec<(&String, &Json)> = map.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                out.push_str(&Json::from(key.as_str()).to_string());
                out.push_str(": ");
                python_json(item, indent, sort, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, messages: Json) -> Result<String> {
        let template = ChatTemplate::new(source.into(), Map::new(), "t.jinja".into())?;
        let messages = messages.as_array().unwrap().clone();
        template.render(&TemplateInput {
            messages: &messages,
            tools: None,
            add_generation_prompt: false,
            arguments: &Map::new(),
        })
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let value = serde_json::json!([{"b": 1, "a": [1.5, "é<&>\"\n", null, true], "c": {}}]);
        let out = render("{{ messages | tojson }}", value.clone()).unwrap();
        assert_eq!(
            out,
            r#"[{"b": 1, "a": [1.5, "é<&>\"\n", null, true], "c": {}}]"#
        );
        let out = render("{{ messages[0] | tojson(indent=2) }}", value).unwrap();
        assert_eq!(
            out,
            "{\n  \"b\": 1,\n  \"a\": [\n    1.5,\n    \"é<&>\\\"\\n\",\n    null,\n    true\n  ],\n  \"c\": {}\n}"
        );
    }

    #[test]
    fn python_string_methods_and_template_errors() {
        let messages = serde_json::json!([{"content": "\n<think>a</think>\n\nb  "}]);
        let source = "{{ messages[0].content.split('</think>')[-1].lstrip('\\n').rstrip() }}|\
                      {{ messages[0].content.strip('\\n').startswith('<think>') }}";
        // Booleans print as Python prints them.
        assert_eq!(render(source, messages.clone()).unwrap(), "b|True");
        let message = render("{{ raise_exception('no tools here') }}", messages)
            .unwrap_err()
            .to_string();
        assert!(message.contains("no tools here"), "{message}");
    }
}
