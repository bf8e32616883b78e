//! Request bodies: read in full before a request takes a concurrency slot, at a minimum rate,
//! within a deadline and a size limit, from a budget shared by all requests of which one caller
//! may hold only a share. Bodies are read only after `auth::authenticate` has found the caller,
//! so an upload that proves nobody is never read.

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{
    body::{Body, Bytes},
    extract::{Request, State},
    http::header,
    middleware::Next,
    response::{IntoResponse, Response},
};
use http_body_util::BodyExt as _;

use crate::{auth::Caller, config::Limits, error::ApiError};

/// Windows over which a body's minimum rate is checked.
const RATE_WINDOW: Duration = Duration::from_secs(5);

/// Bytes of request bodies buffered at once, shared by all requests.
#[derive(Clone)]
pub(crate) struct BodyBudget {
    limits: Arc<Limits>,
    max_body_bytes: usize,
    in_flight: Arc<AtomicUsize>,
    max_in_flight: usize,
    /// Bytes in flight per caller, within `max_per_caller`.
    per_caller: Arc<Mutex<HashMap<String, usize>>>,
    max_per_caller: usize,
}

impl BodyBudget {
    pub(crate) fn new(limits: Limits, max_body_bytes: usize) -> Self {
        Self {
            max_body_bytes,
            in_flight: Arc::default(),
            // Room for a few dozen full-size uploads at once.
            max_in_flight: max_body_bytes.saturating_mul(32),
            per_caller: Arc::default(),
            max_per_caller: max_body_bytes.saturating_mul(limits.bodies_per_caller),
            limits: Arc::new(limits),
        }
    }
}

/// Reserved bytes of the budget, given back when dropped.
struct Reserved<'a> {
    budget: &'a BodyBudget,
    /// The caller whose share it comes from (every body that is read has one).
    caller: String,
    bytes: usize,
}

impl Reserved<'_> {
    fn add(&mut self, n: usize) -> Result<(), ApiError> {
        {
            let mut per_caller = self
                .budget
                .per_caller
                .lock()
                .expect("body budget lock poisoned");
            let mine = per_caller.entry(self.caller.clone()).or_insert(0);
            if *mine + n > self.budget.max_per_caller {
                return Err(ApiError::TooMany {
                    message: format!(
                        "this user is sending {} bodies at once already; wait for one to finish",
                        self.budget.limits.bodies_per_caller
                    ),
                    retry_after_secs: 1,
                });
            }
            *mine += n;
        }
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
        let mut per_caller = self
            .budget
            .per_caller
            .lock()
            .expect("body budget lock poisoned");
        if let Some(mine) = per_caller.get_mut(&self.caller) {
            *mine -= self.bytes;
            if *mine == 0 {
                per_caller.remove(&self.caller);
            }
        }
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
    let Some(caller) = parts.extensions.get::<Caller>().map(|c| c.user.clone()) else {
        // Every route that takes a body needs a caller (`authenticate` refused the request
        // otherwise): a body sent to a public or unknown route proves nobody and is not read,
        // so it costs the shared budget nothing.
        return Err(ApiError::PayloadTooLarge(
            "this route takes no request body; bodies are read only on authenticated routes".into(),
        ));
    };
    let mut reserved = Reserved {
        budget,
        caller,
        bytes: 0,
    };
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
