use ecoscan_proto::v1::{EventStatus, Stage};

use super::*;

fn ev(stage: Stage, status: EventStatus, payload: Option<Payload>) -> ScanEvent {
    ScanEvent {
        event_id: "1700000000000-3".into(),
        job_id: "job".into(),
        seq: 3,
        stage: stage as i32,
        status: status as i32,
        progress: 0.25,
        message: "hi".into(),
        payload,
        ..ScanEvent::default()
    }
}

#[test]
fn events_get_their_sse_names() {
    use EventStatus as S;
    assert_eq!(kind(&ev(Stage::Queued, S::Completed, None)), Kind::Stage);
    assert_eq!(kind(&ev(Stage::Vision, S::Started, None)), Kind::Stage);
    assert_eq!(kind(&ev(Stage::Rule, S::Progress, None)), Kind::Stage);
    let delta = Some(Payload::Delta("분리".into()));
    assert_eq!(kind(&ev(Stage::Answer, S::Delta, delta)), Kind::Delta);
    assert_eq!(kind(&ev(Stage::Done, S::Completed, None)), Kind::Ready);
    assert_eq!(kind(&ev(Stage::Vision, S::Failed, None)), Kind::Stage);
    assert_eq!(kind(&ev(Stage::Done, S::Failed, None)), Kind::Error);
}

#[test]
fn stage_and_status_names_are_short_and_lowercase() {
    assert_eq!(stage_name(Stage::Vision as i32), "vision");
    assert_eq!(stage_name(Stage::Done as i32), "done");
    assert_eq!(status_name(EventStatus::Completed as i32), "completed");
    assert_eq!(status_name(99), "unspecified");
}

#[test]
fn failed_events_without_error_info_still_carry_an_error() {
    let e = ev(Stage::Done, EventStatus::Failed, None);
    let (json, kind) = scan_event_json(&e, &|id| format!("/r/{id}"));
    assert_eq!(kind, Kind::Error);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["error"]["code"], "INTERNAL");
    assert_eq!(v["error"]["http_status"], 500);
    assert_eq!(v["error"]["message"], "hi");
    assert_eq!(v["stage"], "done");
    assert_eq!(v["status"], "failed");
}

#[test]
fn ready_carries_the_gateway_result_url_and_payloads_are_pbjson() {
    let e = ev(Stage::Done, EventStatus::Completed, None);
    let (json, kind) = scan_event_json(&e, &|id| format!("/api/v1/scan/{id}"));
    assert_eq!(kind, Kind::Ready);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["result_url"], "/api/v1/scan/job");
    assert_eq!(v["progress"], 0.25);
    assert_eq!(v["seq"], 3);

    let c = Classification {
        major_category: "재활용폐기물".into(),
        ..Classification::default()
    };
    let e = ev(
        Stage::Vision,
        EventStatus::Completed,
        Some(Payload::Classification(c)),
    );
    let (json, _) = scan_event_json(&e, &|id| id.to_owned());
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["classification"]["major_category"], "재활용폐기물");
    assert!(v.get("error").is_none());
}

#[test]
fn gauge_counts_open_streams() {
    let gauge = crate::limits::SseSlots::new(10, 10);
    let a = gauge.take("u").unwrap();
    let b = gauge.take("u").unwrap();
    assert_eq!(gauge.open(), 2);
    drop(a);
    assert_eq!(gauge.open(), 1);
    drop(b);
    assert_eq!(gauge.open(), 0);
}

/// The body of a job's SSE response over `upstream`, read to its end.
async fn body_of(upstream: Vec<Result<ScanEvent, Status>>) -> String {
    let slots = crate::limits::SseSlots::new(10, 10);
    let upstream: ScanEvents = futures::stream::iter(
        upstream
            .into_iter()
            .map(|item| item.map(|e| Arc::new(SharedEvent::new(e)))),
    )
    .boxed();
    let res = scan_events(
        upstream,
        None,
        "job".into(),
        Arc::new(|id: &str| format!("/api/v1/scan/{id}")),
        slots.take("u").unwrap(),
        CancellationToken::new(),
        StreamTimes {
            lifetime: Duration::from_secs(60),
            keepalive: Duration::from_secs(15),
        },
    );
    let bytes = axum::body::to_bytes(res.into_body(), 1 << 20)
        .await
        .unwrap();
    String::from_utf8(bytes.to_vec()).unwrap()
}

#[tokio::test]
async fn a_stream_whose_ingest_is_unreachable_ends_with_a_retry_hint_not_an_error() {
    let started = ev(Stage::Vision, EventStatus::Started, None);
    for status in [
        Status::unavailable("ingest is restarting"),
        Status::deadline_exceeded("no answer"),
        Status::cancelled("connection reset"),
    ] {
        let body = body_of(vec![Ok(started.clone()), Err(status.clone())]).await;
        assert!(body.contains("event: stage"), "{body}");
        assert!(
            !body.contains("event: error"),
            "{status:?}: the job has not ended, so no error event: {body}"
        );
        assert!(
            body.contains("retry: 1000"),
            "{status:?}: a retry hint: {body}"
        );
    }
    // A failure ingest reports for the request itself is said as an error.
    let body = body_of(vec![Ok(started), Err(Status::internal("corrupt record"))]).await;
    assert!(body.contains("event: error"), "{body}");
}
