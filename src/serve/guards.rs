//! What every request passes before a handler: the access log, the Host allow-list, the API
//! key and the body's size and time limits. Each is an axum middleware over `Shared`.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use tokio_stream::StreamExt;

use super::{Shared, error};

tokio::task_local! {
    /// The tokens of the request this task answers, for its access-log line.
    static TALLY: Arc<Tally>;
}

/// Tokens one request used, filled in by the model worker.
#[derive(Default)]
pub(super) struct Tally {
    prompt: AtomicUsize,
    completion: AtomicUsize,
}

impl Tally {
    /// The tally of the request the current task answers (a fresh one outside a request).
    pub(super) fn current() -> Arc<Tally> {
        TALLY.try_with(Arc::clone).unwrap_or_default()
    }

    pub(super) fn set_prompt(&self, tokens: usize) {
        self.prompt.store(tokens, Ordering::Relaxed);
    }

    /// One more token generated (counted as it is made, so a request that ends early, a client
    /// hanging up or a failure, still logs what it used).
    pub(super) fn add_completion_token(&self) {
        self.completion.fetch_add(1, Ordering::Relaxed);
    }
}

/// One access-log line, written when the response's body has been sent or dropped (a stream's
/// tokens are known only then).
struct AccessLine {
    method: axum::http::Method,
    path: String,
    status: u16,
    started: Instant,
    tally: Arc<Tally>,
}

impl Drop for AccessLine {
    fn drop(&mut self) {
        log::info!(
            "{} {} {} prompt_tokens={} completion_tokens={} {:.1} ms",
            self.method,
            self.path,
            self.status,
            self.tally.prompt.load(Ordering::Relaxed),
            self.tally.completion.load(Ordering::Relaxed),
            self.started.elapsed().as_secs_f64() * 1e3
        );
    }
}

/// A response body that writes its access-log line when it is done.
struct LoggedBody {
    inner: Body,
    _line: AccessLine,
}

impl http_body::Body for LoggedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// One log line per request at info level: method, route, status, prompt and completion
/// tokens, and the time until its body was sent; the status is counted for /metrics.
pub(super) async fn access_log(
    State(shared): State<Arc<Shared>>,
    request: Request,
    next: Next,
) -> Response {
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    let started = Instant::now();
    let tally = Arc::new(Tally::default());
    let response = TALLY.scope(tally.clone(), next.run(request)).await;
    let status = response.status().as_u16();
    shared.metrics.count_response(status);
    let line = AccessLine {
        method,
        path,
        status,
        started,
        tally,
    };
    response.map(|inner| Body::new(LoggedBody { inner, _line: line }))
}

/// Host names a loopback-bound server answers to whatever `--allowed-host` says: a web page
/// that rebinds its own name to 127.0.0.1 still sends its own name as Host.
fn is_loopback_name(host: &str) -> bool {
    host == "localhost"
        || host.ends_with(".localhost")
        || (host.parse::<std::net::IpAddr>()).is_ok_and(|ip| ip.is_loopback())
}

/// The host part of a Host header (no port, brackets kept off IPv6), lower-case.
fn host_name(value: &str) -> String {
    let value = value.trim().to_ascii_lowercase();
    let name = match value.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or_default().to_string(),
        None => value
            .rsplit_once(':')
            .map_or(value.clone(), |(name, _)| name.to_string()),
    };
    name.trim_end_matches('.').to_string()
}

/// Whether Host names are checked: bound to loopback unless the list holds "*", or bound
/// elsewhere with a list given.
pub(super) fn host_check_applies(bound_to_loopback: bool, allowed: &[String]) -> bool {
    !allowed.iter().any(|name| name == "*") && (bound_to_loopback || !allowed.is_empty())
}

/// Whether a checked request naming `host` is served: loopback names and the listed ones.
pub(super) fn host_allowed(host: &str, allowed: &[String]) -> bool {
    let name = host_name(host);
    is_loopback_name(&name) || allowed.iter().any(|allowed| host_name(allowed) == name)
}

/// Refuses a request whose Host header is not allowed (DNS-rebinding protection), or that has
/// none where names are checked.
pub(super) async fn check_host(
    State(shared): State<Arc<Shared>>,
    request: Request,
    next: Next,
) -> Response {
    let allowed = &shared.limits.allowed_hosts;
    if !host_check_applies(shared.bound_to_loopback, allowed) {
        return next.run(request).await;
    }
    let host = (request.headers().get(header::HOST))
        .map(|value| value.to_str().ok())
        .unwrap_or_else(|| request.uri().host());
    match host {
        Some(host) if host_allowed(host, allowed) => next.run(request).await,
        Some(host) => {
            let shown = crate::chat::lines::excerpt(host);
            let message = format!(
                "Host {shown:?} is not allowed; start the server with --allowed-host {name} to \
                 accept it",
                name = crate::chat::lines::excerpt(&host_name(host))
            );
            closing(StatusCode::FORBIDDEN, message, "host_not_allowed")
        }
        None => closing(
            StatusCode::BAD_REQUEST,
            "a Host header naming this server (in ASCII) is needed".into(),
            "host_not_allowed",
        ),
    }
}

/// Refuses a request without the server's API key (when it has one); /health stays open.
pub(super) async fn authorize(
    State(shared): State<Arc<Shared>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(key) = &shared.limits.api_key else {
        return next.run(request).await;
    };
    let given = (request.headers().get(header::AUTHORIZATION))
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "));
    let matches = given.is_some_and(|given| same_secret(given.as_bytes(), key.as_bytes()));
    if request.uri().path() == "/health" || matches {
        return next.run(request).await;
    }
    let mut response = closing(
        StatusCode::UNAUTHORIZED,
        "a valid API key is needed (Authorization: Bearer <key>)".into(),
        "invalid_api_key",
    );
    let challenge = HeaderValue::from_static("Bearer");
    (response.headers_mut()).insert(header::WWW_AUTHENTICATE, challenge);
    response
}

/// Whether `given` equals `key`, in a time that does not depend on where they differ (a
/// client timing the answers learns nothing of the key but its length).
fn same_secret(given: &[u8], key: &[u8]) -> bool {
    given.len() == key.len()
        && given
            .iter()
            .zip(key)
            .fold(0u8, |diff, (g, k)| diff | (g ^ k))
            == 0
}

/// A response that also closes the connection (its request's body was not read whole, or is
/// not wanted).
fn closing(status: StatusCode, message: String, code: &str) -> Response {
    let mut response = error(status, message, code);
    let close = HeaderValue::from_static("close");
    response.headers_mut().insert(header::CONNECTION, close);
    response
}

/// How a request's body failed to arrive whole.
enum BodyError {
    TooLarge,
    TimedOut,
    Broken(axum::Error),
}

/// Reads `body` whole within `limit` bytes and `timeout`; with `keep` false, only discards it.
async fn read_body(
    body: Body,
    limit: usize,
    timeout: std::time::Duration,
    keep: bool,
) -> Result<Vec<u8>, BodyError> {
    let read = async {
        let (mut stream, mut bytes, mut length) = (body.into_data_stream(), Vec::new(), 0);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(BodyError::Broken)?;
            length += chunk.len();
            if length > limit {
                return Err(BodyError::TooLarge);
            }
            if keep {
                bytes.extend_from_slice(&chunk);
            }
        }
        Ok(bytes)
    };
    (tokio::time::timeout(timeout, read).await).unwrap_or(Err(BodyError::TimedOut))
}

/// Largest body read only to be discarded, as a multiple of the limit: a client that sends a
/// body without waiting for `100 Continue` then reads the 413 instead of a reset connection.
const DRAIN_FACTOR: usize = 4;

/// Reads the request's body whole before the handler runs, within the server's size limit
/// (413 otherwise, without reading a body declared larger) and its body timeout (408).
pub(super) async fn limit_body(
    State(shared): State<Arc<Shared>>,
    request: Request,
    next: Next,
) -> Response {
    let (limit, timeout) = (shared.limits.body_bytes, shared.limits.body_timeout);
    let too_large = || {
        let message = format!("the request body is larger than the server's {limit} bytes");
        closing(StatusCode::PAYLOAD_TOO_LARGE, message, "request_too_large")
    };
    // A chunked body's length is what arrives, whatever Content-Length says.
    let chunked = request.headers().contains_key(header::TRANSFER_ENCODING);
    let declared = (request.headers().get(header::CONTENT_LENGTH))
        .filter(|_| !chunked)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<usize>().ok());
    let (parts, body) = request.into_parts();
    if let Some(declared) = declared.filter(|&length| length > limit) {
        let expects_continue = parts.headers.contains_key(header::EXPECT);
        if !expects_continue && declared <= limit.saturating_mul(DRAIN_FACTOR) {
            let _ = read_body(body, declared, timeout, false).await;
        }
        return too_large();
    }
    match read_body(body, limit, timeout, true).await {
        Ok(bytes) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Err(BodyError::TooLarge) => too_large(),
        Err(BodyError::TimedOut) => closing(
            StatusCode::REQUEST_TIMEOUT,
            format!(
                "the request body did not arrive within {} s",
                timeout.as_secs()
            ),
            "request_timeout",
        ),
        Err(BodyError::Broken(e)) => closing(
            StatusCode::BAD_REQUEST,
            format!("the request body could not be read: {e}"),
            "invalid_body",
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_servers_answer_only_loopback_and_listed_hosts() {
        let none: &[String] = &[];
        for host in [
            "localhost:8080",
            "127.0.0.1",
            "[::1]:80",
            "LocalHost.",
            "a.localhost",
        ] {
            assert!(host_allowed(host, none), "{host}");
        }
        for host in ["evil.example:8080", "127.0.0.1.evil.example", "[::2]"] {
            assert!(!host_allowed(host, none), "{host}");
        }
        let listed = ["Box.lan".to_string()];
        assert!(host_allowed("box.lan:8080", &listed));
        assert!(!host_allowed("evil.example", &listed));
        assert!(host_check_applies(true, none) && host_check_applies(false, &listed));
        assert!(!host_check_applies(false, none));
        assert!(!host_check_applies(true, &["*".to_string()]));
    }

    #[test]
    fn secrets_compare_whole() {
        assert!(same_secret(b"s3cret", b"s3cret"));
        for given in [&b"s3cres"[..], b"s3cre", b"s3crett", b""] {
            assert!(!same_secret(given, b"s3cret"));
        }
    }
}
