//! RuleService's `/metrics`, on the gRPC port: RED metrics per RPC and lookups by outcome.

use ecoscan_common::testing::{sample, scrape, spawn};
use ecoscan_proto::v1::{Classification, LookupRequest, rule_service_client::RuleServiceClient};
use ecoscan_rule::{Config, serve};
use tokio_stream::StreamExt;

fn request(major: &str, middle: &str, minor: &str) -> LookupRequest {
    LookupRequest {
        classification: Some(Classification {
            major_category: major.into(),
            middle_category: middle.into(),
            minor_category: minor.into(),
            ..Classification::default()
        }),
        locale: "en".into(),
    }
}

#[tokio::test]
async fn metrics_count_lookups_by_outcome_and_rpcs_by_status_code() {
    let server = spawn(|l, s| serve(Config::default(), l, s)).await;
    let mut client =
        RuleServiceClient::new(ecoscan_common::client::channel(&server.uri()).unwrap());

    let mut stream = client
        .lookup(request("재활용폐기물", "무색페트병", "먹는샘물PET병"))
        .await
        .unwrap()
        .into_inner();
    while let Some(event) = stream.next().await {
        event.unwrap();
    }
    let refused = client.lookup(request("no such major", "", "")).await;
    let text = scrape(server.addr).await;

    assert_eq!(refused.unwrap_err().code(), tonic::Code::NotFound);
    let method = ("method", "ecoscan.v1.RuleService/Lookup");
    let service = ("service", "rule");
    let requests = |code| {
        sample(
            &text,
            "rpc_server_requests_total",
            &[service, method, ("code", code)],
        )
    };
    assert_eq!(requests("OK"), Some(1.0), "{text}");
    assert_eq!(requests("NOT_FOUND"), Some(1.0), "{text}");
    assert_eq!(
        sample(&text, "rpc_server_in_flight", &[method]),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "rpc_server_duration_seconds_count", &[method]),
        Some(2.0),
        "{text}"
    );
    let lookups = |outcome| {
        sample(
            &text,
            "rule_lookups_total",
            &[service, ("outcome", outcome)],
        )
    };
    assert_eq!(lookups("item"), Some(1.0), "{text}");
    assert_eq!(lookups("unknown_category"), Some(1.0), "{text}");
    // Health checks are not RPCs of ours.
    assert!(!text.contains("grpc.health"), "{text}");
    server.stop().await.unwrap();
}
