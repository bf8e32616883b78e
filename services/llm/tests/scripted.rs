//! The OpenAI provider against a scripted, misbehaving OpenAI-compatible server on loopback:
//! every way real servers were seen to differ from OpenAI — a classification in a code fence or
//! in prose, a 400 to `json_schema`, streams without `[DONE]` or cut mid-answer, vLLM's
//! in-stream error objects, every retry hint, a server that hangs — and what goes with a
//! request (user agent, trace context without an empty `tracestate`).

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use axum::{
    Json, Router,
    body::Body,
    extract::{Path, State},
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::post,
};
use bytes::Bytes;
use ecoscan_llm::{
    AnswerChunk, AnswerInput, ClassifyInput, Llm, LlmConfig, LlmError, Locale, PropagateTrace,
    Provider, ResponseFormat, TaxonomyPath,
};
use serde_json::{Value, json};
use tokio_stream::StreamExt;

#[derive(Default)]
struct Server {
    hits: AtomicUsize,
    bodies: Mutex<Vec<Value>>,
    headers: Mutex<Vec<HeaderMap>>,
}

impl Server {
    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    fn body(&self, i: usize) -> Value {
        self.bodies.lock().unwrap()[i].clone()
    }
}

const CLASSIFICATION: &str = r#"{"major":"재활용폐기물","middle":"무색페트병","minor":"음료PET병","item_name":"a clear soda bottle","confidence":0.93,"situation_tags":["내용물_있음"]}"#;

fn completion(content: &str) -> Response {
    Json(json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "scripted-1",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 20},
    }))
    .into_response()
}

fn delta(text: &str) -> String {
    let chunk = json!({"model": "scripted-1", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]});
    format!("data: {chunk}\n\n")
}

fn finish() -> String {
    let chunk = json!({"model": "scripted-1", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]});
    format!("data: {chunk}\n\n")
}

fn usage() -> String {
    let chunk = json!({"model": "scripted-1", "choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 7}});
    format!("data: {chunk}\n\n")
}

const DONE: &str = "data: [DONE]\n\n";

/// A streamed response of `parts`, then the end of the body, or, with `hang`, nothing more
/// and no end.
fn sse(parts: Vec<String>, hang: bool) -> Response {
    let chunks = tokio_stream::iter(
        parts
            .into_iter()
            .map(|p| Ok::<_, std::io::Error>(Bytes::from(p))),
    );
    let body = if hang {
        Body::from_stream(chunks.chain(tokio_stream::pending()))
    } else {
        Body::from_stream(chunks)
    };
    ([(header::CONTENT_TYPE, "text/event-stream")], body).into_response()
}

fn too_many(headers: &[(&'static str, String)]) -> Response {
    let mut response = (StatusCode::TOO_MANY_REQUESTS, "slow down").into_response();
    for (k, v) in headers {
        response
            .headers_mut()
            .insert(*k, v.parse().expect("a header value"));
    }
    response
}

async fn completions(
    State(server): State<Arc<Server>>,
    Path(scenario): Path<String>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let hit = server.hits.fetch_add(1, Ordering::SeqCst);
    server.bodies.lock().unwrap().push(body.clone());
    server.headers.lock().unwrap().push(headers);
    let repair = body["messages"].as_array().map_or(0, Vec::len) > 2;
    let text = ["Rinse ", "the bottle, ", "remove the label."].map(delta);
    match scenario.as_str() {
        // Structured output in other dialects.
        "fenced" => completion(&format!("```json\n{CLASSIFICATION}\n```")),
        "prose" => completion(&format!(
            "Sure! Based on the photo, here is the classification: {CLASSIFICATION} Let me know if you need more."
        )),
        "prose-then-json" if !repair => completion("It is a clear plastic soda bottle."),
        "outside-then-inside" if !repair => completion(
            r#"{"major":"재활용폐기물","middle":"유리병","minor":"맥주병","item_name":"x","confidence":0.5,"situation_tags":[]}"#,
        ),
        "prose-then-json" | "outside-then-inside" => completion(CLASSIFICATION),
        "never-json" => completion("I think it is a bottle."),
        "no-json-schema" if body["response_format"]["type"] == "json_schema" => (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": {"message": "response_format json_schema is not supported", "code": 400}})),
        )
            .into_response(),
        "no-json-schema" => completion(CLASSIFICATION),
        "always-400" => (StatusCode::BAD_REQUEST, "bad request").into_response(),
        // Streams that end in each of the ways servers end them.
        "finish-no-done" => sse([text.to_vec(), vec![finish(), usage()]].concat(), false),
        "done-no-finish" => sse([text.to_vec(), vec![usage(), DONE.into()]].concat(), false),
        "finish-then-hang" => sse([text.to_vec(), vec![finish()]].concat(), true),
        "cut-mid-answer" => sse(text[..2].to_vec(), false),
        "cut-before-text" => sse(vec![], false),
        "hang-mid-answer" => sse(text[..1].to_vec(), true),
        // vLLM's in-stream error objects.
        "stream-500-once" if hit == 0 => sse(
            vec![r#"data: {"error": {"object": "error", "message": "engine died", "type": "InternalServerError", "code": 500}}"#.to_owned() + "\n\n"],
            false,
        ),
        "stream-400" => sse(
            vec![r#"data: {"error": {"message": "prompt too long", "code": 400}}"#.to_owned() + "\n\n"],
            false,
        ),
        "stream-429-after-text" => sse(
            [text[..1].to_vec(), vec![r#"data: {"error": {"message": "rate limited", "code": 429}}"#.to_owned() + "\n\n"]].concat(),
            false,
        ),
        // Every retry hint, once, then success.
        "hint-retry-after-date" if hit == 0 => {
            let at = std::time::SystemTime::now() + Duration::from_secs(2);
            too_many(&[("retry-after", httpdate::fmt_http_date(at))])
        }
        "hint-retry-after-ms" if hit == 0 => too_many(&[("retry-after-ms", "800".into())]),
        "hint-litellm" if hit == 0 => too_many(&[("llm_provider-retry-after", "1".into())]),
        "hint-reset-requests" if hit == 0 => too_many(&[
            ("x-ratelimit-remaining-requests", "0".into()),
            ("x-ratelimit-reset-requests", "1s".into()),
            ("x-ratelimit-remaining-tokens", "9000".into()),
            ("x-ratelimit-reset-tokens", "6m0s".into()),
        ]),
        "hint-reset-tokens" if hit == 0 => too_many(&[
            ("x-ratelimit-remaining-tokens", "0".into()),
            ("x-ratelimit-reset-tokens", "0.9s".into()),
        ]),
        "hang" => std::future::pending::<Response>().await,
        _ if body["stream"] == json!(true) => {
            sse([text.to_vec(), vec![finish(), usage(), DONE.into()]].concat(), false)
        }
        _ => completion(CLASSIFICATION),
    }
}

async fn start() -> (String, Arc<Server>) {
    ecoscan_common::telemetry::init_for_tests();
    let server = Arc::new(Server::default());
    let app = Router::new()
        .route("/{scenario}/v1/chat/completions", post(completions))
        .with_state(server.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), server)
}

fn config(base: &str, scenario: &str) -> LlmConfig {
    LlmConfig {
        provider: Provider::OpenAi,
        base_url: format!("{base}/{scenario}/v1"),
        api_key: Some("sk-test".into()),
        max_retries: 2,
        retry_base_delay: Duration::from_millis(10),
        // Generous: the machine may be slow; the tests are about outcomes and counts.
        retry_budget: Duration::from_secs(120),
        timeout: Duration::from_secs(30),
        ..LlmConfig::default()
    }
}

fn llm(config: LlmConfig) -> Llm {
    Llm::new(config, "test", None).unwrap()
}

fn classify_input() -> ClassifyInput {
    ClassifyInput {
        job_id: "job-1".into(),
        image: Bytes::from_static(b"\xff\xd8\xff\xe0 fake jpeg"),
        content_type: "image/jpeg".into(),
        hint: "bottle".into(),
        taxonomy: vec![
            TaxonomyPath {
                major: "재활용폐기물".into(),
                middle: "무색페트병".into(),
                minor: "음료PET병".into(),
                name_en: "Clear PET bottles".into(),
            },
            TaxonomyPath {
                major: "재활용폐기물".into(),
                middle: "유리병".into(),
                minor: "소주병".into(),
                name_en: "Glass bottles".into(),
            },
        ],
        situation_tags: vec!["내용물_있음".into()],
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

/// Reads an answer stream to its end: the text, and the usage or the error it ended with.
async fn read_answer(llm: &Llm) -> (String, Result<ecoscan_llm::AnswerUsage, LlmError>) {
    let mut stream = match llm.answer(answer_input()).await {
        Ok(s) => s,
        Err(e) => return (String::new(), Err(e)),
    };
    let mut text = String::new();
    let read = async {
        while let Some(chunk) = stream.next().await {
            match chunk {
                Ok(AnswerChunk::Delta(d)) => text.push_str(&d),
                Ok(AnswerChunk::Done(usage)) => return Ok(usage),
                Err(e) => return Err(e),
            }
        }
        panic!("the stream ended without Done or an error");
    };
    let end = tokio::time::timeout(Duration::from_secs(120), read)
        .await
        .expect("the answer ends");
    (text, end)
}

#[tokio::test]
async fn a_classification_in_a_code_fence_or_in_prose_is_read() {
    let (base, server) = start().await;
    for scenario in ["fenced", "prose"] {
        let out = llm(config(&base, scenario))
            .classify(classify_input())
            .await
            .unwrap_or_else(|e| panic!("{scenario}: {e}"));
        assert_eq!(out.minor, "음료PET병", "{scenario}");
        assert_eq!(out.confidence, 0.93);
    }
    assert_eq!(server.hits(), 2, "no repair was needed");
}

#[tokio::test]
async fn an_unreadable_answer_gets_one_repair_request_carrying_what_was_wrong() {
    let (base, server) = start().await;

    let out = llm(config(&base, "prose-then-json"))
        .classify(classify_input())
        .await
        .unwrap();

    assert_eq!(out.minor, "음료PET병");
    assert_eq!(server.hits(), 2);
    let repair = server.body(1);
    let messages = repair["messages"].as_array().unwrap();
    assert_eq!(messages[2]["content"], "It is a clear plastic soda bottle.");
    let ask = messages[3]["content"].as_str().unwrap();
    assert!(ask.contains("contains no JSON object"), "{ask}");
}

#[tokio::test]
async fn an_answer_outside_the_taxonomy_is_repaired_with_the_path_named() {
    let (base, server) = start().await;

    let out = llm(config(&base, "outside-then-inside"))
        .classify(classify_input())
        .await
        .unwrap();

    assert_eq!(
        (out.middle.as_str(), out.minor.as_str()),
        ("무색페트병", "음료PET병")
    );
    let ask = server.body(1)["messages"][3]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(ask.contains("\"맥주병\""), "{ask}");
    assert!(ask.contains("not one of the taxonomy paths"), "{ask}");
}

#[tokio::test]
async fn a_repair_is_asked_once_and_only_within_the_retry_budget() {
    let (base, server) = start().await;
    let err = llm(config(&base, "never-json"))
        .classify(classify_input())
        .await
        .unwrap_err();
    assert!(matches!(err, LlmError::Malformed(_)), "{err:?}");
    assert!(err.to_string().contains("after a repair request"), "{err}");
    assert!(!err.is_retryable());
    assert_eq!(server.hits(), 2, "one answer and one repair");

    // No retries allowed: no repair either.
    let (base, server) = start().await;
    let err = llm(LlmConfig {
        max_retries: 0,
        ..config(&base, "never-json")
    })
    .classify(classify_input())
    .await
    .unwrap_err();
    assert!(matches!(err, LlmError::Malformed(_)), "{err:?}");
    assert_eq!(server.hits(), 1);
}

#[tokio::test]
async fn a_400_to_json_schema_falls_back_to_json_object_once_and_is_remembered() {
    let (base, server) = start().await;
    let llm = llm(config(&base, "no-json-schema"));

    let first = llm.classify(classify_input()).await.unwrap();
    let second = llm.classify(classify_input()).await.unwrap();

    assert_eq!(first.minor, "음료PET병");
    assert_eq!(second.minor, "음료PET병");
    assert_eq!(server.hits(), 3, "one refusal, then json_object twice");
    assert_eq!(server.body(0)["response_format"]["type"], "json_schema");
    assert_eq!(server.body(1)["response_format"]["type"], "json_object");
    assert_eq!(
        server.body(2)["response_format"]["type"],
        "json_object",
        "the model's refusal is remembered"
    );
}

#[tokio::test]
async fn a_400_that_is_not_about_the_schema_still_fails_and_is_not_remembered() {
    let (base, server) = start().await;
    let llm = llm(config(&base, "always-400"));

    let err = llm.classify(classify_input()).await.unwrap_err();
    assert!(
        matches!(err, LlmError::Upstream { status: 400, .. }),
        "{err:?}"
    );
    let _ = llm.classify(classify_input()).await;
    assert_eq!(server.hits(), 4, "json_schema then json_object, each call");
    assert_eq!(server.body(2)["response_format"]["type"], "json_schema");
}

#[tokio::test]
async fn response_format_settings_choose_the_dialect_and_none_leaves_it_out() {
    let (base, server) = start().await;
    for format in [ResponseFormat::JsonObject, ResponseFormat::None] {
        llm(LlmConfig {
            response_format: format,
            ..config(&base, "prose")
        })
        .classify(classify_input())
        .await
        .unwrap();
    }
    assert_eq!(server.body(0)["response_format"]["type"], "json_object");
    assert!(server.body(1).get("response_format").is_none());
}

#[tokio::test]
async fn a_stream_ends_on_finish_reason_without_done_and_on_done_without_finish_reason() {
    let (base, server) = start().await;
    for scenario in ["finish-no-done", "done-no-finish", "finish-then-hang"] {
        let config = LlmConfig {
            // `finish-then-hang` waits a moment after its finish_reason (below the timeout).
            timeout: Duration::from_secs(2),
            ..config(&base, scenario)
        };
        let (text, end) = read_answer(&llm(config)).await;
        let usage = end.unwrap_or_else(|e| panic!("{scenario}: {e}"));
        assert_eq!(text, "Rinse the bottle, remove the label.", "{scenario}");
        if scenario != "finish-then-hang" {
            assert_eq!(
                (usage.input_tokens, usage.output_tokens),
                (50, 7),
                "{scenario}"
            );
        }
    }
    assert_eq!(server.hits(), 3, "nothing was retried");
}

#[tokio::test]
async fn a_stream_that_stays_open_after_its_finish_reason_completes_without_waiting_out_the_timeout()
 {
    // The chunk timeout is 30 s here; the answer is whole at its finish_reason, and only the
    // usage chunk and [DONE], which never come, are waited for a moment.
    let (base, server) = start().await;
    let (text, end) = tokio::time::timeout(
        Duration::from_secs(15),
        read_answer(&llm(config(&base, "finish-then-hang"))),
    )
    .await
    .expect("the answer completes soon after its finish_reason, not after the chunk timeout");
    end.expect("a complete answer");
    assert_eq!(text, "Rinse the bottle, remove the label.");
    assert_eq!(server.hits(), 1, "nothing was retried");
}

#[tokio::test]
async fn a_stream_cut_mid_answer_is_a_retryable_break_that_says_so() {
    let (base, server) = start().await;

    let (text, end) = read_answer(&llm(config(&base, "cut-mid-answer"))).await;

    let err = end.unwrap_err();
    assert_eq!(text, "Rinse the bottle, ");
    assert!(matches!(err, LlmError::Interrupted(_)), "{err:?}");
    assert!(err.is_retryable());
    let message = err.to_string();
    assert!(
        message.contains("18 characters") && message.contains("without finish_reason or [DONE]"),
        "{message}"
    );
    assert!(
        !message.contains("unreachable"),
        "it was reached: {message}"
    );
    assert_eq!(server.hits(), 1, "text went out: never retried here");
}

#[tokio::test]
async fn a_stream_that_ends_before_any_text_is_sent_again_within_the_budget() {
    let (base, server) = start().await;

    let (text, end) = read_answer(&llm(config(&base, "cut-before-text"))).await;

    let err = end.unwrap_err();
    assert!(text.is_empty());
    assert!(
        matches!(err, LlmError::RetriesExhausted { attempts: 3, .. }),
        "{err:?}"
    );
    assert!(matches!(err.cause(), LlmError::Interrupted(_)), "{err:?}");
    assert_eq!(server.hits(), 3, "one try and two retries");
}

#[tokio::test]
async fn in_stream_errors_are_mapped_by_their_code() {
    let (base, server) = start().await;
    // A 500 before any text: retried, and the second stream answers.
    let (text, end) = read_answer(&llm(config(&base, "stream-500-once"))).await;
    end.unwrap();
    assert_eq!(text, "Rinse the bottle, remove the label.");
    assert_eq!(server.hits(), 2);

    // A 400 is the request's fault: not retried.
    let (base, server) = start().await;
    let (_, end) = read_answer(&llm(config(&base, "stream-400"))).await;
    let err = end.unwrap_err();
    assert!(
        matches!(err, LlmError::Upstream { status: 400, .. }),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    assert_eq!(server.hits(), 1);

    // A 429 after text: retryable for the caller, not retried here.
    let (base, server) = start().await;
    let (text, end) = read_answer(&llm(config(&base, "stream-429-after-text"))).await;
    let err = end.unwrap_err();
    assert_eq!(text, "Rinse ");
    assert!(matches!(err, LlmError::RateLimited { .. }), "{err:?}");
    assert!(err.is_retryable());
    assert_eq!(server.hits(), 1);
}

#[tokio::test]
async fn every_retry_hint_is_honoured() {
    let (base, server) = start().await;
    // Each scenario asks for a wait of about a second once; the backoff alone would wait
    // 10 ms. Lower bounds only: a slow machine may take longer, never shorter.
    let cases = [
        ("hint-retry-after-date", Duration::from_millis(900)),
        ("hint-retry-after-ms", Duration::from_millis(750)),
        ("hint-litellm", Duration::from_millis(950)),
        ("hint-reset-requests", Duration::from_millis(950)),
        ("hint-reset-tokens", Duration::from_millis(850)),
    ];
    for (scenario, at_least) in cases {
        let before = server.hits();
        let started = Instant::now();
        llm(config(&base, scenario))
            .classify(classify_input())
            .await
            .unwrap_or_else(|e| panic!("{scenario}: {e}"));
        let waited = started.elapsed();
        assert_eq!(
            server.hits() - before,
            2,
            "{scenario}: one 429, one success"
        );
        assert!(waited >= at_least, "{scenario}: waited only {waited:?}");
        // Reset from the counter for the next scenario's `hit == 0`.
        server.hits.store(0, Ordering::SeqCst);
    }
}

#[tokio::test]
async fn a_hanging_server_times_out_within_the_configured_timeout() {
    let (base, _server) = start().await;
    let config = LlmConfig {
        timeout: Duration::from_millis(500),
        ..config(&base, "hang")
    };
    let err = tokio::time::timeout(
        Duration::from_secs(60),
        llm(config).classify(classify_input()),
    )
    .await
    .expect("the call ends")
    .unwrap_err();
    assert!(matches!(err.cause(), LlmError::Timeout(_)), "{err:?}");

    // A stream that stops sending after its first delta.
    let config = LlmConfig {
        timeout: Duration::from_millis(500),
        ..self::config(&base, "hang-mid-answer")
    };
    let (text, end) = read_answer(&llm(config)).await;
    assert_eq!(text, "Rinse ");
    assert!(matches!(end.unwrap_err(), LlmError::Timeout(_)));
}

#[tokio::test]
async fn requests_carry_the_user_agent_and_trace_context_without_an_empty_tracestate() {
    let (base, server) = start().await;
    let span = tracing::info_span!("test");
    let _guard = span.enter();

    llm(config(&base, "ok"))
        .classify(classify_input())
        .await
        .unwrap();
    llm(LlmConfig {
        propagate_trace: PropagateTrace::Never,
        ..config(&base, "ok")
    })
    .classify(classify_input())
    .await
    .unwrap();

    let headers = server.headers.lock().unwrap().clone();
    let ua = headers[0]["user-agent"].to_str().unwrap();
    assert_eq!(ua, format!("ecoscan/{}", env!("CARGO_PKG_VERSION")));
    assert!(
        headers[0].contains_key("traceparent"),
        "a loopback provider is ours: {:?}",
        headers[0]
    );
    assert!(
        !headers[0].contains_key("tracestate"),
        "an empty tracestate is left out: {:?}",
        headers[0]
    );
    assert!(
        !headers[1].contains_key("traceparent"),
        "LLM_PROPAGATE_TRACE=false"
    );
    assert!(!headers[1].contains_key("baggage"));
}

#[tokio::test]
async fn stream_options_can_be_left_out_for_servers_that_reject_them() {
    let (base, server) = start().await;
    let (_, end) = read_answer(&llm(LlmConfig {
        stream_options: false,
        ..config(&base, "ok")
    }))
    .await;
    end.unwrap();
    assert!(server.body(0).get("stream_options").is_none());
}
