//! `picchio serve --stdio`: a line protocol for embedding picchio in another program, one
//! session per process. The client renders conversations itself (ids in, ids out):
//!
//! - picchio starts with `READY <context> <vocab_size> <stop ids...>`;
//! - `TURN <max_new> <keep> <temperature> <top_p> <top_k> <n_ids> <ids...>` keeps the first
//!   `keep` positions of the session, computes the `n_ids` ids after them, and generates: one
//!   `TOKEN <id>` line per token, then `DONE <RETURN|CALL|MAX_TOKENS|CONTEXT_FULL> <n_output>
//!   <position>`. Every emitted token is fed back, so `position` = `keep` + `n_ids` +
//!   `n_output` and the next turn can keep all of it;
//! - `RESET` empties the session; `SHUTDOWN` (or the end of input) ends the process;
//! - a bad line gets `ERROR <code> <fatal 0|1> <message>`, checked before the session is
//!   touched: a non-fatal error leaves it as it was. Codes: 400 malformed or out of range (an
//!   empty line, bytes that are not UTF-8, a line over `MAX_LINE_BYTES`, arguments after
//!   `RESET` or `SHUTDOWN`), 413 longer than the context, 500 the model failed (fatal: the
//!   process ends). Messages quote at most a short prefix of the offending field.

use std::io::{BufRead, Write};

use super::lines::{Line, MAX_LINE_BYTES, excerpt, read_line};
use super::tokenizer::CALL;
use crate::error::{Error, Result};
use crate::model::Model;
use crate::model::generate::SessionTier;
use crate::model::sampler::{Sampler, SamplingOptions};
use crate::model::session::{ChatSession, Finish};

/// A parsed `TURN` line.
struct Turn {
    max_new: usize,
    keep: usize,
    sampling: SamplingOptions,
    ids: Vec<u32>,
}

fn parse_turn(words: &[&str], seed: u64) -> std::result::Result<Turn, String> {
    let number = |i: usize, what: &str| -> std::result::Result<&str, String> {
        words
            .get(i)
            .copied()
            .ok_or_else(|| format!("TURN needs {what} (field {i})"))
    };
    let int = |i: usize, what: &str| -> std::result::Result<usize, String> {
        let w = number(i, what)?;
        w.parse()
            .map_err(|_| format!("{what} must be a whole number, not {:?}", excerpt(w)))
    };
    let float = |i: usize, what: &str| -> std::result::Result<f32, String> {
        let w = number(i, what)?;
        w.parse()
            .map_err(|_| format!("{what} must be a number, not {:?}", excerpt(w)))
    };
    let max_new = int(0, "max_new")?;
    let keep = int(1, "keep")?;
    let sampling = SamplingOptions {
        temperature: float(2, "temperature")?,
        top_p: float(3, "top_p")?,
        top_k: int(4, "top_k")?,
        seed,
        ..Default::default()
    };
    sampling.check()?;
    let n = int(5, "n_ids")?;
    let ids = &words[6.min(words.len())..];
    if ids.len() != n {
        return Err(format!("n_ids is {n} but {} ids follow", ids.len()));
    }
    let ids = ids
        .iter()
        .map(|w| {
            w.parse()
                .map_err(|_| format!("token id {:?} is not a whole number", excerpt(w)))
        })
        .collect::<std::result::Result<Vec<u32>, String>>()?;
    Ok(Turn {
        max_new,
        keep,
        sampling,
        ids,
    })
}

/// Writes one protocol line and flushes it (the client waits for it).
fn send(output: &mut impl Write, line: &str) -> Result<()> {
    writeln!(output, "{line}")
        .and_then(|()| output.flush())
        .map_err(|e| Error::io("the stdio protocol's output", e))
}

/// Answers a malformed line: `ERROR 400`, not fatal (the session is as it was).
fn refuse(output: &mut impl Write, message: &str) -> Result<()> {
    send(output, &format!("ERROR 400 0 {message}"))
}

/// Serves the protocol on `input`/`output` until `SHUTDOWN`, the end of input or a fatal error
/// (returned after its `ERROR` line), the session on `tier`. `seed` seeds each turn's sampling
/// (plus the turn's number).
pub fn serve(
    model: &Model,
    context: usize,
    tier: &SessionTier,
    seed: u64,
    mut input: impl BufRead,
    mut output: impl Write,
) -> Result<()> {
    let io = |e: std::io::Error| Error::io("the stdio protocol's output", e);
    let mut session = ChatSession::open(model, tier, context)?;
    let stops = super::stop_ids(&model.config);
    let stop_list: Vec<String> = stops.iter().map(u32::to_string).collect();
    let ready = format!(
        "READY {context} {} {}",
        model.config.vocab_size,
        stop_list.join(" ")
    );
    send(&mut output, ready.trim_end())?;
    let mut turns = 0u64;
    let mut buffer = Vec::new();
    loop {
        let line = read_line(&mut input, &mut buffer, MAX_LINE_BYTES)
            .map_err(|e| Error::io("the stdio protocol's input", e))?;
        let line = match line {
            None => break,
            Some(Line::Text(line)) => line,
            Some(Line::TooLong) => {
                let message = format!("the line is longer than {MAX_LINE_BYTES} bytes");
                refuse(&mut output, &message)?;
                continue;
            }
            Some(Line::NotUtf8) => {
                refuse(&mut output, "the line is not UTF-8")?;
                continue;
            }
        };
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            [] => refuse(
                &mut output,
                "an empty line: expected TURN, RESET or SHUTDOWN",
            )?,
            ["SHUTDOWN"] => break,
            ["RESET"] => session.reset(),
            [command @ ("RESET" | "SHUTDOWN"), ..] => {
                refuse(&mut output, &format!("{command} takes no arguments"))?
            }
            ["TURN", arguments @ ..] => {
                let turn = match parse_turn(arguments, seed.wrapping_add(turns)) {
                    Ok(turn) => turn,
                    Err(message) => {
                        refuse(&mut output, &message)?;
                        continue;
                    }
                };
                if let Err(e) = session.check_extend(turn.keep, &turn.ids) {
                    let code = if e.to_string().contains("context") {
                        413
                    } else {
                        400
                    };
                    send(&mut output, &format!("ERROR {code} 0 {e}"))?;
                    continue;
                }
                turns += 1;
                let mut sampler = Sampler::new(turn.sampling);
                let mut written = Ok(());
                let result = session.extend(turn.keep, &turn.ids).and_then(|()| {
                    session.generate(turn.max_new, &mut sampler, &stops, |token| {
                        written = writeln!(output, "TOKEN {token}").and_then(|()| output.flush());
                        written.is_ok()
                    })
                });
                written.map_err(io)?;
                match result {
                    Ok((tokens, finish)) => {
                        let reason = match finish {
                            Finish::Stop(CALL) => "CALL",
                            Finish::Stop(_) => "RETURN",
                            Finish::MaxTokens | Finish::Cancelled => "MAX_TOKENS",
                            Finish::ContextFull => "CONTEXT_FULL",
                        };
                        let done = format!("DONE {reason} {} {}", tokens.len(), session.position());
                        send(&mut output, &done)?;
                    }
                    Err(e) => {
                        send(&mut output, &format!("ERROR 500 1 {e}"))?;
                        return Err(e);
                    }
                }
            }
            [other, ..] => refuse(
                &mut output,
                &format!("unknown command {:?}", excerpt(other)),
            )?,
        }
    }
    Ok(())
}
