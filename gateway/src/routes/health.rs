//! Liveness and readiness.

use axum::{Json, extract::State, http::StatusCode};
use ecoscan_common::client::request;
use serde_json::{Value, json};
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

use crate::{AppState, Backend, READY_DEADLINE};

/// Alive: answers as long as the process serves HTTP, whatever the backends do.
pub(crate) async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// Ready: every backend answers `grpc.health.v1.Health/Check` with SERVING within a short
/// deadline. 503 lists the ones that do not.
pub(crate) async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<Value>) {
    let checks = state.backends.iter().map(check);
    let results = futures::future::join_all(checks).await;
    let mut services = serde_json::Map::new();
    let mut not_ready = Vec::new();
    for (backend, status) in state.backends.iter().zip(results) {
        if status != "serving" {
            not_ready.push(backend.name);
        }
        services.insert(backend.name.to_owned(), json!(status));
    }
    let code = if not_ready.is_empty() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let status = if not_ready.is_empty() {
        "ready"
    } else {
        "not_ready"
    };
    (
        code,
        Json(json!({"status": status, "services": services, "not_ready": not_ready})),
    )
}

async fn check(backend: &Backend) -> &'static str {
    let req = request(
        HealthCheckRequest {
            service: backend.service.to_owned(),
        },
        READY_DEADLINE,
    );
    // The connect timeout of the shared channel is longer than the deadline; bound both.
    let mut client = HealthClient::new(backend.channel.clone());
    match tokio::time::timeout(READY_DEADLINE, client.check(req)).await {
        Ok(Ok(res)) if res.get_ref().status == ServingStatus::Serving as i32 => "serving",
        Ok(Ok(_)) => "not_serving",
        Ok(Err(status)) => {
            tracing::debug!(backend = backend.name, error = %status, "backend not ready");
            "unreachable"
        }
        Err(_) => {
            tracing::debug!(backend = backend.name, "backend health check timed out");
            "unreachable"
        }
    }
}
