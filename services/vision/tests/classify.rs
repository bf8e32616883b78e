//! `VisionService.Classify` over a real socket, with an in-test rule service (the upstream that
//! owns the taxonomy) and, for the openai provider, an in-test Chat Completions server.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use axum::{Json, Router, extract::Path, response::IntoResponse, routing::post};
use ecoscan_common::testing::{Spawned, assert_health_and_reflection, spawn};
use ecoscan_llm::{LlmConfig, Provider};
use ecoscan_proto::v1::{
    Category, Classification, ClassifyRequest, ClassifyResponse, ListCategoriesRequest,
    ListCategoriesResponse, LookupRequest, LookupResponse, classify_response,
    rule_service_server::{RuleService, RuleServiceServer},
    vision_service_client::VisionServiceClient,
};
use ecoscan_vision::{Config, serve};
use serde_json::{Value, json};
use tokio_stream::{StreamExt, wrappers::ReceiverStream};
use tonic::{Code, Request, Response, Status, service::Routes};

const JPEG: &[u8] = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00 pretend jpeg body";

/// Test double of the rule service: a small taxonomy, and a count of how often it was asked.
#[derive(Clone, Default)]
struct Rules {
    list_calls: Arc<AtomicUsize>,
}

#[tonic::async_trait]
impl RuleService for Rules {
    type LookupStream = ReceiverStream<Result<LookupResponse, Status>>;

    async fn lookup(
        &self,
        _: Request<LookupRequest>,
    ) -> Result<Response<Self::LookupStream>, Status> {
        Err(Status::unimplemented("not part of this test double"))
    }

    async fn list_categories(
        &self,
        _: Request<ListCategoriesRequest>,
    ) -> Result<Response<ListCategoriesResponse>, Status> {
        self.list_calls.fetch_add(1, Ordering::SeqCst);
        let category = |major: &str, middle: &str, en: &str, items: &[&str]| Category {
            major_category: major.into(),
            middle_category: middle.into(),
            name_en: en.into(),
            recyclable: !middle.is_empty(),
            items: items.iter().map(|s| (*s).to_owned()).collect(),
            ..Default::default()
        };
        Ok(Response::new(ListCategoriesResponse {
            categories: vec![
                category("재활용폐기물", "종이", "Paper", &["신문지", "책자"]),
                category(
                    "재활용폐기물",
                    "무색페트병",
                    "Clear PET bottles",
                    &["먹는샘물PET병", "음료PET병"],
                ),
                category("음식물류폐기물", "", "Food waste", &["과일껍질"]),
            ],
            situation_tags: vec!["내용물_있음".into(), "뚜껑_열림".into()],
        }))
    }
}

async fn start_rules() -> (Spawned, Rules) {
    let rules = Rules::default();
    let svc = RuleServiceServer::new(rules.clone());
    let server = spawn(|l, s| {
        ecoscan_common::server::serve(Routes::new(svc), &["ecoscan.v1.RuleService"], l, s)
    })
    .await;
    (server, rules)
}

fn mock_llm() -> LlmConfig {
    LlmConfig {
        mock_latency: Duration::from_millis(10),
        ..LlmConfig::default()
    }
}

async fn start_vision(
    rule_url: String,
    llm: LlmConfig,
) -> (
    Spawned,
    VisionServiceClient<ecoscan_common::client::TracedChannel>,
) {
    let config = Config {
        rule_url,
        analytics_url: None,
        llm,
    };
    let server = spawn(|l, s| serve(config, l, s)).await;
    let client = VisionServiceClient::new(ecoscan_common::client::channel(&server.uri()).unwrap());
    (server, client)
}

/// Every event of one call, and the error that ended it (if any).
async fn classify(
    client: &mut VisionServiceClient<ecoscan_common::client::TracedChannel>,
    req: ClassifyRequest,
) -> (Vec<ClassifyResponse>, Option<Status>) {
    let mut stream = match client.classify(req).await {
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

fn request(image: &[u8], content_type: &str, hint: &str) -> ClassifyRequest {
    ClassifyRequest {
        job_id: "job-1".into(),
        image: image.to_vec(),
        content_type: content_type.into(),
        hint: hint.into(),
        ..ClassifyRequest::default()
    }
}

fn final_classification(events: &[ClassifyResponse]) -> &Classification {
    match events.last().and_then(|e| e.event.as_ref()) {
        Some(classify_response::Event::Classification(c)) => c,
        other => panic!("last event is not a classification: {other:?}"),
    }
}

#[tokio::test]
async fn a_pet_bottle_hint_is_classified_with_progress_in_order_and_marked_mock() {
    let (rules, _) = start_rules().await;
    let (server, mut client) = start_vision(rules.uri(), mock_llm()).await;

    let (events, error) = classify(
        &mut client,
        request(JPEG, "image/jpeg", "페트병 내용물 있음"),
    )
    .await;

    assert!(error.is_none(), "{error:?}");
    let steps: Vec<&str> = events
        .iter()
        .filter_map(|e| match &e.event {
            Some(classify_response::Event::Progress(p)) => Some(p.step.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        steps,
        [
            "validate_image",
            "load_taxonomy",
            "model_call",
            "validate_output"
        ]
    );
    let c = final_classification(&events);
    assert_eq!(
        (
            c.major_category.as_str(),
            c.middle_category.as_str(),
            c.minor_category.as_str()
        ),
        ("재활용폐기물", "무색페트병", "음료PET병")
    );
    assert_eq!((c.provider.as_str(), c.model.as_str()), ("mock", "mock"));
    assert_eq!(c.situation_tags, vec!["내용물_있음"]);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn the_taxonomy_is_fetched_once_and_reused() {
    let (rules_server, rules) = start_rules().await;
    let (server, mut client) = start_vision(rules_server.uri(), mock_llm()).await;

    for hint in ["newspaper", "과일껍질"] {
        let (events, error) = classify(&mut client, request(JPEG, "image/jpeg", hint)).await;
        assert!(error.is_none(), "{error:?}");
        final_classification(&events);
    }

    assert_eq!(rules.list_calls.load(Ordering::SeqCst), 1);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn bad_uploads_are_refused_with_invalid_argument_before_any_work() {
    let (rules_server, rules) = start_rules().await;
    let (server, mut client) = start_vision(rules_server.uri(), mock_llm()).await;
    let cases = [
        (request(b"", "image/jpeg", ""), "empty"),
        (
            request(b"%PDF-1.7 not a photo", "image/png", ""),
            "not a JPEG, PNG",
        ),
        (request(JPEG, "text/plain", ""), "not supported"),
        (request(JPEG, "", ""), "not supported"),
    ];

    for (req, needle) in cases {
        let (events, error) = classify(&mut client, req).await;
        let status = error.expect("bad upload must fail");
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(
            status.message().contains(needle),
            "{:?} lacks {needle:?}",
            status.message()
        );
        assert!(events.is_empty(), "no progress for refused input");
    }

    assert_eq!(
        rules.list_calls.load(Ordering::SeqCst),
        0,
        "refused input did work"
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn an_unreachable_rule_service_is_unavailable_with_a_clear_message() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let (server, mut client) = start_vision(dead, mock_llm()).await;

    let (_, error) = classify(&mut client, request(JPEG, "image/jpeg", "")).await;

    let status = error.expect("must fail without the rule service");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status.message().contains("rule service"),
        "{}",
        status.message()
    );
    server.stop().await.unwrap();
}

/// An in-test Chat Completions server whose answer is chosen by the path.
async fn start_fake_openai() -> String {
    async fn complete(Path(scenario): Path<String>, Json(_): Json<Value>) -> impl IntoResponse {
        let (middle, minor, tags) = match scenario.as_str() {
            "outside" => ("무색페트병", "유색페트병", json!([])),
            _ => (
                "무색페트병",
                "음료PET병",
                json!(["뚜껑_열림", "made_up_tag"]),
            ),
        };
        let content = json!({
            "major": "재활용폐기물", "middle": middle, "minor": minor,
            "item_name": "bottle", "confidence": 0.8, "situation_tags": tags,
        })
        .to_string();
        Json(json!({
            "model": "fake-vision-1",
            "choices": [{"message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5},
        }))
    }
    let app = Router::new().route("/{scenario}/v1/chat/completions", post(complete));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

fn openai_llm(base: &str, scenario: &str) -> LlmConfig {
    LlmConfig {
        provider: Provider::OpenAi,
        base_url: format!("{base}/{scenario}/v1"),
        max_retries: 0,
        ..LlmConfig::default()
    }
}

#[tokio::test]
async fn a_model_answer_outside_the_taxonomy_is_an_internal_error_not_a_made_up_category() {
    let (rules, _) = start_rules().await;
    let base = start_fake_openai().await;
    let (server, mut client) = start_vision(rules.uri(), openai_llm(&base, "outside")).await;

    let (events, error) = classify(&mut client, request(JPEG, "image/jpeg", "")).await;

    let status = error.expect("out-of-taxonomy answer must fail");
    assert_eq!(status.code(), Code::Internal);
    // The model client checks the path against the taxonomy it sent, and (with retries
    // allowed) asks once for a repair; here none are, so the answer is refused at once.
    assert_eq!(
        status.message(),
        "the model's answer could not be used as a classification"
    );
    assert!(
        !events
            .iter()
            .any(|e| matches!(e.event, Some(classify_response::Event::Classification(_)))),
        "no classification may be sent"
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn unknown_situation_tags_from_the_model_are_dropped() {
    let (rules, _) = start_rules().await;
    let base = start_fake_openai().await;
    let (server, mut client) = start_vision(rules.uri(), openai_llm(&base, "tags")).await;

    let (events, error) = classify(&mut client, request(JPEG, "image/jpeg", "")).await;

    assert!(error.is_none(), "{error:?}");
    let c = final_classification(&events);
    assert_eq!(c.situation_tags, vec!["뚜껑_열림"]);
    assert_eq!(
        (c.provider.as_str(), c.model.as_str()),
        ("openai", "fake-vision-1")
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn vision_serves_health_and_reflection() {
    let (rules, _) = start_rules().await;
    let (server, _client) = start_vision(rules.uri(), mock_llm()).await;

    assert_health_and_reflection(&server.uri(), "ecoscan.v1.VisionService").await;
    server.stop().await.unwrap();
}

/// An in-test Chat Completions server that answers every request 429 with `Retry-After: 0.1`,
/// counting the requests.
async fn start_rate_limited_openai() -> (String, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let counted = hits.clone();
    let app = Router::new().route(
        "/v1/chat/completions",
        post(move || {
            let hits = counted.clone();
            async move {
                hits.fetch_add(1, Ordering::SeqCst);
                (
                    axum::http::StatusCode::TOO_MANY_REQUESTS,
                    [(axum::http::header::RETRY_AFTER, "0.1")],
                    "rate limit reached",
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), hits)
}

#[tokio::test]
async fn a_provider_rate_limit_outlasting_the_retries_is_unavailable_and_marked_as_retried() {
    let (rules, _) = start_rules().await;
    let (base, hits) = start_rate_limited_openai().await;
    let llm = LlmConfig {
        provider: Provider::OpenAi,
        base_url: format!("{base}/v1"),
        max_retries: 2,
        retry_budget: Duration::from_secs(600),
        ..LlmConfig::default()
    };
    let (server, mut client) = start_vision(rules.uri(), llm).await;

    let (_, error) = classify(&mut client, request(JPEG, "image/jpeg", "")).await;

    let status = error.expect("a rate limit that never lifts fails the call");
    // One model call: the first try and LLM_MAX_RETRIES retries, no more.
    assert_eq!(hits.load(Ordering::SeqCst), 1 + 2);
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
async fn a_chosen_model_must_be_offered_and_is_the_one_asked() {
    let (rules, _) = start_rules().await;
    let llm = LlmConfig {
        offered: ecoscan_common::models::OfferedModels::parse("mini, large=gemini").unwrap(),
        ..mock_llm()
    };
    let (server, mut client) = start_vision(rules.uri(), llm).await;

    // Not offered: refused before a stream opens, naming the offered ones and the field.
    let (events, error) = classify(
        &mut client,
        ClassifyRequest {
            model: "huge".into(),
            ..request(JPEG, "image/jpeg", "newspaper")
        },
    )
    .await;
    let status = error.expect("an unoffered model is refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("mini, large"), "{status:?}");
    assert!(events.is_empty());
    let bad = tonic_types::StatusExt::get_details_bad_request(&status).expect("a BadRequest");
    assert_eq!(bad.field_violations[0].field, "model");

    // Offered: the mock plays it, and says it is the mock.
    let (events, error) = classify(
        &mut client,
        ClassifyRequest {
            model: "large".into(),
            ..request(JPEG, "image/jpeg", "newspaper")
        },
    )
    .await;
    assert!(error.is_none(), "{error:?}");
    let c = final_classification(&events);
    assert_eq!((c.provider.as_str(), c.model.as_str()), ("mock", "large"));

    // None chosen: the configured model.
    let (events, _) = classify(&mut client, request(JPEG, "image/jpeg", "newspaper")).await;
    assert_eq!(final_classification(&events).model, "mock");
    server.stop().await.unwrap();
}
