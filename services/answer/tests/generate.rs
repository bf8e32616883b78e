//! `AnswerService.Generate` over a real socket with the mock provider.

use std::time::Duration;

use ecoscan_answer::{Config, serve};
use ecoscan_common::testing::{Spawned, assert_health_and_reflection, spawn};
use ecoscan_llm::{LlmConfig, Provider};
use ecoscan_proto::v1::{
    Answer, Classification, DisposalRules, GenerateRequest, GenerateResponse,
    answer_service_client::AnswerServiceClient, generate_response,
};
use tokio_stream::StreamExt;
use tonic::{Code, Status};

async fn start(
    llm: LlmConfig,
) -> (
    Spawned,
    AnswerServiceClient<ecoscan_common::client::TracedChannel>,
) {
    let config = Config {
        analytics_url: None,
        llm,
    };
    let server = spawn(|l, s| serve(config, l, s)).await;
    let client = AnswerServiceClient::new(ecoscan_common::client::channel(&server.uri()).unwrap());
    (server, client)
}

fn mock() -> LlmConfig {
    LlmConfig {
        mock_latency: Duration::from_millis(20),
        ..LlmConfig::default()
    }
}

fn classification() -> Classification {
    Classification {
        major_category: "재활용폐기물".into(),
        middle_category: "무색페트병".into(),
        minor_category: "음료PET병".into(),
        item_name: "음료PET병".into(),
        confidence: 0.9,
        situation_tags: vec!["내용물_있음".into()],
        provider: "mock".into(),
        model: "mock".into(),
    }
}

fn rules(locale: &str) -> DisposalRules {
    let (common, item, advice) = if locale == "en" {
        (
            "Rinse it with water",
            "Remove the label",
            "Empty what is left inside first",
        )
    } else {
        (
            "물로 헹궈 주세요",
            "라벨을 떼어 주세요",
            "남은 내용물을 먼저 비워 주세요",
        )
    };
    DisposalRules {
        locale: locale.into(),
        major_category: "재활용폐기물".into(),
        middle_category: "무색페트병".into(),
        minor_category: "음료PET병".into(),
        recyclable: true,
        stream_name: if locale == "en" {
            "clear PET bottles"
        } else {
            "무색페트병"
        }
        .into(),
        common_steps: vec![common.into()],
        item_steps: vec![item.into()],
        situation_advice: vec![advice.into()],
        ..DisposalRules::default()
    }
}

fn request(locale: &str) -> GenerateRequest {
    GenerateRequest {
        job_id: "job-1".into(),
        classification: Some(classification()),
        rules: Some(rules(if locale.is_empty() { "ko" } else { locale })),
        locale: locale.into(),
        ..GenerateRequest::default()
    }
}

/// Every event of one call, and the error that ended it (if any).
async fn generate(
    client: &mut AnswerServiceClient<ecoscan_common::client::TracedChannel>,
    req: GenerateRequest,
) -> (Vec<GenerateResponse>, Option<Status>) {
    let mut stream = match client.generate(req).await {
        Ok(r) => r.into_inner(),
        Err(status) => return (Vec::new(), Some(status)),
    };
    let mut events = Vec::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(e) => events.push(e),
            Err(status) => return (events, Some(status)),
        }
    }
    (events, None)
}

/// Asserts the stream shape (progress, deltas, one answer last) and returns the deltas and answer.
fn split(events: Vec<GenerateResponse>) -> (String, Answer) {
    let mut events = events.into_iter().map(|e| e.event.expect("event is set"));
    let Some(generate_response::Event::Progress(p)) = events.next() else {
        panic!("first event is not progress");
    };
    assert_eq!(p.step, "compose_prompt");
    let mut deltas = String::new();
    let mut count = 0;
    for event in events {
        match event {
            generate_response::Event::Delta(d) => {
                count += 1;
                deltas.push_str(&d);
            }
            generate_response::Event::Answer(a) => {
                assert!(count > 3, "text was not streamed in pieces");
                return (deltas, a);
            }
            generate_response::Event::Progress(p) => panic!("unexpected progress {p:?}"),
        }
    }
    panic!("no final answer");
}

#[tokio::test]
async fn korean_answer_deltas_add_up_to_the_final_text_marked_as_mock() {
    let (server, mut client) = start(mock()).await;

    let (events, error) = generate(&mut client, request("ko")).await;

    assert!(error.is_none(), "{error:?}");
    let (deltas, answer) = split(events);
    assert_eq!(deltas, answer.text);
    assert!(
        answer.text.starts_with("[모의 응답 · mock] "),
        "{}",
        answer.text
    );
    assert!(
        answer.text.contains("1. 물로 헹궈 주세요"),
        "{}",
        answer.text
    );
    assert_eq!(
        answer.steps,
        [
            "물로 헹궈 주세요",
            "라벨을 떼어 주세요",
            "남은 내용물을 먼저 비워 주세요"
        ]
    );
    assert!(
        answer.message.starts_with("[모의 응답 · mock] "),
        "{}",
        answer.message
    );
    assert!(answer.message.contains("무색페트병"), "{}", answer.message);
    assert_eq!(
        (answer.locale.as_str(), answer.provider.as_str()),
        ("ko", "mock")
    );
    assert_eq!(answer.model, "mock");
    server.stop().await.unwrap();
}

#[tokio::test]
async fn english_answer_deltas_add_up_to_the_final_text_marked_as_mock() {
    let (server, mut client) = start(mock()).await;

    let (events, error) = generate(&mut client, request("en")).await;

    assert!(error.is_none(), "{error:?}");
    let (deltas, answer) = split(events);
    assert_eq!(deltas, answer.text);
    assert!(answer.text.starts_with("[mock answer] "), "{}", answer.text);
    assert!(
        answer.text.contains("3. Empty what is left inside first"),
        "{}",
        answer.text
    );
    assert_eq!(answer.steps.len(), 3);
    assert_eq!(
        answer.message,
        "[mock answer] Put 음료PET병 out with clear PET bottles."
    );
    assert_eq!(answer.locale, "en");
    server.stop().await.unwrap();
}

#[tokio::test]
async fn an_empty_locale_answers_in_korean() {
    let (server, mut client) = start(mock()).await;

    let (events, error) = generate(&mut client, request("")).await;

    assert!(error.is_none(), "{error:?}");
    let (_, answer) = split(events);
    assert_eq!(answer.locale, "ko");
    assert!(answer.text.starts_with("[모의 응답 · mock] "));
    server.stop().await.unwrap();
}

#[tokio::test]
async fn bad_requests_are_refused_with_invalid_argument_and_a_clear_message() {
    let (server, mut client) = start(mock()).await;
    let no_category = GenerateRequest {
        classification: Some(Classification::default()),
        ..request("ko")
    };
    let cases = [
        (
            GenerateRequest {
                classification: None,
                ..request("ko")
            },
            "classification is missing",
        ),
        (
            GenerateRequest {
                rules: None,
                ..request("ko")
            },
            "rules are missing",
        ),
        (request("fr"), "locale \"fr\" is not supported"),
        (no_category, "names no category"),
    ];

    for (req, needle) in cases {
        let (events, error) = generate(&mut client, req).await;
        let status = error.expect("bad request must fail");
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().contains(needle),
            "{:?} lacks {needle:?}",
            status.message()
        );
        assert!(events.is_empty(), "no events for a refused request");
    }
    server.stop().await.unwrap();
}

#[tokio::test]
async fn an_unreachable_model_provider_is_unavailable() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let (server, mut client) = start(LlmConfig {
        provider: Provider::OpenAi,
        base_url: format!("http://{dead}/v1"),
        max_retries: 0,
        ..LlmConfig::default()
    })
    .await;

    let (events, error) = generate(&mut client, request("en")).await;

    let status = error.expect("must fail without a provider");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("model provider"),
        "{}",
        status.message()
    );
    // The model client spent its retries (none, here): the caller is told not to add its own.
    assert!(
        ecoscan_common::codes::already_retried(&status),
        "{status:?}"
    );
    assert!(
        !events
            .iter()
            .any(|e| matches!(e.event, Some(generate_response::Event::Answer(_)))),
        "no answer may be sent"
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn answer_serves_health_and_reflection() {
    let (server, _client) = start(mock()).await;

    assert_health_and_reflection(&server.uri(), "ecoscan.v1.AnswerService").await;
    server.stop().await.unwrap();
}

/// A loopback Chat Completions provider that answers every request 429 with `Retry-After: 0.1`
/// (plain HTTP/1.1 over a socket, one request per connection), counting the requests.
async fn start_rate_limited_provider() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = hits.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let hits = counted.clone();
            tokio::spawn(async move {
                // Read the head and the body it announces, then answer.
                let mut request = Vec::new();
                let mut buf = [0u8; 8192];
                loop {
                    let Ok(n) = socket.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    request.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&request);
                    if let Some(end) = text.find("\r\n\r\n") {
                        let length = text[..end]
                            .lines()
                            .find_map(|l| {
                                let (name, value) = l.split_once(':')?;
                                name.eq_ignore_ascii_case("content-length")
                                    .then(|| value.trim().parse::<usize>().ok())?
                            })
                            .unwrap_or(0);
                        if request.len() >= end + 4 + length {
                            break;
                        }
                    }
                }
                hits.fetch_add(1, Ordering::SeqCst);
                let body = "rate limit reached";
                let response = format!(
                    "HTTP/1.1 429 Too Many Requests\r\nretry-after: 0.1\r\ncontent-type: text/plain\r\n\
                     content-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(response.as_bytes()).await;
                let _ = socket.shutdown().await;
            });
        }
    });
    (format!("http://{addr}"), hits)
}

#[tokio::test]
async fn a_provider_rate_limit_outlasting_the_retries_costs_one_plus_max_retries_calls_and_is_marked_as_retried()
 {
    let (base, hits) = start_rate_limited_provider().await;
    let (server, mut client) = start(LlmConfig {
        provider: Provider::OpenAi,
        base_url: format!("{base}/v1"),
        max_retries: 2,
        retry_base_delay: Duration::from_millis(10),
        retry_budget: Duration::from_secs(600),
        ..LlmConfig::default()
    })
    .await;

    let (_, error) = generate(&mut client, request("en")).await;

    let status = error.expect("a rate limit that never lifts fails the call");
    // One model call per Generate: the first try and LLM_MAX_RETRIES retries, no more.
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 1 + 2);
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        ecoscan_common::codes::already_retried(&status),
        "the caller is told not to retry on top: {status:?}"
    );
    assert!(!ecoscan_common::codes::worth_retrying(&status));
    assert!(
        status.message().contains("rate limit") && status.message().contains("3 attempts"),
        "{}",
        status.message()
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn a_chosen_model_must_be_offered_and_writes_the_answer() {
    let (server, mut client) = start(LlmConfig {
        offered: ecoscan_common::models::OfferedModels::parse("mini,large").unwrap(),
        ..mock()
    })
    .await;

    let (events, error) = generate(
        &mut client,
        GenerateRequest {
            model: "huge".into(),
            ..request("en")
        },
    )
    .await;
    let status = error.expect("an unoffered model is refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("mini, large"), "{status:?}");
    assert!(events.is_empty(), "nothing streamed");

    let (events, error) = generate(
        &mut client,
        GenerateRequest {
            model: "large".into(),
            ..request("en")
        },
    )
    .await;
    assert!(error.is_none(), "{error:?}");
    let (_, answer) = split(events);
    assert_eq!(
        (answer.provider.as_str(), answer.model.as_str()),
        ("mock", "large")
    );
    assert!(
        answer.text.starts_with("[mock answer] "),
        "still says it is the mock"
    );
    server.stop().await.unwrap();
}
