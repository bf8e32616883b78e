//! The headers every answer leaves with, set in this one place.
//!
//! - `X-Content-Type-Options: nosniff`: a browser never reads a JSON or SSE body as a script or
//!   a page.
//! - `Content-Security-Policy: frame-ancestors 'none'` (and `X-Frame-Options: DENY` for older
//!   browsers): no other site frames the page to click through it.
//! - `Referrer-Policy: no-referrer`: links the page follows (a Jaeger trace) learn nothing of it.
//! - `Cache-Control: no-store`, unless the route chose its own: answers are per user and carry
//!   tokens and tickets, so no shared cache keeps them. A route that wants an answer cached
//!   (a finished result with an `ETag`, say) sets `Cache-Control` itself and it is kept.
//!
//! And the CORS headers, for the configured origins only ([`cors`]).

use anyhow::Context as _;
use axum::{
    extract::Request,
    http::{HeaderName, HeaderValue, header},
    middleware::Next,
    response::Response,
};

const ALWAYS: [(HeaderName, &str); 4] = [
    (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
    (header::CONTENT_SECURITY_POLICY, "frame-ancestors 'none'"),
    (header::X_FRAME_OPTIONS, "DENY"),
    (header::REFERRER_POLICY, "no-referrer"),
];

/// Middleware: adds the headers above to every answer.
pub(crate) async fn security_headers(req: Request, next: Next) -> Response {
    let mut res = next.run(req).await;
    let headers = res.headers_mut();
    for (name, value) in ALWAYS {
        headers
            .entry(name)
            .or_insert(HeaderValue::from_static(value));
    }
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    res
}

/// CORS for the origins in `GATEWAY_CORS_ORIGINS`, or none.
pub(crate) fn cors(origins: &[String]) -> anyhow::Result<Option<tower_http::cors::CorsLayer>> {
    use axum::http::Method;
    if origins.is_empty() {
        return Ok(None);
    }
    let origins = origins
        .iter()
        .map(|o| HeaderValue::from_str(o).with_context(|| format!("bad CORS origin {o:?}")))
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(Some(
        tower_http::cors::CorsLayer::new()
            .allow_origin(origins)
            // PUT: a browser sends a photo to the gateway's upload URL (embedded store).
            .allow_methods([Method::GET, Method::POST, Method::PUT])
            .allow_headers([
                header::AUTHORIZATION,
                header::CONTENT_TYPE,
                HeaderName::from_static("last-event-id"),
                HeaderName::from_static("idempotency-key"),
                HeaderName::from_static("traceparent"),
            ])
            .expose_headers([header::LOCATION, header::RETRY_AFTER])
            // The SSE routes may carry the token in a cookie (`withCredentials`); origins are an
            // explicit list, never `*`, so this is allowed.
            .allow_credentials(true)
            .max_age(std::time::Duration::from_secs(600)),
    ))
}
