//! Connections: an accept loop per socket that serves each stream with hyper's HTTP/1, bounded
//! in number (`limits.max_connections`, shared by every socket) and in request-head size
//! (`limits.max_header_bytes`), and drained gracefully on shutdown.
//!
//! axum's own `serve` has neither bound, so this loop replaces it: at the connection limit it
//! stops accepting, and further clients wait in the kernel's listen backlog (bounded by the
//! socket's backlog) instead of taking memory here; a request head above the size limit gets
//! 431 from hyper. Both limits are read at start (a `SIGHUP` does not change them).

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

/// A listening socket.
pub(crate) enum Listener {
    /// A Unix stream socket.
    Unix(tokio::net::UnixListener),
    /// A TCP socket.
    Tcp(tokio::net::TcpListener),
}

/// Limits shared by every connection of the daemon.
#[derive(Clone)]
pub(crate) struct ConnLimits {
    /// Connections open at once, across all sockets.
    pub(crate) slots: Arc<Semaphore>,
    /// hyper's read buffer: the largest request head (hyper's minimum is 8 KiB, which the
    /// config's own minimum matches).
    pub(crate) max_header_bytes: usize,
}

/// How long a client has to send a request head once its connection is open.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long running connections get to finish once the daemon stops accepting.
const DRAIN_CONNECTIONS: Duration = Duration::from_secs(2);

fn serve_stream<I>(
    io: I,
    app: &Router,
    limits: &ConnLimits,
    graceful: &GracefulShutdown,
    permit: OwnedSemaphorePermit,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let conn = hyper::server::conn::http1::Builder::new()
        .max_buf_size(limits.max_header_bytes.max(8192))
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .serve_connection(TokioIo::new(io), TowerToHyperService::new(app.clone()));
    let conn = graceful.watch(conn);
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            log::debug!("connection: {e}");
        }
        drop(permit);
    });
}

/// Accepts on `listener` until `stop` turns true, then gives open connections
/// [`DRAIN_CONNECTIONS`] to finish their requests.
pub(crate) async fn serve(
    listener: Listener,
    app: Router,
    limits: ConnLimits,
    mut stop: watch::Receiver<bool>,
) {
    let graceful = GracefulShutdown::new();
    loop {
        // A slot first: at the limit, nothing more is accepted.
        let permit = tokio::select! {
            p = Arc::clone(&limits.slots).acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = stop.wait_for(|v| *v) => break,
        };
        let accepted = tokio::select! {
            r = accept(&listener) => r,
            _ = stop.wait_for(|v| *v) => break,
        };
        match accepted {
            Ok(Stream::Unix(s)) => serve_stream(s, &app, &limits, &graceful, permit),
            Ok(Stream::Tcp(s)) => serve_stream(s, &app, &limits, &graceful, permit),
            Err(e) => {
                // Out of file descriptors, or a client gone before accept: wait a little
                // rather than spin.
                log::warn!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    if tokio::time::timeout(DRAIN_CONNECTIONS, graceful.shutdown())
        .await
        .is_err()
    {
        log::warn!(
            "connections still open {} s after shutdown began: closing them",
            DRAIN_CONNECTIONS.as_secs()
        );
    }
}

enum Stream {
    Unix(tokio::net::UnixStream),
    Tcp(tokio::net::TcpStream),
}

async fn accept(l: &Listener) -> std::io::Result<Stream> {
    match l {
        Listener::Unix(l) => l.accept().await.map(|(s, _)| Stream::Unix(s)),
        Listener::Tcp(l) => {
            let (s, _) = l.accept().await?;
            // Tokens stream one small event at a time: send each at once.
            s.set_nodelay(true)?;
            Ok(Stream::Tcp(s))
        }
    }
}
