//! One backend down, the rest of the API up: every service runs as its own process
//! (`ecoscan serve <service>`), one of them is stopped, and the gateway must stay ready (its
//! `/readyz` on the admin listener answers 200, so no replica leaves the Service) while the
//! routes that need the stopped service answer 503 with `Retry-After` and a message naming it,
//! and every other route keeps working.
//!
//! - analytics stopped: scans still run to `ready` (model-call reports are not on the scan's
//!   path), usage answers 503;
//! - ingest stopped: submitting a scan answers 503, the caller's characters (reward) still
//!   answer 200, and an event stream ends at once with a `retry:` hint for `EventSource`.

mod common;
mod support;

use std::time::Duration;

use common::{image_form, read_sse};
use reqwest::StatusCode;
use support::processes::{Cluster, Service};

/// HS256 secret of the gateway under test (tokens are minted with it below).
const SECRET: &str = "outage-test-secret-k3v9q2xw7m4p8r1t6y5u0z";
const ISSUER: &str = "ecoscan-outage-test";
const AUDIENCE: &str = "ecoscan";

async fn cluster() -> Cluster {
    Cluster::builder()
        .service_env(Service::Gateway, "GATEWAY_JWT_SECRET", SECRET)
        .service_env(Service::Gateway, "GATEWAY_JWT_ISSUER", ISSUER)
        .service_env(Service::Gateway, "GATEWAY_JWT_AUDIENCE", AUDIENCE)
        .start()
        .await
}

fn token(user: &str, admin: bool) -> String {
    ecoscan_gateway::mint_token(
        SECRET,
        user,
        admin,
        ISSUER,
        AUDIENCE,
        Duration::from_secs(600),
    )
    .expect("mint a token")
}

/// Until the gateway's background health checks have seen `service` down: `/readyz` names each
/// backend's last state (and stays 200 throughout, which is the point).
async fn wait_until_seen_down(http: &reqwest::Client, cluster: &Cluster, service: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let res = http
            .get(cluster.gateway_admin_url("/readyz"))
            .send()
            .await
            .expect("the admin listener answers");
        assert_eq!(
            res.status(),
            StatusCode::OK,
            "the gateway stays ready while {service} is down"
        );
        let body: serde_json::Value = res.json().await.expect("readiness is JSON");
        if body["backends"][service] == "unreachable" {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the gateway never saw {service} down: {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The admin listener's `gateway_backend_up{backend}`.
async fn backend_up(http: &reqwest::Client, cluster: &Cluster, backend: &str) -> Option<f64> {
    let text = http
        .get(cluster.gateway_admin_url("/metrics"))
        .send()
        .await
        .expect("metrics answer")
        .text()
        .await
        .expect("metrics text");
    ecoscan_common::testing::sample(&text, "gateway_backend_up", &[("backend", backend)])
}

/// Asserts a 503 that says which backend is down and when to come back.
async fn assert_unavailable(res: reqwest::Response, backend: &str) {
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    let retry_after = res
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .expect("a numeric Retry-After");
    assert!(retry_after > 0);
    let body: serde_json::Value = res.json().await.expect("errors are JSON");
    assert_eq!(body["code"], "UNAVAILABLE", "{body}");
    assert_eq!(
        body["message"],
        format!("{backend} is unavailable, try again in {retry_after} s"),
        "{body}"
    );
}

#[tokio::test]
async fn with_analytics_stopped_the_gateway_stays_ready_scans_succeed_and_usage_is_503() {
    let mut cluster = cluster().await;
    let http = reqwest::Client::new();
    let user = token("outage-ana", false);
    let admin = token("outage-admin", true);

    cluster.kill(Service::Analytics);
    wait_until_seen_down(&http, &cluster, "analytics").await;
    assert_eq!(backend_up(&http, &cluster, "analytics").await, Some(0.0));
    assert_eq!(backend_up(&http, &cluster, "ingest").await, Some(1.0));

    // A scan runs to the end: vision and answer report their model calls to analytics on the
    // side, and a report that cannot be delivered does not hold the scan.
    let res = http
        .post(cluster.gateway_url("/api/v1/scan/completion"))
        .bearer_auth(&user)
        .multipart(image_form("투명 페트병 pet bottle"))
        .send()
        .await
        .expect("scan request");
    let events = read_sse(res).await;
    assert_eq!(
        events.last().map(|e| e.event.as_str()),
        Some("ready"),
        "the scan completes while analytics is down: {events:#?}"
    );

    let res = http
        .get(cluster.gateway_url("/api/v1/analytics/usage"))
        .bearer_auth(&admin)
        .send()
        .await
        .expect("usage request");
    assert_unavailable(res, "analytics").await;

    // Nor do the services that call analytics leave their Services: their gRPC health is
    // their own state, SERVING while a peer is down.
    for (service, name) in [
        (Service::Vision, "ecoscan.v1.VisionService"),
        (Service::Answer, "ecoscan.v1.AnswerService"),
        (Service::Ingest, "ecoscan.v1.ScanService"),
    ] {
        ecoscan_common::testing::assert_health_and_reflection(&cluster.uri(service), name).await;
    }

    // Still ready after all that.
    let res = http
        .get(cluster.gateway_admin_url("/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

#[tokio::test]
async fn with_ingest_stopped_scan_routes_are_503_with_retry_after_and_characters_work() {
    let mut cluster = cluster().await;
    let http = reqwest::Client::new();
    let user = token("outage-ing", false);

    cluster.kill(Service::Ingest);
    wait_until_seen_down(&http, &cluster, "ingest").await;
    assert_eq!(backend_up(&http, &cluster, "ingest").await, Some(0.0));

    let res = http
        .post(cluster.gateway_url("/api/v1/scan"))
        .bearer_auth(&user)
        .multipart(image_form("can 캔"))
        .send()
        .await
        .expect("submit request");
    assert_unavailable(res, "ingest").await;
    let res = http
        .post(cluster.gateway_url("/api/v1/scan/completion"))
        .bearer_auth(&user)
        .multipart(image_form("can 캔"))
        .send()
        .await
        .expect("completion request");
    assert_unavailable(res, "ingest").await;
    let res = http
        .get(cluster.gateway_url("/api/v1/scan/7d2f4c1e-0000-4000-8000-000000000000"))
        .bearer_auth(&user)
        .send()
        .await
        .expect("result request");
    assert_unavailable(res, "ingest").await;
    let res = http
        .get(cluster.gateway_url("/api/v1/scan/7d2f4c1e-0000-4000-8000-000000000000/events"))
        .bearer_auth(&user)
        .send()
        .await
        .expect("events request");
    // An event stream is the exception: an `EventSource` that gets a 503 gives up for good,
    // so the stream opens and ends at once with a `retry:` hint (never an `error` event,
    // which is a job's end), and the browser comes back by itself.
    assert_eq!(res.status(), StatusCode::OK);
    let body = tokio::time::timeout(Duration::from_secs(30), res.text())
        .await
        .expect("the stream ends at once")
        .expect("its body");
    assert!(body.contains("retry:"), "{body}");
    assert!(body.contains("ingest is unavailable"), "{body}");
    assert!(!body.contains("event: error"), "{body}");

    let res = http
        .get(cluster.gateway_url("/api/v1/characters/me"))
        .bearer_auth(&user)
        .send()
        .await
        .expect("characters request");
    assert_eq!(res.status(), StatusCode::OK);

    let res = http
        .get(cluster.gateway_admin_url("/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);

    // Back: the series says so, and scans go through again.
    cluster.restart(Service::Ingest).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while backend_up(&http, &cluster, "ingest").await != Some(1.0) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the gateway never saw ingest back"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let res = http
        .post(cluster.gateway_url("/api/v1/scan"))
        .bearer_auth(&user)
        .multipart(image_form("can 캔"))
        .send()
        .await
        .expect("submit request");
    assert_eq!(res.status(), StatusCode::ACCEPTED);
}
