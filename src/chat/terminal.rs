//! `picchio chat`: an interactive conversation in the terminal. Each line typed is a user turn;
//! the answer streams as it is generated, the reasoning (Harmony's analysis channel, or a
//! template model's `<think>`) dimmed with `--show-reasoning` and hidden otherwise. `/reset` starts over, `/exit` (or the end
//! of input) leaves. After each answer a status line on stderr gives tokens/s and how much of
//! the conversation's cache was reused.

use std::io::{BufRead, Write};
use std::time::Instant;

use std::sync::Arc;

use serde_json::{Map, Value, json};

use super::format::{ChatFormat, TemplateChat, TemplateReply};
use super::harmony::{
    ChatMessage, Conversation, DeveloperSettings, ReasoningEffort, Role, SystemSettings,
};
use super::lines::{Line, MAX_LINE_BYTES, read_line};
use super::parser::{Event, StreamParser};
use super::tagged::Piece;
use super::tokenizer::{HARMONY_VOCAB_SIZE, Tokenizer};
use crate::error::{Error, Result};
use crate::model::Model;
use crate::model::generate::SessionTier;
use crate::model::sampler::{Sampler, SamplingOptions};
use crate::model::session::{ChatSession, Finish};

/// How the chat runs.
#[derive(Debug, Clone)]
pub struct ChatOptions {
    pub context: usize,
    pub max_new_tokens: usize,
    /// Developer instructions (the system prompt, in OpenAI's terms).
    pub instructions: Option<String>,
    pub reasoning_effort: ReasoningEffort,
    pub show_reasoning: bool,
    /// Wrap reasoning in ANSI dim (when the output is a terminal).
    pub dim: bool,
    pub sampling: SamplingOptions,
    /// Where the session runs.
    pub tier: SessionTier,
}

fn message(role: Role, channel: Option<&str>, content: String) -> ChatMessage {
    ChatMessage {
        role,
        content,
        channel: channel.map(str::to_string),
        recipient: None,
        content_type: None,
        name: None,
    }
}

/// The conversation so far, in the model's chat format.
enum Dialogue {
    Harmony {
        base: Box<Conversation>,
        conversation: Box<Conversation>,
    },
    Template {
        chat: Arc<TemplateChat>,
        /// The system message, when `--system` gives one.
        base: Vec<Value>,
        messages: Vec<Value>,
    },
}

/// A reply being read, and for a template model what it said so far (which joins the
/// conversation).
enum Reply {
    Harmony(StreamParser),
    Tagged {
        reply: TemplateReply,
        content: String,
        reasoning: String,
    },
}

impl Dialogue {
    fn new(format: &ChatFormat, options: &ChatOptions) -> Dialogue {
        match format {
            ChatFormat::Harmony => {
                let base = Conversation {
                    system: Some(SystemSettings {
                        reasoning_effort: Some(options.reasoning_effort),
                        conversation_start_date: Some(super::harmony::today()),
                        ..Default::default()
                    }),
                    developer: options.instructions.clone().map(|i| DeveloperSettings {
                        instructions: Some(i),
                        tools: Vec::new(),
                    }),
                    messages: Vec::new(),
                };
                Dialogue::Harmony {
                    conversation: Box::new(base.clone()),
                    base: Box::new(base),
                }
            }
            ChatFormat::Template(chat) => {
                let base: Vec<Value> = (options.instructions.iter())
                    .map(|i| json!({"role": "system", "content": i}))
                    .collect();
                Dialogue::Template {
                    chat: chat.clone(),
                    messages: base.clone(),
                    base,
                }
            }
        }
    }

    fn reset(&mut self) {
        match self {
            Dialogue::Harmony { base, conversation } => *conversation = base.clone(),
            Dialogue::Template { base, messages, .. } => *messages = base.clone(),
        }
    }

    fn push_user(&mut self, text: &str) {
        match self {
            Dialogue::Harmony { conversation, .. } => {
                conversation
                    .messages
                    .push(message(Role::User, None, text.to_string()))
            }
            Dialogue::Template { messages, .. } => {
                messages.push(json!({"role": "user", "content": text}))
            }
        }
    }

    fn pop(&mut self) {
        match self {
            Dialogue::Harmony { conversation, .. } => {
                conversation.messages.pop();
            }
            Dialogue::Template { messages, .. } => {
                messages.pop();
            }
        }
    }

    /// The prompt for the next reply (ended by `stops`), and its reader.
    fn render(&self, tokenizer: Tokenizer, stops: &[u32]) -> Result<(Vec<u32>, Reply)> {
        Ok(match self {
            Dialogue::Harmony { conversation, .. } => (
                conversation.render_for_completion(&tokenizer),
                Reply::Harmony(StreamParser::new(tokenizer)),
            ),
            Dialogue::Template { chat, messages, .. } => {
                let (ids, reply) = chat.prompt(messages, None, &Map::new(), stops)?;
                let reply = Reply::Tagged {
                    reply,
                    content: String::new(),
                    reasoning: String::new(),
                };
                (ids, reply)
            }
        })
    }

    /// The answer joins the conversation (Harmony's analysis is dropped at the next render).
    fn add_reply(&mut self, reply: Reply) {
        match (self, reply) {
            (Dialogue::Harmony { conversation, .. }, Reply::Harmony(parser)) => {
                let mut answered = parser.messages().to_vec();
                answered.extend(parser.unfinished().cloned());
                for m in answered {
                    let mut reply = message(Role::Assistant, m.channel.as_deref(), m.content);
                    reply.recipient = m.recipient;
                    reply.content_type = m.content_type;
                    conversation.messages.push(reply);
                }
            }
            (
                Dialogue::Template { messages, .. },
                Reply::Tagged {
                    content, reasoning, ..
                },
            ) => messages.push(
                json!({"role": "assistant", "content": content, "reasoning_content": reasoning}),
            ),
            _ => {}
        }
    }
}

impl Reply {
    /// The text `token` completes: (whether it is reasoning, the text).
    fn push(&mut self, token: u32) -> Result<Vec<(bool, String)>> {
        Ok(match self {
            Reply::Harmony(parser) => (parser.push(token)?.into_iter())
                .filter_map(|event| match event {
                    Event::Text { channel, text } => {
                        Some((channel.as_deref() == Some("analysis"), text))
                    }
                    _ => None,
                })
                .collect(),
            Reply::Tagged { reply, .. } => {
                let pieces = reply.push(token);
                self.keep(pieces)
            }
        })
    }

    /// What the reply left unshown at its end: output that never reached a Harmony message (a
    /// model not following the format), or the tagged text held back.
    fn finish(&mut self) -> Vec<(bool, String)> {
        match self {
            Reply::Harmony(parser) => {
                let stray = (parser.messages().is_empty() && parser.unfinished().is_none())
                    .then(|| parser.unfinished_header().map(str::to_string))
                    .flatten();
                stray.into_iter().map(|text| (false, text)).collect()
            }
            Reply::Tagged { reply, .. } => {
                let pieces = reply.finish();
                self.keep(pieces)
            }
        }
    }

    /// Keeps a tagged reply's pieces for the conversation; returns their text (a tool call as
    /// it was written: the terminal chat offers no tools).
    fn keep(&mut self, pieces: Vec<Piece>) -> Vec<(bool, String)> {
        let Reply::Tagged {
            content, reasoning, ..
        } = self
        else {
            return Vec::new();
        };
        let mut shown = Vec::new();
        for piece in pieces {
            let (is_reasoning, text) = match piece {
                Piece::Reasoning(text) => (true, text),
                Piece::Content(text) => (false, text),
                Piece::ToolCall { name, arguments } => (
                    false,
                    format!(
                        "<tool_call>{{\"name\": {}, \"arguments\": {arguments}}}</tool_call>",
                        json!(name)
                    ),
                ),
            };
            if is_reasoning {
                reasoning.push_str(&text);
            } else {
                content.push_str(&text);
            }
            shown.push((is_reasoning, text));
        }
        shown
    }
}

/// Runs the conversation in `format`: user lines from `input`, answers to `output`, status to
/// `status`.
pub fn run(
    model: &Model,
    format: &ChatFormat,
    options: &ChatOptions,
    mut input: impl BufRead,
    mut output: impl Write,
    mut status: impl Write,
) -> Result<()> {
    if matches!(format, ChatFormat::Harmony) && model.config.vocab_size < HARMONY_VOCAB_SIZE {
        return Err(Error::Unsupported(format!(
            "chat needs a model with the o200k_harmony vocabulary ({HARMONY_VOCAB_SIZE} tokens); this one has {}",
            model.config.vocab_size
        )));
    }
    let io = |e: std::io::Error| Error::io("the terminal", e);
    let tokenizer = Tokenizer::o200k_harmony();
    let mut session = ChatSession::open(model, &options.tier, options.context)?;
    // Harmony's `<|return|>` and `<|call|>`, or generation_config's EOS ids.
    let stops = super::stop_ids(&model.config);
    let mut dialogue = Dialogue::new(format, options);
    let mut turn = 0u64;
    let mut buffer = Vec::new();
    while let Some(line) = read_line(&mut input, &mut buffer, MAX_LINE_BYTES).map_err(io)? {
        let line = match line {
            Line::Text(line) => line,
            // The conversation goes on: nothing was sent.
            Line::TooLong => {
                writeln!(
                    status,
                    "(a line of more than {MAX_LINE_BYTES} bytes: not sent)"
                )
                .map_err(io)?;
                continue;
            }
            Line::NotUtf8 => {
                writeln!(status, "(that line is not UTF-8: not sent)").map_err(io)?;
                continue;
            }
        };
        let text = line.trim();
        match text {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                dialogue.reset();
                session.reset();
                writeln!(status, "(conversation reset)").map_err(io)?;
                continue;
            }
            _ => {}
        }
        dialogue.push_user(text);
        let (ids, mut reply) = dialogue.render(tokenizer, &stops)?;
        if ids.len() >= options.context {
            writeln!(
                status,
                "(the conversation has {} tokens, the context {}: /reset to start over)",
                ids.len(),
                options.context
            )
            .map_err(io)?;
            dialogue.pop();
            continue;
        }
        let started = Instant::now();
        let reused = session.feed(&ids)?;
        let prefill = started.elapsed();
        let mut sampler = Sampler::new(SamplingOptions {
            seed: options.sampling.seed.wrapping_add(turn),
            ..options.sampling
        });
        turn += 1;
        let mut failure = None;
        let generated = Instant::now();
        let show = |output: &mut dyn Write, shown: Vec<(bool, String)>| {
            for (reasoning, text) in shown {
                if reasoning && !options.show_reasoning {
                    continue;
                }
                let written = if reasoning && options.dim {
                    write!(output, "\x1b[2m{text}\x1b[0m")
                } else {
                    write!(output, "{text}")
                };
                written.and_then(|()| output.flush())?;
            }
            std::io::Result::Ok(())
        };
        let (tokens, finish) = session.generate(
            options.max_new_tokens,
            &mut sampler,
            &stops,
            |token| match reply.push(token) {
                Ok(shown) => show(&mut output, shown).is_ok(),
                Err(e) => {
                    failure = Some(e);
                    false
                }
            },
        )?;
        if let Some(e) = failure {
            return Err(e);
        }
        show(&mut output, reply.finish()).map_err(io)?;
        writeln!(output).map_err(io)?;
        output.flush().map_err(io)?;
        dialogue.add_reply(reply);
        let seconds = generated.elapsed().as_secs_f64();
        let ended = match finish {
            Finish::Stop(_) => "",
            Finish::MaxTokens => ", stopped at --max-new-tokens",
            Finish::ContextFull => ", context full",
            Finish::Cancelled => ", interrupted",
        };
        writeln!(
            status,
            "[{} tokens, {:.2} tokens/s; prompt {} tokens, {} reused, {:.0} ms{ended}]",
            tokens.len(),
            tokens.len() as f64 / seconds.max(1e-9),
            ids.len(),
            reused,
            prefill.as_secs_f64() * 1000.0
        )
        .map_err(io)?;
    }
    Ok(())
}
