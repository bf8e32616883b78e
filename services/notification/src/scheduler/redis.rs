//! The production scheduler on Redis: one sorted set of due notifications scored by due time
//! (`<prefix>{notif}:due`) and one of claimed ones scored by lease deadline
//! (`<prefix>{notif}:inflight`). One Lua script first returns expired claims to the due set,
//! then moves up to `max` due members into the in-flight set, atomically: every replica can
//! claim, none gets a member another holds under a live lease, and a claim that is never
//! acknowledged comes back (at-least-once; the SQL row guards against delivering twice). The
//! `{notif}` hash tag keeps both keys in one Redis Cluster slot, so every script and pipeline
//! here is legal on a Cluster too.

use std::time::Duration;

use anyhow::Context;
use ecoscan_redis::{
    Conn, Redis, Settings,
    redis::{self, AsyncCommands, Script},
};
use tokio::sync::Notify;

use super::{Scheduler, SchedulerError};

/// Returns expired claims to the due set, then claims up to ARGV[2] members due at ARGV[1] with
/// the lease deadline ARGV[3]. KEYS[1] = due set, KEYS[2] = in-flight set. Members move in
/// slices so no Lua call receives more arguments than its stack allows.
///
/// A range from `-inf` is the lowest ranks of its set, so the members it returned are removed
/// by rank (`ZREMRANGEBYRANK 0 n-1`: one range deletion) rather than one by one by name (`ZREM`:
/// a lookup per member); the script runs atomically, so the ranks cannot have changed.
/// (`notification-claim` in `bench/`, 2,000 of 1M: 4.2 ms of Redis time per claim with `ZREM`,
/// 3.3 ms with this.)
const CLAIM_SCRIPT: &str = r"
local now, max, deadline = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local slice = 500

local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'WITHSCORES', 'LIMIT', 0, max)
for i = 1, #expired, 2 * slice do
  local add = {}
  for j = i, math.min(i + 2 * slice - 1, #expired), 2 do
    -- The lease deadline has passed, so as a due time it is due at once.
    add[#add + 1] = expired[j + 1]
    add[#add + 1] = expired[j]
  end
  redis.call('ZADD', KEYS[1], unpack(add))
end
if #expired > 0 then
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, #expired / 2 - 1)
end

local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, max)
for i = 1, #ids, slice do
  local add = {}
  for j = i, math.min(i + slice - 1, #ids) do
    add[#add + 1] = deadline
    add[#add + 1] = ids[j]
  end
  redis.call('ZADD', KEYS[2], unpack(add))
end
if #ids > 0 then
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, #ids - 1)
end
return ids
";

/// Adds each member of ARGV (pairs: due time, id) that is in neither the due set KEYS[1] nor the
/// in-flight set KEYS[2]; returns how many it added. One script, so a claim cannot move a member
/// between the check and the add, and two replicas restoring the same entries add each once.
const ADD_MISSING_SCRIPT: &str = r"
local added = 0
for i = 1, #ARGV, 2 do
  local id = ARGV[i + 1]
  if not redis.call('ZSCORE', KEYS[1], id) and not redis.call('ZSCORE', KEYS[2], id) then
    added = added + redis.call('ZADD', KEYS[1], 'NX', ARGV[i], id)
  end
end
return added
";

/// Members per ZADD (or per add-missing script call) when many are added at once.
const ADD_CHUNK: usize = 1000;

/// Connects to one Redis server at `url` (tests and tools; services use [`open`]).
pub(crate) async fn connect_single(url: &str) -> anyhow::Result<Redis> {
    Redis::connect(&Settings::single(url), "ecoscan-notification")
        .await
        .with_context(|| format!("failed to connect to redis at {url}"))
}

/// Members of a sorted set with their scores, as `ZRANGE … WITHSCORES` returns them.
type Scored = Vec<(String, f64)>;

fn score(us: i64) -> f64 {
    // Microseconds since the epoch stay below 2^53 until the year 2255, so the score is exact.
    #[allow(clippy::cast_precision_loss)]
    let s = us as f64;
    s
}

/// [`Scheduler`] on two Redis sorted sets; see the module docs.
pub struct RedisScheduler {
    conn: Conn,
    due_key: String,
    inflight_key: String,
    claim: Script,
    add_missing: Script,
    /// Longest a wait lasts: other replicas add entries this process is not told about.
    poll: Duration,
    /// Wakes this process's waiter when it adds an entry itself.
    added: Notify,
}

impl RedisScheduler {
    /// Connects to `url`; every key starts with `prefix` (empty in production; tests and
    /// deployments sharing one Redis use it to stay apart). A waiting delivery loop looks at
    /// Redis at least every `poll`.
    pub async fn connect(url: &str, prefix: &str, poll: Duration) -> anyhow::Result<Self> {
        Ok(Self::new(&connect_single(url).await?, prefix, poll))
    }

    /// The scheduler on `redis`'s shared connection.
    pub fn new(redis: &Redis, prefix: &str, poll: Duration) -> Self {
        Self {
            conn: redis.conn(),
            due_key: format!("{prefix}{{notif}}:due"),
            inflight_key: format!("{prefix}{{notif}}:inflight"),
            claim: Script::new(CLAIM_SCRIPT),
            add_missing: Script::new(ADD_MISSING_SCRIPT),
            poll,
            added: Notify::new(),
        }
    }

    /// The keys this scheduler writes.
    pub fn keys(&self) -> [&str; 2] {
        [&self.due_key, &self.inflight_key]
    }

    /// Entries waiting plus entries claimed and not yet acknowledged.
    pub async fn backlog(&self) -> Result<u64, SchedulerError> {
        let mut pipe = redis::pipe();
        pipe.cmd("ZCARD")
            .arg(&self.due_key)
            .cmd("ZCARD")
            .arg(&self.inflight_key);
        let (due, inflight): (u64, u64) = pipe
            .query_async(&mut self.conn.clone())
            .await
            .map_err(SchedulerError::redis("read the scheduled backlog"))?;
        Ok(due + inflight)
    }

    /// Adds many entries at once, leaving any already waiting as they are (`ZADD NX` on the due
    /// set only: a claimed entry is added again; [`Scheduler::add_missing`] does not do that).
    /// For filling a schedule quickly (the `notification-claim` benchmark).
    pub async fn add_many(&self, entries: &[(String, i64)]) -> Result<(), SchedulerError> {
        for chunk in entries.chunks(ADD_CHUNK) {
            let members: Vec<(f64, &str)> = chunk
                .iter()
                .map(|(id, due)| (score(*due), id.as_str()))
                .collect();
            let _: () = redis::cmd("ZADD")
                .arg(&self.due_key)
                .arg("NX")
                .arg(&members)
                .query_async(&mut self.conn.clone())
                .await
                .map_err(SchedulerError::redis("add scheduled notifications"))?;
        }
        if !entries.is_empty() {
            self.added.notify_one();
        }
        Ok(())
    }

    /// Acknowledges `ids` (one id or a slice of them): out of both sets, atomically. Had a
    /// lease run out meanwhile, the entry went back to the due set, and it needs no second round
    /// either.
    async fn remove(
        &self,
        ids: impl redis::ToRedisArgs + Send + Sync,
    ) -> Result<(), SchedulerError> {
        let _: () = redis::pipe()
            .atomic()
            .zrem(&self.inflight_key, &ids)
            .ignore()
            .zrem(&self.due_key, &ids)
            .ignore()
            .query_async(&mut self.conn.clone())
            .await
            .map_err(SchedulerError::redis("acknowledge delivered notifications"))?;
        Ok(())
    }

    /// The earliest due time or lease deadline, if anything is waiting.
    async fn next_at(&self) -> Result<Option<i64>, SchedulerError> {
        let mut pipe = redis::pipe();
        pipe.cmd("ZRANGE")
            .arg(&self.due_key)
            .arg(0)
            .arg(0)
            .arg("WITHSCORES")
            .cmd("ZRANGE")
            .arg(&self.inflight_key)
            .arg(0)
            .arg(0)
            .arg("WITHSCORES");
        let (due, inflight): (Scored, Scored) = pipe
            .query_async(&mut self.conn.clone())
            .await
            .map_err(SchedulerError::redis("read the next due time"))?;
        #[allow(clippy::cast_possible_truncation)]
        Ok(due.into_iter().chain(inflight).map(|(_, s)| s as i64).min())
    }
}

#[async_trait::async_trait]
impl Scheduler for RedisScheduler {
    async fn backlog(&self) -> Result<u64, SchedulerError> {
        RedisScheduler::backlog(self).await
    }

    async fn add(&self, id: String, due_at_us: i64) -> Result<(), SchedulerError> {
        let _: () = self
            .conn
            .clone()
            .zadd(&self.due_key, id, score(due_at_us))
            .await
            .map_err(SchedulerError::redis("schedule a notification"))?;
        self.added.notify_one();
        Ok(())
    }

    async fn add_missing(&self, entries: &[(String, i64)]) -> Result<usize, SchedulerError> {
        let mut added = 0;
        for chunk in entries.chunks(ADD_CHUNK) {
            let mut call = self.add_missing.key(&self.due_key);
            call.key(&self.inflight_key);
            for (id, due) in chunk {
                call.arg(*due).arg(id);
            }
            let n: usize = call
                .invoke_async(&mut self.conn.clone())
                .await
                .map_err(SchedulerError::redis("restore scheduled notifications"))?;
            added += n;
        }
        if added > 0 {
            self.added.notify_one();
        }
        Ok(added)
    }

    async fn claim_due(
        &self,
        now_us: i64,
        max: usize,
        lease: Duration,
    ) -> Result<Vec<String>, SchedulerError> {
        let lease_us = i64::try_from(lease.as_micros()).unwrap_or(i64::MAX);
        let ids: Vec<String> = self
            .claim
            .key(&self.due_key)
            .key(&self.inflight_key)
            .arg(now_us)
            .arg(max)
            .arg(now_us.saturating_add(lease_us))
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(SchedulerError::redis("claim due notifications"))?;
        Ok(ids)
    }

    async fn ack(&self, id: &str) -> Result<(), SchedulerError> {
        self.remove(id).await
    }

    async fn ack_many(&self, ids: &[String]) -> Result<(), SchedulerError> {
        if ids.is_empty() {
            return Ok(());
        }
        self.remove(ids).await
    }

    async fn wait(&self, max_wait: Duration) {
        let cap = max_wait.min(self.poll);
        let wait = match self.next_at().await {
            Ok(Some(at)) => {
                let us = u64::try_from(at.saturating_sub(crate::now_us())).unwrap_or(0);
                Duration::from_micros(us).min(cap)
            }
            Ok(None) => cap,
            Err(e) => {
                tracing::warn!(error = ?e, "failed to read the next due time from redis");
                cap
            }
        };
        if wait.is_zero() {
            return;
        }
        tokio::select! {
            () = self.added.notified() => {}
            () = tokio::time::sleep(wait) => {}
        }
    }
}
