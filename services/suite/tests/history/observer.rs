//! Watches the stores while the scans run: every event each job's Redis log is seen holding
//! (kept after the log loses it: a restarted Redis, a key overwritten), and when each job is
//! first seen ended (its `done` in the log, or its row terminal in PostgreSQL).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use ecoscan_proto::v1::{JobStatus, ScanEvent, Stage};
use sqlx::{PgPool, Row};

use super::contract::EventId;

const EVERY: Duration = Duration::from_millis(50);
/// Jobs are still read this long after they ended (a late event would be a bug to see).
const AFTER_END: Duration = Duration::from_secs(3);

#[derive(Debug, Default, Clone)]
pub struct Seen {
    pub log: HashMap<String, ScanEvent>,
    pub last_seq: u64,
    /// When its final event was first seen in the log.
    pub done_at: Option<Instant>,
    /// When its row was first seen terminal.
    pub row_at: Option<Instant>,
    pub status: Option<JobStatus>,
}

impl Seen {
    /// When the job ended, for its watchers: its final event in the log (the row goes
    /// terminal first, and the final event follows once the log takes it), else its row.
    pub fn ended_at(&self) -> Option<Instant> {
        self.done_at.or(self.row_at)
    }

    /// The id of the job's final event, as far as the log was seen.
    pub fn final_id(&self) -> Option<EventId> {
        self.log
            .values()
            .filter(|e| e.stage == Stage::Done as i32)
            .filter_map(|e| EventId::parse(&e.event_id))
            .max()
    }

    /// The highest id seen.
    pub fn last_id(&self) -> Option<EventId> {
        self.log
            .values()
            .filter_map(|e| EventId::parse(&e.event_id))
            .max()
    }

    /// Writing its answer now (a delta logged, no `done`).
    pub fn answering(&self) -> bool {
        self.ended_at().is_none() && self.log.values().any(|e| e.stage == Stage::Answer as i32)
    }
}

#[derive(Clone)]
pub struct Observer {
    jobs: Arc<Mutex<HashMap<String, Seen>>>,
    redis: ecoscan_redis::Conn,
    prefix: String,
    pg: PgPool,
}

impl Observer {
    pub fn new(redis: ecoscan_redis::Conn, prefix: String, pg: PgPool) -> Self {
        Self {
            jobs: Arc::default(),
            redis,
            prefix,
            pg,
        }
    }

    /// The Redis key of `job`'s event log, as ingest names it.
    pub fn log_key(&self, job: &str) -> String {
        use ecoscan_ingest::store::redis::{DEFAULT_FEED_SHARDS, shard_of};
        format!(
            "{}scan:{{s{}}}:{job}:events",
            self.prefix,
            shard_of(job, DEFAULT_FEED_SHARDS)
        )
    }

    /// A connection to the test's Redis.
    pub fn redis_conn(&self) -> ecoscan_redis::Conn {
        self.redis.clone()
    }

    pub fn watch(&self, job: &str) {
        self.jobs
            .lock()
            .expect("observer lock")
            .entry(job.to_owned())
            .or_default();
    }

    pub fn seen(&self, job: &str) -> Seen {
        self.jobs
            .lock()
            .expect("observer lock")
            .get(job)
            .cloned()
            .unwrap_or_default()
    }

    pub fn all(&self) -> HashMap<String, Seen> {
        self.jobs.lock().expect("observer lock").clone()
    }

    /// Polls until the task is aborted.
    pub fn spawn(self) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut n = 0u64;
            loop {
                tick.tick().await;
                self.read_logs(false).await;
                n += 1;
                if n.is_multiple_of(2) {
                    self.read_rows().await;
                }
            }
        })
    }

    /// Reads every watched job's log once (`all`: ended jobs too).
    pub async fn read_logs(&self, all: bool) {
        let jobs: Vec<String> = self
            .jobs
            .lock()
            .expect("observer lock")
            .iter()
            .filter(|(_, s)| all || s.ended_at().is_none_or(|t| t.elapsed() < AFTER_END))
            .map(|(j, _)| j.clone())
            .collect();
        for job in jobs {
            let mut conn = self.redis.clone();
            let mut xrange = redis::cmd("XRANGE");
            xrange.arg(self.log_key(&job)).arg("-").arg("+");
            let read = xrange.query_async::<redis::streams::StreamRangeReply>(&mut conn);
            // A paused, restarted or refusing Redis: try again next time.
            let Ok(Ok(reply)) = tokio::time::timeout(Duration::from_secs(1), read).await else {
                continue;
            };
            self.absorb(&job, &reply);
        }
    }

    /// Reads the logs and rows until every job whose row is terminal has shown its final
    /// event in its log, for at most `within`. The row finishes a moment before the log takes
    /// the final event (after a worker died or its store failed in between, only once the next
    /// claim runs, a lease later), and an end a client got from the row names the position
    /// that event takes: the checker must see where it landed.
    pub async fn await_finals(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            self.read_logs(true).await;
            self.read_rows().await;
            let waiting = self
                .jobs
                .lock()
                .expect("observer lock")
                .values()
                .any(|s| s.status.is_some() && s.final_id().is_none());
            if !waiting || Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Notes what `job`'s log was seen holding.
    pub fn absorb(&self, job: &str, reply: &redis::streams::StreamRangeReply) {
        let events: Vec<ScanEvent> = reply
            .ids
            .iter()
            .filter_map(|e| e.get::<Vec<u8>>("ev"))
            .map(|b| crate::support::stores::logged_event(&b))
            .collect();
        let mut jobs = self.jobs.lock().expect("observer lock");
        let seen = jobs.entry(job.to_owned()).or_default();
        for e in events {
            seen.last_seq = seen.last_seq.max(e.seq);
            if e.stage == Stage::Done as i32 && seen.done_at.is_none() {
                seen.done_at = Some(Instant::now());
            }
            seen.log.entry(e.event_id.clone()).or_insert(e);
        }
    }

    /// Notes the jobs whose rows are terminal.
    pub async fn read_rows(&self) {
        let read = sqlx::query("SELECT id, status FROM scan_jobs WHERE status IN (3, 4)")
            .fetch_all(&self.pg);
        let Ok(Ok(rows)) = tokio::time::timeout(Duration::from_secs(2), read).await else {
            return;
        };
        let mut jobs = self.jobs.lock().expect("observer lock");
        for row in rows {
            let id: String = row.get("id");
            let Some(seen) = jobs.get_mut(&id) else {
                continue;
            };
            let status = JobStatus::try_from(row.get::<i32, _>("status")).ok();
            seen.status = status;
            if seen.row_at.is_none() {
                seen.row_at = Some(Instant::now());
            }
        }
    }
}
