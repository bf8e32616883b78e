//! The gateway's connections: a cap on how many are open, a deadline on each request's headers
//! (which is also how long an idle keep-alive connection may stay), and graceful shutdown; and
//! request bodies read before a request takes a concurrency slot, at a minimum rate, so slow
//! senders cannot hold the slots the others need.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    body::{Body, Bytes},
    extract::{Request, State},
    http::header,
    middleware::Next,
    response::{IntoResponse, Response},
};
use ecoscan_common::CancellationToken;
use futures::FutureExt as _;
use http_body_util::BodyExt as _;
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::{conn::auto::Builder, graceful::GracefulShutdown},
    service::TowerToHyperService,
};
use tokio::{net::TcpListener, sync::Semaphore};

use crate::{config::Limits, error::ApiError};

/// How long open connections may take to finish after shutdown begins.
const DRAIN: Duration = Duration::from_secs(30);
/// The largest request line and headers accepted (hyper's minimum buffer size).
pub(crate) const MAX_REQUEST_HEAD: usize = 8 * 1024;
/// Windows over which a body's minimum rate is checked.
const RATE_WINDOW: Duration = Duration::from_secs(5);

/// Serves `app` on `listener` until `shutdown`, with the connection limits of `limits`.
pub(crate) async fn serve(
    app: Router,
    listener: TcpListener,
    limits: &Limits,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // Starts whenever the connection waits for a request's head: slow headers and idle
        // keep-alive connections are both cut after it.
        .header_read_timeout(limits.header_timeout)
        // Request heads of at most 8 KiB (hyper answers 431 beyond), which also keeps each
        // connection's read buffer at 8 KiB: with hyper's default the buffer of every
        // connection doubles to 16 KiB on the second read of its first request (the version
        // sniffing above hands hyper the first bytes as a short read of their own), and an
        // idle SSE connection holds it for its whole life.
        .max_buf_size(MAX_REQUEST_HEAD);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(10))
        .max_concurrent_streams(256);
    let service = TowerToHyperService::new(app);
    loop {
        // At the cap, stop accepting: new connections wait in the listen backlog until one
        // closes, and open connections keep their service.
        let permit = tokio::select! {
            () = shutdown.cancelled() => break,
            p = slots.clone().acquire_owned() => p.expect("the semaphore is never closed"),
        };
        let (stream, _) = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors, or a connection reset before it was accepted.
                    tracing::warn!(error = %e, "failed to accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Without TCP_NODELAY small responses wait for delayed ACKs (~40 ms each).
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, "failed to set TCP_NODELAY");
        }
        let connection = builder
            .serve_connection_with_upgrades(TokioIo::new(stream), service.clone())
            .into_owned();
        // A combinator rather than an `async` block, which would hold a second copy of the
        // connection's future (~1.7 KiB) in the task of every connection.
        tokio::spawn(graceful.watch(connection).map(move |ended| {
            if let Err(e) = ended {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(permit);
        }));
    }
    drop(listener);
    if tokio::time::timeout(DRAIN, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("connections still open {DRAIN:?} after shutdown began; closing them");
    }
    Ok(())
}

/// Bytes of request bodies buffered at once, shared by all requests.
#[derive(Clone)]
pub(crate) struct BodyBudget {
    limits: Arc<Limits>,
    max_body_bytes: usize,
    in_flight: Arc<AtomicUsize>,
    max_in_flight: usize,
}

impl BodyBudget {
    pub(crate) fn new(limits: Limits, max_body_bytes: usize) -> Self {
        Self {
            limits: Arc::new(limits),
            max_body_bytes,
            in_flight: Arc::default(),
            // Room for a few dozen full-size uploads at once.
            max_in_flight: max_body_bytes.saturating_mul(32),
        }
    }
}

/// Reserved bytes of the budget, given back when dropped.
struct Reserved<'a> {
    budget: &'a BodyBudget,
    bytes: usize,
}

impl Reserved<'_> {
    fn add(&mut self, n: usize) -> Result<(), ApiError> {
        let before = self.budget.in_flight.fetch_add(n, Ordering::Relaxed);
        self.bytes += n;
        if before + n > self.budget.max_in_flight {
            return Err(ApiError::Overloaded);
        }
        Ok(())
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        self.budget
            .in_flight
            .fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Middleware: reads a request's whole body (up to the body limit, within `body_timeout`, at
/// least `body_min_rate` bytes a second over each window) before the request goes on, so a
/// request that trickles its body never holds a concurrency slot and is cut within a window or
/// two. 413 past the size limit, 408 when too slow.
pub(crate) async fn read_body(
    State(budget): State<BodyBudget>,
    req: Request,
    next: Next,
) -> Response {
    match buffer(&budget, req).await {
        Ok(req) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

async fn buffer(budget: &BodyBudget, req: Request) -> Result<Request, ApiError> {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let has_body =
        declared.is_some_and(|n| n > 0) || req.headers().contains_key(header::TRANSFER_ENCODING);
    if !has_body {
        return Ok(req);
    }
    if declared.is_some_and(|n| n > budget.max_body_bytes) {
        return Err(too_large(budget.max_body_bytes));
    }
    let (parts, mut body) = req.into_parts();
    let mut reserved = Reserved { budget, bytes: 0 };
    let mut buf = Vec::with_capacity(declared.unwrap_or(0).min(budget.max_body_bytes));
    let deadline = tokio::time::Instant::now() + budget.limits.body_timeout;
    let min_per_window = (budget.limits.body_min_rate as f64 * RATE_WINDOW.as_secs_f64()) as usize;
    let mut window_end = tokio::time::Instant::now() + RATE_WINDOW;
    let mut window_bytes = 0usize;
    loop {
        let until = window_end.min(deadline);
        match tokio::time::timeout_at(until, body.frame()).await {
            Ok(Some(Ok(frame))) => {
                if let Ok(data) = frame.into_data() {
                    if buf.len() + data.len() > budget.max_body_bytes {
                        return Err(too_large(budget.max_body_bytes));
                    }
                    reserved.add(data.len())?;
                    window_bytes += data.len();
                    buf.extend_from_slice(&data);
                }
            }
            Ok(Some(Err(e))) => {
                return Err(ApiError::InvalidArgument(format!(
                    "the request body could not be read: {e}"
                )));
            }
            Ok(None) => break,
            Err(_) => {
                let now = tokio::time::Instant::now();
                if now >= deadline {
                    return Err(ApiError::Timeout(format!(
                        "the request body did not arrive within {} s",
                        budget.limits.body_timeout.as_secs()
                    )));
                }
            }
        }
        let now = tokio::time::Instant::now();
        if now >= window_end {
            if window_bytes < min_per_window {
                return Err(ApiError::Timeout(format!(
                    "the request body arrived slower than {} bytes per second",
                    budget.limits.body_min_rate
                )));
            }
            window_bytes = 0;
            window_end = now + RATE_WINDOW;
        }
    }
    Ok(Request::from_parts(parts, Body::from(Bytes::from(buf))))
}

fn too_large(limit: usize) -> ApiError {
    ApiError::PayloadTooLarge(format!("the request body is larger than {limit} bytes"))
}
