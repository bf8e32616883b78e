//! The production scheduler on Redis: one sorted set of due notifications scored by due time
//! (`<prefix>{notif}:due`), and the claims: each claim is a sorted set of its own
//! (`<prefix>{notif}:claim:<id>`, the members with their due times), listed in a sorted set of
//! claims scored by lease deadline (`<prefix>{notif}:claims`). One Lua script first returns
//! expired claims to the due set, then moves up to `max` due members into a new claim,
//! atomically: every replica can claim, none gets a member another holds under a live lease, and
//! a claim that is never acknowledged comes back (at-least-once; the SQL row guards against
//! delivering twice). The `{notif}` hash tag keeps every key in one Redis Cluster slot, so every
//! script and pipeline here is legal on a Cluster too.
//!
//! One lease per claim, not one per member: the claim is copied in one command
//! (`ZRANGESTORE`) instead of 2,000 members passing through Lua into a shared in-flight set
//! (`notification-claim` in `bench/`, 2,000 of 1M, two runs each on one machine: Redis time per
//! claim 3.45–3.89 ms with a lease per member, 2.45–2.68 ms with this; the README has the
//! figures). An acknowledgement looks for its members in the live claims, oldest first; there
//! are few at once (one per delivery loop).

use std::time::Duration;

use anyhow::Context;
use ecoscan_redis::{
    Conn, Redis, Settings,
    redis::{self, AsyncCommands, Script},
};
use tokio::sync::Notify;

use super::{Scheduler, SchedulerError};

/// Returns expired claims to the due set (a few per call), then claims up to ARGV[2] members due
/// at ARGV[1] under the lease deadline ARGV[3]. KEYS[1] = due set, KEYS[2] = the claims by
/// deadline, KEYS[3] = the new claim's key. Returns how many it claimed; the caller reads the
/// claim's members in the same round trip.
///
/// A range from `-inf` is the lowest ranks of its set, so the members claimed are removed by
/// rank (`ZREMRANGEBYRANK 0 n-1`: one range deletion) rather than one by one by name; the script
/// runs atomically, so the ranks cannot have changed. An expired claim's members go back at
/// their own due times: past, so due at once, and ahead of what fell due since.
const CLAIM_SCRIPT: &str = r"
local now, max, deadline = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local slice = 500

local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, 8)
for _, claim in ipairs(expired) do
  local members = redis.call('ZRANGE', claim, 0, -1, 'WITHSCORES')
  for i = 1, #members, 2 * slice do
    local add = {}
    for j = i, math.min(i + 2 * slice - 1, #members), 2 do
      add[#add + 1] = members[j + 1]
      add[#add + 1] = members[j]
    end
    redis.call('ZADD', KEYS[1], unpack(add))
  end
  redis.call('DEL', claim)
  redis.call('ZREM', KEYS[2], claim)
end

local n = redis.call('ZRANGESTORE', KEYS[3], KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, max)
if n > 0 then
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, n - 1)
  redis.call('ZADD', KEYS[2], deadline, KEYS[3])
end
return n
";

/// Acknowledges the ids in ARGV: out of the live claims that hold them (oldest first, stopping
/// once every id is found; an emptied claim is dropped) and out of the due set (a lease that ran
/// out put them back). KEYS[1] = due set, KEYS[2] = the claims. Every key shares the `{notif}`
/// slot, so the claims' keys, read from KEYS[2], are legal on a Cluster.
const ACK_SCRIPT: &str = r"
local slice = 500
local left = #ARGV
for _, claim in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  if left <= 0 then break end
  for i = 1, #ARGV, slice do
    left = left - redis.call('ZREM', claim, unpack(ARGV, i, math.min(i + slice - 1, #ARGV)))
  end
  if redis.call('EXISTS', claim) == 0 then
    redis.call('ZREM', KEYS[2], claim)
  end
end
for i = 1, #ARGV, slice do
  redis.call('ZREM', KEYS[1], unpack(ARGV, i, math.min(i + slice - 1, #ARGV)))
end
return 0
";

/// Adds each member of ARGV (pairs: due time, id) that is neither due (KEYS[1]) nor in a live
/// claim (listed in KEYS[2]); returns how many it added. One script, so a claim cannot move a
/// member between the check and the add, and two replicas restoring the same entries add each
/// once.
const ADD_MISSING_SCRIPT: &str = r"
local claims = redis.call('ZRANGE', KEYS[2], 0, -1)
local added = 0
for i = 1, #ARGV, 2 do
  local id = ARGV[i + 1]
  local held = redis.call('ZSCORE', KEYS[1], id)
  for _, claim in ipairs(claims) do
    if held then break end
    held = redis.call('ZSCORE', claim, id)
  end
  if not held then
    added = added + redis.call('ZADD', KEYS[1], 'NX', ARGV[i], id)
  end
end
return added
";

/// Entries waiting (KEYS[1]) plus the members of every live claim (listed in KEYS[2]).
const BACKLOG_SCRIPT: &str = r"
local n = redis.call('ZCARD', KEYS[1])
for _, claim in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  n = n + redis.call('ZCARD', claim)
end
return n
";

/// Removes the due set, every claim and the claims' list (benchmarks and tools cleaning up).
const REMOVE_ALL_SCRIPT: &str = r"
local claims = redis.call('ZRANGE', KEYS[2], 0, -1)
for i = 1, #claims, 500 do
  redis.call('UNLINK', unpack(claims, i, math.min(i + 499, #claims)))
end
return redis.call('UNLINK', KEYS[1], KEYS[2])
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

/// [`Scheduler`] on Redis sorted sets; see the module docs.
pub struct RedisScheduler {
    conn: Conn,
    due_key: String,
    /// The live claims' keys, scored by lease deadline.
    claims_key: String,
    /// What every claim's key starts with (a fresh id follows).
    claim_prefix: String,
    claim: Script,
    ack: Script,
    add_missing: Script,
    backlog: Script,
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
            claims_key: format!("{prefix}{{notif}}:claims"),
            claim_prefix: format!("{prefix}{{notif}}:claim:"),
            claim: Script::new(CLAIM_SCRIPT),
            ack: Script::new(ACK_SCRIPT),
            add_missing: Script::new(ADD_MISSING_SCRIPT),
            backlog: Script::new(BACKLOG_SCRIPT),
            poll,
            added: Notify::new(),
        }
    }

    /// The due set and the list of claims (each claim has a key of its own besides, listed in
    /// the second: [`Self::remove_all`] removes them all).
    pub fn keys(&self) -> [&str; 2] {
        [&self.due_key, &self.claims_key]
    }

    /// Removes every key of this scheduler: the due set, the claims and their list (benchmarks
    /// and tools cleaning up after themselves; `UNLINK`, so a million members are freed off
    /// Redis's main thread).
    pub async fn remove_all(&self) -> Result<(), SchedulerError> {
        let _: i64 = Script::new(REMOVE_ALL_SCRIPT)
            .key(&self.due_key)
            .key(&self.claims_key)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(SchedulerError::redis("remove the scheduler's keys"))?;
        Ok(())
    }

    /// Entries waiting plus entries claimed and not yet acknowledged.
    pub async fn backlog(&self) -> Result<u64, SchedulerError> {
        self.backlog
            .key(&self.due_key)
            .key(&self.claims_key)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(SchedulerError::redis("read the scheduled backlog"))
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

    /// Acknowledges `ids`: out of the claims holding them and out of the due set, atomically.
    /// Had a lease run out meanwhile, the entry went back to the due set, and it needs no second
    /// round either.
    async fn remove(&self, ids: &[&str]) -> Result<(), SchedulerError> {
        let _: i64 = self
            .ack
            .key(&self.due_key)
            .key(&self.claims_key)
            .arg(ids)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(SchedulerError::redis("acknowledge delivered notifications"))?;
        Ok(())
    }

    /// Runs the claim script and reads the new claim's members, in one round trip (the members
    /// leave Redis as a plain reply, not through Lua, which costs more than the claim itself
    /// for 2,000 of them). After a Redis restart the script is loaded again and the pair resent.
    async fn claim_and_read(
        &self,
        now_us: i64,
        max: usize,
        deadline_us: i64,
    ) -> redis::RedisResult<Vec<String>> {
        let claim_key = format!("{}{}", self.claim_prefix, uuid::Uuid::new_v4().simple());
        let mut invocation = self.claim.key(&self.due_key);
        invocation
            .key(&self.claims_key)
            .key(&claim_key)
            .arg(now_us)
            .arg(max)
            .arg(deadline_us);
        let mut pipe = redis::pipe();
        pipe.invoke_script(&invocation)
            .ignore()
            .cmd("ZRANGE")
            .arg(&claim_key)
            .arg(0)
            .arg(-1);
        let mut conn = self.conn.clone();
        let (ids,) = match pipe.query_async(&mut conn).await {
            Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) => {
                invocation.load_async(&mut conn).await?;
                pipe.query_async(&mut conn).await
            }
            result => result,
        }?;
        Ok(ids)
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
            .arg(&self.claims_key)
            .arg(0)
            .arg(0)
            .arg("WITHSCORES");
        let (due, claims): (Scored, Scored) = pipe
            .query_async(&mut self.conn.clone())
            .await
            .map_err(SchedulerError::redis("read the next due time"))?;
        #[allow(clippy::cast_possible_truncation)]
        Ok(due.into_iter().chain(claims).map(|(_, s)| s as i64).min())
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
            call.key(&self.claims_key);
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
        let ids = self
            .claim_and_read(now_us, max, now_us.saturating_add(lease_us))
            .await
            .map_err(SchedulerError::redis("claim due notifications"))?;
        Ok(ids)
    }

    async fn ack(&self, id: &str) -> Result<(), SchedulerError> {
        self.remove(&[id]).await
    }

    async fn ack_many(&self, ids: &[String]) -> Result<(), SchedulerError> {
        if ids.is_empty() {
            return Ok(());
        }
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        self.remove(&ids).await
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
