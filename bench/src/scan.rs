//! One scan as a browser makes it (multipart upload, then the SSE stream to `ready`), timed
//! by phase: what `scan-load` and `capacity` run in their loops.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant, SystemTime},
};

use futures::StreamExt as _;

use crate::{scan_image, sse};

/// Who the gateway is told the request comes from.
#[derive(Clone, Debug)]
pub enum Caller {
    /// `X-User-Id` (a gateway with `GATEWAY_TRUST_USER_HEADER=loopback`).
    Header(String),
    /// `Authorization: Bearer …` (a token the gateway verifies, as for any app).
    Bearer(String),
}

impl Caller {
    fn apply(&self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match self {
            Self::Header(user) => req.header("x-user-id", user),
            Self::Bearer(token) => req.bearer_auth(token),
        }
    }
}

/// What one scan came to.
pub struct ScanOutcome {
    /// Request sent → `ready` received.
    pub e2e: Duration,
    /// Time inside the vision and answer stages (their `started` → `completed` events): the
    /// model calls and what surrounds them in those two stages.
    pub model_stages: Option<Duration>,
    /// `queued` → vision `started`: waiting for a pipeline worker.
    pub queue_wait: Option<Duration>,
    /// Request sent → first SSE event.
    pub first_event: Option<Duration>,
    /// Where the time went, by the events' own times (the same clock: one machine): the
    /// request's first byte → `queued` (upload, checks, storing the image and the job), the
    /// queue (`queued` → vision `started`), the stages (vision `started` → answer
    /// `completed`), and after the answer (its `completed` → `ready` read by the client:
    /// reward, the notification, the final event and its way to the client).
    pub phases: Option<[Duration; 4]>,
    pub finished_at: Instant,
    /// Which user ran it.
    pub user: usize,
}

/// One scan: POST, then read the SSE stream to `ready`. `Err` is the error's kind.
pub async fn scan(
    client: &reqwest::Client,
    url: &str,
    user: usize,
    caller: &Caller,
    salt: u64,
    hint: &str,
    timeout: Duration,
) -> Result<ScanOutcome, String> {
    let start = Instant::now();
    let wall_start = SystemTime::now();
    let run = async {
        // What a browser's form sends: the photo as a file part, the hint as a field.
        let form = reqwest::multipart::Form::new()
            .part(
                "image",
                reqwest::multipart::Part::bytes(scan_image(salt))
                    .file_name("photo.png")
                    .mime_str("image/png")
                    .map_err(|e| format!("form: {e}"))?,
            )
            .text("hint", hint.to_owned());
        let res = caller
            .apply(client.post(url))
            .multipart(form)
            .send()
            .await
            .map_err(|e| transport_kind(&e))?;
        if !res.status().is_success() {
            let status = res.status().as_u16();
            let body = res.text().await.unwrap_or_default();
            let code = serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v.get("code")?.as_str().map(str::to_owned))
                .unwrap_or_default();
            return Err(format!("http {status} {code}").trim_end().to_owned());
        }
        let mut parser = sse::Parser::new();
        let mut body = res.bytes_stream();
        let mut first_event = None;
        let mut ts: BTreeMap<(String, String), SystemTime> = BTreeMap::new();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| transport_kind(&e))?;
            for ev in parser.push(&chunk) {
                first_event.get_or_insert_with(|| start.elapsed());
                match ev.event.as_str() {
                    "ready" => {
                        let span = |stage: &str| {
                            let a = ts.get(&(stage.to_owned(), "started".to_owned()))?;
                            let b = ts.get(&(stage.to_owned(), "completed".to_owned()))?;
                            b.duration_since(*a).ok()
                        };
                        let queue_wait = ts
                            .get(&("queued".to_owned(), "completed".to_owned()))
                            .zip(ts.get(&("vision".to_owned(), "started".to_owned())))
                            .and_then(|(q, v)| v.duration_since(*q).ok());
                        let at = |stage: &str, status: &str| {
                            ts.get(&(stage.to_owned(), status.to_owned())).copied()
                        };
                        let between =
                            |a: SystemTime, b: SystemTime| b.duration_since(a).unwrap_or_default();
                        let phases = (|| {
                            let queued = at("queued", "completed")?;
                            let started = at("vision", "started")?;
                            let answered = at("answer", "completed")?;
                            Some([
                                between(wall_start, queued),
                                between(queued, started),
                                between(started, answered),
                                between(answered, SystemTime::now()),
                            ])
                        })();
                        return Ok(ScanOutcome {
                            e2e: start.elapsed(),
                            model_stages: span("vision").zip(span("answer")).map(|(v, a)| v + a),
                            queue_wait,
                            first_event,
                            phases,
                            finished_at: Instant::now(),
                            user,
                        });
                    }
                    "error" => {
                        let code = serde_json::from_str::<serde_json::Value>(&ev.data)
                            .ok()
                            .and_then(|v| v.get("error")?.get("code")?.as_str().map(str::to_owned))
                            .unwrap_or_else(|| "unknown".to_owned());
                        return Err(format!("sse error {code}"));
                    }
                    "stage" => {
                        if let (Some(stage), Some(status), Some(t)) =
                            (ev.field("stage"), ev.field("status"), ev.ts())
                        {
                            ts.entry((stage.to_owned(), status.to_owned())).or_insert(t);
                        }
                    }
                    _ => {}
                }
            }
        }
        Err("stream ended before ready".to_owned())
    };
    match tokio::time::timeout(timeout, run).await {
        Ok(r) => r,
        Err(_) => Err("timeout".to_owned()),
    }
}

pub fn transport_kind(e: &reqwest::Error) -> String {
    let kind = if e.is_connect() {
        "connect"
    } else if e.is_timeout() {
        "timeout"
    } else if e.is_body() || e.is_decode() {
        "body"
    } else {
        "request"
    };
    let mut source: &dyn std::error::Error = e;
    while let Some(s) = source.source() {
        source = s;
    }
    format!("transport {kind}: {source}")
}
