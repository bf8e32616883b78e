//! The gateway over real sockets, against in-test doubles of ingest, reward, notification and
//! analytics.

mod support;

use std::{sync::atomic::Ordering, time::Duration};

use axum::body::Body;
use base64::Engine as _;
use ecoscan_gateway::Config;
use futures::StreamExt as _;
use reqwest::StatusCode;
use serde_json::{Value, json};
use support::*;
use tower::ServiceExt as _;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::STANDARD;

async fn post_multipart(
    env: &Env,
    path: &str,
    parts: &[(&str, Option<&str>, &[u8])],
) -> reqwest::Response {
    let (content_type, body) = multipart(parts);
    env.http
        .post(env.url(path))
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .unwrap()
}

async fn post_json(env: &Env, path: &str, body: Value) -> reqwest::Response {
    env.http
        .post(env.url(path))
        .json(&body)
        .send()
        .await
        .unwrap()
}

/// An error answer: an RFC 9457 problem with ecoscan's members, whatever the error.
async fn error_body(res: reqwest::Response) -> (StatusCode, Value) {
    let status = res.status();
    assert_eq!(
        res.headers()["content-type"],
        "application/problem+json",
        "error answers are problems"
    );
    let body: Value = res.json().await.expect("error bodies are JSON");
    assert!(body["code"].is_string(), "no code in {body}");
    assert!(body["message"].is_string(), "no message in {body}");
    assert_eq!(body["status"], status.as_u16(), "{body}");
    assert_eq!(body["detail"], body["message"], "{body}");
    assert_eq!(
        body["title"],
        status.canonical_reason().unwrap(),
        "the title is the status's: {body}"
    );
    let reason = body["reason"].as_str().expect("a reason");
    assert_eq!(
        body["type"],
        format!("urn:ecoscan:problem:{reason}"),
        "the type names the reason: {body}"
    );
    assert!(body["retryable"].is_boolean(), "{body}");
    (status, body)
}

#[tokio::test]
async fn submit_multipart_returns_202_with_links_and_location() {
    let env = start().await;
    let image = png(64);
    let (content_type, body) = multipart(&[
        ("image", Some("bottle.png"), &image),
        ("hint", None, b"plastic bottle"),
        ("locale", None, b"en"),
    ]);
    let res = env
        .http
        .post(env.url("/api/v1/scan"))
        .header("content-type", content_type)
        .header("x-user-id", "alice@example.com")
        .header("idempotency-key", "repeat")
        .body(body)
        .send()
        .await
        .unwrap();

    assert_eq!(res.status(), StatusCode::ACCEPTED);
    let location = format!("/api/v1/scan/{NEW_JOB}");
    assert_eq!(res.headers()["location"], location.as_str());
    let body: Value = res.json().await.unwrap();
    assert_eq!(
        body,
        json!({
            "job_id": NEW_JOB,
            "status": "queued",
            "events_url": format!("/api/v1/scan/{NEW_JOB}/events"),
            "result_url": location,
            "duplicate": true,
        })
    );
    let sent = env.calls.last_submit.lock().unwrap().clone().unwrap();
    assert_eq!(sent.image, image);
    assert_eq!(sent.content_type, "image/png");
    assert_eq!(sent.hint, "plastic bottle");
    assert_eq!(sent.locale, "en");
    assert_eq!(
        env.calls.user_of("submit").as_deref(),
        Some("alice@example.com")
    );
    assert_eq!(sent.idempotency_key, "repeat");
    assert_eq!(
        env.calls.last_user.lock().unwrap().as_deref(),
        Some("alice@example.com")
    );
}

#[tokio::test]
async fn submit_json_with_base64_or_url_reaches_ingest() {
    let env = start_with(|c| Config {
        public_base_url: Some("https://scan.example.com".into()),
        ..c
    })
    .await;
    let jpeg = [0xFF, 0xD8, 0xFF, 0xE0, 1, 2, 3];
    let res = post_json(
        &env,
        "/api/v1/scan",
        json!({"image_base64": B64.encode(jpeg), "hint": "can"}),
    )
    .await;
    assert_eq!(res.status(), StatusCode::ACCEPTED);
    assert_eq!(
        res.headers()["location"],
        format!("https://scan.example.com/api/v1/scan/{NEW_JOB}").as_str()
    );
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["duplicate"], false);
    let sent = env.calls.last_submit.lock().unwrap().clone().unwrap();
    assert_eq!(sent.image, jpeg);
    assert_eq!(sent.content_type, "image/jpeg");
    assert_eq!(
        env.calls.user_of("submit").as_deref(),
        Some("local"),
        "the default user acts when no header is sent"
    );

    let res = post_json(
        &env,
        "/api/v1/scan",
        json!({"image_url": "https://images.example.com/bottle.webp"}),
    )
    .await;
    assert_eq!(res.status(), StatusCode::ACCEPTED);
    let sent = env.calls.last_submit.lock().unwrap().clone().unwrap();
    assert_eq!(sent.image_url, "https://images.example.com/bottle.webp");
    assert!(sent.image.is_empty());
    assert_eq!(env.calls.submit.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn the_trace_context_of_the_request_reaches_ingest() {
    let env = start().await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let (content_type, body) = multipart(&[("image", Some("a.png"), &png(16))]);
    let res = env
        .http
        .post(env.url("/api/v1/scan"))
        .header("content-type", content_type)
        .header("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01"))
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::ACCEPTED);
    let sent = env.calls.last_traceparent.lock().unwrap().clone();
    let sent = sent.expect("submit carried a traceparent");
    assert!(sent.contains(trace_id), "trace id lost: {sent}");
}

#[tokio::test]
async fn bad_scans_are_rejected_at_the_edge_and_never_reach_ingest() {
    let env = start_with(|c| Config {
        max_image_bytes: 1024,
        max_body_bytes: 4096,
        ..c
    })
    .await;
    let big = png(2048);
    // Each case: what, the answer, its status, and the fields the problem names in `errors`.
    let cases: Vec<(&str, reqwest::Response, StatusCode, &[&str])> =
        vec![
        (
            "empty image",
            post_multipart(&env, "/api/v1/scan", &[("image", Some("a.png"), b"")]).await,
            StatusCode::BAD_REQUEST,
            &["image"],
        ),
        (
            "missing image field",
            post_multipart(&env, "/api/v1/scan", &[("hint", None, b"x")]).await,
            StatusCode::BAD_REQUEST,
            &["image"],
        ),
        (
            "not an image",
            post_multipart(&env, "/api/v1/scan", &[("image", Some("a.png"), b"%PDF-1.7 ...")])
                .await,
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            &[],
        ),
        (
            "image over the image limit",
            post_multipart(&env, "/api/v1/scan", &[("image", Some("a.png"), &big)]).await,
            StatusCode::PAYLOAD_TOO_LARGE,
            &[],
        ),
        (
            "body over the body limit",
            post_multipart(&env, "/api/v1/scan", &[("image", Some("a.png"), &png(8192))]).await,
            StatusCode::PAYLOAD_TOO_LARGE,
            &[],
        ),
        (
            "base64 image over the image limit",
            post_json(&env, "/api/v1/scan", json!({"image_base64": B64.encode(&big)})).await,
            StatusCode::PAYLOAD_TOO_LARGE,
            &[],
        ),
        (
            "malformed json",
            env.http
                .post(env.url("/api/v1/scan"))
                .header("content-type", "application/json")
                .body("{\"image_url\": ")
                .send()
                .await
                .unwrap(),
            StatusCode::BAD_REQUEST,
            &[],
        ),
        (
            "bad base64",
            post_json(&env, "/api/v1/scan", json!({"image_base64": "***"})).await,
            StatusCode::BAD_REQUEST,
            &["image_base64"],
        ),
        (
            "both image sources",
            post_json(
                &env,
                "/api/v1/scan",
                json!({"image_base64": B64.encode(png(10)), "image_url": "https://x.org/a.png"}),
            )
            .await,
            StatusCode::BAD_REQUEST,
            &["image_url", "image_base64", "upload_id"],
        ),
        (
            "unknown locale",
            post_json(
                &env,
                "/api/v1/scan",
                json!({"image_base64": B64.encode(png(10)), "locale": "fr"}),
            )
            .await,
            StatusCode::BAD_REQUEST,
            &["locale"],
        ),
        (
            "wrong request content type",
            env.http
                .post(env.url("/api/v1/scan"))
                .header("content-type", "text/plain")
                .body("hello")
                .send()
                .await
                .unwrap(),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            &[],
        ),
        (
            "bad user id",
            env.http
                .post(env.url("/api/v1/scan"))
                .header("x-user-id", "robert'); drop table")
                .json(&json!({"image_base64": B64.encode(png(10))}))
                .send()
                .await
                .unwrap(),
            StatusCode::BAD_REQUEST,
            &["X-User-Id"],
        ),
        (
            "bad idempotency key",
            env.http
                .post(env.url("/api/v1/scan"))
                .header("idempotency-key", "has spaces in it")
                .json(&json!({"image_base64": B64.encode(png(10))}))
                .send()
                .await
                .unwrap(),
            StatusCode::BAD_REQUEST,
            &["Idempotency-Key"],
        ),
        (
            "empty image on the streaming route",
            post_multipart(&env, "/api/v1/scan/completion", &[("image", Some("a"), b"")]).await,
            StatusCode::BAD_REQUEST,
            &["image"],
        ),
    ];
    for (what, res, expected, fields) in cases {
        let (status, body) = error_body(res).await;
        assert_eq!(status, expected, "{what}: {body}");
        let named: Vec<&str> = body["errors"]
            .as_array()
            .map(|errors| {
                errors
                    .iter()
                    .map(|e| {
                        assert!(!e["detail"].as_str().unwrap().is_empty(), "{what}: {body}");
                        e["field"].as_str().unwrap()
                    })
                    .collect()
            })
            .unwrap_or_default();
        assert_eq!(named, fields, "{what}: {body}");
        if !fields.is_empty() {
            assert_eq!(body["reason"], "INVALID_FIELD", "{what}: {body}");
            assert_eq!(
                body["type"], "urn:ecoscan:problem:INVALID_FIELD",
                "{what}: {body}"
            );
        }
    }
    assert_eq!(env.calls.submits(), 0, "bad input reached ingest");
}

#[tokio::test]
async fn the_image_error_messages_say_what_to_do() {
    let env = start().await;
    let res = post_multipart(&env, "/api/v1/scan", &[("image", Some("a.png"), b"")]).await;
    let (_, body) = error_body(res).await;
    assert_eq!(body["code"], "INVALID_ARGUMENT");
    assert_eq!(
        body["message"],
        "image is empty; send the photo bytes in `image`"
    );
    let res = post_multipart(&env, "/api/v1/scan", &[("image", Some("a.txt"), b"hello")]).await;
    let (_, body) = error_body(res).await;
    assert_eq!(body["code"], "UNSUPPORTED_MEDIA_TYPE");
}

/// A multipart scan whose image part declares `declared` (written by hand: the part's own
/// `Content-Type` line is the point).
async fn post_declared(env: &Env, image: Vec<u8>, declared: &str) -> reqwest::Response {
    let boundary = "ecoscan-declared-4b1e";
    let mut body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"photo\"\r\n\
         Content-Type: {declared}\r\n\r\n"
    )
    .into_bytes();
    body.extend_from_slice(&image);
    body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
    env.http
        .post(env.url("/api/v1/scan"))
        .header(
            "content-type",
            format!("multipart/form-data; boundary={boundary}"),
        )
        .body(body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn an_image_part_must_declare_what_its_bytes_are_or_nothing() {
    let env = start().await;
    // The bytes are a PNG: so declared, or undeclared as curl sends an unknown file, it goes.
    for agrees in ["image/png", "application/octet-stream"] {
        let res = post_declared(&env, png(16), agrees).await;
        assert_eq!(res.status(), StatusCode::ACCEPTED, "{agrees}");
    }
    // Declared JPEG: the declaration contradicts the bytes, refused with what they are.
    let res = post_declared(&env, png(16), "image/jpeg").await;
    let (status, body) = error_body(res).await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.contains("\"image/jpeg\"") && detail.contains("bytes are image/png"),
        "{detail}"
    );
}

#[tokio::test]
async fn a_field_ingest_refuses_is_named_in_the_problem() {
    let env = start().await;
    let image = png(16);
    let res = post_multipart(
        &env,
        "/api/v1/scan",
        &[("image", Some("a"), &image), ("hint", None, b"bad-field")],
    )
    .await;
    let (status, body) = error_body(res).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["reason"], "INVALID_FIELD", "{body}");
    assert_eq!(
        body["errors"],
        json!([{"field": "locale", "detail": "locale \"fr\" is not supported; use \"ko\" or \"en\""}]),
        "{body}"
    );
}

#[tokio::test]
async fn a_full_backlog_is_503_with_the_upstream_retry_after() {
    let env = start().await;
    let image = png(16);
    let res = post_multipart(
        &env,
        "/api/v1/scan",
        &[("image", Some("a"), &image), ("hint", None, b"overload")],
    )
    .await;
    assert_eq!(res.headers()["retry-after"], "7");
    let (status, body) = error_body(res).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body["code"], "RESOURCE_EXHAUSTED");
    // The reason ingest sent in its ErrorInfo, as a gRPC caller gets it.
    assert_eq!(body["reason"], "BACKLOG_FULL", "{body}");
    assert_eq!(body["retryable"], true, "{body}");

    let res = post_multipart(
        &env,
        "/api/v1/scan",
        &[
            ("image", Some("a"), &image),
            ("hint", None, b"overload-no-delay"),
        ],
    )
    .await;
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()["retry-after"], "5");

    // Refused inside the stream, before any event: still a 503, not an SSE stream.
    let res = post_multipart(
        &env,
        "/api/v1/scan/completion",
        &[("image", Some("a"), &image), ("hint", None, b"overload")],
    )
    .await;
    assert_eq!(res.headers()["retry-after"], "7");
    let (status, _) = error_body(res).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
}

#[tokio::test]
async fn completion_streams_framed_events_and_ends_after_ready() {
    let env = start().await;
    let res = post_multipart(
        &env,
        "/api/v1/scan/completion",
        &[("image", Some("a"), &png(32))],
    )
    .await;
    assert_eq!(res.status(), StatusCode::OK);
    assert!(
        res.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    // The body ends by itself after `ready`: reading it to the end proves the stream closed.
    let text = tokio::time::timeout(Duration::from_secs(10), res.text())
        .await
        .expect("the stream ended after ready")
        .unwrap();
    let events = parse_sse(&text);
    let names: Vec<_> = events.iter().map(SseEvent::name).collect();
    assert_eq!(
        names,
        [
            "stage", "stage", "stage", "delta", "delta", "stage", "ready"
        ]
    );
    let ids: Vec<_> = events.iter().map(|e| e.id.clone().unwrap()).collect();
    assert_eq!(ids[0], "1700000000000-0");
    assert_eq!(ids[6], "1700000000000-6");

    let queued = events[0].json();
    assert_eq!(queued["event_id"], "1700000000000-0");
    assert_eq!(queued["job_id"], NEW_JOB);
    assert_eq!(queued["seq"], 1);
    assert_eq!(queued["stage"], "queued");
    assert_eq!(queued["status"], "completed");
    assert!(
        queued["ts"].as_str().unwrap().ends_with('Z')
            || queued["ts"].as_str().unwrap().contains('+')
    );
    assert_eq!(queued["trace_id"], "0af7651916cd43dd8448eb211c80319c");

    let vision = events[2].json();
    assert_eq!(vision["stage"], "vision");
    assert_eq!(vision["classification"]["middle_category"], "무색페트병");

    let delta = events[3].json();
    assert_eq!(delta["status"], "delta");
    assert_eq!(delta["delta"], "Rinse ");

    assert_eq!(
        events[5].json()["reward"]["character"]["code"],
        "char-petty"
    );

    let ready = events[6].json();
    assert_eq!(ready["stage"], "done");
    assert_eq!(ready["result_url"], format!("/api/v1/scan/{NEW_JOB}"));
    assert_eq!(env.calls.scan.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn watch_forwards_last_event_id_as_after_event_id() {
    let env = start().await;
    let res = env
        .http
        .get(env.url(&format!("/api/v1/scan/{DONE_JOB}/events")))
        .header("last-event-id", "1700000000000-4")
        .header("x-user-id", "bob")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let events = parse_sse(&res.text().await.unwrap());
    let ids: Vec<_> = events.iter().map(|e| e.id.as_deref().unwrap()).collect();
    assert_eq!(ids, ["1700000000000-5", "1700000000000-6"]);
    let sent = env.calls.last_watch.lock().unwrap().clone().unwrap();
    assert_eq!(sent.after_event_id, "1700000000000-4");
    assert_eq!(sent.job_id, DONE_JOB);
    assert_eq!(env.calls.user_of("watch").as_deref(), Some("bob"));

    // The query parameter works for clients that cannot set headers.
    let res = env
        .http
        .get(env.url(&format!(
            "/api/v1/scan/{DONE_JOB}/events?last_event_id=1700000000000-5"
        )))
        .send()
        .await
        .unwrap();
    let events = parse_sse(&res.text().await.unwrap());
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].name(), "ready");
    let sent = env.calls.last_watch.lock().unwrap().clone().unwrap();
    assert_eq!(sent.after_event_id, "1700000000000-5");
}

/// A resume at (or past) the final event: the stream has nothing more to give, so the answer
/// is 204, which tells an `EventSource` to stop reconnecting (it would otherwise get the end
/// again on every reconnect, forever). A resume just before it still gets the end from a new
/// feed (bug 1 of issue 22: that feed's duplicate filter once dropped ingest's end). The same
/// test runs against the real ingest in `services/suite/tests/resume.rs`.
#[tokio::test]
async fn a_resume_at_the_final_event_is_204_and_one_before_it_gets_the_end() {
    let env = start().await;
    let events = |last: &'static str| {
        env.http
            .get(env.url(&format!("/api/v1/scan/{DONE_JOB}/events")))
            .header("last-event-id", last)
            .send()
    };
    for last in ["1700000000000-6", "1700000000000-9"] {
        let res = events(last).await.unwrap();
        assert_eq!(res.status(), StatusCode::NO_CONTENT, "after {last}");
        assert_eq!(res.text().await.unwrap(), "", "after {last}");
    }
    let res = events("1700000000000-5").await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let events = parse_sse(&res.text().await.unwrap());
    let names: Vec<_> = events.iter().map(SseEvent::name).collect();
    assert_eq!(names, ["ready"], "{events:?}");
    assert_eq!(events[0].id.as_deref(), Some("1700000000000-6"));
    assert_ne!(events[0].json()["seq"], 0);
}

#[tokio::test]
async fn a_resume_refused_for_its_id_does_not_refuse_a_client_that_joined_its_feed() {
    // The first client resumes with another job's id (refused by ingest, a moment later); a
    // second client of the same job, with an id of its own, joins that feed meanwhile: the
    // refusal is the first client's alone.
    let env = start().await;
    let events = |last: &'static str| {
        env.http
            .get(env.url(&format!("/api/v1/scan/{DONE_JOB}/events")))
            .header("last-event-id", last)
            .send()
    };
    let foreign = events("9999999999999-19");
    let own = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        events("1700000000000-2").await
    };
    let (foreign, own) = tokio::join!(foreign, own);
    assert_eq!(foreign.unwrap().status(), StatusCode::BAD_REQUEST);
    let own = own.unwrap();
    assert_eq!(own.status(), StatusCode::OK);
    let got = parse_sse(&own.text().await.unwrap());
    assert_eq!(
        got.first().and_then(|e| e.id.as_deref()),
        Some("1700000000000-3")
    );
    assert_eq!(got.last().map(SseEvent::name), Some("ready"), "{got:?}");
}

#[tokio::test]
async fn watch_rejects_a_malformed_last_event_id_before_calling_ingest() {
    let env = start().await;
    for bad in ["42", "abc-1", "1-2-3", "-1"] {
        let res = env
            .http
            .get(env.url(&format!("/api/v1/scan/{DONE_JOB}/events")))
            .header("last-event-id", bad)
            .send()
            .await
            .unwrap();
        let (status, body) = error_body(res).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {body}");
    }
    let res = env
        .http
        .get(env.url(&format!("/api/v1/scan/{DONE_JOB}/events?last_event_id=x")))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    // A malformed query id is bad input even when a valid header would win (Schemathesis).
    let res = env
        .http
        .get(env.url(&format!("/api/v1/scan/{DONE_JOB}/events?last_event_id=U")))
        .header("last-event-id", "1700000000000-5")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    let res = env
        .http
        .get(env.url("/api/v1/scan/not-a-uuid/events"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(env.calls.watch.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn watch_of_an_unknown_job_is_a_404_json_not_a_stream() {
    let env = start().await;
    let res = env
        .http
        .get(env.url(&format!("/api/v1/scan/{UNKNOWN_JOB}/events")))
        .send()
        .await
        .unwrap();
    let (status, body) = error_body(res).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["code"], "NOT_FOUND");
    assert_eq!(
        body["reason"], "NOT_FOUND",
        "no ErrorInfo: the code: {body}"
    );
}

#[tokio::test]
async fn a_failed_job_ends_its_stream_with_an_error_event() {
    let env = start().await;
    let res = env
        .http
        .get(env.url(&format!("/api/v1/scan/{FAILED_JOB}/events")))
        .send()
        .await
        .unwrap();
    let events = parse_sse(&res.text().await.unwrap());
    let names: Vec<_> = events.iter().map(SseEvent::name).collect();
    assert_eq!(names, ["stage", "stage", "stage", "error"]);
    assert_eq!(
        events[2].json()["status"],
        "failed",
        "the failed stage is a transition"
    );
    assert_eq!(events[2].json()["error"]["code"], "UNAVAILABLE");
    let err = events[3].json();
    assert_eq!(events[3].id.as_deref(), Some("1700000000000-3"));
    assert_eq!(
        err["error"],
        json!({"code": "UNAVAILABLE", "http_status": 503, "message": "the vision service is unavailable", "retryable": true})
    );
}

#[tokio::test]
async fn a_broken_upstream_stream_ends_with_an_error_event_that_hides_internals() {
    let env = start().await;
    let res = env
        .http
        .get(env.url(&format!("/api/v1/scan/{RUNNING_JOB}/events")))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let text = res.text().await.unwrap();
    let events = parse_sse(&text);
    let names: Vec<_> = events.iter().map(SseEvent::name).collect();
    assert_eq!(names, ["stage", "stage", "error"]);
    assert_eq!(events[2].id, None, "a synthetic error has no resumable id");
    let err = events[2].json();
    assert_eq!(err["job_id"], RUNNING_JOB);
    assert_eq!(err["error"]["code"], "INTERNAL");
    assert_eq!(err["error"]["http_status"], 500);
    assert!(!text.contains("redis"), "internal detail leaked: {text}");
}

#[tokio::test]
async fn a_succeeded_result_is_kept_per_user_with_an_etag_and_revalidated_with_304() {
    let env = start().await;
    let get = |user: &'static str, etag: Option<String>| {
        let mut req = env
            .http
            .get(env.url(&format!("/api/v1/scan/{DONE_JOB}")))
            .header("x-user-id", user);
        if let Some(tag) = etag {
            req = req.header("if-none-match", tag);
        }
        req.send()
    };
    let calls = || {
        env.calls
            .get_result
            .load(std::sync::atomic::Ordering::SeqCst)
    };

    let first = get("ann", None).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    let etag = first.headers()["etag"].to_str().unwrap().to_owned();
    assert!(etag.starts_with('"'), "a strong tag: {etag}");
    assert_eq!(
        first.headers()["cache-control"],
        "private, max-age=600, immutable"
    );
    assert_eq!(first.headers()["content-type"], "application/json");
    let body = first.bytes().await.unwrap();
    assert_eq!(calls(), 1);

    // Again: the same bytes and tag, without asking ingest.
    let again = get("ann", None).await.unwrap();
    assert_eq!(again.status(), StatusCode::OK);
    assert_eq!(again.headers()["etag"].to_str().unwrap(), etag);
    assert_eq!(again.bytes().await.unwrap(), body);
    // The tag the caller has: 304, no body.
    let not_modified = get("ann", Some(etag.clone())).await.unwrap();
    assert_eq!(not_modified.status(), StatusCode::NOT_MODIFIED);
    assert_eq!(not_modified.headers()["etag"].to_str().unwrap(), etag);
    assert!(not_modified.bytes().await.unwrap().is_empty());
    let other_tag = get("ann", Some("\"something else\"".into())).await.unwrap();
    assert_eq!(other_tag.status(), StatusCode::OK);
    assert_eq!(calls(), 1, "served from the cache");

    // Another user is never served from ann's entry: ingest decides for them.
    let bob = get("bob", None).await.unwrap();
    assert_eq!(bob.status(), StatusCode::OK);
    assert_eq!(calls(), 2);

    // A failed result is not kept (its job may be requeued): a tag, revalidated each time.
    let failed = |tag: Option<String>| {
        let mut req = env
            .http
            .get(env.url(&format!("/api/v1/scan/{FAILED_JOB}")))
            .header("x-user-id", "ann");
        if let Some(tag) = tag {
            req = req.header("if-none-match", tag);
        }
        req.send()
    };
    let f = failed(None).await.unwrap();
    assert_eq!(f.headers()["cache-control"], "private, no-cache");
    let tag = f.headers()["etag"].to_str().unwrap().to_owned();
    let f2 = failed(Some(tag)).await.unwrap();
    assert_eq!(f2.status(), StatusCode::NOT_MODIFIED);
    assert_eq!(calls(), 4, "each failed read asks ingest");

    // Pending: as before, never cached.
    let pending = env
        .http
        .get(env.url(&format!("/api/v1/scan/{RUNNING_JOB}")))
        .header("x-user-id", "ann")
        .send()
        .await
        .unwrap();
    assert_eq!(pending.status(), StatusCode::ACCEPTED);
    assert_eq!(pending.headers()["cache-control"], "no-store");
}

#[tokio::test]
async fn result_is_202_while_running_and_200_once_finished() {
    let env = start().await;
    let res = env
        .http
        .get(env.url(&format!("/api/v1/scan/{RUNNING_JOB}")))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::ACCEPTED);
    assert_eq!(res.headers()["retry-after"], "1");
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["job_id"], RUNNING_JOB);
    assert_eq!(body["status"], "running");
    assert_eq!(body["stage"], "vision");

    let res = env
        .http
        .get(env.url(&format!("/api/v1/scan/{DONE_JOB}")))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["job_id"], DONE_JOB);
    assert_eq!(body["status"], "succeeded");
    assert_eq!(body["classification"]["major_category"], "재활용폐기물");
    assert_eq!(body["reward"]["character"]["name_en"], "Petty");

    let res = env
        .http
        .get(env.url(&format!("/api/v1/scan/{FAILED_JOB}")))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["status"], "failed");
    assert_eq!(body["error"]["code"], "UNAVAILABLE");
}

#[tokio::test]
async fn result_of_an_unknown_job_is_404_and_a_non_uuid_is_400() {
    let env = start().await;
    let res = env
        .http
        .get(env.url(&format!("/api/v1/scan/{UNKNOWN_JOB}")))
        .send()
        .await
        .unwrap();
    let (status, body) = error_body(res).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["code"], "NOT_FOUND");
    assert_eq!(env.calls.get_result.load(Ordering::SeqCst), 1);

    let res = env
        .http
        .get(env.url("/api/v1/scan/1234"))
        .send()
        .await
        .unwrap();
    let (status, body) = error_body(res).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["code"], "INVALID_ARGUMENT");
    assert_eq!(
        env.calls.get_result.load(Ordering::SeqCst),
        1,
        "a non-uuid reached ingest"
    );
}

#[tokio::test]
async fn characters_notifications_and_usage_act_for_the_caller() {
    let env = start().await;
    let res = env
        .http
        .get(env.url("/api/v1/characters/me"))
        .header("x-user-id", "carol")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["characters"][0]["job_id"], "job-of-carol");
    assert_eq!(
        env.calls.last_user.lock().unwrap().as_deref(),
        Some("carol")
    );

    let res = env
        .http
        .get(env.url("/api/v1/notifications?limit=20"))
        .header("x-user-id", "carol")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["notifications"][0]["user_id"], "carol");
    let list = env.calls.last_list.lock().unwrap().unwrap();
    assert_eq!(
        (env.calls.user_of("list").as_deref(), list.limit),
        (Some("carol"), 20)
    );

    let res = env
        .http
        .get(env.url("/api/v1/notifications?limit=0"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);

    let res = post_json(
        &env,
        "/api/v1/notifications",
        json!({"title": "Take out the bottles", "body": "tonight", "due_at": "2030-05-01T09:00:00+09:00"}),
    )
    .await;
    assert_eq!(res.status(), StatusCode::CREATED);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["title"], "Take out the bottles");
    assert_eq!(body["kind"], "reminder");
    let sent = env.calls.last_schedule.lock().unwrap().clone().unwrap();
    assert_eq!(sent.due_at.unwrap().seconds, 1_903_824_000);

    let res = post_json(
        &env,
        "/api/v1/notifications",
        json!({"title": "x", "delay_seconds": 60}),
    )
    .await;
    assert_eq!(res.status(), StatusCode::CREATED);
    for bad in [
        json!({"title": "x", "due_at": "tomorrow"}),
        json!({"title": "x"}),
        json!({"title": "x", "due_at": "2030-05-01T09:00:00Z", "delay_seconds": 5}),
        json!({"title": "", "delay_seconds": 5}),
        json!({"title": "x", "delay_seconds": 5, "colour": "red"}),
    ] {
        let res = post_json(&env, "/api/v1/notifications", bad.clone()).await;
        assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{bad}");
    }

    // Usage covers every user: only an admin may read it.
    let usage_url =
        env.url("/api/v1/analytics/usage?since=2026-01-01T00:00:00Z&until=2026-01-02T00:00:00Z");
    let res = env.http.get(&usage_url).send().await.unwrap();
    let (status, body) = error_body(res).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(body["code"], "PERMISSION_DENIED");
    let res = env
        .http
        .get(&usage_url)
        .bearer_auth(token("root", true))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["rows"][0]["service"], "vision");
    let usage = env.calls.last_usage.lock().unwrap().unwrap();
    assert_eq!(usage.since.unwrap().seconds, 1_767_225_600);
    let res = env
        .http
        .get(env.url("/api/v1/analytics/usage?since=yesterday"))
        .bearer_auth(token("root", true))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn the_notification_stream_sends_notification_events() {
    let env = start().await;
    let res = env
        .http
        .get(env.url("/api/v1/notifications/stream"))
        .header("x-user-id", "dave")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let mut body = res.bytes_stream();
    let mut text = String::new();
    // The stream stays open; read until the first complete event.
    let first = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(chunk) = body.next().await {
            text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
            if let Some(ev) = parse_sse(&text).into_iter().find(|e| !e.data.is_empty()) {
                return ev;
            }
        }
        panic!("stream ended without a notification");
    })
    .await
    .expect("a notification arrived");
    assert_eq!(first.name(), "notification");
    assert_eq!(first.id.as_deref(), Some("n-1"));
    assert_eq!(first.json()["user_id"], "dave");
}

#[tokio::test]
async fn readyz_and_metrics_are_on_the_admin_listener_only() {
    let env = start().await;
    let res = env.http.get(env.admin_url("/readyz")).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["status"], "ready");
    let res = env
        .http
        .get(env.admin_url("/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    for path in ["/healthz"] {
        let res = env.http.get(env.admin_url(path)).send().await.unwrap();
        assert_eq!(res.status(), StatusCode::OK, "admin {path}");
        let res = env.http.get(env.url(path)).send().await.unwrap();
        assert_eq!(res.status(), StatusCode::OK, "api {path}");
    }
    // The public port answers neither.
    for path in ["/readyz", "/metrics"] {
        let res = env.http.get(env.url(path)).send().await.unwrap();
        assert_eq!(res.status(), StatusCode::NOT_FOUND, "api {path}");
    }
}

/// Scrapes the admin listener until `gateway_backend_up{backend}` is `want` (the checks run in
/// the background every few seconds).
async fn backend_up(env: &Env, backend: &str, want: f64) -> String {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let text = env
            .http
            .get(env.admin_url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let value =
            ecoscan_common::testing::sample(&text, "gateway_backend_up", &[("backend", backend)]);
        if value == Some(want) {
            return text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "gateway_backend_up{{backend={backend}}} never became {want}: {text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn readyz_stays_200_while_a_backend_is_down_and_the_metric_says_which() {
    // A port that was free a moment ago: nothing listens there.
    let closed = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let env = start_with(|c| Config {
        reward_url: closed,
        ..c
    })
    .await;

    let text = backend_up(&env, "reward", 0.0).await;
    assert_eq!(
        ecoscan_common::testing::sample(&text, "gateway_backend_up", &[("backend", "ingest")]),
        Some(1.0),
        "{text}"
    );
    let res = env.http.get(env.admin_url("/readyz")).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["status"], "ready");
    assert_eq!(body["backends"]["reward"], "unreachable");
    assert_eq!(body["backends"]["ingest"], "serving");
    // The routes that do not need reward keep working.
    let res = env
        .http
        .get(env.url("/api/v1/notifications"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_scan_while_ingest_cannot_reach_its_store_is_503_naming_the_store() {
    let env = start().await;
    let image = png(16);
    for route in ["/api/v1/scan", "/api/v1/scan/completion"] {
        let res = post_multipart(
            &env,
            route,
            &[("image", Some("a"), &image), ("hint", None, b"store-down")],
        )
        .await;
        assert_eq!(res.headers()["retry-after"], "1", "{route}");
        let (status, body) = error_body(res).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{route}");
        assert_eq!(body["code"], "UNAVAILABLE", "{route}");
        assert_eq!(
            body["message"], "ingest cannot reach its redis store, try again in 1 s",
            "{route}"
        );
    }
}

#[tokio::test]
async fn a_watch_while_ingest_cannot_reach_its_store_ends_at_once_naming_it_with_a_retry() {
    let env = start().await;
    let started = std::time::Instant::now();
    let res = env
        .http
        .get(env.url(&format!("/api/v1/scan/{STORE_DOWN_JOB}/events")))
        .send()
        .await
        .unwrap();
    // An EventSource given a 503 gives up for good: the stream opens and ends with the hint
    // to come back, as when ingest goes away.
    assert_eq!(res.status(), StatusCode::OK);
    let body = res.text().await.unwrap();
    // Tried again every 250 ms for 2 s (a store blip costs no reconnect), then passed on:
    // far sooner than the ~16 s a broken stream's reconnects take.
    assert!(
        started.elapsed() < std::time::Duration::from_secs(8),
        "{:?} {body}",
        started.elapsed()
    );
    assert!(body.contains("retry: 1000"), "{body}");
    assert!(
        body.contains(
            ": ingest cannot reach its redis store for now; reconnect with Last-Event-ID"
        ),
        "{body}"
    );
}

#[tokio::test]
async fn upstream_unavailable_maps_to_503_without_internal_details() {
    let closed = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let env = start_with(|c| Config {
        reward_url: closed,
        ..c
    })
    .await;
    let res = env
        .http
        .get(env.url("/api/v1/characters/me"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.headers()["retry-after"], "5");
    let (status, body) = error_body(res).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body["code"], "UNAVAILABLE");
    assert_eq!(body["message"], "reward is unavailable, try again in 5 s");
}

#[tokio::test]
async fn the_gateway_sheds_load_past_its_concurrency_limit() {
    let env = start_with(|c| Config {
        concurrency_limit: 1,
        ..c
    })
    .await;
    let slow = tokio::spawn({
        let http = env.http.clone();
        let url = env.url(&format!("/api/v1/scan/{SLOW_JOB}"));
        async move { http.get(url).send().await.unwrap().status() }
    });
    // Wait (with a deadline) until the slow request holds the only slot inside ingest.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while env.calls.get_result.load(Ordering::SeqCst) == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "slow request never arrived"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let res = env
        .http
        .get(env.url(&format!("/api/v1/scan/{DONE_JOB}")))
        .send()
        .await
        .unwrap();
    assert_eq!(res.headers()["retry-after"], "1");
    let (status, body) = error_body(res).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body["code"], "UNAVAILABLE");
    // Probes are outside the limit.
    let res = env.http.get(env.url("/healthz")).send().await.unwrap();
    assert_eq!(res.status(), StatusCode::OK);

    env.gate.notify_one();
    assert_eq!(slow.await.unwrap(), StatusCode::ACCEPTED);
    let res = env
        .http
        .get(env.url(&format!("/api/v1/scan/{DONE_JOB}")))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK, "the slot was released");
}

#[tokio::test]
async fn shutdown_ends_open_streams_and_the_server() {
    let env = start().await;
    let res = env
        .http
        .get(env.url("/api/v1/notifications/stream"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    let gateway = env.gateway;
    let stopped = tokio::time::timeout(Duration::from_secs(10), gateway.stop()).await;
    stopped.expect("graceful shutdown finished").unwrap();
    let rest = tokio::time::timeout(Duration::from_secs(10), res.text()).await;
    assert!(rest.is_ok(), "the open stream was ended");
}

// Router-level tests: no sockets needed.

async fn oneshot(req: http::Request<Body>) -> (http::StatusCode, http::HeaderMap, String) {
    let app = ecoscan_gateway::router(test_config(Config::default())).unwrap();
    let res = app.oneshot(req).await.unwrap();
    let (parts, body) = res.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX).await.unwrap();
    (
        parts.status,
        parts.headers,
        String::from_utf8(bytes.to_vec()).unwrap(),
    )
}

#[tokio::test]
async fn unknown_routes_get_a_json_404() {
    let req = http::Request::get("/api/v1/nope")
        .body(Body::empty())
        .unwrap();
    let (status, _, body) = oneshot(req).await;
    assert_eq!(status, 404);
    let body: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(body["code"], "NOT_FOUND");
}

#[tokio::test]
async fn the_demo_page_is_served_at_the_root() {
    let req = http::Request::get("/").body(Body::empty()).unwrap();
    let (status, headers, body) = oneshot(req).await;
    assert_eq!(status, 200);
    assert!(
        headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html")
    );
    assert!(body.contains("/api/v1/scan"));
    assert!(body.contains("Last-Event-ID"));
    // No Jaeger configured: no trace link.
    assert!(body.contains(r#"<meta name="ecoscan-jaeger-url" content="">"#));
}

#[tokio::test]
async fn the_demo_page_links_traces_to_the_configured_jaeger() {
    let app = ecoscan_gateway::router(test_config(Config {
        jaeger_url: Some("http://jaeger.example:16686".to_owned()),
        ..Config::default()
    }))
    .unwrap();
    let res = app
        .oneshot(http::Request::get("/").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let body = axum::body::to_bytes(res.into_body(), usize::MAX)
        .await
        .unwrap();
    let body = String::from_utf8(body.to_vec()).unwrap();
    assert!(
        body.contains(r#"<meta name="ecoscan-jaeger-url" content="http://jaeger.example:16686">"#)
    );
}

#[tokio::test]
async fn healthz_answers_without_any_backend() {
    let req = http::Request::get("/healthz").body(Body::empty()).unwrap();
    let (status, _, _) = oneshot(req).await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn a_bad_user_id_is_rejected_on_every_route() {
    let env = start().await;
    for path in [
        "/api/v1/characters/me",
        "/api/v1/notifications",
        "/api/v1/analytics/usage",
    ] {
        let res = env
            .http
            .get(env.url(path))
            .header("x-user-id", "a".repeat(129))
            .send()
            .await
            .unwrap();
        let (status, body) = error_body(res).await;
        assert_eq!(status, 400, "{path}: {body}");
    }
}

/// `POST /api/v1/uploads` as `user`, for a photo of `content_type` and `size` bytes.
async fn create_upload(env: &Env, user: &str, content_type: &str, size: u64) -> Value {
    let res = env
        .http
        .post(env.url("/api/v1/uploads"))
        .header("x-user-id", user)
        .json(&json!({"content_type": content_type, "size_bytes": size}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    res.json().await.unwrap()
}

/// A `PUT` of `body` to `url` with `content_type`, from a plain HTTP client that names no
/// user, as an app hands the URL to whatever sends the bytes.
async fn put_upload(env: &Env, url: &str, content_type: &str, body: Vec<u8>) -> reqwest::Response {
    reqwest::Client::new()
        .put(env.url(url))
        .header("content-type", content_type)
        .body(body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn an_upload_url_of_the_embedded_store_takes_the_declared_photo_for_its_owner() {
    let env = start().await;
    let up = create_upload(&env, "ann", "image/png", 100).await;
    assert_eq!(up["upload_id"], NEW_UPLOAD);
    assert_eq!(up["method"], "PUT");
    assert_eq!(up["headers"]["Content-Type"], "image/png");
    assert_eq!(up["headers"]["Content-Length"], "100");
    assert!(
        up["expires_at"].as_str().unwrap().starts_with("20"),
        "RFC 3339: {up}"
    );
    let url = up["upload_url"].as_str().unwrap();
    assert!(
        url.starts_with(&format!("/api/v1/uploads/{NEW_UPLOAD}?token=")),
        "the gateway's own URL: {url}"
    );
    assert_eq!(env.calls.user_of("create_upload").as_deref(), Some("ann"));

    let res = put_upload(&env, url, "image/png", png(100)).await;
    assert_eq!(res.status(), StatusCode::NO_CONTENT);
    // Passed to ingest as the upload's owner, whoever sent it.
    assert_eq!(env.calls.user_of("put_upload").as_deref(), Some("ann"));
    let put = env.calls.last_put_upload.lock().unwrap().take().unwrap();
    assert_eq!(put.upload_id, NEW_UPLOAD);
    assert_eq!(put.image, png(100));
    assert_eq!(put.content_type, "image/png");
}

#[tokio::test]
async fn an_upload_url_refuses_a_forged_expired_or_other_token_and_another_type_or_size() {
    let env = start().await;
    let up = create_upload(&env, "ann", "image/png", 100).await;
    let url = up["upload_url"].as_str().unwrap().to_owned();
    let upload_token = url.split_once("?token=").unwrap().1.to_owned();

    // Forged: a token changed by one character; none at all; one of another upload.
    let mut forged = upload_token.clone();
    let last = forged.pop().unwrap();
    forged.push(if last == 'A' { 'B' } else { 'A' });
    let refused = [
        format!("/api/v1/uploads/{NEW_UPLOAD}?token={forged}"),
        format!("/api/v1/uploads/{NEW_UPLOAD}"),
        format!("/api/v1/uploads/{DONE_JOB}?token={upload_token}"),
    ];
    for bad in &refused {
        let res = put_upload(&env, bad, "image/png", png(100)).await;
        let (status, body) = error_body(res).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{bad}: {body}");
        assert!(
            body["message"]
                .as_str()
                .unwrap()
                .contains("POST /api/v1/uploads"),
            "says how to get a new one: {body}"
        );
    }
    // A bearer token is no upload credential.
    let res = reqwest::Client::new()
        .put(env.url(&format!("/api/v1/uploads/{NEW_UPLOAD}")))
        .bearer_auth(token("ann", false))
        .header("content-type", "image/png")
        .body(png(100))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::UNAUTHORIZED);

    // Expired: the fake ingest answers an upload that expired already.
    let old = create_upload(&env, "ann", "image/png", EXPIRED_UPLOAD_SIZE).await;
    let res = put_upload(
        &env,
        old["upload_url"].as_str().unwrap(),
        "image/png",
        png(EXPIRED_UPLOAD_SIZE as usize),
    )
    .await;
    let (status, body) = error_body(res).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(
        body["message"].as_str().unwrap().contains("expired"),
        "{body}"
    );

    // Another type than signed, more bytes, fewer bytes.
    let res = put_upload(&env, &url, "image/jpeg", png(100)).await;
    let (status, body) = error_body(res).await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert!(
        body["message"].as_str().unwrap().contains("image/png"),
        "{body}"
    );
    let res = put_upload(&env, &url, "image/png", png(101)).await;
    assert_eq!(error_body(res).await.0, StatusCode::PAYLOAD_TOO_LARGE);
    let res = put_upload(&env, &url, "image/png", png(99)).await;
    assert_eq!(error_body(res).await.0, StatusCode::BAD_REQUEST);

    assert!(
        env.calls.last_put_upload.lock().unwrap().is_none(),
        "nothing refused reached ingest"
    );
}

#[tokio::test]
async fn a_scan_may_name_an_upload_instead_of_the_photo() {
    let env = start().await;
    let res = post_json(
        &env,
        "/api/v1/scan",
        json!({"upload_id": NEW_UPLOAD, "hint": "bottle"}),
    )
    .await;
    assert_eq!(res.status(), StatusCode::ACCEPTED);
    let sent = env.calls.last_submit.lock().unwrap().take().unwrap();
    assert_eq!(sent.upload_id, NEW_UPLOAD);
    assert!(sent.image.is_empty() && sent.image_url.is_empty());

    let res = post_multipart(
        &env,
        "/api/v1/scan",
        &[("upload_id", None, NEW_UPLOAD.as_bytes())],
    )
    .await;
    assert_eq!(res.status(), StatusCode::ACCEPTED);
    let sent = env.calls.last_submit.lock().unwrap().take().unwrap();
    assert_eq!(sent.upload_id, NEW_UPLOAD);

    for (what, res) in [
        (
            "both",
            post_multipart(
                &env,
                "/api/v1/scan",
                &[
                    ("upload_id", None, NEW_UPLOAD.as_bytes()),
                    ("image", Some("a.png"), &png(20)),
                ],
            )
            .await,
        ),
        (
            "not a uuid",
            post_json(&env, "/api/v1/scan", json!({"upload_id": "42"})).await,
        ),
    ] {
        let (status, body) = error_body(res).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{what}: {body}");
    }
}
