//! Resuming a job's SSE stream with `Last-Event-ID`, through the real gateway and the real
//! ingest (the gateway's own tests use a fake ingest, which filters strictly after the resume
//! id and so cannot show what the real watch protocol does at the end of a log).
//!
//! The stage services are the suite's (mock model); ingest and the gateway are started here,
//! on port 0, so that each test can tune ingest (a log that keeps 3 events, a log that expires
//! at once).

mod common;

use std::time::Duration;

use common::{Sse, TestSuite, image_form, read_sse};
use ecoscan_common::testing::{Spawned, spawn};
use reqwest::StatusCode;
use serde_json::Value;

/// The suite's stage services, with an ingest and a gateway of this test in front of them.
struct Stack {
    _suite: TestSuite,
    _ingest: Spawned,
    gateway: Spawned,
    /// The gateway's admin listener (`/metrics`).
    admin_url: String,
    _dir: tempfile::TempDir,
    http: reqwest::Client,
}

impl Stack {
    async fn start(tweak: impl FnOnce(&mut ecoscan_ingest::Config)) -> Self {
        let suite =
            TestSuite::start_with(|c| c.llm.mock_latency = Duration::from_millis(300)).await;
        let a = suite.running.addrs;
        let url = |addr: std::net::SocketAddr| format!("http://{addr}");
        let dir = tempfile::tempdir().unwrap();
        let mut config = ecoscan_ingest::Config {
            vision_url: url(a.vision),
            rule_url: url(a.rule),
            answer_url: url(a.answer),
            reward_url: url(a.reward),
            notification_url: url(a.notification),
            database_url: format!(
                "sqlite://{}?mode=rwc",
                dir.path().join("ingest.db").display()
            ),
            object_dir: dir.path().join("objects"),
            ..Default::default()
        };
        tweak(&mut config);
        let ingest = spawn(move |l, s| ecoscan_ingest::serve(config, l, s)).await;
        let gateway_config = ecoscan_gateway::Config {
            ingest_url: ingest.uri(),
            reward_url: url(a.reward),
            analytics_url: url(a.analytics),
            notification_url: url(a.notification),
            // These tests are about resuming, not identity: the caller is `X-User-Id` on loopback.
            auth: ecoscan_gateway::AuthConfig {
                trust_header: ecoscan_gateway::TrustHeader::Loopback,
                ..Default::default()
            },
            ..Default::default()
        };
        // `/metrics` (the gateway's feeds) is on the admin listener only.
        let admin = ecoscan_common::server::listen(([127, 0, 0, 1], 0).into()).expect("bind admin");
        let admin_url = format!("http://{}", admin.local_addr().unwrap());
        let gateway =
            spawn(move |l, s| ecoscan_gateway::serve_with_admin(gateway_config, l, Some(admin), s))
                .await;
        Self {
            _suite: suite,
            _ingest: ingest,
            gateway,
            admin_url,
            _dir: dir,
            http: reqwest::Client::new(),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.gateway.uri())
    }

    /// Submits a scan as `alice`; returns its job id.
    async fn submit(&self) -> String {
        let res = self
            .http
            .post(self.url("/api/v1/scan"))
            .header("x-user-id", "alice")
            .multipart(image_form("투명 페트병 pet bottle"))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::ACCEPTED);
        let body: Value = res.json().await.unwrap();
        body["job_id"].as_str().unwrap().to_owned()
    }

    /// `GET /api/v1/scan/{job}/events` as `alice`, after `last` when given.
    async fn events(&self, job: &str, last: Option<&str>) -> reqwest::Response {
        let mut req = self
            .http
            .get(self.url(&format!("/api/v1/scan/{job}/events")))
            .header("x-user-id", "alice");
        if let Some(id) = last {
            req = req.header("last-event-id", id);
        }
        req.send().await.unwrap()
    }

    /// The job's whole stream, to its end (the connection is closed after, and with it the
    /// gateway's feed of the job).
    async fn follow(&self, job: &str) -> Vec<Sse> {
        let events = read_sse(self.events(job, None).await).await;
        assert_eq!(
            events.last().map(|e| e.event.as_str()),
            Some("ready"),
            "{events:#?}"
        );
        events
    }

    /// The id of an event of another job, one submitted in another millisecond than the job
    /// whose events are `mine` (ids carry their job's time, so a job of the same millisecond
    /// could pass for the same one).
    async fn foreign_id(&self, mine: &[Sse]) -> String {
        let mine = time_of(mine[0].id.as_deref().unwrap()).to_owned();
        loop {
            tokio::time::sleep(Duration::from_millis(2)).await;
            let other = self.submit().await;
            let theirs = self.follow(&other).await;
            if time_of(theirs[0].id.as_deref().unwrap()) != mine {
                return theirs[1].id.clone().unwrap();
            }
        }
    }

    /// Waits until the gateway holds no feed of any job (its last client is gone).
    async fn feeds_gone(&self) {
        let mut text = String::new();
        for _ in 0..400 {
            text = self
                .http
                .get(format!("{}/metrics", self.admin_url))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            if text
                .lines()
                .any(|l| l.starts_with("gateway_watch_feeds") && l.trim().ends_with(" 0"))
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let feeds: Vec<&str> = text.lines().filter(|l| l.contains("watch_feeds")).collect();
        panic!("the gateway still holds a job feed 10 s after its clients left: {feeds:?}");
    }
}

/// The job's events' time: every id of a job is `<T>-<seq>`.
fn time_of(id: &str) -> &str {
    id.split_once('-').unwrap().0
}

#[tokio::test]
async fn a_resume_in_the_middle_gets_exactly_the_events_after_it_from_the_header_or_the_query() {
    let stack = Stack::start(|_| {}).await;
    let job = stack.submit().await;
    let all = stack.follow(&job).await;
    let third = all[2].id.clone().unwrap();

    let rest = read_sse(stack.events(&job, Some(&third)).await).await;
    let ids =
        |events: &[Sse]| -> Vec<String> { events.iter().map(|e| e.id.clone().unwrap()).collect() };
    assert_eq!(ids(&rest), ids(&all[3..]));

    let res = stack
        .http
        .get(stack.url(&format!("/api/v1/scan/{job}/events?last_event_id={third}")))
        .header("x-user-id", "alice")
        .send()
        .await
        .unwrap();
    assert_eq!(ids(&read_sse(res).await), ids(&all[3..]));
}

/// Bug 1 of issue 22: once the gateway had no feed of the job, a resume at the final event got
/// `error` after 16 s (the feed dropped ingest's end as a repeat of the resume id). Now the
/// answer is read from ingest at once: 204, the end is behind the client (an `EventSource`
/// stops reconnecting on it), while a resume one event earlier gets the same end again.
#[tokio::test]
async fn a_resume_at_the_final_event_after_the_feed_is_gone_is_204_one_before_gets_the_end() {
    let stack = Stack::start(|_| {}).await;
    let job = stack.submit().await;
    let all = stack.follow(&job).await;
    let ready = all.last().unwrap();
    stack.feeds_gone().await;

    let res = stack.events(&job, ready.id.as_deref()).await;
    assert_eq!(res.status(), StatusCode::NO_CONTENT);
    let before = all[all.len() - 2].id.as_deref();
    let again = read_sse(stack.events(&job, before).await).await;
    assert_eq!(again.len(), 1, "only the end: {again:#?}");
    assert_eq!(again[0].event, "ready");
    assert_eq!(again[0].id, ready.id, "the same end, at the log's final id");
    assert_eq!(again[0].data["seq"], ready.data["seq"], "never seq 0");
    assert_eq!(again[0].data["result_url"], ready.data["result_url"]);
}

/// Bug 1 of issue 22: a resume past the end of a finished job was a 503. It is the end behind
/// the client: 204.
#[tokio::test]
async fn a_resume_past_the_end_of_a_finished_job_is_204_not_a_5xx() {
    let stack = Stack::start(|_| {}).await;
    let job = stack.submit().await;
    let all = stack.follow(&job).await;
    let ready = all.last().unwrap();
    stack.feeds_gone().await;
    let past = format!("{}-999", time_of(ready.id.as_deref().unwrap()));

    let res = stack.events(&job, Some(&past)).await;
    assert_eq!(res.status(), StatusCode::NO_CONTENT);
    assert_eq!(res.text().await.unwrap(), "");
}

/// Bug 1 of issue 22: a bogus future id on a running job dropped every later event, the end
/// included. Now the gap is said (`resync`, past the end) and the stream goes on to the end.
#[tokio::test]
async fn a_future_id_on_a_running_job_is_announced_and_the_stream_goes_on_to_the_end() {
    let stack = Stack::start(|_| {}).await;
    let job = stack.submit().await;
    // The job's first event names its time; the scan takes a few model calls of 300 ms.
    let first = {
        let res = stack.events(&job, None).await;
        let mut body = res.bytes_stream();
        let mut buf = String::new();
        use futures::StreamExt;
        while !buf.contains("\n\n") {
            buf.push_str(&String::from_utf8_lossy(
                &body.next().await.unwrap().unwrap(),
            ));
        }
        let line = buf
            .lines()
            .find(|l| l.starts_with("id:"))
            .unwrap()
            .to_owned();
        line.trim_start_matches("id:").trim().to_owned()
    };
    let future = format!("{}-999", time_of(&first));

    let events = read_sse(stack.events(&job, Some(&future)).await).await;
    let resync = events
        .iter()
        .find(|e| e.event == "resync")
        .unwrap_or_else(|| panic!("the position past the end is said: {events:#?}"));
    assert_eq!(resync.data["reason"], "past_end");
    assert_eq!(resync.data["after_event_id"], future.as_str());
    assert_eq!(resync.data["result_url"], format!("/api/v1/scan/{job}"));
    assert_eq!(resync.id.as_deref(), resync.data["event_id"].as_str());
    assert_eq!(events.last().unwrap().event, "ready", "{events:#?}");
    // From the resync on, ids strictly increase.
    let seqs: Vec<u64> = events
        .iter()
        .skip_while(|e| e.event != "resync")
        .map(|e| e.data["seq"].as_u64().unwrap())
        .collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
}

#[tokio::test]
async fn a_resume_with_an_id_of_another_job_or_a_malformed_id_is_a_400_with_a_message() {
    let stack = Stack::start(|_| {}).await;
    let job = stack.submit().await;
    let all = stack.follow(&job).await;
    let foreign = stack.foreign_id(&all).await;
    for bad in [foreign.as_str(), "abc", "1-2-3"] {
        let res = stack.events(&job, Some(bad)).await;
        assert_eq!(res.status(), StatusCode::BAD_REQUEST, "{bad}");
        let body: Value = res.json().await.unwrap();
        assert_eq!(body["code"], "INVALID_ARGUMENT", "{bad}: {body}");
        assert!(!body["message"].as_str().unwrap().is_empty(), "{body}");
        // Named as the caller sent it, whether the gateway refused it (malformed) or ingest
        // did (another job's id: ingest's BadRequest names its `after_event_id`).
        assert_eq!(body["reason"], "INVALID_FIELD", "{bad}: {body}");
        assert_eq!(body["errors"][0]["field"], "Last-Event-ID", "{bad}: {body}");
        assert_eq!(body["errors"].as_array().unwrap().len(), 1, "{bad}: {body}");
    }
}

/// The real-ingest twin of the gateway's test of the same name: the first client of a job's
/// feed resumes with another job's id (ingest refuses it, a moment later), and a second client
/// of the same job, with an id of its own, joins that feed meanwhile: the refusal is the first
/// client's alone (found by the history checker, seed 2 on the Cluster).
#[tokio::test]
async fn a_resume_refused_for_its_id_does_not_refuse_a_client_that_joined_its_feed() {
    let stack = Stack::start(|_| {}).await;
    let job = stack.submit().await;
    let all = stack.follow(&job).await;
    let foreign = stack.foreign_id(&all).await;
    stack.feeds_gone().await;
    let own_id = all[1].id.clone().unwrap();

    // At once: whichever starts the feed, the other joins it from another position.
    let (refused, joined) = tokio::join!(
        stack.events(&job, Some(&foreign)),
        stack.events(&job, Some(&own_id))
    );
    assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
    assert_eq!(joined.status(), StatusCode::OK);
    let rest = read_sse(joined).await;
    let ids =
        |events: &[Sse]| -> Vec<String> { events.iter().map(|e| e.id.clone().unwrap()).collect() };
    assert_eq!(
        ids(&rest),
        ids(&all[2..]),
        "exactly the events after its own id"
    );
    assert_eq!(rest.last().map(|e| e.event.as_str()), Some("ready"));
}

#[tokio::test]
async fn a_gap_the_trimmed_log_cannot_fill_reaches_the_client_as_resync() {
    // A log that keeps 3 events of a job: a resume from the first event finds it trimmed.
    let stack = Stack::start(|c| c.event_max_len = 3).await;
    let job = stack.submit().await;
    let all = stack.follow(&job).await;
    stack.feeds_gone().await;
    let events = read_sse(stack.events(&job, all[0].id.as_deref()).await).await;
    let names: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
    assert_eq!(names[0], "resync", "{events:#?}");
    let resync = &events[0];
    assert_eq!(resync.data["reason"], "events_lost");
    assert_eq!(resync.data["result_url"], format!("/api/v1/scan/{job}"));
    let n = all.len();
    assert_eq!(
        resync.id,
        all[n - 4].id,
        "the stream goes on after the last lost event"
    );
    let rest: Vec<_> = events[1..].iter().map(|e| e.id.clone()).collect();
    let expected: Vec<_> = all[n - 3..].iter().map(|e| e.id.clone()).collect();
    assert_eq!(rest, expected);
}

#[tokio::test]
async fn a_resume_after_the_log_expired_says_so_and_ends_with_the_end_from_the_row() {
    // Logs expire as soon as their job ends (swept when the next job ends).
    let stack = Stack::start(|c| c.event_ttl = Duration::from_millis(1)).await;
    let job = stack.submit().await;
    let all = stack.follow(&job).await;
    let other = stack.submit().await;
    stack.follow(&other).await;
    stack.feeds_gone().await;

    let events = read_sse(stack.events(&job, all[2].id.as_deref()).await).await;
    let names: Vec<&str> = events.iter().map(|e| e.event.as_str()).collect();
    assert_eq!(names, ["resync", "ready"], "{events:#?}");
    assert_eq!(events[0].data["reason"], "log_expired");
    // The row recorded where the log's final event stood: the end keeps that id, and the
    // resync names the position before it (the log's last event before its end).
    assert_eq!(
        events[1].id,
        all.last().unwrap().id,
        "the end at its own id"
    );
    assert_eq!(events[0].id, all[all.len() - 2].id);
    assert_eq!(events[1].data["result_url"], format!("/api/v1/scan/{job}"));
}

/// `ecoscan watch`'s client through a `resync`: it reads the job's result, hands it on as a
/// `result` event, and the scan view ends with the stored answer.
#[tokio::test]
async fn the_cli_takes_the_result_after_a_resync_and_ends_with_the_stored_answer() {
    let stack = Stack::start(|c| c.event_max_len = 3).await;
    let job = stack.submit().await;
    stack.follow(&job).await;
    stack.feeds_gone().await;

    let client = ecoscan::cli::Client::new(
        &stack.gateway.uri(),
        ecoscan::cli::Auth::User("alice".into()),
    )
    .unwrap();
    let mut seen: Vec<(String, Value)> = Vec::new();
    let outcome = client
        .follow(&job, |name, data| {
            seen.push((name.to_owned(), data.clone()))
        })
        .await
        .unwrap();
    assert_eq!(outcome, ecoscan::cli::Outcome::Ready);
    let names: Vec<&str> = seen.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(&names[..2], ["resync", "result"], "{names:?}");
    assert_eq!(names.last(), Some(&"ready"));

    let stored = &seen[1].1["answer"]["text"];
    assert!(stored.as_str().is_some_and(|t| !t.is_empty()), "{stored}");
    let mut view = ecoscan::cli::ScanView::new(true);
    for (name, data) in &seen {
        view.event(name, data);
    }
    assert_eq!(Some(view.answer()), stored.as_str());
}
