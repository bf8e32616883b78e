//! The gateway's Prometheus series: RED metrics per route and open SSE streams, served on
//! `GET /metrics` of the admin listener (`admin.rs`).

use std::{sync::Arc, time::Instant};

use axum::{
    extract::{MatchedPath, Request, State},
    http::header,
    middleware::Next,
    response::{IntoResponse, Response},
};
use ecoscan_common::metrics::{Labels1, Labels2, Labels3, Metrics, SecondsFamily, seconds_family};
use prometheus_client::metrics::{counter::Counter, family::Family};

use crate::{error::IdentityRefusedBy, limits::SseSlots};

/// The backends the gateway signs identity assertions for: each one's refusal series exists
/// from the start at 0, so that an alert's `increase()` sees the first refusal.
const IDENTITY_BACKENDS: [&str; 4] = ["ingest", "reward", "analytics", "notification"];

/// Per-route request series. Cheap to clone; clones share the series.
#[derive(Clone, Debug)]
pub(crate) struct HttpMetrics {
    requests: Family<Labels3, Counter>,
    duration: SecondsFamily<Labels2>,
    identity_refused: Family<Labels1, Counter>,
}

impl HttpMetrics {
    /// Registers the gateway's series in `metrics`; `sse` feeds `gateway_sse_connections`.
    pub(crate) fn register(
        metrics: &mut Metrics,
        sse: SseSlots,
        watches: crate::watch::Watches,
    ) -> Self {
        let this = Self {
            requests: Family::default(),
            duration: seconds_family(),
            identity_refused: Family::default(),
        };
        for backend in IDENTITY_BACKENDS {
            drop(
                this.identity_refused
                    .get_or_create(&[("backend", backend.to_owned())]),
            );
        }
        let r = metrics.registry();
        ecoscan_common::register_series! {
            r;
            ("http_server_requests", "HTTP requests answered, by route template, method and status", this.requests.clone());
            ("http_server_duration_seconds", "Time from request to response headers (SSE routes: until the stream starts)", this.duration.clone());
            ("gateway_identity_refused", "Requests a backend refused because it did not accept the identity assertion the gateway signed (ECOSCAN_IDENTITY_KEY or clocks differ), by backend", this.identity_refused.clone());
        }
        metrics.gauge_fn(
            "gateway_sse_connections",
            "SSE streams open now (scan completion, scan events, notifications)",
            move || i64::try_from(sse.open()).unwrap_or(i64::MAX),
        );
        metrics.gauge_fn(
            "gateway_watch_feeds",
            "Upstream Watch streams to ingest, one per job with SSE clients, shared by them",
            move || i64::try_from(watches.feeds()).unwrap_or(i64::MAX),
        );
        this
    }
}

/// Middleware recording every request under its route template (`unmatched` for none, so a
/// client cannot create series by sending made-up paths).
pub(crate) async fn track(
    State(metrics): State<HttpMetrics>,
    req: Request,
    next: Next,
) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_owned(), |p| p.as_str().to_owned());
    let method = match req.method().as_str() {
        m @ ("GET" | "HEAD" | "POST" | "PUT" | "PATCH" | "DELETE" | "OPTIONS") => m.to_owned(),
        _ => "other".to_owned(),
    };
    let started = Instant::now();
    let res = next.run(req).await;
    ecoscan_common::metrics::observe_traced(
        &metrics
            .duration
            .get_or_create(&[("route", route.clone()), ("method", method.clone())]),
        started.elapsed().as_secs_f64(),
    );
    metrics
        .requests
        .get_or_create(&[
            ("route", route),
            ("method", method),
            ("status", res.status().as_u16().to_string()),
        ])
        .inc();
    if let Some(IdentityRefusedBy(backend)) = res.extensions().get::<IdentityRefusedBy>() {
        metrics
            .identity_refused
            .get_or_create(&[("backend", (*backend).to_owned())])
            .inc();
    }
    res
}

/// `GET /metrics`: OpenMetrics (with exemplars) to a scraper that asks for it.
pub(crate) async fn serve_metrics(
    State(metrics): State<Arc<Metrics>>,
    headers: http::HeaderMap,
) -> impl IntoResponse {
    let (content_type, body) = metrics.scrape(headers.get(header::ACCEPT)).await;
    ([(header::CONTENT_TYPE, content_type)], body)
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use ecoscan_common::testing::sample;
    use tower::ServiceExt;

    async fn get(app: &axum::Router, path: &str) -> (http::Response<()>, String) {
        let req = http::Request::get(path).body(Body::empty()).unwrap();
        let res = app.clone().oneshot(req).await.unwrap();
        let (parts, body) = res.into_parts();
        let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
        (
            http::Response::from_parts(parts, ()),
            String::from_utf8(bytes.to_vec()).unwrap(),
        )
    }

    #[tokio::test]
    async fn metrics_count_requests_by_route_template_and_status() {
        let (app, admin) = crate::routers(crate::Config::local_for_tests()).unwrap();

        get(&app, "/healthz").await;
        get(&app, "/api/v1/made-up/path").await;
        // Not on the API port.
        let (res, _) = get(&app, "/metrics").await;
        assert_eq!(res.status(), 404);
        let (res, text) = get(&admin, "/metrics").await;

        assert_eq!(res.status(), 200);
        assert!(
            res.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/plain")
        );
        let requests = |route, status| {
            sample(
                &text,
                "http_server_requests_total",
                &[
                    ("service", "gateway"),
                    ("route", route),
                    ("method", "GET"),
                    ("status", status),
                ],
            )
        };
        assert_eq!(requests("/healthz", "200"), Some(1.0), "{text}");
        // Unknown paths share one series instead of one each.
        assert_eq!(requests("unmatched", "404"), Some(2.0), "{text}");
        assert_eq!(
            sample(
                &text,
                "http_server_duration_seconds_count",
                &[("route", "/healthz")]
            ),
            Some(1.0),
            "{text}"
        );
        assert_eq!(
            sample(&text, "gateway_sse_connections", &[]),
            Some(0.0),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_backend_refusing_the_gateway_s_identity_is_counted_by_backend() {
        let mut metrics = ecoscan_common::metrics::Metrics::new("gateway");
        // Never called: the route below answers by itself.
        let scan = ecoscan_proto::v1::scan_service_client::ScanServiceClient::new(
            ecoscan_common::client::channel("http://127.0.0.1:9").unwrap(),
        );
        let watches = crate::watch::Watches::new(
            scan,
            std::time::Duration::from_secs(1),
            std::time::Duration::from_secs(1),
        );
        let http =
            super::HttpMetrics::register(&mut metrics, crate::limits::SseSlots::new(1, 1), watches);
        let app = axum::Router::new()
            .route(
                "/refused",
                axum::routing::get(|| async {
                    crate::error::ApiError::upstream(
                        "reward",
                        tonic::Status::unauthenticated("the identity assertion is refused"),
                    )
                }),
            )
            .route("/fine", axum::routing::get(|| async { "ok" }))
            .layer(axum::middleware::from_fn_with_state(http, super::track));

        let (res, _) = get(&app, "/refused").await;
        assert_eq!(res.status(), 500);
        get(&app, "/refused").await;
        get(&app, "/fine").await;
        let text = metrics.render().await;
        let refused = |backend| {
            sample(
                &text,
                "gateway_identity_refused_total",
                &[("backend", backend)],
            )
        };
        assert_eq!(refused("reward"), Some(2.0), "{text}");
        // Every backend's series is there from the start, at 0 (an alert's increase() needs it).
        assert_eq!(refused("ingest"), Some(0.0), "{text}");
        assert_eq!(refused("notification"), Some(0.0), "{text}");
    }
}
