//! The whole suite in one process on ephemeral ports, driven through the gateway over HTTP (and
//! ingest over gRPC) the way an app, a browser or `grpcurl` would.

mod common;

use std::time::Duration;

use common::{PNG, TestSuite, image_form, read_sse, wait_result};
use ecoscan_common::client::request_as;
use ecoscan_proto::v1::{
    GetResultRequest, SubmitRequest, WatchRequest, scan_service_client::ScanServiceClient,
};
use serde_json::{Value, json};
use tonic::Code;

fn stages(events: &[common::Sse]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for e in events {
        let stage = e.data["stage"].as_str().unwrap_or_default().to_owned();
        if out.last() != Some(&stage) {
            out.push(stage);
        }
    }
    out
}

#[tokio::test]
async fn scan_streams_every_stage_in_order_and_resumes_after_last_event_id() {
    let suite = TestSuite::start().await;

    let res = suite
        .http
        .post(suite.url("/api/v1/scan/completion"))
        .header("x-user-id", "alice")
        .multipart(image_form("투명 페트병 pet bottle"))
        .send()
        .await
        .unwrap();
    let events = read_sse(res).await;

    assert_eq!(
        stages(&events),
        ["queued", "vision", "rule", "answer", "reward", "done"],
        "events: {events:#?}"
    );
    let ids: Vec<&str> = events
        .iter()
        .map(|e| e.id.as_deref().expect("every event has an id"))
        .collect();
    let seqs: Vec<u64> = events
        .iter()
        .map(|e| e.data["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(
        seqs,
        (1..=events.len() as u64).collect::<Vec<_>>(),
        "no event missing or repeated"
    );
    assert!(
        events.iter().any(|e| e.event == "delta"),
        "answer text streams as delta events"
    );
    let last = events.last().unwrap();
    assert_eq!(last.event, "ready");
    let job_id = last.data["job_id"].as_str().unwrap().to_owned();
    assert!(last.data["result_url"].as_str().unwrap().ends_with(&job_id));

    let classified = events
        .iter()
        .find(|e| e.data["stage"] == "vision" && e.data["status"] == "completed")
        .expect("vision completed event");
    assert_eq!(
        classified.data["classification"]["middle_category"],
        "무색페트병"
    );
    assert_eq!(classified.data["classification"]["provider"], "mock");
    let text: String = events
        .iter()
        .filter(|e| e.event == "delta")
        .map(|e| e.data["delta"].as_str().unwrap())
        .collect();
    assert!(
        text.contains("mock"),
        "the mock answer says it is mock: {text}"
    );

    // Resume after the fourth event: exactly the rest, nothing before, nothing twice.
    let res = suite
        .http
        .get(suite.url(&format!("/api/v1/scan/{job_id}/events")))
        .header("x-user-id", "alice")
        .header("last-event-id", ids[3])
        .send()
        .await
        .unwrap();
    let resumed = read_sse(res).await;
    let resumed_ids: Vec<&str> = resumed.iter().map(|e| e.id.as_deref().unwrap()).collect();
    assert_eq!(
        resumed_ids,
        ids[4..],
        "resume yields exactly the events after Last-Event-ID"
    );

    // Another user cannot watch it.
    let res = suite
        .http
        .get(suite.url(&format!("/api/v1/scan/{job_id}/events")))
        .header("x-user-id", "mallory")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 404);
}

#[tokio::test]
async fn result_endpoint_answers_202_while_running_then_200_with_the_result() {
    let suite = TestSuite::start_with(|c| c.llm.mock_latency = Duration::from_millis(800)).await;
    let res = suite
        .http
        .post(suite.url("/api/v1/scan"))
        .header("x-user-id", "bob")
        .json(&json!({"image_base64": base64_png(), "hint": "aluminium can 알루미늄캔", "locale": "en"}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 202);
    assert!(res.headers().get("location").is_some());
    let body: Value = res.json().await.unwrap();
    let job_id = body["job_id"].as_str().unwrap().to_owned();
    assert_eq!(body["result_url"], format!("/api/v1/scan/{job_id}"));

    let running = suite
        .http
        .get(suite.url(&format!("/api/v1/scan/{job_id}")))
        .header("x-user-id", "bob")
        .send()
        .await
        .unwrap();
    assert_eq!(
        running.status(),
        202,
        "a model call of 800 ms is still running"
    );
    assert!(running.headers().get("retry-after").is_some());

    let result = wait_result(&suite, &job_id, "bob").await;
    assert_eq!(result["status"], "succeeded", "{result:#}");
    assert_eq!(result["classification"]["middle_category"], "금속류");
    assert_eq!(result["rules"]["locale"], "en");
    assert!(result["rules"]["recyclable"].as_bool().unwrap());
    assert!(!result["answer"]["steps"].as_array().unwrap().is_empty());
    assert_eq!(result["answer"]["locale"], "en");
    assert_eq!(result["reward"]["newly_granted"], true);
}

fn base64_png() -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(PNG)
}

async fn scan_and_wait(suite: &TestSuite, user: &str, hint: &str) -> Value {
    let res = suite
        .http
        .post(suite.url("/api/v1/scan"))
        .header("x-user-id", user)
        .multipart(image_form(hint))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 202);
    let job_id = res.json::<Value>().await.unwrap()["job_id"]
        .as_str()
        .unwrap()
        .to_owned();
    wait_result(suite, &job_id, user).await
}

#[tokio::test]
async fn two_scans_of_the_same_category_grant_the_character_once_and_notify_the_owner() {
    let suite = TestSuite::start().await;

    let first = scan_and_wait(&suite, "carol", "glass bottle 유리병 소주병").await;
    let second = scan_and_wait(&suite, "carol", "glass bottle 유리병 소주병").await;
    assert_eq!(first["classification"]["middle_category"], "유리병");
    assert_eq!(first["reward"]["newly_granted"], true, "{first:#}");
    assert_eq!(second["reward"]["newly_granted"], false, "{second:#}");
    assert_eq!(second["reward"]["eligible"], true);
    assert_eq!(
        first["reward"]["character"]["code"],
        second["reward"]["character"]["code"]
    );

    let owned: Value = suite.get_json_as("/api/v1/characters/me", "carol").await;
    let characters = owned["characters"].as_array().expect("characters array");
    assert_eq!(characters.len(), 1, "{owned:#}");

    // The catalogue says the same: that character owned, from the first scan, the rest not.
    let code = first["reward"]["character"]["code"]
        .as_str()
        .unwrap()
        .to_owned();
    let catalogue: Value = suite.get_json_as("/api/v1/characters", "carol").await;
    let entries = catalogue["characters"]
        .as_array()
        .expect("characters array");
    assert_eq!(entries.len(), 13, "{catalogue:#}");
    assert_eq!(
        entries[0]["is_default"], true,
        "the default first: {catalogue:#}"
    );
    let owned: Vec<&Value> = entries.iter().filter(|e| e["owned"] == true).collect();
    assert_eq!(owned.len(), 1, "{catalogue:#}");
    assert_eq!(owned[0]["character"]["code"], code.as_str());
    assert_eq!(owned[0]["job_id"], first["job_id"]);
    // One character by its English name, as the caller and as someone else.
    let name = first["reward"]["character"]["name_en"]
        .as_str()
        .unwrap()
        .to_lowercase();
    let one: Value = suite
        .get_json_as(&format!("/api/v1/characters/{name}"), "carol")
        .await;
    assert_eq!(one["entry"]["character"]["code"], code.as_str(), "{one:#}");
    assert_eq!(one["entry"]["owned"], true);
    let theirs: Value = suite
        .get_json_as(&format!("/api/v1/characters/{code}"), "dave")
        .await;
    assert_eq!(theirs["entry"]["owned"], false, "{theirs:#}");
    let missing = suite
        .http
        .get(suite.url("/api/v1/characters/pikachu"))
        .header("x-user-id", "carol")
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);

    // The owner has one scan_completed notification per scan; nobody else has any.
    let inbox: Value = suite.get_json_as("/api/v1/notifications", "carol").await;
    let notes = inbox["notifications"]
        .as_array()
        .expect("notifications array");
    let scan_notes: Vec<&Value> = notes
        .iter()
        .filter(|n| n["kind"] == "scan_completed")
        .collect();
    assert_eq!(scan_notes.len(), 2, "{inbox:#}");
    assert!(scan_notes.iter().any(|n| n["job_id"] == first["job_id"]));
    let others: Value = suite.get_json_as("/api/v1/notifications", "dave").await;
    assert!(
        others["notifications"]
            .as_array()
            .is_none_or(|a| a.is_empty()),
        "{others:#}"
    );
}

#[tokio::test]
async fn the_services_call_each_other_in_memory_not_over_loopback() {
    let suite = TestSuite::start().await;
    let result = scan_and_wait(&suite, "frank", "glass bottle 유리병").await;
    assert_eq!(result["status"], "succeeded", "{result:#}");
    // The scan crossed gateway -> ingest -> vision -> rule, answer, reward, notification and
    // analytics, all in memory: the kernel shows no connection on any service's port.
    for (name, addr) in suite.running.addrs.services() {
        assert_eq!(
            ecoscan_common::testing::established_tcp(addr.port()),
            0,
            "a call to {name} crossed loopback TCP"
        );
    }
}

#[tokio::test]
async fn an_idempotency_key_returns_the_first_job() {
    let suite = TestSuite::start().await;
    let submit = || {
        suite
            .http
            .post(suite.url("/api/v1/scan"))
            .header("x-user-id", "erin")
            .header("idempotency-key", "photo-42")
            .multipart(image_form("milk carton 우유팩"))
            .send()
    };
    let a: Value = submit().await.unwrap().json().await.unwrap();
    let b: Value = submit().await.unwrap().json().await.unwrap();
    assert_eq!(a["job_id"], b["job_id"]);
    assert_eq!(a["duplicate"], false);
    assert_eq!(b["duplicate"], true);
}

#[tokio::test]
async fn bad_input_gets_a_clear_4xx_and_stores_nothing() {
    let suite = TestSuite::start().await;
    let post = |body: reqwest::RequestBuilder| async move {
        body.header("x-user-id", "frank").send().await.unwrap()
    };
    let scan = || suite.http.post(suite.url("/api/v1/scan"));

    let empty = reqwest::multipart::Form::new().part(
        "image",
        reqwest::multipart::Part::bytes(Vec::new()).file_name("a.png"),
    );
    let not_image = reqwest::multipart::Form::new().part(
        "image",
        reqwest::multipart::Part::bytes(b"%PDF-1.7 not a photo".to_vec()).file_name("a.png"),
    );
    let mut huge = PNG.to_vec();
    huge.resize(11 * 1024 * 1024, 0);
    let too_big = reqwest::multipart::Form::new().part(
        "image",
        reqwest::multipart::Part::bytes(huge).file_name("a.png"),
    );

    let cases = [
        ("empty image", post(scan().multipart(empty)).await, 400),
        ("not an image", post(scan().multipart(not_image)).await, 415),
        (
            "image over the limit",
            post(scan().multipart(too_big)).await,
            413,
        ),
        (
            "malformed JSON",
            post(
                scan()
                    .header("content-type", "application/json")
                    .body("{\"image_base64\": "),
            )
            .await,
            400,
        ),
    ];
    for (what, res, want) in cases {
        let status = res.status().as_u16();
        let body: Value = res.json().await.unwrap_or(Value::Null);
        assert_eq!(status, want, "{what}: {body}");
        assert!(
            body["code"].is_string() && body["message"].is_string(),
            "{what}: JSON error body, got {body}"
        );
    }

    let unknown = uuid::Uuid::now_v7();
    let res = suite
        .http
        .get(suite.url(&format!("/api/v1/scan/{unknown}")))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 404);
    assert_eq!(res.json::<Value>().await.unwrap()["code"], "NOT_FOUND");
    let res = suite
        .http
        .get(suite.url(&format!("/api/v1/scan/{unknown}/events")))
        .header("last-event-id", "yesterday")
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 400);

    // Nothing was stored: the user has no jobs, no notifications, and ingest's image store is empty.
    let images = suite.data_dir.path().join("objects").join("images");
    let stored = std::fs::read_dir(&images).map(|d| d.count()).unwrap_or(0);
    assert_eq!(stored, 0, "no image stored under {}", images.display());
}

#[tokio::test]
async fn ingest_answers_bad_grpc_input_with_the_matching_codes() {
    let suite = TestSuite::start().await;
    let mut ingest = ScanServiceClient::new(
        ecoscan_common::client::channel(&format!("http://{}", suite.running.addrs.ingest)).unwrap(),
    );
    let deadline = Duration::from_secs(10);
    let submit = |req: SubmitRequest| request_as(req, deadline, "grace");

    let empty = ingest
        .submit(submit(SubmitRequest::default()))
        .await
        .unwrap_err();
    assert_eq!(empty.code(), Code::InvalidArgument, "{empty:?}");
    let not_image = ingest
        .submit(submit(SubmitRequest {
            image: b"hello".to_vec(),
            ..Default::default()
        }))
        .await
        .unwrap_err();
    assert_eq!(not_image.code(), Code::InvalidArgument);
    let bad_locale = ingest
        .submit(submit(SubmitRequest {
            image: PNG.to_vec(),
            locale: "fr".into(),
            ..Default::default()
        }))
        .await
        .unwrap_err();
    assert_eq!(bad_locale.code(), Code::InvalidArgument);
    assert!(bad_locale.message().contains("locale"));

    let unknown = uuid::Uuid::now_v7().to_string();
    let missing = ingest
        .get_result(request_as(
            GetResultRequest {
                job_id: unknown.clone(),
            },
            deadline,
            "grace",
        ))
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    let not_uuid = ingest
        .get_result(request_as(
            GetResultRequest {
                job_id: "42".into(),
            },
            deadline,
            "grace",
        ))
        .await
        .unwrap_err();
    assert_eq!(not_uuid.code(), Code::InvalidArgument);
    let bad_event_id = ingest
        .watch(request_as(
            WatchRequest {
                job_id: unknown,
                after_event_id: "not-an-id".into(),
            },
            deadline,
            "grace",
        ))
        .await
        .unwrap_err();
    assert_eq!(bad_event_id.code(), Code::InvalidArgument);
    let anonymous = ingest
        .submit(tonic::Request::new(SubmitRequest {
            image: PNG.to_vec(),
            ..Default::default()
        }))
        .await
        .unwrap_err();
    assert_eq!(
        anonymous.code(),
        Code::Unauthenticated,
        "a job needs an owner: no identity is a missing credential"
    );
}

#[tokio::test]
async fn every_service_answers_health_and_reflection() {
    let suite = TestSuite::start().await;
    let a = &suite.running.addrs;
    for (addr, service) in [
        (a.ingest, "ecoscan.v1.ScanService"),
        (a.vision, "ecoscan.v1.VisionService"),
        (a.rule, "ecoscan.v1.RuleService"),
        (a.answer, "ecoscan.v1.AnswerService"),
        (a.reward, "ecoscan.v1.RewardService"),
        (a.analytics, "ecoscan.v1.AnalyticsService"),
        (a.notification, "ecoscan.v1.NotificationService"),
    ] {
        ecoscan_common::testing::assert_health_and_reflection(&format!("http://{addr}"), service)
            .await;
        for probe in ["/healthz", "/readyz"] {
            let res = suite
                .http
                .get(format!("http://{addr}{probe}"))
                .send()
                .await
                .unwrap();
            assert_eq!(res.status(), 200, "{service} {probe}");
        }
    }
    let res = suite.http.get(suite.url("/healthz")).send().await.unwrap();
    assert_eq!(res.status(), 200);
    // Readiness and metrics are on the gateway's admin listener, not the API port.
    let admin = suite.running.addrs.gateway_admin;
    let res = suite.http.get(suite.url("/readyz")).send().await.unwrap();
    assert_eq!(res.status(), 404);
    let res = suite
        .http
        .get(format!("http://{admin}/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        res.status(),
        200,
        "{}",
        res.text().await.unwrap_or_default()
    );
}

#[tokio::test]
async fn a_scan_whose_model_is_unreachable_ends_with_an_error_event_and_a_failed_result() {
    let suite = TestSuite::start_with(|c| {
        c.llm.provider = ecoscan_llm::Provider::OpenAi;
        // Nothing listens on port 1: every model call fails to connect.
        c.llm.base_url = "http://127.0.0.1:1/v1".into();
        c.llm.max_retries = 0;
    })
    .await;
    let res = suite
        .http
        .post(suite.url("/api/v1/scan/completion"))
        .header("x-user-id", "heidi")
        .multipart(image_form("can"))
        .send()
        .await
        .unwrap();
    let events = read_sse(res).await;
    let last = events.last().unwrap();
    assert_eq!(last.event, "error", "{events:#?}");
    assert_eq!(last.data["error"]["code"], "UNAVAILABLE");
    assert_eq!(last.data["error"]["http_status"], 503);
    assert_eq!(last.data["error"]["retryable"], true);
    assert!(
        events
            .iter()
            .any(|e| e.data["stage"] == "vision" && e.data["status"] == "failed"),
        "the failed stage is reported: {events:#?}"
    );
    assert!(
        !events.iter().any(|e| e.data["stage"] == "rule"),
        "no stage runs after a failure"
    );

    let job_id = last.data["job_id"].as_str().unwrap();
    let result = wait_result(&suite, job_id, "heidi").await;
    assert_eq!(result["status"], "failed", "{result:#}");
    assert_eq!(result["error"]["code"], "UNAVAILABLE");

    // The failed model call was recorded in analytics (which only an admin may read).
    let admin = suite.token("ops", true);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let usage: Value = suite.usage(&admin).await;
        let errors: u64 = usage["rows"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["service"] == "vision")
            .map(|r| {
                r["errors"]
                    .as_u64()
                    .or_else(|| r["errors"].as_str()?.parse().ok())
                    .unwrap_or(0)
            })
            .sum();
        if errors >= 1 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no vision error in analytics: {usage:#}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `ecoscan token` mints tokens the local gateway accepts; a job, its events and result are its
/// owner's alone (404 for anyone else, so ids do not leak); usage needs the admin role.
#[tokio::test]
async fn tokens_act_for_their_user_and_jobs_are_visible_to_their_owner_only() {
    let suite = TestSuite::start().await;
    let ivan = suite.token("ivan", false);
    let judy = suite.token("judy", false);

    let res = suite
        .http
        .post(suite.url("/api/v1/scan"))
        .bearer_auth(&ivan)
        .multipart(image_form("can"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 202);
    let job_id = res.json::<Value>().await.unwrap()["job_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let result = wait_result(&suite, &job_id, "ivan").await;
    assert_eq!(result["status"], "succeeded", "{result:#}");

    for path in [
        format!("/api/v1/scan/{job_id}"),
        format!("/api/v1/scan/{job_id}/events"),
    ] {
        let res = suite
            .http
            .get(suite.url(&path))
            .bearer_auth(&judy)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 404, "{path} as another user");
        let res = suite
            .http
            .get(suite.url(&path))
            .bearer_auth(&ivan)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 200, "{path} as the owner");
    }
    // `EventSource` cannot send headers: it opens the stream with a single-use ticket.
    let ticket = suite
        .http
        .post(suite.url("/api/v1/sse-tickets"))
        .bearer_auth(&ivan)
        .send()
        .await
        .unwrap()
        .json::<Value>()
        .await
        .unwrap()["ticket"]
        .as_str()
        .unwrap()
        .to_owned();
    let res = suite
        .http
        .get(suite.url(&format!("/api/v1/scan/{job_id}/events?ticket={ticket}")))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let events = read_sse(res).await;
    assert_eq!(events.last().unwrap().event, "ready");

    // The character went to ivan, not to judy.
    let owned = |token: String| {
        let http = suite.http.clone();
        let url = suite.url("/api/v1/characters/me");
        async move {
            http.get(url)
                .bearer_auth(token)
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mine = owned(ivan.clone()).await;
        if mine["characters"].as_array().is_some_and(|c| !c.is_empty()) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no character: {mine}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let theirs = owned(judy.clone()).await;
    assert_eq!(theirs["characters"], serde_json::json!([]), "{theirs}");

    let usage = suite.url("/api/v1/analytics/usage");
    let res = suite
        .http
        .get(&usage)
        .bearer_auth(&judy)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 403);
    let admin = suite.token("ops", true);
    let res = suite
        .http
        .get(&usage)
        .bearer_auth(&admin)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);

    // A token signed with another secret (another data dir) is refused.
    let stranger = TestSuite::start().await.token("ivan", false);
    let res = suite
        .http
        .get(suite.url(&format!("/api/v1/scan/{job_id}")))
        .bearer_auth(&stranger)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 401);
}

#[tokio::test]
async fn a_host_given_to_the_suite_exposes_the_gateway_alone() {
    // 127.0.0.2 stands for a public address: another address than the services' loopback, on
    // which nothing of this test is reachable from outside the machine.
    let host: std::net::IpAddr = "127.0.0.2".parse().unwrap();
    let suite = TestSuite::start_with(|c| c.host = host).await;
    let a = &suite.running.addrs;

    assert_eq!(
        a.gateway.ip(),
        host,
        "the gateway is where it was asked to be"
    );
    for (name, addr) in a
        .services()
        .into_iter()
        .chain([("gateway admin", a.gateway_admin)])
    {
        assert_eq!(
            addr.ip(),
            std::net::IpAddr::from([127, 0, 0, 1]),
            "{name} listens on {addr}, beyond the machine's own loopback"
        );
    }
    let res = reqwest::get(format!("http://{}/healthz", a.gateway))
        .await
        .expect("the gateway answers on its host");
    assert_eq!(res.status(), 200);
}

#[tokio::test]
async fn the_taxonomy_is_public_cacheable_and_in_both_languages() {
    let suite = TestSuite::start().await;
    // No credentials at all: a client that names no user.
    let http = reqwest::Client::new();
    let res = http
        .get(suite.url("/api/v1/scan/categories"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.headers()["cache-control"], "public, max-age=300");
    assert!(res.headers().get("vary").is_none(), "the same for everyone");
    let etag = res.headers()["etag"].clone();
    let body: Value = res.json().await.unwrap();
    let categories = body["categories"].as_array().expect("categories");
    assert_eq!(categories.len(), 18, "{body:#}");
    let paper = &categories[0];
    assert_eq!(paper["middle_category"], "종이");
    assert_eq!(paper["name_en"], "Paper");
    assert_eq!(paper["major_name_en"], "Recyclables");
    assert_eq!(
        paper["items"].as_array().unwrap().len(),
        paper["items_en"].as_array().unwrap().len()
    );
    assert!(
        body["situation_tags"]
            .as_array()
            .is_some_and(|t| t.iter().any(|t| t == "내용물_있음")),
        "{body:#}"
    );
    // Revalidated with its tag: 304, no body.
    let again = http
        .get(suite.url("/api/v1/scan/categories"))
        .header("if-none-match", etag.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 304);
    assert_eq!(again.headers()["etag"], etag);
    assert!(again.bytes().await.unwrap().is_empty());
}

/// `POST /api/v1/uploads` as `user` for the test PNG.
async fn create_upload(suite: &TestSuite, user: &str) -> Value {
    let res = suite
        .http
        .post(suite.url("/api/v1/uploads"))
        .header("x-user-id", user)
        .json(&json!({"content_type": "image/png", "size_bytes": PNG.len()}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    res.json().await.unwrap()
}

/// A `PUT` of `body` to the upload's URL with the headers it names, from a plain HTTP client
/// that sends no credential of its own.
async fn put_photo(suite: &TestSuite, up: &Value, body: &[u8]) -> reqwest::StatusCode {
    let mut req = reqwest::Client::new()
        .put(suite.url(up["upload_url"].as_str().unwrap()))
        .body(body.to_vec());
    for (k, v) in up["headers"].as_object().unwrap() {
        // reqwest sets the length from the body.
        if !k.eq_ignore_ascii_case("content-length") {
            req = req.header(k.as_str(), v.as_str().unwrap());
        }
    }
    req.send().await.unwrap().status()
}

async fn submit_upload(suite: &TestSuite, user: &str, upload_id: &str) -> reqwest::Response {
    suite
        .http
        .post(suite.url("/api/v1/scan"))
        .header("x-user-id", user)
        .json(&json!({"upload_id": upload_id, "hint": "투명 페트병 pet bottle"}))
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_direct_upload_is_put_then_submitted_once_and_the_scan_succeeds() {
    let suite = TestSuite::start().await;
    let up = create_upload(&suite, "alice").await;
    let id = up["upload_id"].as_str().unwrap();
    assert!(
        up["upload_url"]
            .as_str()
            .unwrap()
            .starts_with(&format!("/api/v1/uploads/{id}?token=")),
        "the embedded store's photos come through the gateway: {up}"
    );
    assert_eq!(put_photo(&suite, &up, PNG).await, 204);

    // Another user's upload is not theirs to know of.
    let res = submit_upload(&suite, "bob", id).await;
    assert_eq!(res.status(), 404, "{}", res.text().await.unwrap());

    let res = submit_upload(&suite, "alice", id).await;
    assert_eq!(res.status(), 202);
    let job_id = res.json::<Value>().await.unwrap()["job_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let result = wait_result(&suite, &job_id, "alice").await;
    assert_eq!(result["status"], "succeeded", "{result:#}");
    assert_eq!(result["hint"], "투명 페트병 pet bottle");

    let res = submit_upload(&suite, "alice", id).await;
    assert_eq!(res.status(), 400);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["reason"], "UPLOAD_SUBMITTED", "{body}");
}

#[tokio::test]
async fn an_upload_of_no_image_is_refused_at_submit_before_any_stage_runs() {
    let suite = TestSuite::start().await;
    let garbage = vec![b'x'; PNG.len()];
    let up = create_upload(&suite, "alice").await;
    // The gateway's URL holds the PUT to the declared type and size, not to what the bytes are
    // (as S3 does): the check of the bytes is the submit's.
    assert_eq!(put_photo(&suite, &up, &garbage).await, 204);
    let res = submit_upload(&suite, "alice", up["upload_id"].as_str().unwrap()).await;
    assert_eq!(res.status(), 400);
    let body: Value = res.json().await.unwrap();
    assert_eq!(body["reason"], "INVALID_FIELD", "{body}");
    assert_eq!(body["errors"][0]["field"], "upload_id", "{body}");
    assert!(
        body["message"]
            .as_str()
            .unwrap()
            .contains("not a JPEG, PNG, WebP or GIF"),
        "{body}"
    );
}
