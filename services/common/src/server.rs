//! The gRPC serving helper every service uses: health (`grpc.health.v1`), server reflection (v1
//! and v1alpha), a span per RPC whose parent comes from the caller's `traceparent`, graceful
//! shutdown, and TLS or mutual TLS when the process has it configured ([`crate::tls`]).

use std::{net::SocketAddr, sync::Arc, time::Duration};

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::{service::Routes, transport::Server};
use tonic_health::ServingStatus;
use tower_http::trace::TraceLayer;
use tracing::{Span, field::Empty};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::{
    metrics::{Metrics, RpcMetrics, RpcMetricsLayer},
    tls::{
        TlsConfig,
        server::{ClientCertLayer, incoming as tls_incoming},
    },
};

/// Connections the kernel may queue for `accept` (capped by `net.core.somaxconn`). Tokio's
/// default of 1,024 drops handshakes when a burst of clients arrives at once — a thousand
/// browsers reconnecting after a deploy — and the dropped ones see resets.
const LISTEN_BACKLOG: u32 = 8192;

/// Binds `addr` (with `SO_REUSEADDR`, so a restart does not wait for old connections in
/// TIME_WAIT) and listens with a deep accept queue.
pub fn listen(addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Largest message any ecoscan server accepts (images travel in messages).
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// Serves `routes` on `listener` until `shutdown` is cancelled, with health and reflection
/// mounted. `service_names` are the fully-qualified names reported SERVING by the health service
/// (the empty name, meaning the whole server, is always reported). `/metrics` shows the RPC
/// metrics only; services with metrics of their own use [`serve_with_metrics`].
pub async fn serve(
    routes: Routes,
    service_names: &[&str],
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    serve_with_metrics(
        routes,
        service_names,
        Metrics::default(),
        listener,
        shutdown,
    )
    .await
}

/// [`serve`], with `metrics` (the service's registry) served as plain HTTP/1.1 `GET /metrics`
/// on the same port as gRPC, and the RED metrics of every RPC registered into it.
///
/// With the `GRPC_TLS_*` variables set ([`crate::tls`]), the port speaks TLS only (mutual TLS
/// with `GRPC_TLS_CA`); a configuration error is returned before anything is served.
pub async fn serve_with_metrics(
    routes: Routes,
    service_names: &[&str],
    metrics: Metrics,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let tls = TlsConfig::global()?.cloned();
    serve_with_tls(routes, service_names, metrics, listener, tls, shutdown).await
}

/// [`serve_with_metrics`] with an explicit TLS configuration instead of the `GRPC_TLS_*`
/// variables (`None`: plaintext).
pub async fn serve_with_tls(
    routes: Routes,
    service_names: &[&str],
    mut metrics: Metrics,
    listener: TcpListener,
    tls: Option<TlsConfig>,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    refuse_open_plaintext(&listener, tls.is_some())?;
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", ServingStatus::Serving)
        .await;
    for name in service_names {
        reporter
            .set_service_status(*name, ServingStatus::Serving)
            .await;
    }
    let reflection_v1 = reflection(service_names).build_v1()?;
    let reflection_v1alpha = reflection(service_names).build_v1alpha()?;

    // Not ready from the moment the process starts draining (a signal) or shuts down: load
    // balancers and balanced clients stop sending new calls while the listener still serves.
    let draining = crate::shutdown::draining().clone();
    let not_ready = {
        let (shutdown, draining) = (shutdown.clone(), draining.clone());
        move || shutdown.is_cancelled() || draining.is_cancelled()
    };
    let names: Vec<String> = service_names.iter().map(|s| (*s).to_owned()).collect();
    let report_not_serving = {
        let shutdown = shutdown.clone();
        async move {
            tokio::select! {
                () = shutdown.cancelled() => {}
                () = draining.cancelled() => {}
            }
            reporter
                .set_service_status("", ServingStatus::NotServing)
                .await;
            for name in &names {
                reporter
                    .set_service_status(name, ServingStatus::NotServing)
                    .await;
            }
        }
    };
    // Then, once the drain grace is over (the token is cancelled), stop accepting and drain
    // in-flight calls.
    let on_shutdown = {
        let shutdown = shutdown.clone();
        async move {
            tokio::join!(report_not_serving, shutdown.cancelled());
        }
    };

    let rpc_metrics = RpcMetrics::register(metrics.registry(), service_names);
    let metrics = Arc::new(metrics);
    // Same port as gRPC: nothing more to bind, and scraping works with port 0 in tests.
    let routes = Routes::from(
        routes
            .into_axum_router()
            .route(
                "/metrics",
                axum::routing::get(move |headers: http::HeaderMap| {
                    let metrics = metrics.clone();
                    async move {
                        let (content_type, body) =
                            metrics.scrape(headers.get(http::header::ACCEPT)).await;
                        ([(http::header::CONTENT_TYPE, content_type)], body)
                    }
                }),
            )
            // HTTP probes for orchestrators that do not speak gRPC health: alive while the
            // process answers; ready until draining begins (the stores were opened before
            // `serve` was called, so a server that answers has them).
            .route("/healthz", axum::routing::get(|| async { "ok" }))
            .route(
                "/readyz",
                axum::routing::get(move || {
                    let draining = not_ready();
                    async move {
                        if draining {
                            (http::StatusCode::SERVICE_UNAVAILABLE, "shutting down")
                        } else {
                            (http::StatusCode::OK, "ready")
                        }
                    }
                }),
            ),
    );

    let require_client_cert = tls.as_ref().is_some_and(TlsConfig::is_mutual);
    // The layers every call passes, over a connection or from this process ([`crate::local`]).
    let layers = tower::ServiceBuilder::new()
        // One span per RPC, child of the caller's trace context; health checks are not traced.
        .layer(
            TraceLayer::new_for_grpc()
                .make_span_with(rpc_span)
                .on_request(())
                .on_response(on_response)
                .on_eos(on_eos)
                // A span event per message sent: every server stream is marked, message by message.
                .on_body_chunk(crate::telemetry::GrpcMessageEvents::default())
                .on_failure(()),
        )
        // Inside the span layer: RED metrics per RPC, recorded at the end of each stream.
        .layer(RpcMetricsLayer(rpc_metrics))
        // Plain words for the statuses tonic writes itself (a request over the size limit), and
        // the details every error carries (ErrorInfo, RequestInfo with the trace id, RetryInfo)
        // on every refusal the layers below make, identity and deadlines included.
        .layer(crate::plain::PlainStatusLayer)
        // A deadline that runs out is `DEADLINE_EXCEEDED` to the span, the metrics and the
        // caller; a caller that left while its request was read is `CANCELLED`.
        .layer(crate::deadline::CallEndLayer)
        // Innermost: a refused request is still traced and counted.
        .layer(ClientCertLayer {
            required: require_client_cert,
        })
        // The acting user comes from a verified assertion or nowhere (and the span records it).
        .layer(crate::assertion::IdentityLayer);
    let routes = routes
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha);
    let router = Server::builder()
        // `GET /metrics` is plain HTTP/1.1 (Prometheus does not speak HTTP/2 without TLS).
        .accept_http1(true)
        // Detect dead peers on idle connections (watch streams can be quiet for a long time).
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .layer(layers.clone())
        .add_routes(routes.clone());
    let addr = listener.local_addr()?;
    match tls {
        None => {
            // Callers in this process (`ecoscan up`) call the same stack directly when the suite
            // offered this address ([`crate::local`]), with the error recovery tonic's server
            // puts around it; everyone else connects over TCP.
            let local = crate::local::publish(
                addr,
                crate::local::boxed(
                    tower::ServiceBuilder::new()
                        .layer(tonic::service::RecoverErrorLayer::new())
                        .layer(layers)
                        .service(routes),
                ),
            );
            // Draining starts both sides at once: no new in-process call once the listener
            // stops, and the calls in flight finish, like the connections' open streams.
            let (on_shutdown, local_done) = drain_local(on_shutdown, local);
            let (served, ()) = tokio::join!(
                router.serve_with_incoming_shutdown(incoming(listener), on_shutdown),
                local_done,
            );
            served?;
        }
        Some(tls) => {
            // TLS on every call, in-process callers included.
            crate::local::withdraw(addr);
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.server_config());
            router
                .serve_with_incoming_shutdown(tls_incoming(listener, acceptor), on_shutdown)
                .await?
        }
    }
    Ok(())
}

/// The variable that lets a plaintext service listen beyond loopback.
pub const ALLOW_PLAINTEXT_VAR: &str = "GRPC_ALLOW_PLAINTEXT_BIND";

/// A plaintext service listens on loopback only, unless `GRPC_ALLOW_PLAINTEXT_BIND=true` says
/// the network it listens on is closed to everyone else (Kubernetes NetworkPolicies, a private
/// compose network): on an open network its calls, signed identity assertions included, could
/// be read and replayed within their minute.
fn refuse_open_plaintext(listener: &TcpListener, tls: bool) -> anyhow::Result<()> {
    let addr = listener.local_addr()?;
    let allowed = crate::config::env_opt(ALLOW_PLAINTEXT_VAR)
        .is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "true" | "1" | "yes"));
    plaintext_bind(addr, tls, allowed)?;
    if !tls && !addr.ip().is_loopback() {
        tracing::warn!(%addr, "serving plaintext gRPC beyond loopback ({ALLOW_PLAINTEXT_VAR}=true)");
    }
    Ok(())
}

/// Whether a server may listen on `addr`: with TLS anywhere, in plaintext on loopback only,
/// unless the operator said (`allowed`) that only trusted peers reach its network.
fn plaintext_bind(addr: SocketAddr, tls: bool, allowed: bool) -> anyhow::Result<()> {
    anyhow::ensure!(
        tls || allowed || addr.ip().is_loopback(),
        "refusing to serve plaintext gRPC on {addr}, beyond loopback: set GRPC_TLS_CERT and \
         GRPC_TLS_KEY (and GRPC_TLS_CA for mutual TLS), listen on 127.0.0.1, or set \
         {ALLOW_PLAINTEXT_VAR}=true if only trusted peers can reach this network"
    );
    Ok(())
}

/// Server reflection with full descriptors (messages, enums, streaming shapes, imports) that
/// lists only what this server serves: its own services, health and reflection (both versions:
/// grpcurl and most tools still ask v1alpha), not every service of the shared proto package.
fn reflection(service_names: &[&str]) -> tonic_reflection::server::Builder<'static> {
    let mut builder = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ecoscan_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
        .include_reflection_service(false)
        .with_service_name("grpc.health.v1.Health")
        .with_service_name("grpc.reflection.v1.ServerReflection")
        .with_service_name("grpc.reflection.v1alpha.ServerReflection");
    for name in service_names {
        builder = builder.with_service_name(*name);
    }
    builder
}

/// The server's shutdown signal, and the in-process side's drain that begins with it: once
/// `on_shutdown` fires, `local` takes no new call, and the second future ends when the calls in
/// flight have.
fn drain_local(
    on_shutdown: impl Future<Output = ()> + Send + 'static,
    local: Option<crate::local::Published>,
) -> (
    impl Future<Output = ()> + Send + 'static,
    impl Future<Output = ()> + Send + 'static,
) {
    let (begun, begins) = tokio::sync::oneshot::channel::<()>();
    let on_shutdown = async move {
        on_shutdown.await;
        let _ = begun.send(());
    };
    let local_done = async move {
        let Some(local) = local else { return };
        // Whether the signal came or the server stopped without it (an error), drain.
        let _ = begins.await;
        local.drain().await;
    };
    (on_shutdown, local_done)
}

/// Accepted connections, with `TCP_NODELAY` (without it, small replies wait for delayed ACKs
/// and every unary call takes ~40 ms longer).
fn incoming(
    listener: TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    use tokio_stream::StreamExt;
    TcpListenerStream::new(listener).map(|conn| {
        let conn = conn?;
        if let Err(e) = conn.set_nodelay(true) {
            tracing::debug!(error = %e, "failed to set TCP_NODELAY");
        }
        Ok(conn)
    })
}

fn rpc_span<B>(req: &http::Request<B>) -> Span {
    let path = req.uri().path();
    if path.starts_with("/grpc.health.v1.Health/")
        || path.starts_with("/grpc.reflection.")
        || matches!(path, "/metrics" | "/healthz" | "/readyz")
    {
        return Span::none();
    }
    let (service, method) = path
        .trim_start_matches('/')
        .split_once('/')
        .unwrap_or((path, ""));
    // A root for `tracing` (its parent is the caller's trace context below): a call from this
    // process runs inside the caller's task ([`crate::local`]), whose span is not its parent.
    let span = tracing::info_span!(
        parent: None,
        "rpc",
        otel.name = %path.trim_start_matches('/'),
        otel.kind = "server",
        otel.status_code = Empty,
        rpc.system = "grpc",
        rpc.service = %service,
        rpc.method = %method,
        rpc.grpc.status_code = Empty,
        error.type = Empty,
        otel.status_description = Empty,
        user.id = Empty,
    );
    // `user.id` is recorded by `assertion::IdentityLayer` once the caller's assertion is
    // verified: what a caller sends in `x-user-id` is never believed.
    let _ = span.set_parent(crate::telemetry::context_from_headers(req.headers()));
    span
}

/// Records the call's gRPC status. Following the OpenTelemetry gRPC conventions for server
/// spans, only codes that say the server failed mark the span as an error; a caller's mistake
/// (`INVALID_ARGUMENT`, `NOT_FOUND`, …) is recorded as `error.type` without failing the span.
fn record_status(headers: &http::HeaderMap, span: &Span) {
    let Some(code) = headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok())
    else {
        return;
    };
    span.record("rpc.grpc.status_code", code);
    if code == 0 {
        return;
    }
    let code = tonic::Code::from_i32(code);
    let name = crate::codes::code_name(code);
    if matches!(
        code,
        tonic::Code::Unknown
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Unimplemented
            | tonic::Code::Internal
            | tonic::Code::Unavailable
            | tonic::Code::DataLoss
    ) {
        // `grpc-message` is percent-encoded on the wire: the status decodes it.
        let message = tonic::Status::from_header_map(headers)
            .map(|s| s.message().to_owned())
            .unwrap_or_default();
        crate::telemetry::record_error(span, name, &message);
    } else {
        span.record("error.type", name);
    }
}

fn on_response<B>(res: &http::Response<B>, _latency: Duration, span: &Span) {
    record_status(res.headers(), span);
}

fn on_eos(trailers: Option<&http::HeaderMap>, _latency: Duration, span: &Span) {
    if let Some(t) = trailers {
        record_status(t, span);
    }
}

/// The deadline a caller set on its call (`grpc-timeout`), as a duration from now. tonic
/// enforces it only until the response headers; a server stream uses it to bound its whole
/// life (with a maximum of its own).
pub fn call_timeout(metadata: &tonic::metadata::MetadataMap) -> Option<std::time::Duration> {
    crate::deadline::grpc_timeout(metadata.as_ref())
}

#[cfg(test)]
mod plaintext_bind_tests {
    use super::plaintext_bind;

    #[test]
    fn plaintext_grpc_stays_on_loopback_unless_tls_or_the_operator_allows_it() {
        for open in [
            "0.0.0.0:50051",
            "[::]:50051",
            "10.1.2.3:50051",
            "192.168.0.9:1",
        ] {
            let addr = open.parse().unwrap();
            let refused = plaintext_bind(addr, false, false).unwrap_err().to_string();
            assert!(
                refused.contains("GRPC_ALLOW_PLAINTEXT_BIND"),
                "{open}: {refused}"
            );
            plaintext_bind(addr, true, false).expect("TLS may listen anywhere");
            plaintext_bind(addr, false, true).expect("the operator allowed it");
        }
        for inside in ["127.0.0.1:50051", "127.0.0.2:9", "[::1]:50051"] {
            plaintext_bind(inside.parse().unwrap(), false, false).expect(inside);
        }
    }
}

#[cfg(test)]
mod call_timeout_tests {
    use std::time::Duration;

    use tonic::metadata::{MetadataMap, MetadataValue};

    use super::call_timeout;

    fn with(v: &str) -> MetadataMap {
        let mut m = MetadataMap::new();
        m.insert("grpc-timeout", MetadataValue::try_from(v).unwrap());
        m
    }

    #[test]
    fn grpc_timeouts_parse_in_every_unit() {
        assert_eq!(call_timeout(&with("600S")), Some(Duration::from_secs(600)));
        assert_eq!(call_timeout(&with("2H")), Some(Duration::from_secs(7200)));
        assert_eq!(
            call_timeout(&with("1500m")),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(call_timeout(&with("10u")), Some(Duration::from_micros(10)));
        assert_eq!(call_timeout(&MetadataMap::new()), None);
        for bad in ["S", "12", "1x", "123456789S", "-1S"] {
            assert_eq!(call_timeout(&with(bad)), None, "{bad}");
        }
    }
}
