//! The dispatch queue on Redis: one stream, `scan:dispatch`, and its consumer group `ingest`
//! (see the parent module's docs).

use ecoscan_sql::db_span;
use std::{
    collections::HashSet,
    time::{Duration, UNIX_EPOCH},
};

use async_trait::async_trait;
use ecoscan_redis::{
    Conn, Redis,
    redis::{
        self, RedisError, RedisResult,
        streams::{
            StreamClaimReply, StreamId, StreamPendingCountReply, StreamRangeReply, StreamReadReply,
        },
    },
};

use super::scripts::{
    ACK_HELD_SCRIPT, EXTEND_MANY_SCRIPT, FORGET_IDLE_SCRIPT, RESERVE_REQUEUE_SCRIPT,
};
use crate::{
    error::StoreError,
    store::queue::{Lease, Queue, QueueEntry},
};

fn field_str(entry: &StreamId, name: &str) -> Result<String, StoreError> {
    entry
        .get::<String>(name)
        .ok_or_else(|| StoreError::Corrupt(format!("stream entry {} has no {name}", entry.id)))
}

const GROUP: &str = "ingest";
/// Longest single blocking read; the claim loop then looks for expired leases again.
const MAX_BLOCK: Duration = Duration::from_millis(250);

/// The dispatch queue on a Redis Streams consumer group; see the module docs.
pub struct RedisQueue {
    conn: Conn,
    /// When this process last looked for expired leases: `XPENDING IDLE` walks every pending
    /// entry, so it runs a few times per lease, not on every claim.
    last_reclaim: std::sync::Mutex<Option<tokio::time::Instant>>,
    /// The connection blocking reads wait on, taken in turn.
    blocking: tokio::sync::Mutex<Conn>,
    key: String,
    consumer: String,
    /// How long a command's sender waits for its answer (`REDIS_RESPONSE_TIMEOUT`): a lease
    /// renewal that reaches Redis later than that after it was sent does nothing.
    response_timeout: Duration,
    /// Wakes [`Queue::lost`]'s waiter (the sweeper) when Redis is found to have lost the
    /// queue: its consumer group is gone, and with it every entry waiting or claimed.
    lost: tokio::sync::Notify,
    /// Whether Redis answers (the handle's, shared by every connection of it).
    health: ecoscan_common::store_health::StoreHealth,
}

/// The idle time a released entry is given (30 days): longer than any lease.
const RELEASED_IDLE_MS: u64 = 30 * 24 * 3600 * 1000;

/// A lease's handle: the stream id and the delivery count it was claimed with.
fn lease_id(stream_id: &str, delivered: usize) -> String {
    format!("{stream_id}/{delivered}")
}

fn parse_lease_id(id: &str) -> Result<(&str, usize), StoreError> {
    id.split_once('/')
        .and_then(|(s, n)| Some((s, n.parse().ok()?)))
        .ok_or_else(|| StoreError::Corrupt(format!("malformed lease id {id:?}")))
}

/// Redis answered that the consumer group is gone: `NOGROUP`, or `UNBLOCKED` for a blocked
/// read whose stream (and its group) vanished while it waited. Only a blocked `XREADGROUP`
/// is ever answered `UNBLOCKED`, so to every other command this is `NOGROUP` alone.
fn is_group_gone(e: &RedisError) -> bool {
    matches!(e.code(), Some("NOGROUP" | "UNBLOCKED"))
}

/// What a command that needs the consumer group does when Redis answers that it is gone
/// ([`RedisQueue::unless_group_gone`]).
#[derive(Clone, Copy)]
enum OnGroupGone {
    /// Recreate the group and wake [`Queue::lost`] ([`RedisQueue::lost_group`]): the commands
    /// that claim entries and extend leases, which cannot go on without it.
    Recreate,
    /// Only go on without a reply: what the command would have touched went with the group,
    /// and the next claim recreates it.
    Skip,
}

impl RedisQueue {
    /// The queue under `prefix` (`""` in production); `consumer` names this process in the
    /// consumer group. Creates the stream and the group when missing.
    pub async fn open(redis: &Redis, prefix: &str, consumer: &str) -> Result<Self, StoreError> {
        let blocking = redis
            .blocking(MAX_BLOCK)
            .await
            .map_err(|e| StoreError::Unavailable(format!("cannot open a redis connection: {e}")))?;
        let queue = Self {
            conn: redis.conn(),
            last_reclaim: std::sync::Mutex::new(None),
            blocking: tokio::sync::Mutex::new(blocking),
            key: format!("{prefix}scan:dispatch"),
            consumer: consumer.to_owned(),
            response_timeout: redis.response_timeout(),
            lost: tokio::sync::Notify::new(),
            health: redis.health().clone(),
        };
        if queue.ensure_group().await? {
            // A new deployment, or a Redis that lost the queue while no ingest ran: rows of
            // unfinished jobs (if any) have no entry. The sweeper puts them back at once.
            tracing::info!("created the dispatch queue's consumer group");
            queue.lost.notify_one();
        }
        Ok(queue)
    }

    /// Redis answered that the group is gone (`NOGROUP`, or `UNBLOCKED` for a blocked read
    /// whose stream vanished): it lost the queue — a restart without persistence, `FLUSHALL`,
    /// a failover that had not caught up. Recreates the group and wakes [`Queue::lost`].
    async fn lost_group(&self, e: &RedisError) -> Result<(), StoreError> {
        tracing::warn!(error = %e, "the dispatch queue's consumer group is gone: redis lost its data; every unfinished job goes back on the queue");
        self.lost.notify_one();
        self.ensure_group().await.map(|_| ())
    }

    /// Creates the group (and the stream) unless it exists; true when it did not. After a
    /// Redis restart without persistence it is gone, and every command that needs it
    /// recreates it ([`Self::lost_group`]).
    async fn ensure_group(&self) -> Result<bool, StoreError> {
        let created = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.key)
            .arg(GROUP)
            .arg("0")
            .arg("MKSTREAM")
            .query_async::<()>(&mut self.conn.clone())
            .await;
        match created {
            Ok(()) => Ok(true),
            Err(e) if e.code() == Some("BUSYGROUP") => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    /// The reply of a command that needs the consumer group, `None` when Redis answered that
    /// the group is gone (after recreating it if `on_gone` says so); other errors pass on.
    /// One place, so every command reads a lost queue the same way.
    async fn unless_group_gone<T>(
        &self,
        reply: RedisResult<T>,
        on_gone: OnGroupGone,
    ) -> Result<Option<T>, StoreError> {
        match reply {
            Ok(v) => Ok(Some(v)),
            Err(e) if is_group_gone(&e) => {
                if let OnGroupGone::Recreate = on_gone {
                    self.lost_group(&e).await?;
                }
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The lease of entry `e`, claimed (its `delivered`th delivery) by a request sent at `sent`.
    fn lease_of(
        &self,
        e: &StreamId,
        delivered: usize,
        sent: tokio::time::Instant,
    ) -> Result<Lease, StoreError> {
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
                enqueued_at: UNIX_EPOCH + Duration::from_millis(at_ms.max(0).unsigned_abs()),
            },
            id: lease_id(&e.id, delivered),
            renewed: sent,
        })
    }

    /// Takes over up to `max` entries idle longer than `lease`, oldest first; looks at most
    /// every quarter lease (an expired lease waits that much longer, at most).
    async fn reclaim(&self, lease: Duration, max: usize) -> Result<Vec<Lease>, StoreError> {
        {
            let mut last = self.last_reclaim.lock().expect("reclaim lock poisoned");
            let now = tokio::time::Instant::now();
            if last.is_some_and(|t| now.duration_since(t) < lease / 4) {
                return Ok(Vec::new());
            }
            *last = Some(now);
        }
        let idle = lease.as_millis() as u64;
        let pending = redis::cmd("XPENDING")
            .arg(&self.key)
            .arg(GROUP)
            .arg("IDLE")
            .arg(idle)
            .arg("-")
            .arg("+")
            .arg(max)
            .query_async::<StreamPendingCountReply>(&mut self.conn.clone())
            .await;
        // Redis lost the group (a restart without persistence): nothing to reclaim.
        let Some(pending) = self
            .unless_group_gone(pending, OnGroupGone::Recreate)
            .await?
        else {
            return Ok(Vec::new());
        };
        if pending.ids.is_empty() {
            return Ok(Vec::new());
        }
        // Atomic on the idle time: an entry someone claimed meanwhile is no longer idle and
        // is left out of the reply.
        let mut cmd = redis::cmd("XCLAIM");
        cmd.arg(&self.key).arg(GROUP).arg(&self.consumer).arg(idle);
        let sent = tokio::time::Instant::now();
        for p in &pending.ids {
            cmd.arg(&p.id);
        }
        let claimed: StreamClaimReply = cmd.query_async(&mut self.conn.clone()).await?;
        claimed
            .ids
            .iter()
            .filter_map(|e| {
                let delivered = pending.ids.iter().find(|p| p.id == e.id)?.times_delivered;
                Some(self.lease_of(e, delivered + 1, sent))
            })
            .collect()
    }

    /// Reads up to `max` new entries, blocking up to `block` (not at all when `None`).
    async fn read_new(
        &self,
        conn: &mut Conn,
        block: Option<Duration>,
        max: usize,
    ) -> Result<Vec<Lease>, StoreError> {
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg("GROUP")
            .arg(GROUP)
            .arg(&self.consumer)
            .arg("COUNT")
            .arg(max);
        if let Some(b) = block {
            cmd.arg("BLOCK").arg((b.as_millis() as u64).max(1));
        }
        cmd.arg("STREAMS").arg(&self.key).arg(">");
        let sent = tokio::time::Instant::now();
        let reply = cmd.query_async::<Option<StreamReadReply>>(conn).await;
        let Some(reply) = self.unless_group_gone(reply, OnGroupGone::Recreate).await? else {
            return Ok(Vec::new());
        };
        reply
            .into_iter()
            .flat_map(|r| r.keys)
            .flat_map(|stream| stream.ids)
            .map(|e| self.lease_of(&e, 1, sent))
            .collect()
    }
}

#[async_trait]
impl Queue for RedisQueue {
    #[db_span(
        system = "redis",
        op = "XADD",
        name = "XADD scan:dispatch",
        fields(job.id = %entry.job_id)
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
            // Milliseconds, like the stream ids beside it: the queue's own wire format.
            .arg(
                entry
                    .enqueued_at
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            )
            .query_async::<String>(&mut self.conn.clone())
            .await?;
        Ok(())
    }

    async fn claim_many(
        &self,
        lease: Duration,
        wait: Duration,
        max: usize,
    ) -> Result<Vec<Lease>, StoreError> {
        let max = max.max(1);
        let deadline = tokio::time::Instant::now() + wait;
        // What is ready now needs no blocking: the shared connection answers at once.
        let mut claimed = self.reclaim(lease, max).await?;
        if claimed.len() < max {
            let more = self
                .read_new(&mut self.conn.clone(), None, max - claimed.len())
                .await?;
            claimed.extend(more);
        }
        loop {
            if !claimed.is_empty() || tokio::time::Instant::now() >= deadline {
                return Ok(claimed);
            }
            let Ok(mut conn) = tokio::time::timeout_at(deadline, self.blocking.lock()).await else {
                return Ok(claimed);
            };
            // Short blocks, so entries whose lease ran out meanwhile are reclaimed in time.
            let block = (deadline - tokio::time::Instant::now()).min(MAX_BLOCK);
            claimed = self.read_new(&mut conn, Some(block), max).await?;
            drop(conn);
            if claimed.is_empty() {
                claimed = self.reclaim(lease, max).await?;
            }
        }
    }

    async fn extend_many(&self, leases: &[Lease], _by: Duration) -> Result<Vec<bool>, StoreError> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        // Reclaiming goes by idle time, so resetting it extends a lease by a full lease. Each
        // lease carries the longest idle time this renewal can meet if it arrives while this
        // call still waits (its entry was last reset no earlier than `renewed`, and the call
        // gives up after the response timeout): more, and it arrived late, so it does nothing.
        let now = tokio::time::Instant::now();
        let mut call = EXTEND_MANY_SCRIPT.key(&self.key);
        call.arg(GROUP).arg(&self.consumer);
        for lease in leases {
            let (stream_id, delivered) = parse_lease_id(&lease.id)?;
            let late_after = now.saturating_duration_since(lease.renewed) + self.response_timeout;
            call.arg(stream_id)
                .arg(delivered)
                .arg(late_after.as_millis() as u64);
        }
        let extended = call.invoke_async::<Vec<i64>>(&mut self.conn.clone()).await;
        match self
            .unless_group_gone(extended, OnGroupGone::Recreate)
            .await?
        {
            Some(v) => Ok(v.into_iter().map(|x| x == 1).collect()),
            // The group is gone (Redis restarted): so are the leases.
            None => Ok(vec![false; leases.len()]),
        }
    }

    #[db_span(
        system = "redis",
        op = "XACK",
        name = "XACK scan:dispatch",
        fields(job.id = %lease.entry.job_id)
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
        if self
            .unless_group_gone(acked, OnGroupGone::Skip)
            .await?
            .is_none()
        {
            // Nothing left to acknowledge after a restart; delete the entry anyway.
            redis::cmd("XDEL")
                .arg(&self.key)
                .arg(stream_id)
                .query_async::<()>(&mut self.conn.clone())
                .await?;
        }
        Ok(())
    }

    #[db_span(
        system = "redis",
        op = "EVALSHA",
        name = "XACK scan:dispatch (held)",
        fields(job.id = %lease.entry.job_id)
    )]
    async fn ack_held(&self, lease: &Lease) -> Result<bool, StoreError> {
        let (stream_id, delivered) = parse_lease_id(&lease.id)?;
        let acked = ACK_HELD_SCRIPT
            .key(&self.key)
            .arg(GROUP)
            .arg(&self.consumer)
            .arg(stream_id)
            .arg(delivered)
            .invoke_async::<i64>(&mut self.conn.clone())
            .await;
        // The group is gone, and the entry with it: not held.
        Ok(self
            .unless_group_gone(acked, OnGroupGone::Skip)
            .await?
            .is_some_and(|n| n == 1))
    }

    async fn lost(&self) {
        self.lost.notified().await;
    }

    fn health(&self) -> Option<ecoscan_common::store_health::StoreHealth> {
        Some(self.health.clone())
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

    #[db_span(
        system = "redis",
        op = "XCLAIM",
        name = "XCLAIM scan:dispatch",
        fields(leases = leases.len())
    )]
    async fn release(&self, leases: &[Lease]) -> Result<(), StoreError> {
        if leases.is_empty() {
            return Ok(());
        }
        // Reclaiming goes by idle time: an entry made to look idle for ages is taken by the
        // next claimer of any process, as one whose lease ran out.
        let mut pipe = redis::pipe();
        for lease in leases {
            let (stream_id, _) = parse_lease_id(&lease.id)?;
            pipe.cmd("XCLAIM")
                .arg(&self.key)
                .arg(GROUP)
                .arg(&self.consumer)
                .arg(0)
                .arg(stream_id)
                .arg("IDLE")
                .arg(RELEASED_IDLE_MS)
                .arg("JUSTID")
                .ignore();
        }
        let released = pipe.query_async::<()>(&mut self.conn.clone()).await;
        // The group is gone, and the leases with it: nothing to release.
        self.unless_group_gone(released, OnGroupGone::Skip).await?;
        Ok(())
    }

    #[db_span(
        system = "redis",
        op = "EVALSHA",
        name = "EVALSHA scan:dispatch:requeue",
        fields(job.id = %job_id)
    )]
    async fn reserve_requeue(
        &self,
        job_id: &str,
        hold: Duration,
        holder: &str,
    ) -> Result<bool, StoreError> {
        // One key per job (any slot on a cluster), holding its holder's name: the first
        // sweeper is the only one, and it again at its next pass.
        let reserved: i64 = RESERVE_REQUEUE_SCRIPT
            .key(format!("{}:requeue:{job_id}", self.key))
            .arg(holder)
            .arg(hold.as_millis().max(1) as u64)
            .invoke_async(&mut self.conn.clone())
            .await?;
        Ok(reserved == 1)
    }

    async fn forget_idle_claimers(&self, idle: Duration) -> Result<usize, StoreError> {
        let forgotten = FORGET_IDLE_SCRIPT
            .key(&self.key)
            .arg(GROUP)
            .arg(&self.consumer)
            .arg(idle.as_millis() as u64)
            .invoke_async::<i64>(&mut self.conn.clone())
            .await;
        // The group is gone, and its consumers with it.
        let forgotten = self
            .unless_group_gone(forgotten, OnGroupGone::Skip)
            .await?
            .unwrap_or(0);
        if forgotten > 0 {
            tracing::info!(
                forgotten,
                "removed idle consumers of processes that are gone"
            );
        }
        Ok(usize::try_from(forgotten).unwrap_or(0))
    }
}
