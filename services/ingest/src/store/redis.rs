//! Redis stores (production): the event log per job and the dispatch queue, both on Redis
//! Streams.
//!
//! Connections per process stay constant: one multiplexed [`ConnectionManager`] shared by every
//! command that answers at once, one dedicated connection for the event log's blocking reader
//! (every watched job's stream read by one `XREAD BLOCK`), and one for the queue's blocking
//! `XREADGROUP` (claimers take turns on it). Blocking commands never run on the shared
//! connection, where they would stall every command queued behind them.
//!
//! Keys (after the configurable prefix): `scan:{<job>}:events`, `scan:{<job>}:seq` and
//! `scan:{<job>}:finished` per job (hash tags keep a job's keys in one Cluster slot),
//! `scan:dispatch` for the queue, and `scan:hub:<process>:wakeup` for waking this process's
//! reader. The multiplexed `XREAD` names
//! several jobs' keys, so it needs a single Redis (or one reader per Cluster node, not built).

use std::{
    collections::{HashMap, HashSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use async_trait::async_trait;
use ecoscan_proto::v1::ScanEvent;
use prost::Message;
use redis::{
    AsyncConnectionConfig, Client, RedisError, Script,
    aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection},
    streams::{
        StreamClaimReply, StreamId, StreamPendingCountReply, StreamRangeReply, StreamReadReply,
    },
};
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use super::{
    events::{EventId, EventLog},
    jobs::ms,
    queue::{Lease, Queue, QueueEntry},
};
use crate::error::StoreError;

/// How long a command on the shared connection may take before it counts as failed.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);
/// Upper bound of one blocking read, so the reader notices a changed watch set or shutdown.
const MAX_BLOCK: Duration = Duration::from_millis(1000);

/// A process's connection to Redis, shared by its Redis stores. Every connection it opens is
/// named (`CLIENT SETNAME`), so `CLIENT LIST` shows what belongs to whom.
#[derive(Clone)]
pub struct RedisConn {
    client: Client,
    manager: ConnectionManager,
    name: String,
}

impl RedisConn {
    /// Connects to `url`; `name` (no spaces) labels this process's connections.
    pub async fn connect(url: &str, name: &str) -> Result<Self, StoreError> {
        let client = Client::open(url)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(5)))
            .set_response_timeout(Some(RESPONSE_TIMEOUT))
            .set_number_of_retries(3);
        let mut manager = client.get_connection_manager_with_config(config).await?;
        set_name(&mut manager, name).await?;
        Ok(Self {
            client,
            manager,
            name: name.to_owned(),
        })
    }

    /// The label of this process's connections.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Names the shared connection again. It reconnects by itself after Redis restarts or
    /// the network drops, and a new connection has no name; whoever notices such a break calls
    /// this, so every connection of the process stays identifiable in `CLIENT LIST`.
    async fn rename_shared(&self) {
        // The first command after a break may still meet the dead connection (and make the
        // manager reconnect); the next one reaches the new one.
        for attempt in 1..=3u64 {
            match set_name(&mut self.manager.clone(), &self.name).await {
                Ok(()) => return,
                Err(e) if attempt == 3 => {
                    tracing::warn!(error = %e, "cannot name the shared redis connection")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50 * attempt)).await,
            }
        }
    }

    /// A connection of its own for blocking commands: no response timeout (the command's BLOCK
    /// bounds it).
    async fn dedicated(&self) -> Result<MultiplexedConnection, StoreError> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(5)))
            .set_response_timeout(None);
        let mut conn = self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        set_name(&mut conn, &self.name).await?;
        Ok(conn)
    }
}

async fn set_name<C: redis::aio::ConnectionLike>(
    conn: &mut C,
    name: &str,
) -> Result<(), StoreError> {
    redis::cmd("CLIENT")
        .arg("SETNAME")
        .arg(name)
        .query_async::<()>(conn)
        .await?;
    Ok(())
}

fn field_str(entry: &StreamId, name: &str) -> Result<String, StoreError> {
    entry
        .get::<String>(name)
        .ok_or_else(|| StoreError::Corrupt(format!("stream entry {} has no {name}", entry.id)))
}

// ---------------------------------------------------------------------------------------------
// Event log

/// Appends an event and numbers it in one step: the sequence counter and the stream share the
/// job's hash tag.
const APPEND: &str = r"
local seq = redis.call('INCR', KEYS[2])
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'seq', seq, 'ev', ARGV[2])
return {id, seq}
";

/// [`APPEND`] for a job's final event: only the first one is appended (`KEYS[3]` marks the
/// job finished), so concurrent or repeated finishes leave one `done` in the log.
const APPEND_FINAL: &str = r"
if not redis.call('SET', KEYS[3], '1', 'NX') then return false end
local seq = redis.call('INCR', KEYS[2])
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', 'seq', seq, 'ev', ARGV[2])
return {id, seq}
";

/// Event log on Redis Streams: `XADD MAXLEN ~`, ids are the stream ids, a TTL once the job has
/// ended, and one blocking reader per process over every watched job.
pub struct RedisEventLog {
    conn: ConnectionManager,
    prefix: String,
    max_len: usize,
    append: Script,
    append_final: Script,
    watched: Arc<Watched>,
    feed: broadcast::Sender<ScanEvent>,
    stop: CancellationToken,
}

/// The jobs this process's hub watches, and where the reader is in each.
struct Watched {
    jobs: Mutex<HashMap<String, Watch>>,
    wakeup_key: String,
}

struct Watch {
    /// Watchers of the job (`watch` minus `unwatch`).
    count: usize,
    /// The last stream id delivered (or the position to read after).
    cursor: EventId,
    /// Bumped when `watch` moves the cursor back, so the reader does not move it forward again
    /// past events it never read.
    generation: u64,
}

impl RedisEventLog {
    /// The log under `prefix` (`""` in production; tests use their own), keeping about
    /// `max_len` events per job. Starts the process's reader (stopped when the log is dropped).
    pub async fn open(redis: &RedisConn, prefix: &str, max_len: usize) -> Result<Self, StoreError> {
        let reader_conn = redis.dedicated().await?;
        let (feed, _) = broadcast::channel(4096);
        let watched = Arc::new(Watched {
            jobs: Mutex::new(HashMap::new()),
            wakeup_key: format!("{prefix}scan:hub:{}:wakeup", uuid::Uuid::new_v4()),
        });
        let stop = CancellationToken::new();
        let log = Self {
            conn: redis.manager.clone(),
            prefix: prefix.to_owned(),
            max_len: max_len.max(1),
            append: Script::new(APPEND),
            append_final: Script::new(APPEND_FINAL),
            watched: watched.clone(),
            feed: feed.clone(),
            stop: stop.clone(),
        };
        let reader = Reader {
            redis: redis.clone(),
            conn: reader_conn,
            prefix: prefix.to_owned(),
            watched,
            feed,
            stop,
        };
        tokio::spawn(reader.run());
        Ok(log)
    }

    fn events_key(&self, job_id: &str) -> String {
        events_key(&self.prefix, job_id)
    }
}

fn events_key(prefix: &str, job_id: &str) -> String {
    format!("{prefix}scan:{{{job_id}}}:events")
}

fn seq_key(prefix: &str, job_id: &str) -> String {
    format!("{prefix}scan:{{{job_id}}}:seq")
}

/// Set once the job's final event is in its log.
fn finished_key(prefix: &str, job_id: &str) -> String {
    format!("{prefix}scan:{{{job_id}}}:finished")
}

impl Drop for RedisEventLog {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn decode_event(job_id: &str, entry: &StreamId) -> Result<ScanEvent, StoreError> {
    let bytes: Vec<u8> = entry
        .get("ev")
        .ok_or_else(|| StoreError::Corrupt(format!("event {} has no body", entry.id)))?;
    let mut event = ScanEvent::decode(bytes.as_slice())
        .map_err(|e| StoreError::Corrupt(format!("event {}: {e}", entry.id)))?;
    event.event_id = entry.id.clone();
    event.seq = entry
        .get::<u64>("seq")
        .ok_or_else(|| StoreError::Corrupt(format!("event {} has no seq", entry.id)))?;
    event.job_id = job_id.to_owned();
    Ok(event)
}

fn parse_id(id: &str) -> Result<EventId, StoreError> {
    id.parse().map_err(StoreError::Corrupt)
}

#[async_trait]
impl EventLog for RedisEventLog {
    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "XADD scan events", otel.kind = "client", db.system = "redis", db.operation.name = "EVALSHA", job.id = %event.job_id),
        err
    )]
    async fn append(&self, mut event: ScanEvent) -> Result<ScanEvent, StoreError> {
        let job_id = event.job_id.clone();
        // The id and seq live in the stream entry itself; keep the body small.
        event.event_id.clear();
        event.seq = 0;
        let (id, seq): (String, u64) = self
            .append
            .key(self.events_key(&job_id))
            .key(seq_key(&self.prefix, &job_id))
            .arg(self.max_len)
            .arg(event.encode_to_vec())
            .invoke_async(&mut self.conn.clone())
            .await?;
        event.event_id = id;
        event.seq = seq;
        Ok(event)
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "XADD scan events (final)", otel.kind = "client", db.system = "redis", db.operation.name = "EVALSHA", job.id = %event.job_id),
        err
    )]
    async fn append_final(&self, mut event: ScanEvent) -> Result<Option<ScanEvent>, StoreError> {
        let job_id = event.job_id.clone();
        event.event_id.clear();
        event.seq = 0;
        let appended: Option<(String, u64)> = self
            .append_final
            .key(self.events_key(&job_id))
            .key(seq_key(&self.prefix, &job_id))
            .key(finished_key(&self.prefix, &job_id))
            .arg(self.max_len)
            .arg(event.encode_to_vec())
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(appended.map(|(id, seq)| {
            event.event_id = id;
            event.seq = seq;
            event
        }))
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "XRANGE scan events", otel.kind = "client", db.system = "redis", db.operation.name = "XRANGE", job.id = %job_id),
        err
    )]
    async fn read_after(
        &self,
        job_id: &str,
        after: Option<EventId>,
    ) -> Result<Vec<ScanEvent>, StoreError> {
        let start = after.map_or_else(|| "-".to_owned(), |id| format!("({id}"));
        let reply: StreamRangeReply = redis::cmd("XRANGE")
            .arg(self.events_key(job_id))
            .arg(start)
            .arg("+")
            .query_async(&mut self.conn.clone())
            .await?;
        reply.ids.iter().map(|e| decode_event(job_id, e)).collect()
    }

    fn feed(&self) -> broadcast::Receiver<ScanEvent> {
        self.feed.subscribe()
    }

    async fn watch(&self, job_id: &str) -> Result<(), StoreError> {
        // Read from the stream's current end: anything appended after this returns is newer.
        let last: StreamRangeReply = redis::cmd("XREVRANGE")
            .arg(self.events_key(job_id))
            .arg("+")
            .arg("-")
            .arg("COUNT")
            .arg(1)
            .query_async(&mut self.conn.clone())
            .await?;
        let cursor = match last.ids.first() {
            Some(e) => parse_id(&e.id)?,
            None => EventId { ms: 0, n: 0 },
        };
        let wake = {
            let mut jobs = self.watched.jobs.lock().expect("watch set lock poisoned");
            match jobs.get_mut(job_id) {
                Some(w) => {
                    w.count += 1;
                    if cursor < w.cursor {
                        w.cursor = cursor;
                        w.generation += 1;
                        true
                    } else {
                        false
                    }
                }
                None => {
                    jobs.insert(
                        job_id.to_owned(),
                        Watch {
                            count: 1,
                            cursor,
                            generation: 0,
                        },
                    );
                    true
                }
            }
        };
        if wake {
            // Wake the reader out of its current XREAD so it reads the new key now, not at the
            // end of its block.
            redis::pipe()
                .cmd("XADD")
                .arg(&self.watched.wakeup_key)
                .arg("MAXLEN")
                .arg("~")
                .arg(16)
                .arg("*")
                .arg("w")
                .arg(1)
                .ignore()
                .cmd("PEXPIRE")
                .arg(&self.watched.wakeup_key)
                .arg(3_600_000)
                .ignore()
                .query_async::<()>(&mut self.conn.clone())
                .await?;
        }
        Ok(())
    }

    fn unwatch(&self, job_id: &str) {
        let mut jobs = self.watched.jobs.lock().expect("watch set lock poisoned");
        if let Some(w) = jobs.get_mut(job_id) {
            w.count = w.count.saturating_sub(1);
            if w.count == 0 {
                jobs.remove(job_id);
            }
        }
    }

    async fn expire(&self, job_id: &str, ttl: Duration) -> Result<(), StoreError> {
        let ttl_ms = ttl.as_millis().min(i64::MAX as u128) as i64;
        redis::pipe()
            .cmd("PEXPIRE")
            .arg(self.events_key(job_id))
            .arg(ttl_ms)
            .ignore()
            .cmd("PEXPIRE")
            .arg(seq_key(&self.prefix, job_id))
            .arg(ttl_ms)
            .ignore()
            .cmd("PEXPIRE")
            .arg(finished_key(&self.prefix, job_id))
            .arg(ttl_ms)
            .ignore()
            .query_async::<()>(&mut self.conn.clone())
            .await?;
        Ok(())
    }
}

/// The process's one reader of every watched job's stream.
struct Reader {
    redis: RedisConn,
    conn: MultiplexedConnection,
    prefix: String,
    watched: Arc<Watched>,
    feed: broadcast::Sender<ScanEvent>,
    stop: CancellationToken,
}

impl Reader {
    async fn run(mut self) {
        let mut wakeup_cursor = "0-0".to_owned();
        let mut failures = 0u32;
        while !self.stop.is_cancelled() {
            match self.read_once(&mut wakeup_cursor).await {
                Ok(()) => failures = 0,
                Err(e) => {
                    failures += 1;
                    tracing::warn!(error = %e, failures, "event log reader failed; reconnecting");
                    let backoff = Duration::from_millis(100 * u64::from(failures.min(20)));
                    tokio::select! {
                        () = self.stop.cancelled() => break,
                        () = tokio::time::sleep(backoff) => {}
                    }
                    match self.redis.dedicated().await {
                        Ok(conn) => {
                            self.conn = conn;
                            // Whatever broke this connection broke the shared one too.
                            self.redis.rename_shared().await;
                        }
                        Err(e) => tracing::warn!(error = %e, "event log reader cannot reconnect"),
                    }
                }
            }
        }
        // Best effort: the key also expires on its own.
        let _ = redis::cmd("DEL")
            .arg(&self.watched.wakeup_key)
            .query_async::<()>(&mut self.redis.manager.clone())
            .await;
    }

    async fn read_once(&mut self, wakeup_cursor: &mut String) -> Result<(), StoreError> {
        // key -> (job, cursor, generation) of this round.
        let snapshot: HashMap<String, (String, EventId, u64)> = {
            let jobs = self.watched.jobs.lock().expect("watch set lock poisoned");
            jobs.iter()
                .map(|(job, w)| {
                    (
                        events_key(&self.prefix, job),
                        (job.clone(), w.cursor, w.generation),
                    )
                })
                .collect()
        };
        let mut cmd = redis::cmd("XREAD");
        cmd.arg("COUNT")
            .arg(512)
            .arg("BLOCK")
            .arg(MAX_BLOCK.as_millis() as u64)
            .arg("STREAMS")
            .arg(&self.watched.wakeup_key);
        for key in snapshot.keys() {
            cmd.arg(key);
        }
        cmd.arg(wakeup_cursor.as_str());
        for (_, cursor, _) in snapshot.values() {
            cmd.arg(cursor.to_string());
        }
        let reply: Option<StreamReadReply> = tokio::select! {
            () = self.stop.cancelled() => return Ok(()),
            r = cmd.query_async(&mut self.conn) => r?,
        };
        let Some(reply) = reply else {
            return Ok(());
        };
        for stream in reply.keys {
            let Some(last) = stream.ids.last() else {
                continue;
            };
            if stream.key == self.watched.wakeup_key {
                *wakeup_cursor = last.id.clone();
                continue;
            }
            let Some((job, _, generation)) = snapshot.get(&stream.key) else {
                continue;
            };
            let last_id = parse_id(&last.id)?;
            for entry in &stream.ids {
                match decode_event(job, entry) {
                    // No receiver simply means no one is watching right now.
                    Ok(ev) => drop(self.feed.send(ev)),
                    Err(e) => tracing::warn!(error = %e, "skipping an undecodable event"),
                }
            }
            let mut jobs = self.watched.jobs.lock().expect("watch set lock poisoned");
            if let Some(w) = jobs.get_mut(job)
                && w.generation == *generation
                && w.cursor < last_id
            {
                w.cursor = last_id;
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Dispatch queue

const GROUP: &str = "ingest";

/// Extends a lease: resets the entry's idle time with `XCLAIM … JUSTID` (which leaves the
/// delivery count alone), only while the same consumer holds the same delivery of it.
const EXTEND: &str = r"
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 then return 0 end
if p[1][2] ~= ARGV[2] or tonumber(p[1][4]) ~= tonumber(ARGV[4]) then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
return 1
";

/// The dispatch queue on a Redis Streams consumer group: entries are claimed with
/// `XREADGROUP`, a claim is a pending entry, an entry idle longer than the lease is reclaimed
/// (`XPENDING IDLE` + `XCLAIM`, atomic on the idle time), acknowledged entries are deleted.
pub struct RedisQueue {
    redis: RedisConn,
    conn: ConnectionManager,
    /// The one connection claimers block on, taking turns.
    blocking: tokio::sync::Mutex<MultiplexedConnection>,
    key: String,
    consumer: String,
    extend: Script,
}

/// A lease's handle: the stream id and the delivery count it was claimed with.
fn lease_id(stream_id: &str, delivered: usize) -> String {
    format!("{stream_id}/{delivered}")
}

fn parse_lease_id(id: &str) -> Result<(&str, usize), StoreError> {
    id.split_once('/')
        .and_then(|(s, n)| Some((s, n.parse().ok()?)))
        .ok_or_else(|| StoreError::Corrupt(format!("malformed lease id {id:?}")))
}

fn is_nogroup(e: &RedisError) -> bool {
    e.code() == Some("NOGROUP")
}

/// The stream (and its group) vanished while a claimer was blocked on it.
fn is_unblocked(e: &RedisError) -> bool {
    e.code() == Some("UNBLOCKED")
}

impl RedisQueue {
    /// The queue under `prefix` (`""` in production); `consumer` names this process in the
    /// consumer group. Creates the stream and the group when missing.
    pub async fn open(redis: &RedisConn, prefix: &str, consumer: &str) -> Result<Self, StoreError> {
        let queue = Self {
            redis: redis.clone(),
            conn: redis.manager.clone(),
            blocking: tokio::sync::Mutex::new(redis.dedicated().await?),
            key: format!("{prefix}scan:dispatch"),
            consumer: consumer.to_owned(),
            extend: Script::new(EXTEND),
        };
        queue.ensure_group().await?;
        Ok(queue)
    }

    /// Creates the group (and the stream); after a Redis restart without persistence it is
    /// gone, and every command that needs it recreates it.
    async fn ensure_group(&self) -> Result<(), StoreError> {
        let created = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.key)
            .arg(GROUP)
            .arg("0")
            .arg("MKSTREAM")
            .query_async::<()>(&mut self.conn.clone())
            .await;
        match created {
            Err(e) if e.code() != Some("BUSYGROUP") => Err(e.into()),
            _ => Ok(()),
        }
    }

    fn entry_of(&self, e: &StreamId, delivered: usize) -> Result<Lease, StoreError> {
        let carrier = e
            .get::<String>("carrier")
            .and_then(|c| serde_json::from_str(&c).ok())
            .unwrap_or_default();
        let at_ms = e.get::<i64>("at").unwrap_or(0);
        Ok(Lease {
            entry: QueueEntry {
                job_id: field_str(e, "job")?,
                carrier,
                deliveries: delivered.saturating_sub(1) as u32,
                enqueued_at: super::jobs::from_ms(at_ms),
            },
            id: lease_id(&e.id, delivered),
        })
    }

    /// Takes over the oldest entry idle longer than `lease`, if any.
    async fn reclaim(&self, lease: Duration) -> Result<Option<Lease>, StoreError> {
        let idle = lease.as_millis() as u64;
        // A few tries: another process may take the same entry first.
        for _ in 0..3 {
            let pending: StreamPendingCountReply = match redis::cmd("XPENDING")
                .arg(&self.key)
                .arg(GROUP)
                .arg("IDLE")
                .arg(idle)
                .arg("-")
                .arg("+")
                .arg(1)
                .query_async(&mut self.conn.clone())
                .await
            {
                Ok(p) => p,
                // Redis lost the group (a restart without persistence): nothing to reclaim.
                Err(e) if is_nogroup(&e) => {
                    self.ensure_group().await?;
                    return Ok(None);
                }
                Err(e) => return Err(e.into()),
            };
            let Some(p) = pending.ids.first() else {
                return Ok(None);
            };
            // Atomic on the idle time: if someone claimed it meanwhile, it is no longer idle.
            let claimed: StreamClaimReply = redis::cmd("XCLAIM")
                .arg(&self.key)
                .arg(GROUP)
                .arg(&self.consumer)
                .arg(idle)
                .arg(&p.id)
                .query_async(&mut self.conn.clone())
                .await?;
            if let Some(e) = claimed.ids.first() {
                return self.entry_of(e, p.times_delivered + 1).map(Some);
            }
        }
        Ok(None)
    }

    /// Reads one new entry, blocking up to `block` (not at all when `None`).
    async fn read_new<C: redis::aio::ConnectionLike>(
        &self,
        conn: &mut C,
        block: Option<Duration>,
    ) -> Result<Option<Lease>, StoreError> {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(GROUP)
            .arg(&self.consumer)
            .arg("COUNT")
            .arg(1);
        if let Some(b) = block {
            cmd.arg("BLOCK").arg((b.as_millis() as u64).max(1));
        }
        cmd.arg("STREAMS").arg(&self.key).arg(">");
        let reply: Option<StreamReadReply> = match cmd.query_async(conn).await {
            Ok(r) => r,
            Err(e) if is_nogroup(&e) || is_unblocked(&e) => {
                self.ensure_group().await?;
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        };
        match reply.and_then(|r| r.keys.into_iter().next()) {
            Some(stream) => match stream.ids.first() {
                Some(e) => self.entry_of(e, 1).map(Some),
                None => Ok(None),
            },
            None => Ok(None),
        }
    }
}

#[async_trait]
impl Queue for RedisQueue {
    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "XADD scan:dispatch", otel.kind = "client", db.system = "redis", db.operation.name = "XADD", job.id = %entry.job_id),
        err
    )]
    async fn enqueue(&self, entry: QueueEntry) -> Result<(), StoreError> {
        let carrier = serde_json::to_string(&entry.carrier).unwrap_or_else(|_| "{}".into());
        redis::cmd("XADD")
            .arg(&self.key)
            .arg("*")
            .arg("job")
            .arg(&entry.job_id)
            .arg("carrier")
            .arg(carrier)
            .arg("at")
            .arg(ms(entry.enqueued_at))
            .query_async::<String>(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    async fn claim(&self, lease: Duration, wait: Duration) -> Result<Option<Lease>, StoreError> {
        let deadline = tokio::time::Instant::now() + wait;
        // What is ready now needs no blocking: the shared connection answers at once.
        if let Some(l) = self.reclaim(lease).await? {
            return Ok(Some(l));
        }
        if let Some(l) = self.read_new(&mut self.conn.clone(), None).await? {
            return Ok(Some(l));
        }
        loop {
            let now = tokio::time::Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            let Ok(mut conn) = tokio::time::timeout_at(deadline, self.blocking.lock()).await else {
                return Ok(None);
            };
            // Short blocks, so entries whose lease ran out meanwhile are reclaimed in time.
            let block = (deadline - tokio::time::Instant::now()).min(Duration::from_millis(250));
            let got = match self.read_new(&mut *conn, Some(block)).await {
                Ok(got) => got,
                Err(e) => {
                    // The connection may be dead (Redis restarted): the next claimer gets a
                    // fresh one.
                    match self.redis.dedicated().await {
                        Ok(fresh) => *conn = fresh,
                        Err(re) => {
                            tracing::warn!(error = %re, "cannot reconnect the queue's blocking connection")
                        }
                    }
                    return Err(e);
                }
            };
            drop(conn);
            if got.is_some() {
                return Ok(got);
            }
            if let Some(l) = self.reclaim(lease).await? {
                return Ok(Some(l));
            }
        }
    }

    async fn extend(&self, lease: &Lease, _by: Duration) -> Result<bool, StoreError> {
        // Reclaiming goes by idle time, so resetting it extends the lease by a full lease.
        let (stream_id, delivered) = parse_lease_id(&lease.id)?;
        let extended: i64 = match self
            .extend
            .key(&self.key)
            .arg(GROUP)
            .arg(&self.consumer)
            .arg(stream_id)
            .arg(delivered)
            .invoke_async(&mut self.conn.clone())
            .await
        {
            Ok(v) => v,
            // The group is gone (Redis restarted): so is the lease.
            Err(e) if is_nogroup(&e) => 0,
            Err(e) => return Err(e.into()),
        };
        Ok(extended == 1)
    }

    #[tracing::instrument(
        name = "db",
        skip_all,
        fields(otel.name = "XACK scan:dispatch", otel.kind = "client", db.system = "redis", db.operation.name = "XACK", job.id = %lease.entry.job_id),
        err
    )]
    async fn ack(&self, lease: &Lease) -> Result<(), StoreError> {
        let (stream_id, _) = parse_lease_id(&lease.id)?;
        let acked = redis::pipe()
            .atomic()
            .cmd("XACK")
            .arg(&self.key)
            .arg(GROUP)
            .arg(stream_id)
            .ignore()
            .cmd("XDEL")
            .arg(&self.key)
            .arg(stream_id)
            .ignore()
            .query_async::<()>(&mut self.conn.clone())
            .await;
        match acked {
            // Nothing left to acknowledge after a restart; delete the entry anyway.
            Err(e) if is_nogroup(&e) => {
                redis::cmd("XDEL")
                    .arg(&self.key)
                    .arg(stream_id)
                    .query_async::<()>(&mut self.conn.clone())
                    .await?;
                Ok(())
            }
            other => Ok(other?),
        }
    }

    async fn backlog(&self) -> Result<u64, StoreError> {
        // Acknowledged entries are deleted, so the stream holds exactly waiting + claimed.
        Ok(redis::cmd("XLEN")
            .arg(&self.key)
            .query_async(&mut self.conn.clone())
            .await?)
    }

    async fn queued(&self, job_ids: &[String]) -> Result<HashSet<String>, StoreError> {
        let wanted: HashSet<&str> = job_ids.iter().map(String::as_str).collect();
        let mut found = HashSet::new();
        let mut start = "-".to_owned();
        loop {
            let page: StreamRangeReply = redis::cmd("XRANGE")
                .arg(&self.key)
                .arg(&start)
                .arg("+")
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut self.conn.clone())
                .await?;
            for e in &page.ids {
                if let Some(job) = e.get::<String>("job")
                    && wanted.contains(job.as_str())
                {
                    found.insert(job);
                }
            }
            match page.ids.last() {
                Some(last) if page.ids.len() == 1000 => start = format!("({}", last.id),
                _ => return Ok(found),
            }
        }
    }
}

/// This process's consumer name in the dispatch group: host plus a random suffix, so a
/// restarted process never inherits a dead one's claims except through reclaiming.
pub fn consumer_name() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "ingest".into());
    let host: String = host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!(
        "{host}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}
