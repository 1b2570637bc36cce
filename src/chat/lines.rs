//! Input lines read with a bound: a line longer than the limit is skipped without being held in
//! memory, and bytes that are not UTF-8 are reported rather than ending the session.

use std::io::BufRead;

/// The longest line `serve --stdio` and `chat` read: a stdio `TURN` of a full 131,072-position
/// context takes about 1 MB.
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// One line of input, without its line ending.
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    Text(String),
    /// Longer than the limit (its bytes were read and dropped).
    TooLong,
    /// Not valid UTF-8.
    NotUtf8,
}

/// Reads the next line of at most `limit` bytes; None at the end of input.
pub fn read_line(
    input: &mut impl BufRead,
    buffer: &mut Vec<u8>,
    limit: usize,
) -> std::io::Result<Option<Line>> {
    buffer.clear();
    let (mut too_long, mut any) = (false, false);
    loop {
        let available = input.fill_buf()?;
        if available.is_empty() {
            break;
        }
        any = true;
        let newline = available.iter().position(|&b| b == b'\n');
        let chunk = &available[..newline.unwrap_or(available.len())];
        if !too_long {
            if buffer.len() + chunk.len() > limit {
                too_long = true;
                buffer.clear();
            } else {
                buffer.extend_from_slice(chunk);
            }
        }
        let used = chunk.len() + usize::from(newline.is_some());
        input.consume(used);
        if newline.is_some() {
            break;
        }
    }
    if !any {
        return Ok(None);
    }
    if too_long {
        return Ok(Some(Line::TooLong));
    }
    if buffer.last() == Some(&b'\r') {
        buffer.pop();
    }
    Ok(Some(match std::str::from_utf8(buffer) {
        Ok(text) => Line::Text(text.to_string()),
        Err(_) => Line::NotUtf8,
    }))
}

/// At most the first `MAX_ECHO` characters of `text`, for error messages that quote input.
pub fn excerpt(text: &str) -> String {
    const MAX_ECHO: usize = 32;
    match text.char_indices().nth(MAX_ECHO) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(bytes: &[u8], limit: usize) -> Vec<Line> {
        let mut input = std::io::BufReader::with_capacity(4, bytes);
        let mut buffer = Vec::new();
        std::iter::from_fn(|| read_line(&mut input, &mut buffer, limit).unwrap()).collect()
    }

    #[test]
    fn long_and_broken_lines_are_reported_and_the_next_ones_read() {
        let text = |s: &str| Line::Text(s.to_string());
        assert_eq!(
            lines(b"TURN 1\r\n\nabcdefghijkl\n\xff\xfe\nRESET", 8),
            vec![
                text("TURN 1"),
                text(""),
                Line::TooLong,
                Line::NotUtf8,
                text("RESET")
            ]
        );
        assert!(lines(b"", 8).is_empty());
    }

    #[test]
    fn excerpts_cut_long_text_on_a_character_boundary() {
        assert_eq!(excerpt("short"), "short");
        let long = "é".repeat(40);
        assert_eq!(excerpt(&long), format!("{}...", "é".repeat(32)));
    }
}
