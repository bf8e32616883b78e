//! An SSE client over plain HTTP that reads the raw bytes of the gateway's stream, drops the
//! connection at planned byte counts (in the middle of an event, too: the part after the cut
//! is lost, as it is when a network fails) and resumes with its last complete event's id in
//! `Last-Event-ID`, the way a browser's `EventSource` does.

use std::time::Duration;

use futures::StreamExt;
use tokio::time::Instant;

use super::contract::{Connection, History, Kind, Outcome, Received};

/// The wait before a reconnect after a failure the client did not choose.
const RETRY: Duration = Duration::from_millis(250);

/// What one client will do.
#[derive(Clone, Debug)]
pub struct Plan {
    pub job: String,
    pub kind: Kind,
    pub first_after: Option<String>,
    /// For each connection in turn, the byte count at which the client drops it.
    pub drops: Vec<usize>,
    /// The pause before each reconnect after a drop.
    pub pauses: Vec<Duration>,
    pub deadline: Instant,
}

/// Runs `plan` against the gateway at `gateway` as `user`; returns all it saw.
pub async fn run(http: &reqwest::Client, gateway: &str, user: &str, plan: Plan) -> History {
    let url = format!("{gateway}/api/v1/scan/{}/events", plan.job);
    let mut history = History {
        job: plan.job.clone(),
        kind: plan.kind.clone(),
        first_after: plan.first_after.clone(),
        connections: Vec::new(),
        gave_up: false,
    };
    let mut last_id = plan.first_after.clone();
    let mut drops = plan.drops.iter().copied();
    let mut pauses = plan.pauses.iter().copied();
    loop {
        let now = Instant::now();
        if now >= plan.deadline {
            history.gave_up = true;
            return history;
        }
        let began = std::time::Instant::now();
        let mut req = http
            .get(&url)
            .header("x-user-id", user)
            .timeout(plan.deadline - now);
        if let Some(id) = &last_id {
            req = req.header("last-event-id", id);
        }
        let mut conn = Connection {
            after: last_id.clone(),
            began,
            outcome: Outcome::NoAnswer(String::new()),
            events: Vec::new(),
        };
        let res = match req.send().await {
            Ok(res) => res,
            Err(e) => {
                conn.outcome = Outcome::NoAnswer(e.to_string());
                history.connections.push(conn);
                tokio::time::sleep(RETRY).await;
                continue;
            }
        };
        let status = res.status().as_u16();
        if status == 204 {
            conn.outcome = Outcome::Ended;
            history.connections.push(conn);
            return history;
        }
        if status != 200 {
            let body = tokio::time::timeout(Duration::from_secs(5), res.text())
                .await
                .ok()
                .and_then(Result::ok)
                .unwrap_or_default();
            conn.outcome = Outcome::Refused(status, body);
            let foreign_refused =
                plan.kind == Kind::ForeignId && status == 400 && conn.after == plan.first_after;
            history.connections.push(conn);
            // Another job's id may be refused as not this job's: start over from the start,
            // as an application would.
            if foreign_refused {
                last_id = None;
                continue;
            }
            // A refusal of bad input or of the caller is final; a server error is retried.
            if plan.kind == Kind::Malformed || status < 500 {
                return history;
            }
            tokio::time::sleep(RETRY).await;
            continue;
        }
        if plan.kind == Kind::Malformed {
            conn.outcome = Outcome::Streamed { cut: true };
            history.connections.push(conn);
            return history;
        }

        let cut_at = drops.next();
        let mut body = res.bytes_stream();
        let mut read = 0usize;
        let mut buf: Vec<u8> = Vec::new();
        let mut cut = false;
        let mut ended = false;
        'read: while let Ok(Some(Ok(mut chunk))) =
            tokio::time::timeout_at(plan.deadline, body.next()).await
        {
            if let Some(at) = cut_at
                && read + chunk.len() >= at
            {
                // The network fails here: what came after this byte never arrives.
                chunk.truncate(at - read);
                cut = true;
            }
            read += chunk.len();
            buf.extend_from_slice(&chunk);
            while let Some(end) = block_end(&buf) {
                let block: Vec<u8> = buf.drain(..end).collect();
                let Some(ev) = parse_block(&String::from_utf8_lossy(&block)) else {
                    continue;
                };
                // An empty `id:` resets the position (a resync of an expired log).
                if let Some(id) = &ev.id {
                    last_id = (!id.is_empty()).then(|| id.clone());
                }
                let ends = ev.is_end() && ev.id.is_some();
                conn.events.push(ev);
                if ends {
                    ended = true;
                    break 'read;
                }
            }
            if cut {
                break;
            }
        }
        drop(body);
        conn.outcome = Outcome::Streamed { cut };
        history.connections.push(conn);
        if ended {
            return history;
        }
        let pause = if cut {
            pauses.next().unwrap_or(RETRY)
        } else {
            RETRY
        };
        tokio::time::sleep(pause).await;
    }
}

/// Where the first complete event of `buf` ends (after its blank line).
fn block_end(buf: &[u8]) -> Option<usize> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// One SSE event block; `None` for a comment-only block (`: keepalive`).
fn parse_block(block: &str) -> Option<Received> {
    let (mut id, mut event, mut data, mut any) = (None, "message".to_owned(), String::new(), false);
    for line in block.lines() {
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "id" => {
                id = Some(value.to_owned());
                any = true;
            }
            "event" => {
                event = value.to_owned();
                any = true;
            }
            "data" => {
                if !data.is_empty() {
                    data.push('\n');
                }
                data.push_str(value);
                any = true;
            }
            _ => {}
        }
    }
    if !any || data.is_empty() {
        return None;
    }
    Some(Received {
        id,
        event,
        data: serde_json::from_str(&data).unwrap_or(serde_json::Value::String(data)),
        at: std::time::Instant::now(),
    })
}
