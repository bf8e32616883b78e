//! Shared helpers for the suite's end-to-end tests: start the whole suite on ephemeral ports in a
//! temporary data directory, and read SSE streams.

#![allow(dead_code)]

use std::time::Duration;

use ecoscan::{Running, SuiteConfig};
use ecoscan_common::CancellationToken;
use futures::StreamExt;

pub struct TestSuite {
    pub running: Running,
    pub shutdown: CancellationToken,
    pub http: reqwest::Client,
    pub data_dir: tempfile::TempDir,
}

impl TestSuite {
    /// `GET path` as `user` (`X-User-Id`), as JSON.
    pub async fn get_json_as(&self, path: &str, user: &str) -> serde_json::Value {
        self.http
            .get(self.url(path))
            .header("x-user-id", user)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// `GET /api/v1/analytics/usage` for the caller of `token` (an admin's), as JSON.
    pub async fn usage(&self, token: &str) -> serde_json::Value {
        self.http
            .get(self.url("/api/v1/analytics/usage"))
            .bearer_auth(token)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    pub async fn start() -> Self {
        Self::start_with(|_| {}).await
    }

    pub async fn start_with(tweak: impl FnOnce(&mut SuiteConfig)) -> Self {
        ecoscan_common::telemetry::init_for_tests();
        let data_dir = tempfile::tempdir().expect("temp dir");
        // The services of every suite in this process sign identity with one key, which the
        // data directory holds too, so that `ecoscan token --grpc` signs as `ecoscan up` would.
        let _ = ecoscan_common::assertion::set_key(TEST_IDENTITY_KEY);
        std::fs::write(data_dir.path().join("identity-key"), TEST_IDENTITY_KEY)
            .expect("write the identity key");
        let mut config = SuiteConfig::ephemeral(data_dir.path());
        // Fast enough for tests, slow enough that a scan is observably "running" for a moment.
        config.llm.mock_latency = Duration::from_millis(150);
        // Most tests name their users in X-User-Id: header mode, explicitly (the default is
        // off; tokens work too).
        config.gateway.auth.trust_header = ecoscan_gateway::TrustHeader::Loopback;
        tweak(&mut config);
        let shutdown = CancellationToken::new();
        let running = ecoscan::start(config, shutdown.clone())
            .await
            .expect("suite starts");
        Self {
            running,
            shutdown,
            // A request that names no user acts as `local` (what `ecoscan up`'s token is for).
            http: reqwest::Client::builder()
                .default_headers(
                    [(
                        reqwest::header::HeaderName::from_static("x-user-id"),
                        reqwest::header::HeaderValue::from_static("local"),
                    )]
                    .into_iter()
                    .collect(),
                )
                .build()
                .unwrap(),
            data_dir,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.running.addrs.gateway)
    }

    /// A bearer token for `user` from the real `ecoscan token` command, signed with this suite's
    /// secret.
    pub fn token(&self, user: &str, admin: bool) -> String {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_ecoscan"));
        cmd.args(["token", "--user", user, "--ttl", "10m", "--data-dir"])
            .arg(self.data_dir.path());
        if admin {
            cmd.arg("--admin");
        }
        let out = cmd.output().expect("ecoscan token runs");
        assert!(
            out.status.success(),
            "ecoscan token failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    }
}

impl TestSuite {
    /// The `-H` argument a grpcurl caller acting for `user` attaches to calls of `service`, from
    /// the real `ecoscan token --grpc` command.
    pub fn grpc_identity(&self, user: &str, admin: bool, service: &str) -> String {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_ecoscan"));
        cmd.args(["token", "--user", user, "--ttl", "5m", "--grpc", service])
            .arg("--data-dir")
            .arg(self.data_dir.path())
            .env_remove(ecoscan_common::assertion::KEY_VAR);
        if admin {
            cmd.arg("--admin");
        }
        let out = cmd.output().expect("ecoscan token runs");
        assert!(
            out.status.success(),
            "ecoscan token --grpc failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    }
}

/// The identity key of the suites tests start in this process.
const TEST_IDENTITY_KEY: &str = "suite-tests-identity-key-0123456789-abcdefghij";

impl Drop for TestSuite {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// A 1×1 PNG.
pub const PNG: &[u8] = &[
    0x89, 0x50, 0x4E, 0x47, 0x0D, 0x0A, 0x1A, 0x0A, 0x00, 0x00, 0x00, 0x0D, 0x49, 0x48, 0x44, 0x52,
    0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x06, 0x00, 0x00, 0x00, 0x1F, 0x15, 0xC4,
    0x89, 0x00, 0x00, 0x00, 0x0D, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9C, 0x63, 0xF8, 0xCF, 0xC0, 0xF0,
    0x1F, 0x00, 0x05, 0x00, 0x01, 0xFF, 0x89, 0x99, 0x3D, 0x1D, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45,
    0x4E, 0x44, 0xAE, 0x42, 0x60, 0x82,
];

/// One parsed SSE event.
#[derive(Clone, Debug)]
pub struct Sse {
    pub id: Option<String>,
    pub event: String,
    pub data: serde_json::Value,
}

/// Asserts that `events` is job `job`'s whole stream as one client saw it: every event once, in
/// order (`seq` 1, 2, … with no gap), ending with `ready`.
#[allow(dead_code)] // Each test binary uses its own part of this module.
pub fn assert_whole_stream(job: &str, events: &[Sse]) {
    let seqs: Vec<u64> = events
        .iter()
        .map(|e| e.data["seq"].as_u64().expect("seq"))
        .collect();
    let expected: Vec<u64> = (1..=seqs.len() as u64).collect();
    assert_eq!(
        seqs, expected,
        "job {job}: every event once, in order, no gap: {events:#?}"
    );
    assert_eq!(
        events.last().map(|e| e.event.as_str()),
        Some("ready"),
        "job {job} ends with ready: {events:#?}"
    );
}

/// Reads an SSE response to its end (the server closes after `ready` or `error`), with a
/// generous overall deadline so a hung stream fails the test instead of hanging it.
pub async fn read_sse(res: reqwest::Response) -> Vec<Sse> {
    assert_eq!(res.status(), 200, "SSE response status");
    let ct = res
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(ct.starts_with("text/event-stream"), "content type {ct}");
    let mut body = res.bytes_stream();
    let mut buf = String::new();
    let mut events = Vec::new();
    let read = async {
        while let Some(chunk) = body.next().await {
            buf.push_str(&String::from_utf8_lossy(&chunk.expect("stream chunk")));
            while let Some(end) = buf.find("\n\n") {
                let block: String = buf.drain(..end + 2).collect();
                if let Some(ev) = parse_block(&block) {
                    events.push(ev);
                }
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .expect("SSE stream ended within 60 s");
    events
}

fn parse_block(block: &str) -> Option<Sse> {
    let (mut id, mut event, mut data) = (None, String::from("message"), String::new());
    for line in block.lines() {
        if let Some(v) = line.strip_prefix("id:") {
            id = Some(v.trim().to_owned());
        } else if let Some(v) = line.strip_prefix("event:") {
            event = v.trim().to_owned();
        } else if let Some(v) = line.strip_prefix("data:") {
            if !data.is_empty() {
                data.push('\n');
            }
            data.push_str(v.strip_prefix(' ').unwrap_or(v));
        }
    }
    if data.is_empty() {
        return None; // a comment such as `: keepalive`
    }
    Some(Sse {
        id,
        event,
        data: serde_json::from_str(&data).unwrap_or(serde_json::Value::String(data)),
    })
}

pub fn image_form(hint: &str) -> reqwest::multipart::Form {
    reqwest::multipart::Form::new()
        .part(
            "image",
            reqwest::multipart::Part::bytes(PNG.to_vec())
                .file_name("photo.png")
                .mime_str("image/png")
                .expect("valid mime"),
        )
        .text("hint", hint.to_owned())
}

/// Polls `GET /api/v1/scan/{id}` until it answers 200, within a deadline.
pub async fn wait_result(suite: &TestSuite, job_id: &str, user: &str) -> serde_json::Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let res = suite
            .http
            .get(suite.url(&format!("/api/v1/scan/{job_id}")))
            .header("x-user-id", user)
            .send()
            .await
            .expect("result request");
        match res.status().as_u16() {
            200 => return res.json().await.expect("result json"),
            202 => {}
            other => panic!(
                "unexpected status {other}: {}",
                res.text().await.unwrap_or_default()
            ),
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "scan {job_id} did not finish in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What one SSE client of a job saw, across every connection it made.
#[derive(Debug, Default)]
pub struct FollowedSse {
    /// Every event with an id, in the order received.
    pub events: Vec<Sse>,
    /// Connections it made beyond the first (the gateway or ingest went away, or the stream
    /// failed upstream).
    pub reconnects: usize,
    /// `error` events without an id: a failed upstream stream, not the job's end.
    pub stream_errors: Vec<Sse>,
}

impl FollowedSse {
    /// The last event seen (the job's end once [`follow_sse`] returned).
    pub fn last(&self) -> Option<&Sse> {
        self.events.last()
    }
}

/// Follows a job's events through the gateway the way a browser's `EventSource` does: reads
/// `GET /api/v1/scan/{id}/events`, and when the connection fails, the stream ends without the
/// job's end, or an id-less `error` (the upstream stream failed) arrives, connects again with
/// `Last-Event-ID` after a short pause. Returns once an event that ends the job arrives
/// (`ready`, or an `error` with an id); panics, with what it saw, after `deadline`.
pub async fn follow_sse(
    http: &reqwest::Client,
    url: &str,
    user: &str,
    deadline: Duration,
) -> FollowedSse {
    let until = tokio::time::Instant::now() + deadline;
    let mut seen = FollowedSse::default();
    let mut connections = 0;
    loop {
        assert!(
            tokio::time::Instant::now() < until,
            "{url}: no end within {deadline:?}; saw {seen:#?}"
        );
        if connections > 0 {
            seen.reconnects += 1;
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        connections += 1;
        let mut req = http
            .get(url)
            .header("x-user-id", user)
            .timeout(until - tokio::time::Instant::now());
        if let Some(id) = seen.events.last().and_then(|e| e.id.clone()) {
            req = req.header("last-event-id", id);
        }
        let Ok(res) = req.send().await else { continue };
        if !res.status().is_success() {
            // 502/503/504 while a service restarts; anything else is a bug.
            assert!(
                res.status().is_server_error(),
                "{url}: {} {}",
                res.status(),
                res.text().await.unwrap_or_default()
            );
            continue;
        }
        let mut body = res.bytes_stream();
        let mut buf = String::new();
        while let Ok(Some(Ok(chunk))) = tokio::time::timeout_at(until, body.next()).await {
            buf.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = buf.find("\n\n") {
                let block: String = buf.drain(..end + 2).collect();
                let Some(ev) = parse_block(&block) else {
                    continue;
                };
                if ev.id.is_none() {
                    if ev.event == "error" {
                        seen.stream_errors.push(ev);
                    }
                    continue;
                }
                let ends = ev.event == "ready" || ev.event == "error";
                seen.events.push(ev);
                if ends {
                    return seen;
                }
            }
        }
    }
}
