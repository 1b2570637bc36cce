//! Parsing what the model generates after `<|start|>assistant`, token by token, into Harmony
//! messages: their channel (analysis, commentary, final), recipient (a tool call's
//! `functions.NAME`), content type and text. `<|end|>` ends a message, not the answer: the model
//! goes on with `<|start|>assistant...`. `<|return|>` ends the answer and `<|call|>` a tool call.

use super::tokenizer::{CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START, Tokenizer};
use crate::error::Result;

/// One message the model wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ParsedMessage {
    /// `assistant` (the model writes only as the assistant).
    pub author: String,
    pub channel: Option<String>,
    /// `functions.NAME` for a tool call.
    pub recipient: Option<String>,
    /// e.g. `<|constrain|>json`.
    pub content_type: Option<String>,
    pub content: String,
}

/// Why the model stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Stop {
    /// `<|return|>`: the answer is complete.
    Return,
    /// `<|call|>`: the last message is a tool call to run.
    Call,
}

/// What one token changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// More text of the current message (whole UTF-8 characters only).
    Text {
        channel: Option<String>,
        text: String,
    },
    /// A message ended (by `<|end|>`, `<|return|>` or `<|call|>`).
    Message(ParsedMessage),
    Stop(Stop),
}

enum State {
    /// Reading a header (author, recipient, channel, content type) until `<|message|>`.
    Header,
    /// Reading content until an end token.
    Content,
    /// After `<|end|>`: the next token should be `<|start|>`.
    BetweenMessages,
    Stopped,
}

/// An incremental parser of generated tokens.
pub struct StreamParser {
    tokenizer: Tokenizer,
    state: State,
    /// The header so far, special tokens written by name.
    header: String,
    /// Bytes of content not yet emitted (an unfinished UTF-8 character).
    pending: Vec<u8>,
    current: ParsedMessage,
    messages: Vec<ParsedMessage>,
    stop: Option<Stop>,
}

impl StreamParser {
    /// A parser of what follows `<|start|>assistant` (the role is already given).
    pub fn new(tokenizer: Tokenizer) -> StreamParser {
        StreamParser {
            tokenizer,
            state: State::Header,
            header: "assistant".into(),
            pending: Vec::new(),
            current: ParsedMessage::default(),
            messages: Vec::new(),
            stop: None,
        }
    }

    /// Feeds one generated token.
    pub fn push(&mut self, token: u32) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        match self.state {
            State::Stopped => {}
            State::BetweenMessages => {
                if token == START {
                    self.header.clear();
                    self.state = State::Header;
                }
                // Anything else between messages is not Harmony: ignored.
            }
            State::Header => match token {
                CHANNEL => self.header.push_str("<|channel|>"),
                CONSTRAIN => self.header.push_str("<|constrain|>"),
                MESSAGE => {
                    self.current = parse_header(&self.header);
                    self.state = State::Content;
                }
                // The message ended before its content (or a stray token): keep what there is.
                END | RETURN | CALL => self.finish(token, &mut events),
                _ => {
                    let text = self.tokenizer.decode_bytes(&[token])?;
                    self.header.push_str(&String::from_utf8_lossy(&text));
                }
            },
            State::Content => match token {
                END | RETURN | CALL => {
                    self.flush(true, &mut events);
                    self.finish(token, &mut events);
                }
                _ => {
                    self.pending.extend(self.tokenizer.decode_bytes(&[token])?);
                    self.flush(false, &mut events);
                }
            },
        }
        Ok(events)
    }

    /// Emits the complete UTF-8 characters of the pending bytes (all of them, lossily, when
    /// `all`).
    fn flush(&mut self, all: bool, events: &mut Vec<Event>) {
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) if all || e.error_len().is_some() => self.pending.len(),
            Err(e) => e.valid_up_to(),
        };
        if valid == 0 {
            return;
        }
        let bytes: Vec<u8> = self.pending.drain(..valid).collect();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        self.current.content.push_str(&text);
        events.push(Event::Text {
            channel: self.current.channel.clone(),
            text,
        });
    }

    fn finish(&mut self, token: u32, events: &mut Vec<Event>) {
        if matches!(self.state, State::Header) {
            self.current = parse_header(&self.header);
        }
        let message = std::mem::take(&mut self.current);
        self.messages.push(message.clone());
        events.push(Event::Message(message));
        self.state = match token {
            RETURN => {
                self.stop = Some(Stop::Return);
                events.push(Event::Stop(Stop::Return));
                State::Stopped
            }
            CALL => {
                self.stop = Some(Stop::Call);
                events.push(Event::Stop(Stop::Call));
                State::Stopped
            }
            _ => State::BetweenMessages,
        };
    }

    /// The messages completed so far.
    pub fn messages(&self) -> &[ParsedMessage] {
        &self.messages
    }

    /// The message being written, if the output stopped inside one (truncated output).
    pub fn unfinished(&self) -> Option<&ParsedMessage> {
        matches!(self.state, State::Content).then_some(&self.current)
    }

    /// The header text read since the last message began, if the output stopped inside a
    /// header: for output that does not follow Harmony at all (no `<|message|>`), its text.
    pub fn unfinished_header(&self) -> Option<&str> {
        matches!(self.state, State::Header).then(|| {
            self.header
                .strip_prefix("assistant")
                .unwrap_or(&self.header)
        })
    }

    pub fn stop(&self) -> Option<Stop> {
        self.stop
    }

    /// Parses a whole completion.
    pub fn parse(tokenizer: Tokenizer, tokens: &[u32]) -> Result<StreamParser> {
        let mut parser = StreamParser::new(tokenizer);
        for &t in tokens {
            parser.push(t)?;
        }
        Ok(parser)
    }
}

/// `assistant to=functions.f<|channel|>commentary <|constrain|>json` and the like.
fn parse_header(header: &str) -> ParsedMessage {
    let (before, channel_part) = match header.split_once("<|channel|>") {
        Some((before, after)) => (before, Some(after)),
        None => (header, None),
    };
    let mut message = ParsedMessage::default();
    let mut words = before.split_whitespace();
    message.author = words.next().unwrap_or("assistant").to_string();
    let mut rest: Vec<&str> = words.collect();
    if let Some(channel_part) = channel_part {
        let mut words = channel_part.split_whitespace();
        message.channel = words.next().map(str::to_string);
        rest.extend(words);
    }
    for word in rest {
        if let Some(to) = word.strip_prefix("to=") {
            message.recipient = Some(to.to_string());
        } else {
            message.content_type = Some(word.to_string());
        }
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(text: &str) -> Vec<u32> {
        Tokenizer::o200k_harmony().encode_with_special_tokens(text)
    }

    #[test]
    fn analysis_then_final_then_return() {
        let t = tokens(
            "<|channel|>analysis<|message|>User greets; answer.<|end|><|start|>assistant<|channel|>final<|message|>Hi there 🌸<|return|>",
        );
        let p = StreamParser::parse(Tokenizer::o200k_harmony(), &t).unwrap();
        let m = p.messages();
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].channel.as_deref(), Some("analysis"));
        assert_eq!(m[0].content, "User greets; answer.");
        assert_eq!(m[1].channel.as_deref(), Some("final"));
        assert_eq!(m[1].content, "Hi there 🌸");
        assert_eq!(p.stop(), Some(Stop::Return));
        assert!(p.unfinished().is_none());
    }

    #[test]
    fn tool_call_with_recipient_and_constraint() {
        for header in [
            "<|channel|>commentary to=functions.get_weather <|constrain|>json",
            " to=functions.get_weather<|channel|>commentary <|constrain|>json",
        ] {
            let t = tokens(&format!(
                "{header}<|message|>{{\"location\":\"Tokyo\"}}<|call|>"
            ));
            let p = StreamParser::parse(Tokenizer::o200k_harmony(), &t).unwrap();
            let m = &p.messages()[0];
            assert_eq!(m.author, "assistant", "{header}");
            assert_eq!(m.channel.as_deref(), Some("commentary"));
            assert_eq!(m.recipient.as_deref(), Some("functions.get_weather"));
            assert_eq!(m.content_type.as_deref(), Some("<|constrain|>json"));
            assert_eq!(m.content, "{\"location\":\"Tokyo\"}");
            assert_eq!(p.stop(), Some(Stop::Call));
        }
    }

    #[test]
    fn truncated_output_keeps_the_unfinished_message() {
        let t = tokens("<|channel|>final<|message|>The answer is");
        let p = StreamParser::parse(Tokenizer::o200k_harmony(), &t).unwrap();
        assert!(p.messages().is_empty() && p.stop().is_none());
        let m = p.unfinished().unwrap();
        assert_eq!(
            (m.channel.as_deref(), m.content.as_str()),
            (Some("final"), "The answer is")
        );
    }

    #[test]
    fn streamed_text_never_splits_a_character() {
        let t = tokens("<|channel|>final<|message|>東京🌸 ok<|return|>");
        let mut p = StreamParser::new(Tokenizer::o200k_harmony());
        let mut streamed = String::new();
        for &token in &t {
            for event in p.push(token).unwrap() {
                if let Event::Text { channel, text } = event {
                    assert_eq!(channel.as_deref(), Some("final"));
                    assert!(!text.contains('\u{FFFD}'), "{text:?}");
                    streamed.push_str(&text);
                }
            }
        }
        assert_eq!(streamed, "東京🌸 ok");
        // After the stop, tokens change nothing.
        assert!(p.push(tokens("more")[0]).unwrap().is_empty());
    }
}
