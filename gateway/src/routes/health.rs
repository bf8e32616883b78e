//! Liveness and readiness.

use std::collections::BTreeMap;

use axum::{Json, extract::State, http::StatusCode};
use ecoscan_common::client::request;
use serde::Serialize;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};
use utoipa::ToSchema;

use crate::{AppState, Backend, READY_DEADLINE};

/// The body of `GET /healthz`.
#[derive(Serialize, ToSchema)]
pub(crate) struct Health {
    /// Always `ok`.
    #[schema(value_type = String, pattern = "^ok$")]
    status: &'static str,
}

/// The body of `GET /readyz`. Fields are in alphabetical order, as the JSON they replace had them.
#[derive(Serialize, ToSchema)]
pub(crate) struct Readiness {
    /// The backends that are not serving (empty when ready); `gateway` while the gateway itself
    /// drains after SIGTERM.
    #[schema(value_type = Vec<String>)]
    not_ready: Vec<&'static str>,
    /// Each backend's answer: `serving`, `not_serving` or `unreachable`.
    #[schema(value_type = BTreeMap<String, String>)]
    services: BTreeMap<&'static str, &'static str>,
    /// `ready` (200) or `not_ready` (503).
    #[schema(value_type = String, pattern = "^(ready|not_ready)$")]
    status: &'static str,
}

/// Alive: answers as long as the process serves HTTP, whatever the backends do.
#[utoipa::path(
    get,
    path = "/healthz",
    tag = "operations",
    operation_id = "healthz",
    summary = "Liveness",
    description = "Answers as long as the process serves HTTP, whatever the backends do. Outside \
                   the concurrency limit.",
    responses((status = 200, description = "The gateway is alive.", body = Health)),
)]
pub(crate) async fn healthz() -> Json<Health> {
    Json(Health { status: "ok" })
}

/// Ready: every backend answers `grpc.health.v1.Health/Check` with SERVING within a short
/// deadline. 503 lists the ones that do not.
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    operation_id = "readyz",
    summary = "Readiness",
    description = "Ready when every backend (ingest, reward, analytics, notification) answers \
                   `grpc.health.v1.Health/Check` with SERVING within a second, and the gateway \
                   is not draining after SIGTERM. Outside the concurrency limit.",
    responses(
        (status = 200, description = "Every backend serves.", body = Readiness),
        (status = 503, description = "Some backend does not serve; `not_ready` lists them.",
            body = Readiness),
    ),
)]
pub(crate) async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<Readiness>) {
    let checks = state.backends.iter().map(check);
    let results = futures::future::join_all(checks).await;
    let mut services = BTreeMap::new();
    let mut not_ready = Vec::new();
    // Draining after SIGTERM: not ready at once, so no new traffic comes, while requests and
    // streams already here go on until the drain grace is over.
    if state.shutdown.is_cancelled() || ecoscan_common::shutdown::draining().is_cancelled() {
        not_ready.push("gateway");
    }
    for (backend, status) in state.backends.iter().zip(results) {
        if status != "serving" {
            not_ready.push(backend.name);
        }
        services.insert(backend.name, status);
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
        Json(Readiness {
            not_ready,
            services,
            status,
        }),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_bodies_serialize_as_the_json_they_replace() {
        let health = serde_json::to_string(&Health { status: "ok" }).unwrap();
        assert_eq!(health, serde_json::json!({"status": "ok"}).to_string());
        let ready = Readiness {
            not_ready: vec!["reward"],
            services: BTreeMap::from([("reward", "unreachable"), ("ingest", "serving")]),
            status: "not_ready",
        };
        let expected = serde_json::json!({
            "status": "not_ready",
            "services": {"ingest": "serving", "reward": "unreachable"},
            "not_ready": ["reward"],
        });
        assert_eq!(serde_json::to_string(&ready).unwrap(), expected.to_string());
    }
}
