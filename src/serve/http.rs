//! The server's connections: accepted up to a cap, closed when a request's head does not
//! arrive in time (idle keep-alive included), and wound down gracefully on a stop signal.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::metrics::Metrics;

/// How long requests in flight may run on after a stop signal.
pub(super) const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// What bounds the connections.
pub(super) struct ConnectionLimits {
    pub max_open: usize,
    pub head_timeout: Duration,
}

/// Serves `app` on `listener` until `stop` completes, then lets open connections finish their
/// requests for at most `SHUTDOWN_GRACE`.
pub(super) async fn run(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    metrics: Arc<Metrics>,
    stop: impl Future<Output = ()>,
) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.head_timeout);
    let max_open = limits.max_open;
    let open = Arc::new(Semaphore::new(max_open));
    // Refusals are bounded too: past this many being answered, a connection is just closed.
    let refusing = Arc::new(Semaphore::new(max_open));
    let graceful = GracefulShutdown::new();
    tokio::pin!(stop);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: wait rather than spin.
                    log::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let Ok(permit) = open.clone().try_acquire_owned() else {
            metrics.count_refused_connection();
            if let Ok(refusal) = refusing.clone().try_acquire_owned() {
                tokio::spawn(async move {
                    refuse(stream, max_open).await;
                    drop(refusal);
                });
            }
            continue;
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let connection = builder.serve_connection(TokioIo::new(stream), service);
        let connection = graceful.watch(connection);
        let open = OpenConnection::new(permit, metrics.clone());
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                log::debug!("connection closed: {e}");
            }
            drop(open);
        });
    }
    // New clients get a refused connection rather than a wait in the backlog.
    drop(listener);
    log::info!(
        "stopping: no new connections; requests in flight get {} s to finish",
        SHUTDOWN_GRACE.as_secs()
    );
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(SHUTDOWN_GRACE) => {
            log::warn!("requests still running after the grace period: ending them");
        }
    }
}

/// One open connection: its place under the cap and in the gauge, given back when dropped
/// (however its task ends).
struct OpenConnection {
    _permit: OwnedSemaphorePermit,
    metrics: Arc<Metrics>,
}

impl OpenConnection {
    fn new(permit: OwnedSemaphorePermit, metrics: Arc<Metrics>) -> OpenConnection {
        metrics.count_connection(1);
        OpenConnection {
            _permit: permit,
            metrics,
        }
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.metrics.count_connection(-1);
    }
}

/// Answers a connection over the cap with 503 and closes it, after reading what the client
/// sent at once (closing with unread bytes would reset the connection before it reads this).
async fn refuse(mut stream: TcpStream, max_open: usize) {
    let mut request = [0u8; 8192];
    let _ = tokio::time::timeout(Duration::from_millis(200), stream.read(&mut request)).await;
    let body = serde_json::json!({"error": {
        "message": format!("the server has {max_open} connections open; retry later"),
        "type": "server_error", "param": null, "code": "server_busy"}})
    .to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(
        Duration::from_secs(1),
        stream.write_all(response.as_bytes()),
    )
    .await;
    let _ = stream.shutdown().await;
}
