//! `picchio chat`: an interactive conversation in the terminal. Each line typed is a user turn;
//! the answer's final channel streams as it is generated, the reasoning (analysis channel)
//! dimmed with `--show-reasoning` and hidden otherwise. `/reset` starts over, `/exit` (or the end
//! of input) leaves. After each answer a status line on stderr gives tokens/s and how much of
//! the conversation's cache was reused.

use std::io::{BufRead, Write};
use std::time::Instant;

use super::harmony::{
    ChatMessage, Conversation, DeveloperSettings, ReasoningEffort, Role, SystemSettings,
};
use super::lines::{Line, MAX_LINE_BYTES, read_line};
use super::parser::{Event, StreamParser};
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

/// Runs the conversation: user lines from `input`, answers to `output`, status to `status`.
pub fn run(
    model: &Model,
    options: &ChatOptions,
    mut input: impl BufRead,
    mut output: impl Write,
    mut status: impl Write,
) -> Result<()> {
    if model.config.vocab_size < HARMONY_VOCAB_SIZE {
        return Err(Error::Unsupported(format!(
            "chat needs a model with the o200k_harmony vocabulary ({HARMONY_VOCAB_SIZE} tokens); this one has {}",
            model.config.vocab_size
        )));
    }
    let io = |e: std::io::Error| Error::io("the terminal", e);
    let tokenizer = Tokenizer::o200k_harmony();
    let mut session = ChatSession::open(model, &options.tier, options.context)?;
    // The vocabulary is Harmony's (checked above): `<|return|>` and `<|call|>` are among these.
    let stops = super::stop_ids(&model.config);
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
    let mut conversation = base.clone();
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
                conversation = base.clone();
                session.reset();
                writeln!(status, "(conversation reset)").map_err(io)?;
                continue;
            }
            _ => {}
        }
        conversation
            .messages
            .push(message(Role::User, None, text.to_string()));
        let ids = conversation.render_for_completion(&tokenizer);
        if ids.len() >= options.context {
            writeln!(
                status,
                "(the conversation has {} tokens, the context {}: /reset to start over)",
                ids.len(),
                options.context
            )
            .map_err(io)?;
            conversation.messages.pop();
            continue;
        }
        let started = Instant::now();
        let reused = session.feed(&ids)?;
        let prefill = started.elapsed();
        let mut parser = StreamParser::new(tokenizer);
        let mut sampler = Sampler::new(SamplingOptions {
            seed: options.sampling.seed.wrapping_add(turn),
            ..options.sampling
        });
        turn += 1;
        let mut failure = None;
        let generated = Instant::now();
        let (tokens, finish) =
            session.generate(options.max_new_tokens, &mut sampler, &stops, |token| {
                let events = match parser.push(token) {
                    Ok(events) => events,
                    Err(e) => {
                        failure = Some(e);
                        return false;
                    }
                };
                for event in events {
                    if let Event::Text { channel, text } = event {
                        let reasoning = channel.as_deref() == Some("analysis");
                        if reasoning && !options.show_reasoning {
                            continue;
                        }
                        let written = if reasoning && options.dim {
                            write!(output, "\x1b[2m{text}\x1b[0m")
                        } else {
                            write!(output, "{text}")
                        };
                        if written.and_then(|()| output.flush()).is_err() {
                            return false;
                        }
                    }
                }
                true
            })?;
        if let Some(e) = failure {
            return Err(e);
        }
        // Output that never reached a message (a model not following Harmony) is still shown.
        if parser.messages().is_empty()
            && parser.unfinished().is_none()
            && let Some(text) = parser.unfinished_header()
        {
            write!(output, "{text}").map_err(io)?;
        }
        writeln!(output).map_err(io)?;
        output.flush().map_err(io)?;
        // The answer joins the conversation (its analysis is dropped at the next render).
        let mut answered = parser.messages().to_vec();
        answered.extend(parser.unfinished().cloned());
        for m in answered {
            let mut reply = message(Role::Assistant, m.channel.as_deref(), m.content);
            reply.recipient = m.recipient;
            reply.content_type = m.content_type;
            conversation.messages.push(reply);
        }
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
