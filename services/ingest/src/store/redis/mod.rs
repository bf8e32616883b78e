//! Redis stores (production): the event log per job with its live feed, and the dispatch
//! queue. They work alike on one Redis and on a Redis Cluster (`ecoscan-redis` picks the
//! client), because every command and script touches keys of one hash slot only.
//!
//! **Event log.** Jobs are spread over a fixed number of feed shards (`shard = hash(job) mod
//! N`). A job's keys and its shard's feed channel share one hash tag, `{s<shard>}`:
//!
//! | key | what |
//! |---|---|
//! | `scan:{s<n>}:<job>:events` | the job's events (a stream; `XADD MAXLEN ~`), the replay log for `Last-Event-ID` |
//! | `scan:{s<n>}:<job>:finished` | set with the job's final event, so there is only one |
//! | `scan:{s<n>}:<job>:fence` | the epoch of the job's newest claim |
//! | `scan:{s<n>}:feed` | the shard's Pub/Sub channel (sharded Pub/Sub on a Cluster) |
//!
//! Appending is **one round trip per batch**: a process's appends of the same 5 ms gather (on a
//! Cluster, per shard, whose keys share a slot), and every event but a job's final one goes as
//! one pipeline of an `XADD` per event followed by one `PUBLISH` (`SPUBLISH` on a Cluster) of
//! those the streams took ([`append`]'s `send_piped`), the final events as one script call
//! that checks the fence and publishes only what the streams took ([`append`]'s
//! `APPEND_BATCH`). No event Redis refused — for whatever reason: a stale id, `OOM`,
//! `WRONGTYPE`, `READONLY`, a redirect out of retries — is ever published. Under load one
//! round trip and one publish carry many events, and idle an event costs one of each. The
//! writer numbers its events (it remembers each job's last `seq`; a claim's fence script
//! returns the log's end, and the `queued` event of a job just submitted assumes a new log)
//! and gives each the public id `<T>-<seq>`; `XADD` refuses an id that is not past the
//! stream's end, so two writers of one job cannot fork its log. The stream id of an event is
//! `<T + epoch>-<seq>`, `epoch` its writer's claim: a claim moves the stream's last id to its
//! own epoch (`XSETID`), so every older writer's next `XADD` is refused by the stream itself
//! and an append reads no fence (the fence key is read only to say why an `XADD` was
//! refused). A claim that finds the job's stream gone (Redis lost it) starts a new run of
//! the numbering above every earlier one ([`RUN_SPAN`](super::events::RUN_SPAN)), so
//! watchers never take the new run's events for ones they saw. The claim's script also
//! publishes a fence marker on the job's channel; hubs drop events of an older claim
//! published after it (only writers of an earlier release publish such events, beside their
//! `XADD`; [`FeedItem::Event`](super::events::FeedItem::Event) carries the writer's epoch).
//! Every process's hub subscribes to all N shard channels on one connection and filters in
//! memory, so the Redis cost of an event is flat in the number of jobs and watchers. Pub/Sub
//! drops what a disconnected subscriber misses; the feed then says
//! [`FeedItem::Resync`](super::events::FeedItem::Resync) and watchers catch up from the
//! per-job streams.
//!
//! **Dispatch queue.** One stream `scan:dispatch` with the consumer group `ingest`; entries are
//! claimed with `XREADGROUP` (a claim is a pending entry), leases are kept alive by resetting
//! the entries' idle time, an entry idle longer than the lease is reclaimed (`XPENDING IDLE` +
//! `XCLAIM`, atomic on the idle time), acknowledged entries are deleted, and consumers of
//! processes that are gone are removed from the group. A worker fenced off its job drops its
//! own entry only while its lease still holds it (the newer claim holds another). A group
//! found gone (`NOGROUP`: Redis lost its data) is recreated and wakes the sweeper, which puts
//! every unfinished job back at once.
//!
//! Connections per process: the shared one, one for the queue's blocking reads, one for the
//! feed subscription — three, whatever the load.

mod append;
mod feed;
mod names;
mod queue;
mod scripts;

use ecoscan_sql::db_span;
use std::time::Duration;

use async_trait::async_trait;
use ecoscan_proto::v1::ScanEvent;
use ecoscan_redis::{
    Conn, Redis, publish_command,
    redis::{self, streams::StreamRangeReply},
};

use self::append::{MAX_BATCH, PendingAppend, run_batches};
use self::feed::{FENCE_MARKER, RedisFeed, decode_event, encode_message};
use self::names::stream_ms;
pub use self::names::{consumer_name, shard_of};
pub use self::queue::RedisQueue;
use self::scripts::{FENCE_SCRIPT, RESTART_LOG, run_base};
use super::events::{EventId, EventLog, Feed};
use crate::error::StoreError;

pub use crate::config::{DEFAULT_APPEND_LINGER, DEFAULT_FEED_SHARDS, EventLogSettings};

/// Jobs whose last sequence number this process remembers, at most (a bound, not a tuning
/// knob: entries leave when a job finishes).
const MAX_REMEMBERED_JOBS: usize = 100_000;

/// Event log on Redis Streams with a sharded Pub/Sub feed; see the module docs.
pub struct RedisEventLog {
    redis: Redis,
    conn: Conn,
    prefix: String,
    shards: u32,
    /// Appends wait here for their batch (see [`APPEND_BATCH`]).
    appends: tokio::sync::mpsc::Sender<PendingAppend>,
    /// The last `seq` this process appended per job, so an append needs no read first. A job
    /// new to this process (just submitted, or resumed from another) reads its log's end once.
    seqs: std::sync::Mutex<std::collections::HashMap<String, u64>>,
}

impl RedisEventLog {
    /// The log under `prefix` (`""` in production; tests use their own), keeping about
    /// `max_len` events per job, with the other settings' defaults.
    pub fn open(redis: &Redis, prefix: &str, max_len: usize) -> Self {
        Self::with_settings(
            redis,
            &EventLogSettings {
                prefix: prefix.to_owned(),
                max_len,
                ..EventLogSettings::default()
            },
        )
    }

    /// The log laid out and batching as `settings` say. Every process of one deployment must
    /// use the same prefix and number of shards: they decide where a job's keys live.
    pub fn with_settings(redis: &Redis, settings: &EventLogSettings) -> Self {
        let (appends, rx) = tokio::sync::mpsc::channel(4 * MAX_BATCH);
        tokio::spawn(run_batches(
            redis.conn(),
            publish_command(redis.is_cluster()),
            settings.max_len.max(1),
            settings.linger,
            rx,
        ));
        Self {
            redis: redis.clone(),
            conn: redis.conn(),
            prefix: settings.prefix.clone(),
            shards: settings.shards.max(1),
            appends,
            seqs: std::sync::Mutex::default(),
        }
    }

    fn tag(&self, job_id: &str) -> u32 {
        shard_of(job_id, self.shards)
    }

    fn key(&self, job_id: &str, what: &str) -> String {
        format!(
            "{}scan:{{s{}}}:{job_id}:{what}",
            self.prefix,
            self.tag(job_id)
        )
    }

    fn channel(&self, shard: u32) -> String {
        format!("{}scan:{{s{shard}}}:feed", self.prefix)
    }

    /// The `seq` the job's next event gets, and whether it is a guess. Only the writer before
    /// any claim (epoch 0: the `queued` event of a job just submitted) guesses, that the log is
    /// new; a guess that was wrong is refused by `XADD` and [`Self::invoke`] reads the log's
    /// end then. Everyone else reads the end of a log it does not know (a claim's fence
    /// returns it, so a worker never does).
    async fn next_seq(&self, job_id: &str, epoch: u64) -> Result<(u64, bool), StoreError> {
        let known = self
            .seqs
            .lock()
            .expect("seq cache lock poisoned")
            .get(job_id)
            .copied();
        Ok(match known {
            Some(seq) => (seq + 1, false),
            None if epoch == 0 => (1, true),
            None => match self.numbered(job_id).await {
                // The log is gone (Redis lost it since the claim's fence): a new run, above
                // every seq an earlier run gave, as the fence would number it, so that
                // watchers at a higher seq are not silenced.
                EventId { ms: 0, n: 0 } => (scripts::run_base(epoch) + 1, false),
                at => (at.n + 1, false),
            },
        })
    }

    /// The last stream id the job's log ever gave (`<T + epoch>-<seq>`; `0-0` without a log):
    /// past its last event even if that was trimmed, and where a new run's numbering stands
    /// before its first event ([`scripts::RAISE_FENCE`]).
    async fn numbered(&self, job_id: &str) -> EventId {
        let info: redis::Value = redis::cmd("XINFO")
            .arg("STREAM")
            .arg(self.key(job_id, "events"))
            .query_async(&mut self.conn.clone())
            .await
            .unwrap_or(redis::Value::Nil);
        stream_last_generated(&info).unwrap_or(EventId { ms: 0, n: 0 })
    }

    fn remember(&self, job_id: &str, seq: Option<u64>) {
        let mut seqs = self.seqs.lock().expect("seq cache lock poisoned");
        match seq {
            Some(seq) => {
                if seqs.len() >= MAX_REMEMBERED_JOBS && !seqs.contains_key(job_id) {
                    // Only a process that keeps losing jobs mid-run gets here; reading a log's
                    // end again is cheap.
                    seqs.clear();
                }
                seqs.insert(job_id.to_owned(), seq);
            }
            None => {
                seqs.remove(job_id);
            }
        }
    }

    async fn invoke(
        &self,
        event: ScanEvent,
        epoch: u64,
        is_final: bool,
    ) -> Result<Option<ScanEvent>, StoreError> {
        let job_id = event.job_id.clone();
        let (seq, guessed) = self.next_seq(&job_id, epoch).await?;
        if !guessed {
            return self.invoke_at(event, seq, epoch, is_final).await;
        }
        // Kept for a second try: only a guess can be wrong without anyone else at fault.
        match self.invoke_at(event.clone(), seq, epoch, is_final).await {
            // The log was not new after all: go on from its end.
            Err(StoreError::Conflict(_)) => {
                let seq = self.numbered(&job_id).await.n + 1;
                self.invoke_at(event, seq, epoch, is_final).await
            }
            other => other,
        }
    }

    /// Appends `event` as number `seq` of its job.
    async fn invoke_at(
        &self,
        mut event: ScanEvent,
        seq: u64,
        epoch: u64,
        is_final: bool,
    ) -> Result<Option<ScanEvent>, StoreError> {
        let job_id = event.job_id.clone();
        let id = EventId::of(&job_id, seq);
        event.event_id = id.to_string();
        event.seq = seq;
        let shard = self.tag(&job_id);
        let (reply, replied) = tokio::sync::oneshot::channel();
        let stream_id = format!("{}-{seq}", stream_ms(&job_id, epoch));
        let pending = PendingAppend {
            group: if self.redis.is_cluster() { shard } else { 0 },
            events_key: self.key(&job_id, "events"),
            finished_key: self.key(&job_id, "finished"),
            fence_key: self.key(&job_id, "fence"),
            channel: self.channel(shard),
            id: stream_id,
            message: encode_message(&event),
            is_final,
            epoch,
            reply,
        };
        let stopped = || StoreError::Unavailable("the event log's writer stopped".into());
        self.appends.send(pending).await.map_err(|_| stopped())?;
        let appended = replied.await.map_err(|_| stopped())??;
        match appended {
            1 => {
                self.remember(&job_id, (!is_final).then_some(seq));
                Ok(Some(event))
            }
            0 => Ok(None),
            -2 => {
                self.remember(&job_id, None);
                Err(StoreError::Fenced { job: job_id, epoch })
            }
            -1 => {
                // Someone else appended since this process last did: forget what it knew.
                self.remember(&job_id, None);
                // Which someone: a newer claim (this writer lost the job), or a writer of the
                // same claim (this one's view of the log was stale).
                let fence: Option<u64> = redis::cmd("GET")
                    .arg(self.key(&job_id, "fence"))
                    .query_async(&mut self.conn.clone())
                    .await?;
                if epoch < fence.unwrap_or(0) {
                    Err(StoreError::Fenced { job: job_id, epoch })
                } else {
                    Err(StoreError::Conflict(format!(
                        "job {job_id}'s log moved on without this writer (event {id} is taken)"
                    )))
                }
            }
            other => {
                self.remember(&job_id, None);
                Err(StoreError::Unavailable(format!(
                    "Redis refused to append event {id} of job {job_id} (append script answered \
                     {other}; see the Redis log)"
                )))
            }
        }
    }
}

/// `last-generated-id` of an `XINFO STREAM` reply.
fn stream_last_generated(info: &redis::Value) -> Option<EventId> {
    // A flat array of keys and values over RESP2, a map over RESP3 (the Cluster client).
    let pairs: Vec<(&redis::Value, &redis::Value)> = match info {
        redis::Value::Array(items) => items.chunks_exact(2).map(|kv| (&kv[0], &kv[1])).collect(),
        redis::Value::Map(items) => items.iter().map(|(k, v)| (k, v)).collect(),
        _ => return None,
    };
    pairs.into_iter().find_map(|(k, v)| {
        (redis::from_redis_value_ref::<String>(k).ok()? == "last-generated-id")
            .then(|| redis::from_redis_value_ref::<String>(v).ok()?.parse().ok())
            .flatten()
    })
}

fn parse_id(id: &str) -> Result<EventId, StoreError> {
    id.parse().map_err(StoreError::Corrupt)
}

#[async_trait]
impl EventLog for RedisEventLog {
    fn health(&self) -> Option<ecoscan_common::store_health::StoreHealth> {
        Some(self.redis.health().clone())
    }

    #[db_span(
        system = "redis",
        op = "EVALSHA",
        name = "XADD scan events",
        fields(job.id = %event.job_id)
    )]
    async fn append_as(&self, event: ScanEvent, epoch: u64) -> Result<ScanEvent, StoreError> {
        self.invoke(event, epoch, false)
            .await?
            .ok_or_else(|| StoreError::Corrupt("the append script appended nothing".into()))
    }

    #[db_span(
        system = "redis",
        op = "EVALSHA",
        name = "XADD scan events (final)",
        fields(job.id = %event.job_id)
    )]
    async fn append_final_as(
        &self,
        event: ScanEvent,
        epoch: u64,
    ) -> Result<Option<ScanEvent>, StoreError> {
        self.invoke(event, epoch, true).await
    }

    #[db_span(system = "redis", op = "EVALSHA", name = "SET scan fence", fields(job.id = %job_id))]
    async fn fence(&self, job_id: &str, epoch: u64) -> Result<(), StoreError> {
        // Whoever wrote the log last, this writer goes on from its end, which the script
        // returns with the raised fence.
        self.remember(job_id, None);
        let marker = format!("{job_id}\n{FENCE_MARKER}\n{epoch}\n");
        let last: i64 = FENCE_SCRIPT
            .key(self.key(job_id, "fence"))
            .key(self.key(job_id, "events"))
            .key(self.channel(self.tag(job_id)))
            .arg(epoch)
            .arg(stream_ms(job_id, epoch))
            .arg(publish_command(self.redis.is_cluster()))
            .arg(format!("{}:{marker}", marker.len()))
            .arg(run_base(epoch))
            .invoke_async(&mut self.conn.clone())
            .await?;
        let last = u64::try_from(last).map_err(|_| StoreError::Fenced {
            job: job_id.to_owned(),
            epoch,
        })?;
        self.remember(job_id, Some(last));
        Ok(())
    }

    async fn restart(&self, mut event: ScanEvent) -> Result<ScanEvent, StoreError> {
        let job_id = event.job_id.clone();
        self.remember(&job_id, None);
        let last = self.numbered(&job_id).await;
        let seq = last.n + 1;
        let id = EventId::of(&job_id, seq);
        event.event_id = id.to_string();
        event.seq = seq;
        // The stream's millisecond part stays where the last claim moved it (the next claim,
        // of a higher epoch, moves it on).
        let stream_id = format!("{}-{seq}", last.ms.max(id.ms));
        let shard = self.tag(&job_id);
        redis::cmd("EVAL")
            .arg(RESTART_LOG)
            .arg(3)
            .arg(self.key(&job_id, "events"))
            .arg(self.key(&job_id, "finished"))
            .arg(self.channel(shard))
            .arg(&stream_id)
            .arg(encode_message(&event))
            .arg(publish_command(self.redis.is_cluster()))
            .query_async::<i64>(&mut self.conn.clone())
            .await?;
        Ok(event)
    }

    #[db_span(
        system = "redis",
        op = "XRANGE",
        name = "XRANGE scan events",
        fields(job.id = %job_id)
    )]
    async fn read_after(
        &self,
        job_id: &str,
        after: Option<EventId>,
    ) -> Result<Vec<ScanEvent>, StoreError> {
        // Public ids are `<T>-<seq>`, stream ids `<T + epoch>-<seq>` (see [`stream_ms`]):
        // every event after `<T>-<n>` has a stream id after it too, and those of later epochs
        // with a seq up to n (there are such only after a claim was lost) are filtered out.
        let t = EventId::of(job_id, 0).ms;
        let start = match after {
            None => "-".to_owned(),
            Some(after) if after.ms < t => "-".to_owned(),
            Some(after) if after.ms > t => return Ok(Vec::new()),
            Some(after) => format!("({t}-{}", after.n),
        };
        let reply: StreamRangeReply = redis::cmd("XRANGE")
            .arg(self.key(job_id, "events"))
            .arg(start)
            .arg("+")
            .query_async(&mut self.conn.clone())
            .await?;
        let mut events = Vec::with_capacity(reply.ids.len());
        for entry in &reply.ids {
            if let Some(after) = after
                && after.ms == t
                && parse_id(&entry.id)?.n <= after.n
            {
                continue;
            }
            events.push(decode_event(entry)?);
        }
        Ok(events)
    }

    async fn last_id(&self, job_id: &str) -> Result<Option<EventId>, StoreError> {
        let last: StreamRangeReply = redis::cmd("XREVRANGE")
            .arg(self.key(job_id, "events"))
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(1)
            .query_async(&mut self.conn.clone())
            .await?;
        // The public id: the stream's millisecond part also carries the writer's epoch.
        last.ids
            .first()
            .map(|e| Ok(EventId::of(job_id, parse_id(&e.id)?.n)))
            .transpose()
    }

    async fn epoch(&self, job_id: &str) -> Result<u64, StoreError> {
        let fence: Option<u64> = redis::cmd("GET")
            .arg(self.key(job_id, "fence"))
            .query_async(&mut self.conn.clone())
            .await?;
        Ok(fence.unwrap_or(0))
    }

    async fn expire(&self, job_id: &str, ttl: Duration) -> Result<(), StoreError> {
        self.remember(job_id, None);
        let ttl_ms = ttl.as_millis().min(i64::MAX as u128) as i64;
        let mut pipe = redis::pipe();
        for what in ["events", "finished", "fence"] {
            pipe.cmd("PEXPIRE")
                .arg(self.key(job_id, what))
                .arg(ttl_ms)
                .ignore();
        }
        pipe.query_async::<()>(&mut self.conn.clone()).await?;
        Ok(())
    }

    async fn feed(&self) -> Result<Box<dyn Feed>, StoreError> {
        let channels = (0..self.shards).map(|n| self.channel(n)).collect();
        let subscriber =
            self.redis.subscribe(channels).await.map_err(|e| {
                StoreError::Unavailable(format!("cannot subscribe to the feed: {e}"))
            })?;
        Ok(Box::new(RedisFeed::new(subscriber)))
    }
}
