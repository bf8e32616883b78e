//! AnalyticsService on its production stores, over a real socket: rows in PostgreSQL (a schema of
//! its own on `TEST_DATABASE_URL`), bodies in S3 (a bucket of its own on `TEST_S3_ENDPOINT`).

mod support;

use std::time::Duration;

use ecoscan_analytics::{BODY_KEY_PREFIX, Config, serve};
use ecoscan_common::testing::{assert_health_and_reflection, spawn};
use ecoscan_objects::{ObjectStoreConfig, S3Config, S3ObjectStore};
use ecoscan_proto::v1::{
    CallStatus, GetCallRequest, LlmCall, RecordRequest, UsageRequest,
    analytics_service_client::AnalyticsServiceClient,
};
use support::PgSchema;

/// Where the tests find S3 unless `TEST_S3_ENDPOINT` says otherwise.
const DEFAULT_TEST_S3_ENDPOINT: &str = "http://127.0.0.1:9000";

/// A bucket of the test's own, emptied and removed at the end.
async fn bucket() -> (S3Config, S3ObjectStore) {
    let endpoint = std::env::var("TEST_S3_ENDPOINT")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| DEFAULT_TEST_S3_ENDPOINT.to_owned());
    let config = S3Config {
        endpoint: endpoint.clone(),
        bucket: format!("t-{}", uuid::Uuid::new_v4()),
        region: "us-east-1".into(),
        credentials: Some(("test".into(), "test".into())),
        key_prefix: BODY_KEY_PREFIX.into(),
    };
    let store = S3ObjectStore::connect(config.clone())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "S3 is not reachable at {endpoint} ({e}); start it with infra/services.sh or \
                 point TEST_S3_ENDPOINT at a server"
            )
        });
    (config, store)
}

fn call(i: usize) -> LlmCall {
    LlmCall {
        call_id: uuid::Uuid::now_v7().to_string(),
        service: "answer".into(),
        provider: "mock".into(),
        model: "mock-1".into(),
        operation: "generate".into(),
        input_tokens: 100,
        output_tokens: 10,
        latency_ms: 5.0,
        ttft_ms: 1.0,
        status: CallStatus::Ok as i32,
        error: String::new(),
        request_body: format!("request {i} ").repeat(i + 1),
        response_body: if i.is_multiple_of(4) {
            String::new()
        } else {
            format!("응답 {i}")
        },
        job_id: format!("job-{i}"),
        trace_id: String::new(),
        started_at: Some(now_in_whole_micros()),
    }
}

/// Calls are stored to the microsecond.
fn now_in_whole_micros() -> ecoscan_proto::Timestamp {
    let mut ts = ecoscan_proto::now();
    ts.nanos -= ts.nanos % 1_000;
    ts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_are_committed_to_postgresql_with_their_bodies_in_s3() {
    let schema = PgSchema::create().await;
    let (s3, objects) = bucket().await;
    let config = Config {
        database_url: schema.url.clone(),
        bodies: ObjectStoreConfig::S3(s3),
        batch_linger: Duration::from_millis(5),
        ..Config::default()
    };
    let server = spawn(|l, s| serve(config, l, s)).await;
    let client = AnalyticsServiceClient::connect(server.uri()).await.unwrap();
    let calls: Vec<_> = (0..50).map(call).collect();

    let recorded = futures::future::join_all(calls.iter().cloned().map(|c| {
        let mut client = client.clone();
        async move {
            client
                .record(RecordRequest { call: Some(c) })
                .await
                .unwrap()
                .into_inner()
        }
    }))
    .await;
    let repeat = client
        .clone()
        .record(RecordRequest {
            call: Some(calls[7].clone()),
        })
        .await
        .unwrap()
        .into_inner();
    let read_back = futures::future::join_all(calls.iter().map(|c| {
        let mut client = client.clone();
        let call_id = c.call_id.clone();
        async move {
            client
                .get_call(GetCallRequest { call_id })
                .await
                .unwrap()
                .into_inner()
                .call
                .unwrap()
        }
    }))
    .await;
    let usage = client
        .clone()
        .usage(UsageRequest::default())
        .await
        .unwrap()
        .into_inner();

    assert!(recorded.iter().all(|r| !r.duplicate));
    assert!(repeat.duplicate);
    // The service has no local body directory: every body came back from S3.
    for (back, sent) in read_back.iter().zip(&calls) {
        assert_eq!(back, sent, "call {} read back differently", sent.job_id);
    }
    assert_eq!(usage.rows.len(), 1);
    assert_eq!(usage.rows[0].calls, 50);
    assert_health_and_reflection(&server.uri(), "ecoscan.v1.AnalyticsService").await;
    server.stop().await.unwrap();
    objects.delete_bucket().await.unwrap();
}
