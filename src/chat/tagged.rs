//! A reply in the tags Qwen3's chat template teaches its models, split as it streams: reasoning
//! inside `<think>` … `</think>`, tool calls as `<tool_call>` + `{"name": …, "arguments": …}` +
//! `</tool_call>`, the rest content. Text that could still be the start of a tag is held back
//! until the next text shows what it is; nothing the model wrote is lost (a tool call whose JSON
//! does not parse is content).

const THINK: &str = "<think>";
const END_THINK: &str = "</think>";
const CALL: &str = "<tool_call>";
const END_CALL: &str = "</tool_call>";

/// A classified part of the reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    Reasoning(String),
    Content(String),
    /// A complete call: the function's name and its arguments as JSON text.
    ToolCall {
        name: String,
        arguments: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing yet: a reply may open with `<think>`.
    Start,
    Reasoning,
    Content,
    ToolCall,
}

/// The streaming splitter.
pub struct TaggedParser {
    state: State,
    /// Text received and not yet classified.
    pending: String,
    /// Newlines right after a tag are the template's layout, not text.
    skip_newlines: bool,
}

impl TaggedParser {
    /// A parser for a reply whose prompt ended inside `<think>` (`reasoning_open`: the template
    /// opened the reasoning itself) or not.
    pub fn new(reasoning_open: bool) -> TaggedParser {
        TaggedParser {
            state: if reasoning_open {
                State::Reasoning
            } else {
                State::Start
            },
            pending: String::new(),
            skip_newlines: reasoning_open,
        }
    }

    /// The pieces `text` completes.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.pending.push_str(text);
        let mut pieces = Vec::new();
        while self.step(&mut pieces) {}
        pieces
    }

    /// Everything held back, at the end of the reply (an unfinished tool call is content).
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut pieces = Vec::new();
        while self.step(&mut pieces) {}
        let rest = std::mem::take(&mut self.pending);
        let piece = match self.state {
            State::Reasoning => Piece::Reasoning(rest),
            State::ToolCall => Piece::Content(format!("{CALL}{rest}")),
            State::Start | State::Content => Piece::Content(rest),
        };
        if !matches!(&piece, Piece::Reasoning(t) | Piece::Content(t) if t.is_empty()) {
            pieces.push(piece);
        }
        self.state = State::Content;
        pieces
    }

    /// Classifies what it can of `pending`; whether to go on.
    fn step(&mut self, pieces: &mut Vec<Piece>) -> bool {
        if self.skip_newlines {
            let kept = self.pending.trim_start_matches('\n').len();
            self.pending.drain(..self.pending.len() - kept);
            if self.pending.is_empty() {
                return false;
            }
            self.skip_newlines = false;
        }
        match self.state {
            State::Start => {
                if let Some(rest) = self.pending.strip_prefix(THINK) {
                    self.pending = rest.to_string();
                    self.enter(State::Reasoning);
                    true
                } else if THINK.starts_with(self.pending.as_str()) {
                    false
                } else {
                    self.state = State::Content;
                    true
                }
            }
            State::Reasoning => self.until(END_THINK, pieces, Piece::Reasoning, State::Content),
            State::Content => self.until(CALL, pieces, Piece::Content, State::ToolCall),
            State::ToolCall => match self.pending.find(END_CALL) {
                Some(end) => {
                    let body: String = self.pending.drain(..end + END_CALL.len()).collect();
                    pieces.push(tool_call(&body[..end]));
                    self.enter(State::Content);
                    true
                }
                None => false,
            },
        }
    }

    /// Emits `pending` up to `tag` as `piece` and moves to `next` past it; without the tag,
    /// emits all but a tail that could begin it.
    fn until(
        &mut self,
        tag: &str,
        pieces: &mut Vec<Piece>,
        piece: fn(String) -> Piece,
        next: State,
    ) -> bool {
        if let Some(at) = self.pending.find(tag) {
            let text: String = self.pending.drain(..at).collect();
            self.pending.drain(..tag.len());
            if !text.is_empty() {
                pieces.push(piece(text));
            }
            self.enter(next);
            return true;
        }
        let keep = partial_tag_len(&self.pending, tag);
        let text: String = self.pending.drain(..self.pending.len() - keep).collect();
        if !text.is_empty() {
            pieces.push(piece(text));
        }
        false
    }

    fn enter(&mut self, state: State) {
        self.state = state;
        self.skip_newlines = true;
    }
}

/// The longest tail of `text` that is a proper prefix of `tag`.
fn partial_tag_len(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// A tool call's body: `{"name": ..., "arguments": {...}}`, else the text as content.
fn tool_call(body: &str) -> Piece {
    let parsed: Option<(String, String)> = serde_json::from_str::<serde_json::Value>(body.trim())
        .ok()
        .and_then(|call| {
            let name = call.get("name")?.as_str()?.to_string();
            let arguments = match call.get("arguments") {
                Some(serde_json::Value::String(text)) => text.clone(),
                Some(value) => value.to_string(),
                None => "{}".into(),
            };
            Some((name, arguments))
        });
    match parsed {
        Some((name, arguments)) => Piece::ToolCall { name, arguments },
        None => Piece::Content(format!("{CALL}{body}{END_CALL}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `text` a few characters at a time and merges neighbouring pieces of one kind.
    fn split(text: &str, reasoning_open: bool, chunk: usize) -> Vec<Piece> {
        let mut parser = TaggedParser::new(reasoning_open);
        let chars: Vec<char> = text.chars().collect();
        let mut pieces = Vec::new();
        for part in chars.chunks(chunk) {
            pieces.extend(parser.push(&part.iter().collect::<String>()));
        }
        pieces.extend(parser.finish());
        let mut merged: Vec<Piece> = Vec::new();
        for piece in pieces {
            match (merged.last_mut(), piece) {
                (Some(Piece::Reasoning(a)), Piece::Reasoning(b))
                | (Some(Piece::Content(a)), Piece::Content(b)) => a.push_str(&b),
                (_, piece) => merged.push(piece),
            }
        }
        merged
    }

    #[test]
    fn reasoning_content_and_calls_split_whatever_the_chunks() {
        let text = "<think>\nCheck the weather.\n</think>\n\nLet me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>";
        for chunk in [1, 2, 3, 7, 1000] {
            assert_eq!(
                split(text, false, chunk),
                vec![
                    Piece::Reasoning("Check the weather.\n".into()),
                    Piece::Content("Let me look.\n".into()),
                    Piece::ToolCall {
                        name: "get_weather".into(),
                        arguments: r#"{"city":"Paris"}"#.into()
                    },
                    Piece::ToolCall {
                        name: "add".into(),
                        arguments: r#"{"a":1}"#.into()
                    },
                ],
                "chunks of {chunk}"
            );
        }
    }

    #[test]
    fn open_reasoning_plain_text_and_broken_calls() {
        assert_eq!(
            split("Planning.</think>\n\nDone <3 <tool", true, 2),
            vec![
                Piece::Reasoning("Planning.".into()),
                Piece::Content("Done <3 <tool".into())
            ]
        );
        assert_eq!(
            split("<thinking aloud>", false, 1),
            vec![Piece::Content("<thinking aloud>".into())]
        );
        assert_eq!(
            split(
                "<tool_call>{not json}</tool_call>x<tool_call>{\"name\"",
                false,
                3
            ),
            vec![Piece::Content(
                "<tool_call>{not json}</tool_call>x<tool_call>{\"name\"".into()
            )]
        );
    }
}
