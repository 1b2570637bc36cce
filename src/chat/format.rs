//! How a model's conversations are written and its replies read: Harmony for GPT-OSS (with
//! o200k_harmony), the checkpoint's own chat template and tokenizer for the other families
//! (replies in Qwen3's tags, `chat::tagged`).

use std::path::Path;
use std::sync::Arc;

use serde_json::{Map, Value};

use super::hf_tokenizer::HfTokenizer;
use super::tagged::{Piece, TaggedParser};
use super::template::{ChatTemplate, TemplateInput};
use crate::arch::Family;
use crate::config::Config;
use crate::error::{Error, Result};

/// A model's chat format.
#[derive(Clone)]
pub enum ChatFormat {
    Harmony,
    Template(Arc<TemplateChat>),
}

/// A checkpoint's chat template with the tokenizer that reads what it renders.
pub struct TemplateChat {
    pub template: ChatTemplate,
    pub tokenizer: HfTokenizer,
}

impl ChatFormat {
    /// The format of the checkpoint in `dir`: Harmony for GPT-OSS; else its template and
    /// tokenizer, an error naming the missing file where it lacks one.
    pub fn for_model(dir: &Path, config: &Config) -> Result<ChatFormat> {
        if config.family == Family::GptOss {
            return Ok(ChatFormat::Harmony);
        }
        let missing = |what: &str| {
            Error::InvalidArgument(format!(
                "{} has no {what}, which chat with a {} model needs",
                dir.display(),
                config.family.model_type()
            ))
        };
        let template = ChatTemplate::load(dir)?.ok_or_else(|| {
            missing("chat template (tokenizer_config.json or chat_template.jinja)")
        })?;
        let tokenizer = HfTokenizer::load(dir)?.ok_or_else(|| missing("tokenizer.json"))?;
        Ok(ChatFormat::Template(Arc::new(TemplateChat {
            template,
            tokenizer,
        })))
    }
}

impl TemplateChat {
    /// The ids of a conversation ready for the assistant's reply, and the reader of that reply
    /// (`stops`: the ids that end it).
    pub fn prompt(
        self: &Arc<Self>,
        messages: &[Value],
        tools: Option<&[Value]>,
        arguments: &Map<String, Value>,
        stops: &[u32],
    ) -> Result<(Vec<u32>, TemplateReply)> {
        let text = self.template.render(&TemplateInput {
            messages,
            tools,
            add_generation_prompt: true,
            arguments,
        })?;
        // A template that opens the reasoning itself leaves the reply inside `<think>`.
        let reasoning_open = text.trim_end().ends_with("<think>");
        let reply = TemplateReply {
            chat: self.clone(),
            text: TextStream::default(),
            parser: TaggedParser::new(reasoning_open),
            stops: stops.to_vec(),
        };
        Ok((self.tokenizer.encode(&text)?, reply))
    }
}

/// A template model's reply as it is generated: its tokens decoded and split into Qwen3's
/// tags (`chat::tagged`); the stop tokens end it and are no part of it.
pub struct TemplateReply {
    chat: Arc<TemplateChat>,
    text: TextStream,
    parser: TaggedParser,
    stops: Vec<u32>,
}

impl TemplateReply {
    /// The pieces `token` completes.
    pub fn push(&mut self, token: u32) -> Vec<Piece> {
        if self.stops.contains(&token) {
            return Vec::new();
        }
        let text = self.text.push(&self.chat.tokenizer, token);
        self.parser.push(&text)
    }

    /// Everything held back, at the end of the reply.
    pub fn finish(&mut self) -> Vec<Piece> {
        let text = self.text.finish(&self.chat.tokenizer);
        let mut pieces = self.parser.push(&text);
        pieces.extend(self.parser.finish());
        pieces
    }
}

/// Generated ids turned into text as they come: a token that ends inside a UTF-8 character
/// waits for the next.
#[derive(Default)]
pub struct TextStream {
    ids: Vec<u32>,
    emitted: usize,
}

impl TextStream {
    /// The text `id` completes.
    pub fn push(&mut self, tokenizer: &HfTokenizer, id: u32) -> String {
        self.ids.push(id);
        self.take(tokenizer, false)
    }

    /// What is left, incomplete characters replaced.
    pub fn finish(&mut self, tokenizer: &HfTokenizer) -> String {
        self.take(tokenizer, true)
    }

    fn take(&mut self, tokenizer: &HfTokenizer, last: bool) -> String {
        let text = tokenizer.decode(&self.ids).unwrap_or_default();
        if !last && text.ends_with('\u{FFFD}') {
            return String::new();
        }
        // What was emitted is a prefix of the text: byte-level decoding only grows.
        let new = text.get(self.emitted..).unwrap_or_default().to_string();
        self.emitted = self.emitted.max(text.len());
        new
    }
}
