//! A `picchio serve` child over a fresh tiny-harmony model, and raw HTTP/1.1 requests to it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};

pub struct Server {
    pub child: Child,
    pub port: u16,
    _model: Option<tempfile::TempDir>,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn picchio() -> Command {
    Command::new(env!("CARGO_BIN_EXE_picchio"))
}

/// A fresh tiny-harmony model, in `DIR/tiny-harmony`.
pub fn tiny_harmony() -> (tempfile::TempDir, std::path::PathBuf) {
    let model = tempfile::tempdir().unwrap();
    let dir = model.path().join("tiny-harmony");
    super::picchio_stdout(&[
        "synth",
        "--shape",
        "tiny-harmony",
        "--out",
        dir.to_str().unwrap(),
    ]);
    (model, dir)
}

/// A server on a free port over a fresh tiny-harmony model.
pub fn server(extra: &[&str]) -> Server {
    let (model, dir) = tiny_harmony();
    spawn(&dir, extra, Some(model))
}

/// A server on a free port over the model in `dir`.
pub fn server_on(dir: &std::path::Path, extra: &[&str]) -> Server {
    spawn(dir, extra, None)
}

/// A server over `dir`, which `model` (when given) holds.
fn spawn(dir: &std::path::Path, extra: &[&str], model: Option<tempfile::TempDir>) -> Server {
    let mut child = picchio()
        .args(["serve", "--model", dir.to_str().unwrap(), "--port", "0"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines();
    let port = loop {
        let line = lines.next().expect("server exited").unwrap();
        if let Some(address) = line.strip_prefix("picchio: listening on http://") {
            break address.rsplit(':').next().unwrap().parse().unwrap();
        }
    };
    // Keep draining stderr so the server never blocks on it.
    std::thread::spawn(move || for _ in lines {});
    Server {
        child,
        port,
        _model: model,
    }
}

/// One HTTP/1.1 request; returns the status and the (de-chunked) body.
pub fn request(port: u16, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    request_with(port, method, path, "", body)
}

/// `request` with more header lines (each ending in CRLF).
pub fn request_with(
    port: u16,
    method: &str,
    path: &str,
    headers: &str,
    body: Option<&str>,
) -> (u16, String) {
    try_request_with(port, method, path, headers, body).unwrap()
}

/// `request_with`, any failure to send, receive or parse returned as its description.
pub fn try_request_with(
    port: u16,
    method: &str,
    path: &str,
    headers: &str,
    body: Option<&str>,
) -> Result<(u16, String), String> {
    let io = |e: std::io::Error| format!("{method} {path}: {e}");
    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(io)?;
    // A server that stops answering fails the test instead of hanging it.
    let patience = Some(std::time::Duration::from_secs(120));
    stream.set_read_timeout(patience).map_err(io)?;
    stream.set_write_timeout(patience).map_err(io)?;
    let body = body.unwrap_or("");
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{headers}Connection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(io)?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).map_err(io)?;
    let raw = String::from_utf8(raw).map_err(|e| format!("{method} {path}: {e}"))?;
    parse_response(&raw).ok_or_else(|| format!("{method} {path}: not an HTTP response: {raw:?}"))
}

/// The status and (de-chunked) body of a raw HTTP/1.1 response.
fn parse_response(raw: &str) -> Option<(u16, String)> {
    let (head, rest) = raw.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    if !chunked {
        return Some((status, rest.to_string()));
    }
    let (mut out, mut rest) = (String::new(), rest);
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.trim(), 16).ok()?;
        if size == 0 {
            return Some((status, out));
        }
        out.push_str(after.get(..size)?);
        rest = after.get(size + 2..)?;
    }
}
