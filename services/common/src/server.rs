//! The gRPC serving helper every service uses: health (`grpc.health.v1`), server reflection (v1
//! and v1alpha), a span per RPC whose parent comes from the caller's `traceparent`, and graceful
//! shutdown.

use std::time::Duration;

use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::{service::Routes, transport::Server};
use tonic_health::ServingStatus;
use tower_http::trace::TraceLayer;
use tracing::{Span, field::Empty};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Largest message any ecoscan server accepts (images travel in messages).
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// Serves `routes` on `listener` until `shutdown` is cancelled, with health and reflection
/// mounted. `service_names` are the fully-qualified names reported SERVING by the health service
/// (the empty name, meaning the whole server, is always reported).
pub async fn serve(
    routes: Routes,
    service_names: &[&str],
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("", ServingStatus::Serving)
        .await;
    for name in service_names {
        reporter
            .set_service_status(*name, ServingStatus::Serving)
            .await;
    }
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ecoscan_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(ecoscan_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;

    let names: Vec<String> = service_names.iter().map(|s| (*s).to_owned()).collect();
    let on_shutdown = {
        let shutdown = shutdown.clone();
        async move {
            shutdown.cancelled().await;
            // Tell load balancers first, then stop accepting and drain in-flight calls.
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

    Server::builder()
        // Detect dead peers on idle connections (watch streams can be quiet for a long time).
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        // One span per RPC, child of the caller's trace context; health checks are not traced.
        .layer(
            TraceLayer::new_for_grpc()
                .make_span_with(rpc_span)
                .on_request(())
                .on_response(on_response)
                .on_eos(on_eos)
                .on_failure(()),
        )
        .add_routes(routes)
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .serve_with_incoming_shutdown(incoming(listener), on_shutdown)
        .await?;
    Ok(())
}

/// Accepted connections with `TCP_NODELAY`: without it, small replies wait for delayed ACKs and
/// every unary call takes ~40 ms longer.
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
    if path.starts_with("/grpc.health.v1.Health/") || path.starts_with("/grpc.reflection.") {
        return Span::none();
    }
    let (service, method) = path
        .trim_start_matches('/')
        .split_once('/')
        .unwrap_or((path, ""));
    let span = tracing::info_span!(
        "rpc",
        otel.name = %path.trim_start_matches('/'),
        otel.kind = "server",
        otel.status_code = Empty,
        rpc.system = "grpc",
        rpc.service = %service,
        rpc.method = %method,
        rpc.grpc.status_code = Empty,
        user.id = Empty,
    );
    if let Some(user) = req
        .headers()
        .get(crate::USER_ID_HEADER)
        .and_then(|v| v.to_str().ok())
    {
        span.record("user.id", user);
    }
    let _ = span.set_parent(crate::telemetry::context_from_headers(req.headers()));
    span
}

fn record_status(headers: &http::HeaderMap, span: &Span) {
    if let Some(code) = headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok())
    {
        span.record("rpc.grpc.status_code", code);
        if code != 0 {
            span.record("otel.status_code", "ERROR");
        }
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
