//! What the checker records: the clients' histories (every connection, every complete SSE
//! event with when it came), what the stores held, and the violations found.

use std::{collections::HashMap, fmt, time::Instant};

use ecoscan_proto::v1::{JobStatus, ScanEvent};
use serde_json::Value;

/// An event id, `<ms>-<seq>`, ordered as numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct EventId(pub u64, pub u64);

impl EventId {
    pub fn parse(s: &str) -> Option<Self> {
        let (a, b) = s.split_once('-')?;
        Some(Self(a.parse().ok()?, b.parse().ok()?))
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.0, self.1)
    }
}

/// One complete SSE event a client got.
#[derive(Clone, Debug)]
pub struct Received {
    pub id: Option<String>,
    pub event: String,
    pub data: Value,
    pub at: Instant,
}

impl Received {
    pub fn is_end(&self) -> bool {
        self.event == "ready" || self.event == "error"
    }
}

/// How one connection went.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// No HTTP answer (refused, reset before the head).
    NoAnswer(String),
    /// A non-200 answer and its body.
    Refused(u16, String),
    /// 204: the job ended at or before the id the client sent (nothing follows).
    Ended,
    /// 200 and an SSE body, which ended: `cut` when the client dropped it on purpose.
    Streamed { cut: bool },
}

/// One connection of a client.
#[derive(Clone, Debug)]
pub struct Connection {
    /// The `Last-Event-ID` it sent.
    pub after: Option<String>,
    pub began: Instant,
    pub outcome: Outcome,
    pub events: Vec<Received>,
}

/// What a client does.
#[derive(Clone, Debug, PartialEq)]
pub enum Kind {
    /// From the start, dropping at random points and resuming with its last id.
    Follower,
    /// First connects with another job's id, then resumes with its own.
    ForeignId,
    /// After the job ended and the gateway's feed for it is gone: resumes at the final id.
    AtEnd,
    /// After the job ended: resumes with an id past the end.
    PastEnd,
    /// After the job ended and its log was deleted (expired): resumes from inside the log.
    Expired,
    /// One request with a malformed id.
    Malformed,
}

/// Everything one client saw.
#[derive(Clone, Debug)]
pub struct History {
    pub job: String,
    pub kind: Kind,
    /// The id of its first connection (`None`: from the start).
    pub first_after: Option<String>,
    pub connections: Vec<Connection>,
    /// It gave up waiting (its deadline passed) before an end.
    pub gave_up: bool,
}

impl History {
    pub fn events(&self) -> impl Iterator<Item = (&Connection, &Received)> {
        self.connections
            .iter()
            .flat_map(|c| c.events.iter().map(move |e| (c, e)))
    }

    /// Connections the client dropped on purpose (mid-event, often).
    pub fn drops(&self) -> usize {
        self.connections
            .iter()
            .filter(|c| matches!(c.outcome, Outcome::Streamed { cut: true }))
            .count()
    }

    pub fn resumes(&self) -> usize {
        self.connections
            .iter()
            .filter(|c| c.after.is_some())
            .count()
    }
}

/// What the stores say about a job.
#[derive(Debug)]
pub struct Stored {
    /// Every event the job's Redis log was seen holding, by id.
    pub log: HashMap<String, ScanEvent>,
    /// The highest seq the log was seen holding.
    pub last_seq: u64,
    /// The row's final status (`None`: not finished).
    pub status: Option<JobStatus>,
    /// When the job was first seen ended (its `done` in the log or its row terminal).
    pub ended_at: Option<Instant>,
    /// The stored answer text (from the result), when it succeeded.
    pub answer: Option<String>,
    /// Windows in which the gateway or ingest was down (a 5xx is then the truth).
    pub outages: Vec<(Instant, Instant)>,
    /// Windows in which a store did not answer (a network partition): an end due meanwhile
    /// comes once the store answers again (docs/failure-model.md: a watch waits for the
    /// store and gets the job's end as soon as it answers).
    pub store_outages: Vec<(Instant, Instant)>,
    /// When the run began: times in violations are since then.
    pub run_began: Instant,
}

/// One broken promise.
#[derive(Debug, Clone)]
pub struct Violation {
    pub job: String,
    pub client: String,
    pub rule: &'static str,
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "[{}] job {} {}: {}",
            self.rule, self.job, self.client, self.detail
        )
    }
}

/// The answer text the gateway serves for a job the stores hold as succeeded (`None` for any
/// other job, or when the gateway does not answer): what the checker holds the streamed
/// answer to.
pub async fn stored_answer(
    http: &reqwest::Client,
    gateway: &str,
    user: &str,
    job: &str,
    status: Option<JobStatus>,
) -> Option<String> {
    if status != Some(JobStatus::Succeeded) {
        return None;
    }
    let res = http
        .get(format!("{gateway}/api/v1/scan/{job}"))
        .header("x-user-id", user)
        .timeout(std::time::Duration::from_secs(10))
        .send()
        .await
        .ok()?;
    let body: Value = res.json().await.ok()?;
    body["answer"]["text"].as_str().map(str::to_owned)
}
