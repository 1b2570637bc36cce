//! Stop sequences (the completion endpoints' `stop`): the reply's text is matched as it grows, so
//! a sequence split across tokens is found; text that could still begin one is held back, and
//! the reply ends before the first one found, which is not part of it.

use serde_json::Value;

/// At most this many sequences, as OpenAI's API takes.
pub const MAX_STOP_SEQUENCES: usize = 4;

/// A reply's stop sequences and the text held back while it may begin one.
#[derive(Debug, Default)]
pub struct StopSequences {
    sequences: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopSequences {
    /// The request's `stop`: absent, null, a string or an array of at most four strings, none
    /// empty; else why not.
    pub fn parse(stop: Option<&Value>) -> std::result::Result<StopSequences, String> {
        let sequences = match stop {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| {
                    item.as_str()
                        .map(str::to_string)
                        .ok_or("stop must be a string or an array of strings")
                })
                .collect::<std::result::Result<_, _>>()?,
            Some(_) => return Err("stop must be a string or an array of strings".into()),
        };
        if sequences.len() > MAX_STOP_SEQUENCES {
            return Err(format!(
                "stop takes at most {MAX_STOP_SEQUENCES} sequences, not {}",
                sequences.len()
            ));
        }
        if sequences.iter().any(String::is_empty) {
            return Err("a stop sequence must not be empty".into());
        }
        Ok(StopSequences {
            sequences,
            ..Default::default()
        })
    }

    /// Whether a sequence has been found: the reply is over.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The part of the reply that `text` lets through: what precedes the first sequence found,
    /// or what can no longer begin one; nothing once stopped.
    pub fn push(&mut self, text: &str) -> String {
        if self.stopped {
            return String::new();
        }
        self.held.push_str(text);
        let found = self
            .sequences
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(start) = found {
            self.stopped = true;
            self.held.truncate(start);
            return std::mem::take(&mut self.held);
        }
        let keep = self.longest_open_suffix();
        let ready = self.held.len() - keep;
        let rest = self.held.split_off(ready);
        std::mem::replace(&mut self.held, rest)
    }

    /// Whether text is held back.
    pub fn holding(&self) -> bool {
        !self.held.is_empty()
    }

    /// What was held back, at the end of the reply (nothing once stopped).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// The length in bytes of the longest end of the held text that begins a sequence.
    fn longest_open_suffix(&self) -> usize {
        let held = &self.held;
        // A whole sequence would have been found: only shorter ends can still grow into one.
        let longest = self.longest_sequence().saturating_sub(1);
        (1..=held.len().min(longest))
            .rev()
            .filter(|&n| held.is_char_boundary(held.len() - n))
            .find(|&n| {
                let end = &held[held.len() - n..];
                self.sequences.iter().any(|s| s.starts_with(end))
            })
            .unwrap_or(0)
    }

    fn longest_sequence(&self) -> usize {
        self.sequences.iter().map(String::len).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(stop: Value, pieces: &[&str]) -> (String, bool) {
        let mut stops = StopSequences::parse(Some(&stop)).unwrap();
        let mut out: String = pieces.iter().map(|p| stops.push(p)).collect();
        out.push_str(&stops.finish());
        (out, stops.stopped())
    }

    #[test]
    fn a_sequence_split_across_pieces_ends_the_reply_before_it() {
        let stop = json!(["END", "\n\n"]);
        assert_eq!(
            run(stop.clone(), &["one E", "N", "D two"]),
            ("one ".into(), true)
        );
        assert_eq!(run(stop.clone(), &["a\n", "\nb END"]), ("a".into(), true));
        // The earliest sequence wins, whichever is listed first.
        assert_eq!(run(stop.clone(), &["x\n\nyEND"]), ("x".into(), true));
        // A prefix that does not go on is let through; a prefix at the end is too.
        assert_eq!(
            run(stop.clone(), &["EN", "X E", "N"]),
            ("ENX EN".into(), false)
        );
    }

    #[test]
    fn held_text_waits_only_while_it_may_begin_a_sequence() {
        let mut stops = StopSequences::parse(Some(&json!("<stop>"))).unwrap();
        assert_eq!(stops.push("hello <st"), "hello ");
        assert_eq!(stops.push("ay"), "<stay");
        assert_eq!(stops.push("é<"), "é");
        assert_eq!(stops.push("stop> more"), "");
        assert!(stops.stopped());
        assert_eq!(stops.push("after"), "");
        assert_eq!(stops.finish(), "");
    }

    #[test]
    fn bad_stop_fields_are_refused_by_name() {
        assert!(StopSequences::parse(None).unwrap().sequences.is_empty());
        assert!(
            StopSequences::parse(Some(&json!(["a", "b", "c", "d", "e"])))
                .unwrap_err()
                .contains("at most 4")
        );
        assert!(
            StopSequences::parse(Some(&json!([""])))
                .unwrap_err()
                .contains("empty")
        );
        assert!(
            StopSequences::parse(Some(&json!([1])))
                .unwrap_err()
                .contains("array of strings")
        );
        assert!(StopSequences::parse(Some(&json!({"a": 1}))).is_err());
    }
}
