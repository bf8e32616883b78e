//! AnalyticsService on its production stores, over a real socket: rows in PostgreSQL (a schema of
//! its own on `TEST_DATABASE_URL`), bodies in S3 (a bucket of its own on `TEST_S3_ENDPOINT`).

mod support;

use std::{
    collections::HashSet,
    net::SocketAddr,
    time::{Duration, Instant},
};

use ecoscan_analytics::{BODY_KEY_PREFIX, Config, serve};
use ecoscan_common::testing::{assert_health_and_reflection, spawn};
use ecoscan_objects::{ObjectStoreConfig, S3Config, S3ObjectStore};
use ecoscan_proto::v1::{
    GetCallRequest, LlmCall, RecordRequest, RecordStreamRequest, UsageRequest,
    analytics_service_client::AnalyticsServiceClient,
};
use support::{PgSchema, as_recorded};

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

/// Every call of `calls`, read back over `GetCall` (as an admin).
async fn read_back<'a>(
    client: &AnalyticsServiceClient<ecoscan_common::client::TracedChannel>,
    calls: impl Iterator<Item = &'a LlmCall>,
) -> Vec<LlmCall> {
    futures::future::join_all(calls.map(|c| {
        let mut client = client.clone();
        let call_id = c.call_id.clone();
        async move {
            client
                .get_call(ecoscan_common::client::as_admin(GetCallRequest { call_id }))
                .await
                .unwrap()
                .into_inner()
                .call
                .unwrap()
        }
    }))
    .await
}

fn call(i: usize) -> LlmCall {
    let response = if i.is_multiple_of(4) {
        String::new()
    } else {
        format!("응답 {i}")
    };
    support::llm_call(i, format!("request {i} ").repeat(i + 1), response)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_are_committed_to_postgresql_with_their_bodies_in_s3() {
    let schema = PgSchema::create().await;
    let (s3, objects) = bucket().await;
    let spool = tempfile::TempDir::new().unwrap();
    let config = Config {
        database_url: schema.url.clone(),
        bodies: ObjectStoreConfig::S3(s3),
        batch_linger: Duration::from_millis(5),
        spool_dir: Some(spool.path().to_owned()),
        ..Config::default()
    };
    let server = spawn(|l, s| serve(config, l, s)).await;
    let client =
        AnalyticsServiceClient::new(ecoscan_common::client::channel(&server.uri()).unwrap());
    let calls: Vec<_> = (0..50).map(call).collect();

    let recorded = futures::future::join_all(calls.iter().cloned().map(|c| {
        let mut client = client.clone();
        async move {
            client
                .record(reported(RecordRequest { call: Some(c) }))
                .await
                .unwrap()
                .into_inner()
        }
    }))
    .await;
    let repeat = client
        .clone()
        .record(reported(RecordRequest {
            call: Some(calls[7].clone()),
        }))
        .await
        .unwrap()
        .into_inner();
    let read_back = read_back(&client, calls.iter()).await;
    let usage = client
        .clone()
        .usage(ecoscan_common::client::as_admin(UsageRequest::default()))
        .await
        .unwrap()
        .into_inner();

    assert!(recorded.iter().all(|r| !r.duplicate));
    assert!(repeat.duplicate);
    // The service has no local body directory: every body came back from S3.
    for (back, sent) in read_back.iter().zip(&calls) {
        assert_eq!(
            back,
            &as_recorded(sent),
            "call {} read back differently",
            sent.job_id
        );
    }
    assert_eq!(usage.rows.len(), 1);
    assert_eq!(usage.rows[0].calls, 50);
    assert_health_and_reflection(&server.uri(), "ecoscan.v1.AnalyticsService").await;
    server.stop().await.unwrap();
    objects.delete_bucket().await.unwrap();
}

async fn scrape_value(addr: SocketAddr, name: &str) -> f64 {
    let text = ecoscan_common::testing::scrape(addr).await;
    ecoscan_common::testing::sample(&text, name, &[]).unwrap_or_else(|| panic!("{name}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_recorded_while_s3_is_unreachable_land_exactly_once_after_it_returns() {
    let schema = PgSchema::create().await;
    let (s3, objects) = bucket().await;
    let target: SocketAddr = s3
        .endpoint
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .expect("TEST_S3_ENDPOINT is http://<ip>:<port>");
    let proxy = ecoscan_common::testing::CuttingProxy::start(target).await;
    let spool = tempfile::TempDir::new().unwrap();
    let config = Config {
        database_url: schema.url.clone(),
        bodies: ObjectStoreConfig::S3(S3Config {
            endpoint: format!("http://{}", proxy.addr()),
            ..s3.clone()
        }),
        batch_linger: Duration::from_millis(5),
        spool_dir: Some(spool.path().to_owned()),
        store_timeout: Duration::from_secs(2),
        spool_retry_max: Duration::from_millis(500),
        ..Config::default()
    };
    let server = spawn(|l, s| serve(config, l, s)).await;
    let client =
        AnalyticsServiceClient::new(ecoscan_common::client::channel(&server.uri()).unwrap());
    let record = |c: LlmCall| {
        let mut client = client.clone();
        async move {
            client
                .record(reported(RecordRequest { call: Some(c) }))
                .await
                .map(|r| r.into_inner())
        }
    };
    let before: Vec<_> = (0..10).map(call).collect();
    for c in &before {
        assert!(!record(c.clone()).await.unwrap().duplicate);
    }

    // S3 goes away; 300 calls arrive, 240 unary (32 in flight) and 60 on two streams.
    proxy.set_up(false);
    let during: Vec<_> = (10..310).map(call).collect();
    let started = Instant::now();
    let (unary, streamed) = during.split_at(240);
    let unary = async {
        use futures::StreamExt;
        futures::stream::iter(unary.iter().cloned())
            .for_each_concurrent(32, |c| {
                let record = &record;
                async move {
                    let res = record(c).await.unwrap();
                    assert!(!res.duplicate);
                }
            })
            .await;
    };
    let streams = futures::future::join_all(streamed.chunks(30).map(|chunk| {
        let mut client = client.clone();
        let chunk = chunk.to_vec();
        async move {
            let res = client
                .record_stream(reported(tokio_stream::iter(
                    chunk
                        .into_iter()
                        .map(|c| RecordStreamRequest { call: Some(c) }),
                )))
                .await
                .unwrap()
                .into_inner();
            assert_eq!((res.recorded, res.duplicates), (30, 0));
        }
    }));
    tokio::join!(unary, streams);
    let took = started.elapsed();
    let waiting = scrape_value(server.addr, "analytics_spool_batches").await;
    // Down a little longer, so the replayer fails and backs off.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        scrape_value(server.addr, "analytics_spool_replayed_total").await,
        0.0
    );

    // S3 is back: the spool drains.
    proxy.set_up(true);
    let deadline = Instant::now() + Duration::from_secs(30);
    while scrape_value(server.addr, "analytics_spool_batches").await > 0.0 {
        assert!(Instant::now() < deadline, "the spool did not drain");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Every call is stored exactly once: one row per id in PostgreSQL...
    let pool = sqlx::PgPool::connect(&schema.url).await.unwrap();
    let ids: Vec<(String,)> = sqlx::query_as("SELECT call_id FROM llm_calls")
        .fetch_all(&pool)
        .await
        .unwrap();
    pool.close().await;
    let stored: HashSet<String> = ids.iter().map(|(id,)| id.clone()).collect();
    let sent: HashSet<String> = before
        .iter()
        .chain(&during)
        .map(|c| c.call_id.clone())
        .collect();
    assert_eq!(ids.len(), 310, "rows");
    assert_eq!(stored, sent);
    // ...and reads back whole, its bodies from S3.
    let read_back = read_back(&client, before.iter().chain(&during)).await;
    for (back, sent) in read_back.iter().zip(before.iter().chain(&during)) {
        assert_eq!(
            back,
            &as_recorded(sent),
            "call {} read back differently",
            sent.job_id
        );
    }
    assert!(
        took < Duration::from_secs(15),
        "recording during the outage took {took:?}"
    );
    assert!(waiting > 0.0, "nothing was spooled");
    let spooled = scrape_value(server.addr, "analytics_spooled_total").await;
    assert_eq!(
        scrape_value(server.addr, "analytics_spool_replayed_total").await,
        spooled
    );
    assert_eq!(
        scrape_value(server.addr, "analytics_calls_recorded_total").await,
        310.0
    );
    assert!(
        std::fs::read_dir(spool.path()).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .ends_with(".batch"))
    );
    server.stop().await.unwrap();
    objects.delete_bucket().await.unwrap();
}

/// `message` as vision reports its model calls: signed as itself (recording needs an identity).
fn reported<T>(message: T) -> tonic::Request<T> {
    ecoscan_common::client::by_actor(tonic::Request::new(message), "vision")
}
