//! AnalyticsService over a real socket, on a SQLite file and a body directory in a temporary
//! directory.

use std::time::Duration;

use ecoscan_analytics::{Config, serve};
use ecoscan_common::testing::{Spawned, assert_health_and_reflection, spawn};
use ecoscan_proto::{
    Timestamp,
    v1::{
        CallStatus, GetCallRequest, LlmCall, RecordRequest, RecordStreamRequest, UsageRequest,
        UsageRow, analytics_service_client::AnalyticsServiceClient,
    },
};
use tempfile::TempDir;
use tonic::Code;

struct Harness {
    server: Spawned,
    client: AnalyticsServiceClient<ecoscan_common::client::TracedChannel>,
    dir: TempDir,
}

async fn start() -> Harness {
    start_with(|c| c).await
}

async fn start_with(tweak: impl FnOnce(Config) -> Config) -> Harness {
    let dir = TempDir::new().unwrap();
    let config = tweak(Config {
        database_url: format!("sqlite://{}/db/analytics.db?mode=rwc", dir.path().display()),
        bodies: ecoscan_objects::ObjectStoreConfig::Local(dir.path().join("bodies")),
        batch_max_rows: 100,
        batch_linger: Duration::from_millis(2),
        queue_capacity: 64,
        spool_dir: Some(dir.path().join("spool")),
        ..Config::default()
    });
    let server = spawn(|l, s| serve(config, l, s)).await;
    let client =
        AnalyticsServiceClient::new(ecoscan_common::client::channel(&server.uri()).unwrap());
    Harness {
        server,
        client,
        dir,
    }
}

fn id() -> String {
    uuid::Uuid::now_v7().to_string()
}

const BASE_SECONDS: i64 = 1_750_000_000;

fn at_ms(ms: i64) -> Timestamp {
    Timestamp {
        seconds: BASE_SECONDS + ms.div_euclid(1000),
        nanos: i32::try_from(ms.rem_euclid(1000) * 1_000_000).unwrap(),
    }
}

fn call(id: &str) -> LlmCall {
    LlmCall {
        call_id: id.into(),
        service: "vision".into(),
        provider: "mock".into(),
        model: "mock-1".into(),
        operation: "classify".into(),
        input_tokens: 120,
        output_tokens: 30,
        latency_ms: 812.5,
        ttft_ms: 95.25,
        status: CallStatus::Ok as i32,
        error: String::new(),
        request_body: r#"{"messages":[{"role":"user","content":"페트병"}]}"#.into(),
        response_body: r#"{"choices":[{"message":{"content":"무색페트병"}}]}"#.into(),
        job_id: "job-1".into(),
        trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
        started_at: Some(at_ms(0)),
        ..LlmCall::default()
    }
}

/// `call` as analytics stores it: the mock's calls are priced at zero.
fn as_recorded(call: LlmCall) -> LlmCall {
    LlmCall {
        cost_micros: Some(0),
        price_version: "mock".into(),
        ..call
    }
}

/// The Record request for `call`, made by the service that made the model call (recording
/// needs an identity).
fn record(call: LlmCall) -> tonic::Request<RecordRequest> {
    reported(RecordRequest { call: Some(call) })
}

/// `message` as vision reports its model calls: signed as itself (the `act` claim).
fn reported<T>(message: T) -> tonic::Request<T> {
    ecoscan_common::client::by_actor(tonic::Request::new(message), "vision")
}

/// The RecordStream requests for `calls`, in order.
fn record_stream(
    calls: Vec<LlmCall>,
) -> tonic::Request<impl tokio_stream::Stream<Item = RecordStreamRequest>> {
    reported(tokio_stream::iter(
        calls
            .into_iter()
            .map(|call| RecordStreamRequest { call: Some(call) }),
    ))
}

#[tokio::test]
async fn recording_needs_an_identity() {
    let mut h = start().await;
    let id = uuid::Uuid::now_v7().to_string();
    let err = h
        .client
        .record(RecordRequest {
            call: Some(call(&id)),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err:?}");
    let err = h
        .client
        .record_stream(tokio_stream::iter([RecordStreamRequest {
            call: Some(call(&id)),
        }]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err:?}");
    // Nothing was stored; signed as the reporting service, the same call is.
    assert_eq!(
        get(&mut h, &id).await.unwrap_err().code(),
        tonic::Code::NotFound
    );
    h.client.record(record(call(&id))).await.unwrap();
    assert!(get(&mut h, &id).await.is_ok());
}

async fn get(h: &mut Harness, call_id: &str) -> Result<LlmCall, tonic::Status> {
    h.client
        .get_call(ecoscan_common::client::as_admin(GetCallRequest {
            call_id: call_id.into(),
        }))
        .await
        .map(|r| r.into_inner().call.unwrap())
}

#[tokio::test]
async fn a_recorded_call_reads_back_with_every_field_and_its_bodies() {
    let mut h = start().await;
    let sent = call(&id());

    let res = h
        .client
        .record(record(sent.clone()))
        .await
        .unwrap()
        .into_inner();
    let back = get(&mut h, &sent.call_id).await.unwrap();

    assert_eq!(res.call_id, sent.call_id);
    assert!(!res.duplicate);
    assert_eq!(back, as_recorded(sent));
    // Bodies live in the object directory, not only in the database.
    let objects = std::fs::read_dir(h.dir.path().join("bodies"))
        .unwrap()
        .count();
    assert_eq!(objects, 1);
    h.server.stop().await.unwrap();
}

#[tokio::test]
async fn concurrent_records_each_read_back_their_own_bodies() {
    let h = start().await;
    let calls: Vec<LlmCall> = (0..64)
        .map(|i| LlmCall {
            request_body: format!("request {i}").repeat(i + 1),
            response_body: if i % 3 == 0 {
                String::new()
            } else {
                format!("response {i}")
            },
            ..call(&id())
        })
        .collect();

    let results = futures::future::join_all(calls.iter().cloned().map(|c| {
        let mut client = h.client.clone();
        async move { client.record(record(c)).await.unwrap().into_inner() }
    }))
    .await;

    assert!(results.iter().all(|r| !r.duplicate));
    let read_back = futures::future::join_all(calls.iter().map(|sent| {
        let mut client = h.client.clone();
        let call_id = sent.call_id.clone();
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
    .await;
    assert_eq!(
        read_back,
        calls.into_iter().map(as_recorded).collect::<Vec<_>>()
    );
    h.server.stop().await.unwrap();
}

#[tokio::test]
async fn a_call_recorded_twice_is_stored_once_and_reported_as_duplicate() {
    let mut h = start().await;
    let first = call(&id());
    let again = LlmCall {
        // Same id in another spelling, and different content: the first one wins.
        call_id: first.call_id.to_uppercase(),
        input_tokens: 9999,
        ..first.clone()
    };

    let r1 = h
        .client
        .record(record(first.clone()))
        .await
        .unwrap()
        .into_inner();
    let r2 = h.client.record(record(again)).await.unwrap().into_inner();

    assert!(!r1.duplicate);
    assert!(r2.duplicate);
    assert_eq!(r2.call_id, first.call_id);
    assert_eq!(get(&mut h, &first.call_id).await.unwrap().input_tokens, 120);
}

fn expected_row(service: &str, model: &str, n: u64, errors: u64, p50: f64, p95: f64) -> UsageRow {
    UsageRow {
        service: service.into(),
        model: model.into(),
        calls: n,
        errors,
        input_tokens: 10 * n,
        output_tokens: 3 * n,
        latency_p50_ms: p50,
        latency_p95_ms: p95,
        // The mock's calls cost nothing, and are priced.
        cost_micros: 0,
        unpriced_calls: 0,
    }
}

#[tokio::test]
async fn a_stream_of_500_calls_gives_exact_usage() {
    let mut h = start().await;
    // vision/m1 gets latencies 1..=400 ms, answer/m2 gets 1..=100 ms, sent in a scrambled order;
    // every tenth vision call failed.
    let mut calls: Vec<LlmCall> = (1..=400)
        .map(|i| ("vision", "m1", i, i % 10 == 0))
        .chain((1..=100).map(|i| ("answer", "m2", i, false)))
        .map(|(service, model, latency, failed)| LlmCall {
            service: service.into(),
            model: model.into(),
            input_tokens: 10,
            output_tokens: 3,
            latency_ms: f64::from(latency),
            status: if failed {
                CallStatus::Error
            } else {
                CallStatus::Ok
            } as i32,
            error: if failed {
                "upstream 503".into()
            } else {
                String::new()
            },
            started_at: Some(at_ms(i64::from(latency))),
            ..call(&id())
        })
        .collect();
    calls.reverse();
    calls.swap(3, 450);
    // A call outside the window must not count.
    let outside = LlmCall {
        started_at: Some(at_ms(-3_600_000)),
        ..call(&id())
    };
    calls.push(outside);
    // And a repeat inside the stream is a duplicate.
    calls.push(calls[0].clone());

    let res = h
        .client
        .record_stream(record_stream(calls))
        .await
        .unwrap()
        .into_inner();
    let usage = h
        .client
        .usage(ecoscan_common::client::as_admin(UsageRequest {
            since: Some(at_ms(-1000)),
            until: Some(at_ms(1_000_000)),
        }))
        .await
        .unwrap()
        .into_inner();

    assert_eq!(res.recorded, 501);
    assert_eq!(res.duplicates, 1);
    assert_eq!(
        usage.rows,
        [
            expected_row("answer", "m2", 100, 0, 50.0, 95.0),
            expected_row("vision", "m1", 400, 40, 200.0, 380.0),
        ]
    );
    assert_eq!(usage.since, Some(at_ms(-1000)));
}

#[tokio::test]
async fn a_bad_stream_item_fails_the_stream_naming_its_index_and_keeps_the_calls_before_it() {
    let mut h = start().await;
    let good: Vec<LlmCall> = (0..3).map(|_| call(&id())).collect();
    let after = call(&id());
    let mut items = good.clone();
    items.push(LlmCall {
        model: String::new(),
        ..call(&id())
    });
    items.push(after.clone());

    let err = h
        .client
        .record_stream(record_stream(items))
        .await
        .unwrap_err();

    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("#3"), "{}", err.message());
    assert!(
        err.message().contains("model is empty"),
        "{}",
        err.message()
    );
    assert!(
        err.message().contains("3 calls before it were committed"),
        "{}",
        err.message()
    );
    for g in &good {
        assert_eq!(
            get(&mut h, &g.call_id).await.unwrap(),
            as_recorded(g.clone())
        );
    }
    assert_eq!(
        get(&mut h, &after.call_id).await.unwrap_err().code(),
        Code::NotFound
    );
}

#[tokio::test]
async fn invalid_calls_are_rejected_with_invalid_argument_and_not_stored() {
    let mut h = start().await;
    let cases: Vec<(LlmCall, &str)> = vec![
        (call(""), "call_id is empty"),
        (call("not-a-uuid"), "not a uuid"),
        (
            LlmCall {
                service: " ".into(),
                ..call(&id())
            },
            "service is empty",
        ),
        (
            LlmCall {
                model: String::new(),
                ..call(&id())
            },
            "model is empty",
        ),
        (
            LlmCall {
                latency_ms: -1.0,
                ..call(&id())
            },
            "latency_ms",
        ),
        (
            LlmCall {
                latency_ms: f64::NAN,
                ..call(&id())
            },
            "latency_ms",
        ),
        (
            LlmCall {
                ttft_ms: f64::INFINITY,
                ..call(&id())
            },
            "ttft_ms",
        ),
        (
            LlmCall {
                status: 42,
                ..call(&id())
            },
            "status 42",
        ),
        (
            LlmCall {
                error: "bad\0byte".into(),
                ..call(&id())
            },
            "error contains a NUL character",
        ),
    ];
    for (bad, needle) in cases {
        let err = h.client.record(record(bad.clone())).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{needle}");
        assert!(
            err.message().contains(needle),
            "{needle}: {}",
            err.message()
        );
        if uuid::Uuid::parse_str(&bad.call_id).is_ok() {
            assert_eq!(
                get(&mut h, &bad.call_id).await.unwrap_err().code(),
                Code::NotFound
            );
        }
    }
}

#[tokio::test]
async fn get_call_answers_not_found_for_unknown_and_invalid_argument_for_malformed_ids() {
    let mut h = start().await;
    assert_eq!(get(&mut h, &id()).await.unwrap_err().code(), Code::NotFound);
    assert_eq!(
        get(&mut h, "x").await.unwrap_err().code(),
        Code::InvalidArgument
    );
    assert_eq!(
        get(&mut h, "").await.unwrap_err().code(),
        Code::InvalidArgument
    );
}

#[tokio::test]
async fn usage_defaults_to_the_last_day_and_rejects_a_reversed_window() {
    let mut h = start().await;
    let recent = LlmCall {
        started_at: None,
        ..call(&id())
    };
    let old = call(&id()); // started in 2025, far outside the last day
    h.client.record(record(recent)).await.unwrap();
    h.client.record(record(old)).await.unwrap();

    let usage = h
        .client
        .usage(ecoscan_common::client::as_admin(UsageRequest::default()))
        .await
        .unwrap()
        .into_inner();
    let err = h
        .client
        .usage(ecoscan_common::client::as_admin(UsageRequest {
            since: Some(at_ms(1000)),
            until: Some(at_ms(0)),
        }))
        .await
        .unwrap_err();

    assert_eq!(usage.rows.len(), 1);
    assert_eq!(usage.rows[0].calls, 1);
    let (since, until) = (usage.since.unwrap(), usage.until.unwrap());
    assert_eq!(until.seconds - since.seconds, 24 * 3600);
    assert_eq!(err.code(), Code::InvalidArgument);
}

#[tokio::test]
async fn reading_calls_needs_the_admin_role() {
    let mut h = start().await;
    let id = id();
    h.client.record(record(call(&id))).await.unwrap();
    // A plain user (or no one) may record calls but not read anyone's.
    for request in [
        tonic::Request::new(UsageRequest::default()),
        ecoscan_common::client::request_as(UsageRequest::default(), Duration::from_secs(5), "eve"),
    ] {
        let err = h.client.usage(request).await.unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied);
        assert!(err.message().contains("admin"), "{}", err.message());
    }
    let err = h
        .client
        .get_call(GetCallRequest {
            call_id: id.clone(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::PermissionDenied);
    let got = h
        .client
        .get_call(ecoscan_common::client::as_admin(GetCallRequest {
            call_id: id,
        }))
        .await
        .unwrap();
    assert!(got.into_inner().call.is_some());
}

#[tokio::test]
async fn serves_health_and_reflection() {
    let h = start().await;
    assert_health_and_reflection(&h.server.uri(), "ecoscan.v1.AnalyticsService").await;
}

#[tokio::test]
async fn calls_are_priced_by_the_table_in_effect_and_an_unpriced_model_stays_unknown() {
    let prices = ecoscan_analytics::prices::PriceTable::from_json(
        Some("2025-01-01"),
        br#"{"gpt-4o-mini": {"input_cost_per_token": 1.5e-07, "output_cost_per_token": 6e-07}}"#,
    )
    .unwrap();
    let mut h = start_with(|c| Config {
        prices: std::sync::Arc::new(prices),
        ..c
    })
    .await;
    let priced = LlmCall {
        provider: "openai".into(),
        model: "gpt-4o-mini".into(),
        input_tokens: 1000,
        output_tokens: 500,
        // A caller's own figure is not taken.
        cost_micros: Some(1),
        price_version: "mine".into(),
        ..call(&id())
    };
    let unpriced = LlmCall {
        provider: "openai".into(),
        model: "gpt-unlisted".into(),
        ..call(&id())
    };
    for c in [&priced, &unpriced] {
        h.client.record(record(c.clone())).await.unwrap();
    }

    let back = get(&mut h, &priced.call_id).await.unwrap();
    assert_eq!(back.cost_micros, Some(450), "150 + 300 micro-dollars");
    assert!(
        back.price_version.starts_with("2025-01-01/"),
        "{}",
        back.price_version
    );
    let back = get(&mut h, &unpriced.call_id).await.unwrap();
    assert_eq!((back.cost_micros, back.price_version.as_str()), (None, ""));

    // Usage sums the known costs and counts the unknown ones apart.
    let usage = h
        .client
        .usage(ecoscan_common::client::as_admin(UsageRequest {
            since: Some(at_ms(-1000)),
            until: Some(at_ms(1000)),
        }))
        .await
        .unwrap()
        .into_inner();
    let row = |model: &str| {
        usage
            .rows
            .iter()
            .find(|r| r.model == model)
            .unwrap()
            .clone()
    };
    assert_eq!(
        (
            row("gpt-4o-mini").cost_micros,
            row("gpt-4o-mini").unpriced_calls
        ),
        (450, 0)
    );
    assert_eq!(
        (
            row("gpt-unlisted").cost_micros,
            row("gpt-unlisted").unpriced_calls
        ),
        (0, 1)
    );

    // And the metrics say both.
    let metrics = ecoscan_common::testing::scrape(h.server.addr).await;
    let value = |name: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{name} in {metrics}"))
    };
    assert_eq!(
        value("analytics_cost_micros_total{service=\"analytics\"} "),
        450.0
    );
    assert_eq!(
        value("analytics_calls_unpriced_total{service=\"analytics\"} "),
        1.0
    );
}
