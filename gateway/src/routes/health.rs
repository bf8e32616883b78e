//! Liveness (API and admin listeners) and readiness (admin listener).

use std::collections::BTreeMap;

use axum::{Json, extract::State, http::StatusCode};
use serde::Serialize;
use utoipa::ToSchema;

use crate::admin::Admin;

/// The body of `GET /healthz`.
#[derive(Serialize, ToSchema)]
pub(crate) struct Health {
    /// Always `ok`.
    #[schema(value_type = String, pattern = "^ok$")]
    status: &'static str,
}

/// The body of `GET /readyz` (admin listener). Fields are in alphabetical order, as
/// `serde_json` prints a map.
#[derive(Serialize)]
pub(crate) struct Readiness {
    /// What the gateway last heard from each backend's health (checked every 5 s in the
    /// background): `serving`, `not_serving`, `unreachable` or `unknown`. For people only:
    /// readiness never depends on it (a backend's outage fails the routes that need it).
    backends: BTreeMap<&'static str, &'static str>,
    /// `ready` (200), or `draining` (503) from SIGTERM on.
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

/// Ready: the gateway itself serves and is not draining. No backend is called: a backend's
/// outage must not take every gateway replica out of the Service (see `crate::admin`).
pub(crate) async fn readyz(State(admin): State<Admin>) -> (StatusCode, Json<Readiness>) {
    // Draining after SIGTERM: not ready at once, so no new traffic comes, while requests and
    // streams already here go on until the drain grace is over.
    let (code, status) = if admin.draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining")
    } else {
        (StatusCode::OK, "ready")
    };
    (
        code,
        Json(Readiness {
            backends: admin.health.snapshot(),
            status,
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_bodies_serialize_as_the_json_they_replace() {
        let health = serde_json::to_string(&Health { status: "ok" }).unwrap();
        assert_eq!(health, serde_json::json!({"status": "ok"}).to_string());
        let ready = Readiness {
            backends: BTreeMap::from([("reward", "unreachable"), ("ingest", "serving")]),
            status: "ready",
        };
        let expected = serde_json::json!({
            "status": "ready",
            "backends": {"ingest": "serving", "reward": "unreachable"},
        });
        assert_eq!(serde_json::to_string(&ready).unwrap(), expected.to_string());
    }
}
