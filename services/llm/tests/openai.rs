//! The OpenAI provider against an in-test server that speaks the Chat Completions wire format.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    Json, Router,
    extract::{Path, State},
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::post,
};
use bytes::Bytes;
use ecoscan_llm::{
    AnswerChunk, AnswerInput, ClassifyInput, Llm, LlmConfig, LlmError, Locale, Provider,
    TaxonomyPath,
};
use serde_json::{Value, json};
use tokio_stream::StreamExt;

#[derive(Default)]
struct Fake {
    hits: AtomicUsize,
    /// Requests answered 429 by the `by-hint` scenario.
    limited_hits: AtomicUsize,
    last_body: Mutex<Option<Value>>,
    last_headers: Mutex<Option<HeaderMap>>,
}

/// A classify hint that makes the `by-hint` scenario answer 429 with `Retry-After: 120`.
const RATE_LIMIT_ME: &str = "please-rate-limit-me";

async fn completions(
    State(fake): State<Arc<Fake>>,
    Path(scenario): Path<String>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let hit = fake.hits.fetch_add(1, Ordering::SeqCst);
    *fake.last_body.lock().unwrap() = Some(body.clone());
    *fake.last_headers.lock().unwrap() = Some(headers);
    match scenario.as_str() {
        "ratelimited-once" if hit == 0 => (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, "1")],
            "slow down",
        )
            .into_response(),
        "down" => (StatusCode::SERVICE_UNAVAILABLE, "overloaded").into_response(),
        "always-429" => (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, "1")],
            "slow down",
        )
            .into_response(),
        "always-429-fast" => (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, "0.1")],
            "slow down",
        )
            .into_response(),
        "always-429-long" => (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, "120")],
            "slow down",
        )
            .into_response(),
        "by-hint" if body.to_string().contains(RATE_LIMIT_ME) => {
            fake.limited_hits.fetch_add(1, Ordering::SeqCst);
            (
                StatusCode::TOO_MANY_REQUESTS,
                [(header::RETRY_AFTER, "120")],
                "slow down",
            )
                .into_response()
        }
        "garbage" => (StatusCode::OK, "this is not json").into_response(),
        "unauthorized" => (StatusCode::UNAUTHORIZED, "bad key").into_response(),
        _ if body["stream"] == json!(true) => sse_answer(),
        _ => classification(),
    }
}

fn classification() -> Response {
    let content = json!({
        "major": "재활용폐기물",
        "middle": "무색페트병",
        "minor": "음료PET병",
        "item_name": "a clear soda bottle",
        "confidence": 0.87,
        "situation_tags": ["내용물_있음"],
    })
    .to_string();
    Json(json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1200, "completion_tokens": 40, "total_tokens": 1240},
    }))
    .into_response()
}

fn sse_answer() -> Response {
    let mut body = String::new();
    for piece in ["Rinse ", "the bottle, ", "remove the label."] {
        let chunk = json!({"model": "gpt-4o-mini-2024-07-18", "choices": [{"index": 0, "delta": {"content": piece}}]});
        body.push_str(&format!("data: {chunk}\n\n"));
    }
    let usage = json!({"model": "gpt-4o-mini-2024-07-18", "choices": [], "usage": {"prompt_tokens": 90, "completion_tokens": 9}});
    body.push_str(&format!("data: {usage}\n\ndata: [DONE]\n\n"));
    ([(header::CONTENT_TYPE, "text/event-stream")], body).into_response()
}

async fn start_fake() -> (String, Arc<Fake>) {
    ecoscan_common::telemetry::init_for_tests();
    let fake = Arc::new(Fake::default());
    let app = Router::new()
        .route("/{scenario}/v1/chat/completions", post(completions))
        .with_state(fake.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), fake)
}

fn llm(base: &str, scenario: &str) -> Llm {
    let config = LlmConfig {
        provider: Provider::OpenAi,
        base_url: format!("{base}/{scenario}/v1"),
        api_key: Some("sk-test".into()),
        max_retries: 2,
        retry_base_delay: Duration::from_millis(10),
        timeout: Duration::from_secs(5),
        ..LlmConfig::default()
    };
    Llm::new(config, "test", None).unwrap()
}

fn taxonomy() -> Vec<TaxonomyPath> {
    vec![
        TaxonomyPath {
            major: "재활용폐기물".into(),
            middle: "무색페트병".into(),
            minor: "음료PET병".into(),
            name_en: "Clear PET bottles".into(),
        },
        TaxonomyPath {
            major: "음식물류폐기물".into(),
            middle: String::new(),
            minor: "과일껍질".into(),
            name_en: "Food waste".into(),
        },
    ]
}

fn classify_input() -> ClassifyInput {
    ClassifyInput {
        job_id: "job-1".into(),
        image: Bytes::from_static(b"\xff\xd8\xff\xe0 fake jpeg"),
        content_type: "image/jpeg".into(),
        hint: "bottle".into(),
        taxonomy: taxonomy(),
        situation_tags: vec!["내용물_있음".into(), "뚜껑_열림".into()],
        model: None,
    }
}

fn answer_input() -> AnswerInput {
    AnswerInput {
        job_id: "job-1".into(),
        locale: Locale::En,
        system_prompt: "You write disposal instructions.".into(),
        user_prompt: "Clear PET bottle".into(),
        subject: "PET bottle".into(),
        steps: vec!["Rinse".into()],
        model: None,
    }
}

#[tokio::test]
async fn classify_sends_the_image_and_a_strict_schema_and_parses_the_answer() {
    let (base, fake) = start_fake().await;

    let out = llm(&base, "ok").classify(classify_input()).await.unwrap();

    assert_eq!(
        (out.major.as_str(), out.middle.as_str(), out.minor.as_str()),
        ("재활용폐기물", "무색페트병", "음료PET병")
    );
    assert_eq!(out.provider, "openai");
    assert_eq!(out.model, "gpt-4o-mini-2024-07-18");
    assert_eq!(out.situation_tags, vec!["내용물_있음"]);
    let body = fake.last_body.lock().unwrap().clone().unwrap();
    let format = &body["response_format"];
    assert_eq!(format["type"], "json_schema");
    assert_eq!(format["json_schema"]["strict"], true);
    let schema = &format["json_schema"]["schema"];
    assert_eq!(
        schema["properties"]["minor"]["enum"],
        json!(["음료PET병", "과일껍질"])
    );
    assert_eq!(
        schema["properties"]["middle"]["enum"],
        json!(["무색페트병", ""])
    );
    assert_eq!(
        schema["properties"]["situation_tags"]["items"]["enum"],
        json!(["내용물_있음", "뚜껑_열림"])
    );
    let url = body["messages"][1]["content"][1]["image_url"]["url"]
        .as_str()
        .unwrap();
    assert!(url.starts_with("data:image/jpeg;base64,/9j/"), "{url}");
    let headers = fake.last_headers.lock().unwrap().clone().unwrap();
    assert_eq!(headers["authorization"], "Bearer sk-test");
    assert!(
        headers.contains_key("traceparent"),
        "trace context not propagated"
    );
}

#[tokio::test]
async fn answer_streams_the_deltas_then_usage_and_time_to_first_token() {
    let (base, fake) = start_fake().await;

    let mut stream = llm(&base, "ok").answer(answer_input()).await.unwrap();
    let mut text = String::new();
    let mut done = None;
    while let Some(chunk) = stream.next().await {
        match chunk.unwrap() {
            AnswerChunk::Delta(d) => text.push_str(&d),
            AnswerChunk::Done(usage) => done = Some(usage),
        }
    }

    assert_eq!(text, "Rinse the bottle, remove the label.");
    let usage = done.expect("a final usage item");
    assert_eq!((usage.input_tokens, usage.output_tokens), (90, 9));
    assert_eq!(usage.provider, "openai");
    assert!(usage.ttft.is_some());
    let body = fake.last_body.lock().unwrap().clone().unwrap();
    assert_eq!(body["stream"], true);
    assert_eq!(body["stream_options"]["include_usage"], true);
}

#[tokio::test]
async fn a_429_with_retry_after_is_retried_after_the_requested_wait() {
    let (base, fake) = start_fake().await;
    let started = Instant::now();

    let out = llm(&base, "ratelimited-once")
        .classify(classify_input())
        .await;

    assert!(out.is_ok(), "{out:?}");
    assert_eq!(fake.hits.load(Ordering::SeqCst), 2);
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "Retry-After: 1 not honoured"
    );
}

#[tokio::test]
async fn a_server_error_that_persists_exhausts_the_retries_and_fails() {
    let (base, fake) = start_fake().await;

    let err = llm(&base, "down")
        .classify(classify_input())
        .await
        .unwrap_err();

    assert!(
        matches!(err, LlmError::RetriesExhausted { attempts: 3, .. }),
        "{err:?}"
    );
    assert!(
        matches!(err.cause(), LlmError::Upstream { status: 503, .. }),
        "{err:?}"
    );
    assert!(err.is_retryable());
    // One try and two retries.
    assert_eq!(fake.hits.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn a_client_error_is_not_retried() {
    let (base, fake) = start_fake().await;

    let err = llm(&base, "unauthorized")
        .answer(answer_input())
        .await
        .err()
        .unwrap();

    assert!(
        matches!(err, LlmError::Upstream { status: 401, .. }),
        "{err:?}"
    );
    assert_eq!(fake.hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_body_that_is_not_a_completion_is_malformed() {
    let (base, _fake) = start_fake().await;

    let err = llm(&base, "garbage")
        .classify(classify_input())
        .await
        .unwrap_err();

    assert!(matches!(err, LlmError::Malformed(_)), "{err:?}");
}

#[tokio::test]
async fn an_unreachable_provider_is_a_transport_error() {
    // Bind and drop a listener to get a port nothing listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let config = LlmConfig {
        provider: Provider::OpenAi,
        base_url: format!("http://127.0.0.1:{port}/v1"),
        max_retries: 1,
        retry_base_delay: Duration::from_millis(1),
        ..LlmConfig::default()
    };
    let llm = Llm::new(config, "test", None).unwrap();

    let err = llm.classify(classify_input()).await.unwrap_err();

    assert!(matches!(err.cause(), LlmError::Transport(_)), "{err:?}");
    assert!(err.retries_exhausted(), "connect errors are retried here");
}

fn rate_limited_llm(base: &str, scenario: &str, max_retries: usize) -> Llm {
    let config = LlmConfig {
        provider: Provider::OpenAi,
        base_url: format!("{base}/{scenario}/v1"),
        max_retries,
        retry_base_delay: Duration::from_millis(10),
        // Generous: the machine may be slow, and this test is about counts.
        retry_budget: Duration::from_secs(600),
        timeout: Duration::from_secs(60),
        ..LlmConfig::default()
    };
    Llm::new(config, "test", None).unwrap()
}

#[tokio::test]
async fn a_provider_that_always_answers_429_gets_exactly_one_plus_max_retries_requests() {
    let (base, fake) = start_fake().await;
    let started = Instant::now();

    let err = rate_limited_llm(&base, "always-429", 3)
        .classify(classify_input())
        .await
        .unwrap_err();

    assert_eq!(fake.hits.load(Ordering::SeqCst), 1 + 3);
    assert!(err.retries_exhausted(), "{err:?}");
    assert!(
        matches!(err, LlmError::RetriesExhausted { attempts: 4, .. }),
        "{err:?}"
    );
    assert!(
        matches!(err.cause(), LlmError::RateLimited { retry_after: Some(d) } if *d == Duration::from_secs(1)),
        "{err:?}"
    );
    assert!(err.is_retryable(), "a later call may succeed");
    // Three waits of `Retry-After: 1` (a lower bound only: the machine may be slow).
    assert!(
        started.elapsed() >= Duration::from_millis(2_900),
        "Retry-After not honoured"
    );
}

#[tokio::test]
async fn a_streamed_answer_rate_limited_throughout_also_stops_after_its_retries() {
    let (base, fake) = start_fake().await;

    let err = rate_limited_llm(&base, "always-429-fast", 2)
        .answer(answer_input())
        .await
        .err()
        .unwrap();

    assert_eq!(fake.hits.load(Ordering::SeqCst), 1 + 2);
    assert!(
        matches!(err, LlmError::RetriesExhausted { attempts: 3, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("(retry after 0.1s)"), "{err}");
}

#[tokio::test]
async fn a_retry_after_longer_than_the_budget_fails_at_once_without_waiting() {
    let (base, fake) = start_fake().await;
    let config = LlmConfig {
        provider: Provider::OpenAi,
        base_url: format!("{base}/always-429-long/v1"),
        max_retries: 3,
        retry_budget: Duration::from_secs(30),
        ..LlmConfig::default()
    };
    let llm = Llm::new(config, "test", None).unwrap();

    // Were the 120 s wait started, this would not end within the deadline.
    let err = tokio::time::timeout(Duration::from_secs(60), llm.classify(classify_input()))
        .await
        .expect("the call gives up instead of waiting past its budget")
        .unwrap_err();

    assert_eq!(fake.hits.load(Ordering::SeqCst), 1);
    assert!(
        matches!(err, LlmError::RetriesExhausted { attempts: 1, .. }),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_call_waiting_to_retry_does_not_hold_the_concurrency_permit() {
    let (base, fake) = start_fake().await;
    let config = LlmConfig {
        provider: Provider::OpenAi,
        base_url: format!("{base}/by-hint/v1"),
        max_concurrency: 1,
        max_retries: 3,
        retry_budget: Duration::from_secs(3_600),
        timeout: Duration::from_secs(60),
        ..LlmConfig::default()
    };
    let llm = Llm::new(config, "test", None).unwrap();

    // The first call is answered 429 with `Retry-After: 120` and goes to sleep.
    let limited = {
        let llm = llm.clone();
        tokio::spawn(async move {
            llm.classify(ClassifyInput {
                hint: RATE_LIMIT_ME.into(),
                ..classify_input()
            })
            .await
        })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while fake.limited_hits.load(Ordering::SeqCst) == 0 {
        assert!(
            Instant::now() < deadline,
            "the first call never reached the provider"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // With one permit, a second call gets through only if the sleeper gave its permit up.
    let out = tokio::time::timeout(Duration::from_secs(60), llm.classify(classify_input()))
        .await
        .expect("the second call was not blocked by the sleeping one");

    assert!(out.is_ok(), "{out:?}");
    assert!(
        !limited.is_finished(),
        "the first call is still waiting out its Retry-After"
    );
    assert_eq!(fake.limited_hits.load(Ordering::SeqCst), 1);
    limited.abort();
}
