//! The ecoscan edge gateway: REST and Server-Sent Events for browsers and apps, over gRPC calls
//! to ingest, rule, reward, analytics and notification. It speaks gRPC to the services and nothing
//! else (no Redis, SQL or object store here).
//!
//! Routes:
//!
//! | route | backend call |
//! |---|---|
//! | `POST /api/v1/scan` (multipart `image` or JSON) | `ScanService.Submit` → 202 |
//! | `POST /api/v1/scan/completion` | `ScanService.Scan` → SSE |
//! | `GET /api/v1/scan/{id}` | `ScanService.GetResult` |
//! | `GET /api/v1/scan/{id}/events` (`Last-Event-ID`) | `ScanService.Watch` → SSE |
//! | `GET /api/v1/scan/categories` (public, `ETag`) | `RuleService.ListCategories` |
//! | `GET /api/v1/characters` | `RewardService.ListCatalogue` |
//! | `GET /api/v1/characters/me` | `RewardService.ListOwned` |
//! | `GET /api/v1/characters/{name}` | `RewardService.GetCharacter` |
//! | `GET /api/v1/notifications?limit=` | `NotificationService.List` |
//! | `GET /api/v1/notifications/stream` | `NotificationService.Subscribe` → SSE |
//! | `POST /api/v1/notifications` | `NotificationService.Schedule` → 201 |
//! | `GET /api/v1/analytics/usage?since=&until=` | `AnalyticsService.Usage` |
//! | `POST /api/v1/uploads` | `ScanService.CreateUpload` → 201 (where to `PUT` the photo) |
//! | `PUT /api/v1/uploads/{id}?token=` (embedded store) | `ScanService.PutUpload` → 204 |
//! | `POST /api/v1/sse-tickets` | none (a ticket for one event stream and its reconnects) |
//! | `GET /healthz` | none |
//! | `GET /api/v1/openapi.json` | none (the OpenAPI 3.1 document of all of these) |
//! | `GET /` | the demo page |
//!
//! [`ROUTES`] lists them; the router mounts exactly those, and the OpenAPI document
//! (`openapi/`) describes exactly those. `GET /metrics`, `/readyz` and `/healthz` are on the
//! admin listener (`admin.rs`, `GATEWAY_ADMIN_ADDR`), apart from the API.
//!
//! Modules import one way, each only from the layers below its own (a folder's children may also
//! use their folder, and any module the crate root's `AppState`, `Backend` and deadlines); the
//! crate root assembles both routers from all of them:
//!
//! 1. `config`, `error`, `event`, `headers`, `results`, `admin`: import no other module;
//! 2. `schema` (the OpenAPI pieces handlers name), `limits`, `input`, `proxy`;
//! 3. `auth`;
//! 4. `body`, `server`, `watch`;
//! 5. `sse`, `metrics`;
//! 6. `routes`, the handlers of both listeners;
//! 7. `openapi`, which names the handlers and which only the crate root names.
//!
//! Two modules that need the same thing share a module below both (`event` for `watch` and
//! `sse`, `schema` for the handlers and the document) rather than importing each other.

mod admin;
mod auth;
mod body;
mod config;
mod error;
mod event;
mod headers;
mod input;
mod limits;
mod metrics;
mod openapi;
mod proxy;
mod results;
mod routes;
mod schema;
mod server;
mod sse;
mod watch;

use std::{sync::Arc, time::Duration};

use anyhow::Context as _;
use axum::{
    BoxError, Router,
    error_handling::HandleErrorLayer,
    extract::{DefaultBodyLimit, MatchedPath, Request},
    http::Response,
    routing::{MethodRouter, get, post, put},
};
use ecoscan_common::{
    CancellationToken,
    client::{TracedChannel, channel},
};
use ecoscan_proto::v1::{
    analytics_service_client::AnalyticsServiceClient,
    notification_service_client::NotificationServiceClient,
    reward_service_client::RewardServiceClient, rule_service_client::RuleServiceClient,
    scan_service_client::ScanServiceClient,
};
use tokio::net::TcpListener;
use tower::{ServiceBuilder, limit::GlobalConcurrencyLimitLayer};
use tower_http::trace::TraceLayer;
use tracing::{Span, field::Empty};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::limits::{IpLimits, RateLimits, SseSlots};

pub use admin::DEFAULT_ADMIN_ADDR;
pub use auth::{Peer, mint as mint_token};
pub use config::{
    AuthConfig, Config, DEFAULT_ADDR, ForwardedHeader, Limits, ProxyConfig, ProxyProtocol,
    TrustHeader,
};
pub use error::ApiError;

/// Deadline of ordinary unary calls.
const UNARY_DEADLINE: Duration = Duration::from_secs(5);
/// `Submit` carries the image (up to the image limit), so it gets longer.
const SUBMIT_DEADLINE: Duration = Duration::from_secs(15);
/// A scan stream lives as long as the job; this bounds a stuck one.
const SCAN_STREAM_DEADLINE: Duration = Duration::from_secs(10 * 60);
/// A notification stream is long-lived; clients reconnect when it ends.
const NOTIFICATION_STREAM_DEADLINE: Duration = Duration::from_secs(60 * 60);
/// A backend the gateway calls, for the background health checks (`admin.rs`).
#[derive(Clone)]
struct Backend {
    name: &'static str,
    /// Fully-qualified gRPC service name reported by the backend's health service.
    service: &'static str,
    channel: TracedChannel,
}

/// What every handler and middleware shares. axum clones the state for each extractor of
/// each request, so it is one `Arc`: cloning the four gRPC clients and the caches field by
/// field was a tenth of the gateway's CPU serving finished results (`perf` under `wrk`).
#[derive(Clone)]
pub(crate) struct AppState(Arc<Shared>);

impl std::ops::Deref for AppState {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// The gateway's shared parts, behind [`AppState`]: configuration and one client per backend
/// (each a shared, multiplexed HTTP/2 channel, so connections stay constant however many
/// callers there are).
pub(crate) struct Shared {
    config: Arc<Config>,
    scan: ScanServiceClient<TracedChannel>,
    rule: RuleServiceClient<TracedChannel>,
    reward: RewardServiceClient<TracedChannel>,
    analytics: AnalyticsServiceClient<TracedChannel>,
    notification: NotificationServiceClient<TracedChannel>,
    backends: Arc<[Backend]>,
    /// Who is calling.
    auth: auth::SharedAuth,
    /// Per-user token buckets.
    rate: Arc<RateLimits>,
    /// Open SSE streams within their caps.
    sse: SseSlots,
    /// One upstream `Watch` per job, shared by its SSE clients.
    watches: watch::Watches,
    /// Succeeded results, served without asking ingest again.
    results: results::ResultCache,
    /// Cancelled at shutdown so long-lived SSE streams end and graceful shutdown can finish.
    shutdown: CancellationToken,
}

impl AppState {
    fn new(config: Config, shutdown: CancellationToken) -> anyhow::Result<Self> {
        config.validate()?;
        let auth = Arc::new(auth::Authenticator::new(config.auth.clone())?);
        let ch = |url: &str, name: &str| {
            channel(url).with_context(|| format!("invalid {name} url {url:?}"))
        };
        let ingest = ch(&config.ingest_url, "ingest")?;
        let rule = ch(&config.rule_url, "rule")?;
        let reward = ch(&config.reward_url, "reward")?;
        let analytics = ch(&config.analytics_url, "analytics")?;
        let notification = ch(&config.notification_url, "notification")?;
        let backends: Arc<[Backend]> = Arc::new([
            Backend {
                name: "ingest",
                service: "ecoscan.v1.ScanService",
                channel: ingest.clone(),
            },
            Backend {
                name: "rule",
                service: "ecoscan.v1.RuleService",
                channel: rule.clone(),
            },
            Backend {
                name: "reward",
                service: "ecoscan.v1.RewardService",
                channel: reward.clone(),
            },
            Backend {
                name: "analytics",
                service: "ecoscan.v1.AnalyticsService",
                channel: analytics.clone(),
            },
            Backend {
                name: "notification",
                service: "ecoscan.v1.NotificationService",
                channel: notification.clone(),
            },
        ]);
        let scan = ScanServiceClient::new(ingest)
            .max_encoding_message_size(ecoscan_common::server::MAX_MESSAGE_BYTES);
        Ok(Self(Arc::new(Shared {
            watches: watch::Watches::new(
                scan.clone(),
                SCAN_STREAM_DEADLINE,
                sse::FIRST_MESSAGE_WAIT,
            ),
            scan,
            rule: RuleServiceClient::new(rule),
            reward: RewardServiceClient::new(reward),
            analytics: AnalyticsServiceClient::new(analytics),
            notification: NotificationServiceClient::new(notification),
            backends,
            auth,
            rate: RateLimits::new(&config.limits),
            sse: SseSlots::new(config.limits.max_sse, config.limits.max_sse_per_user),
            results: results::ResultCache::new(config.result_cache_bytes, config.result_cache_ttl),
            shutdown,
            config: Arc::new(config),
        })))
    }

    /// Public URL of a job's result.
    fn result_url(&self, job_id: &str) -> String {
        self.config.public_url(&format!("/api/v1/scan/{job_id}"))
    }

    /// Public URL of a job's event stream.
    fn events_url(&self, job_id: &str) -> String {
        self.config
            .public_url(&format!("/api/v1/scan/{job_id}/events"))
    }

    /// The lifetime and keepalive of every SSE response.
    fn stream_times(&self) -> sse::StreamTimes {
        sse::StreamTimes {
            lifetime: self.config.sse_max_lifetime,
            keepalive: self.config.sse_keepalive,
        }
    }

    /// [`Self::result_url`] as a shareable function, for SSE streams.
    fn result_url_fn(&self) -> Arc<dyn Fn(&str) -> String + Send + Sync> {
        let config = self.config.clone();
        Arc::new(move |job_id| config.public_url(&format!("/api/v1/scan/{job_id}")))
    }
}

/// Every route the gateway serves, as `(method, path template)`. The router mounts exactly these
/// (each through `mount`, which refuses any other), and the OpenAPI document served at
/// `/api/v1/openapi.json` must describe exactly these (tests hold both to this list). A new
/// route goes here, into the router through `mount`, and into the document: `#[utoipa::path]`
/// on its handler and the handler in `openapi::ApiDoc`.
pub const ROUTES: &[(&str, &str)] = &[
    ("GET", "/"),
    ("POST", "/api/v1/scan"),
    ("POST", "/api/v1/scan/completion"),
    ("GET", "/api/v1/scan/{id}"),
    ("GET", "/api/v1/scan/{id}/events"),
    ("GET", "/api/v1/scan/categories"),
    ("GET", "/api/v1/characters"),
    ("GET", "/api/v1/characters/me"),
    ("GET", "/api/v1/characters/{name}"),
    ("GET", "/api/v1/notifications"),
    ("POST", "/api/v1/notifications"),
    ("GET", "/api/v1/notifications/stream"),
    ("GET", "/api/v1/analytics/usage"),
    ("POST", "/api/v1/uploads"),
    ("PUT", "/api/v1/uploads/{id}"),
    ("POST", "/api/v1/sse-tickets"),
    ("GET", "/healthz"),
    ("GET", "/api/v1/openapi.json"),
];

/// Mounts `handler` (which must answer `method` only) at `path`, a route of [`ROUTES`].
fn mount<S: Clone + Send + Sync + 'static>(
    router: Router<S>,
    method: &str,
    path: &str,
    handler: MethodRouter<S>,
) -> Router<S> {
    assert!(
        ROUTES.contains(&(method, path)),
        "{method} {path} is not in ROUTES: add it there and to the OpenAPI document"
    );
    router.route(path, handler)
}

/// The gateway's routes and middleware, for [`serve`] and for router-level tests. Clients
/// connect lazily, so no backend needs to be up to build it. Requests that reach it without
/// [`serve`] carry no [`Peer`]: header mode `loopback` believes none of them.
pub fn router(config: Config) -> anyhow::Result<Router> {
    routers(config).map(|(api, _)| api)
}

/// [`router`] and the admin listener's router beside it (`/metrics`, `/readyz`, `/healthz`).
pub fn routers(config: Config) -> anyhow::Result<(Router, Router)> {
    let (api, admin) = router_with(config, CancellationToken::new())?;
    Ok((api, admin_router(&admin)))
}

/// The admin listener's routes: `GET /metrics`, `/readyz` and `/healthz`.
fn admin_router(admin: &admin::Admin) -> Router {
    Router::new()
        .route("/healthz", get(routes::health::healthz))
        .route(
            "/readyz",
            get(routes::health::readyz).with_state(admin.clone()),
        )
        .route(
            "/metrics",
            get(metrics::serve_metrics).with_state(admin.registry.clone()),
        )
}

/// The API router, and what the admin listener serves about it.
fn router_with(
    config: Config,
    shutdown: CancellationToken,
) -> anyhow::Result<(Router, admin::Admin)> {
    let state = AppState::new(config, shutdown.clone())?;
    let config = state.config.clone();
    let mut registry = ecoscan_common::metrics::Metrics::new("gateway");
    let http_metrics =
        metrics::HttpMetrics::register(&mut registry, state.sse.clone(), state.watches.clone());
    let health = admin::BackendHealth::register(&mut registry, state.backends.clone());
    let admin = admin::Admin {
        registry: Arc::new(registry),
        health,
        shutdown,
    };

    let api = [
        ("GET", "/", get(routes::index)),
        ("POST", "/api/v1/scan", post(routes::scan::submit)),
        (
            "POST",
            "/api/v1/scan/completion",
            post(routes::scan::completion),
        ),
        ("GET", "/api/v1/scan/{id}", get(routes::scan::result)),
        ("GET", "/api/v1/scan/{id}/events", get(routes::scan::events)),
        (
            "GET",
            "/api/v1/scan/categories",
            get(routes::catalogue::categories),
        ),
        (
            "GET",
            "/api/v1/characters",
            get(routes::catalogue::characters),
        ),
        (
            "GET",
            "/api/v1/characters/me",
            get(routes::account::characters),
        ),
        (
            "GET",
            "/api/v1/characters/{name}",
            get(routes::catalogue::character),
        ),
        (
            "GET",
            "/api/v1/notifications",
            get(routes::account::notifications),
        ),
        (
            "POST",
            "/api/v1/notifications",
            post(routes::account::schedule),
        ),
        (
            "GET",
            "/api/v1/notifications/stream",
            get(routes::account::notification_stream),
        ),
        (
            "GET",
            "/api/v1/analytics/usage",
            get(routes::account::usage),
        ),
        ("POST", "/api/v1/uploads", post(routes::uploads::create)),
        ("PUT", "/api/v1/uploads/{id}", put(routes::uploads::put)),
        (
            "POST",
            "/api/v1/sse-tickets",
            post(auth::tickets::sse_ticket),
        ),
    ]
    .into_iter()
    .fold(Router::new(), |r, (method, path, handler)| {
        mount(r, method, path, handler)
    })
    .fallback(routes::not_found)
    .layer(
        ServiceBuilder::new()
            // axum needs infallible services: this turns a shed request into a JSON 503.
            .layer(HandleErrorLayer::new(middleware_error))
            // Refuse at once when at the limit instead of queueing: a queue only adds
            // latency to every request while the gateway is saturated.
            .load_shed()
            // Bound the requests in flight across all routes (one semaphore shared by every
            // route). An SSE stream holds a slot only until its headers are sent.
            .layer(GlobalConcurrencyLimitLayer::new(config.concurrency_limit))
            // Bound what a body extractor may buffer; beyond it the request gets a 413.
            .layer(DefaultBodyLimit::max(config.max_body_bytes)),
    )
    // Outside the concurrency limit: a body is read (at a minimum rate, within a deadline)
    // before its request takes a slot, so slow senders cannot hold the slots; and after
    // `authenticate`, so only a known caller's body is read, from that caller's share.
    .layer(axum::middleware::from_fn_with_state(
        body::BodyBudget::new(config.limits.clone(), config.max_body_bytes),
        body::read_body,
    ));

    let gate = auth::Gate {
        auth: state.auth.clone(),
        per_ip: IpLimits::new(config.limits.unauthenticated_per_minute),
    };
    let openapi = openapi::render(state.auth.header_mode());
    let app = [
        // Liveness stays outside the concurrency limit: a saturated gateway is still alive, and
        // a failing liveness probe would restart it and drop every open stream. (Readiness and
        // metrics are on the admin listener.)
        ("GET", "/healthz", get(routes::health::healthz)),
        // And the API's description, which costs nothing to serve.
        (
            "GET",
            "/api/v1/openapi.json",
            get(openapi::serve).with_state(openapi),
        ),
    ]
    .into_iter()
    .fold(Router::new(), |r, (method, path, handler)| {
        mount(r, method, path, handler)
    })
    .merge(api)
    .with_state(state)
    // Who calls, from the headers alone, before any body is read.
    .layer(axum::middleware::from_fn_with_state(
        gate,
        auth::authenticate,
    ))
    // RED metrics per route template, inside the span so a slow scrape shows in traces.
    .layer(axum::middleware::from_fn_with_state(
        http_metrics,
        metrics::track,
    ))
    // Browsers on the configured origins may call the API (preflights answered here, before
    // authentication); with no origins configured no CORS header is ever sent.
    .layer(tower::util::option_layer(headers::cors(
        &config.cors_origins,
    )?))
    // Outermost but for the span: every answer, refusals and preflights included.
    .layer(axum::middleware::from_fn(headers::security_headers))
    .layer(
        ServiceBuilder::new()
            // One span per request, child of the caller's `traceparent`; it is current while
            // handlers call the backends, so the trace continues over gRPC.
            .layer(
                TraceLayer::new_for_http()
                    .make_span_with(request_span)
                    .on_response(on_response)
                    // A span event per SSE message the response streams.
                    .on_body_chunk(ecoscan_common::telemetry::SseMessageEvents::default())
                    .on_failure(()),
            ),
    );
    Ok((app, admin))
}

/// Serves the gateway on `listener` until `shutdown` is cancelled, then ends open SSE streams
/// and drains in-flight requests. No admin listener: [`serve_with_admin`] adds one.
pub async fn serve(
    config: Config,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    serve_with_admin(config, listener, None, shutdown).await
}

/// [`serve`], with `GET /metrics`, `/readyz` and `/healthz` on `admin` (the admin listener,
/// `GATEWAY_ADMIN_ADDR`) when given: off the API port, so the series and the probes are not
/// public. The backends' health is checked in the background either way.
pub async fn serve_with_admin(
    config: Config,
    listener: TcpListener,
    admin: Option<TcpListener>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let addr = listener.local_addr().context("listener has no address")?;
    let limits = config.limits.clone();
    let proxies = config.proxies.clone();
    let header_mode = config.auth.trust_header;
    let (app, admin_state) = router_with(config, shutdown.clone())?;
    tracing::info!(
        %addr,
        header_mode = ?header_mode,
        trusted_proxies = proxies.trusted.len(),
        proxy_protocol = ?proxies.protocol,
        "gateway listening"
    );
    // Both end with the API server, whatever ends it.
    let stop = shutdown.child_token();
    let monitor = tokio::spawn(admin_state.health.clone().monitor(stop.clone()));
    let admin_task =
        admin.map(|l| tokio::spawn(admin::serve(admin_router(&admin_state), l, stop.clone())));
    let served = server::serve(app, listener, &limits, proxies, shutdown)
        .await
        .context("gateway server failed");
    stop.cancel();
    let _ = monitor.await;
    if let Some(task) = admin_task {
        task.await.context("the admin listener panicked")??;
    }
    served?;
    tracing::info!("gateway stopped");
    Ok(())
}

async fn middleware_error(err: BoxError) -> ApiError {
    if err.is::<tower::load_shed::error::Overloaded>() {
        ApiError::Overloaded
    } else {
        ApiError::Internal(format!("middleware failed: {err}"))
    }
}

fn request_span(req: &Request) -> Span {
    let path = req.uri().path();
    // Probes and scrapes are frequent and say nothing about user traffic.
    if path == "/healthz" {
        return Span::none();
    }
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", MatchedPath::as_str);
    let span = tracing::info_span!(
        "http",
        otel.name = %format!("{} {route}", req.method()),
        otel.kind = "server",
        otel.status_code = Empty,
        otel.status_description = Empty,
        error.type = Empty,
        http.request.method = %req.method(),
        http.route = route,
        url.path = path,
        http.response.status_code = Empty,
        user.id = Empty,
        client.address = Empty,
    );
    if let Some(client) = req.extensions().get::<proxy::ClientAddr>() {
        span.record("client.address", tracing::field::display(client.ip));
    }
    let _ = span.set_parent(ecoscan_common::telemetry::context_from_headers(
        req.headers(),
    ));
    span
}

fn on_response<B>(res: &Response<B>, latency: Duration, span: &Span) {
    let status = res.status().as_u16();
    span.record("http.response.status_code", i64::from(status));
    if res.status().is_server_error() {
        // By the HTTP conventions: `error.type` is the status code, and only a server error
        // fails a server span.
        let reason = res
            .extensions()
            .get::<error::FailureReason>()
            .map(|r| r.0.clone())
            .or_else(|| res.status().canonical_reason().map(str::to_owned))
            .unwrap_or_default();
        ecoscan_common::telemetry::record_error(span, &status.to_string(), &reason);
    }
    tracing::debug!(
        status,
        latency_ms = latency.as_millis() as u64,
        "request finished"
    );
}
