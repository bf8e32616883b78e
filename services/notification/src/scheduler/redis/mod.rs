//! The production scheduler on Redis. Scheduled notifications wait in *segments*, small sorted
//! sets scored by due time: one per second of due time (`<prefix>{notif}:s:<second>`), listed in
//! the waiting index (`<prefix>{notif}:waiting`, each segment scored by its earliest member). A
//! claim is a few sorted sets of its own (`<prefix>{notif}:part:<claim>:<n>`), listed by lease
//! deadline in `<prefix>{notif}:leases`; a part whose lease ran out goes back to the waiting index
//! as a segment as it is (and into `<prefix>{notif}:returned`, so an acknowledgement still finds
//! it). `<prefix>{notif}:count` counts what is neither delivered nor acknowledged. One Lua script
//! returns expired parts and claims up to `max` due members atomically: every replica can claim,
//! none gets a member another holds under a live lease, and a claim never acknowledged comes back
//! (at-least-once; the SQL row guards against delivering twice). The `{notif}` hash tag keeps
//! every key in one Redis Cluster slot, so every script and pipeline here is legal on a Cluster.
//!
//! Why segments: a claim that copies its members out of one big sorted set pays for each member
//! twice, once to insert it into the claim and once to remove it from the set (`notification-claim`
//! in `bench/`, 2,000 of 1M: Redis 3.99 ms per claim, p50 4.96 ms). A segment wholly due is
//! claimed by `RENAME`, whatever its size: the members move without being touched, and each
//! leaves its part when it is acknowledged (a `ZREM` from a set of about a second's members,
//! outside the claim). Only a segment partly due (the current second), one larger than what is
//! left of `max`, or one smaller than [`SMALL`] is copied, and then only the members claimed. A
//! second shared by more than [`CROWDED`] members (a campaign due at one moment) spreads over
//! more segments as it fills, so it too is claimed by renaming.
//!
//! An acknowledgement looks for its members in the live parts (oldest first, stopping once every
//! id is found) and in the returned segments; a part is at most [`PARTS`] per claim and there are
//! few claims at once (one per delivery loop). Since acknowledgements do not know due times,
//! an id that was never claimed is not looked for among the waiting segments.
//!
//! Upgrading from releases before 2026-12-06 (one `{notif}:due` set and claims listed in
//! `{notif}:claims`): those keys are not read; what they held is neither waiting nor claimed here,
//! so the reconcile sweep at start puts every scheduled row back, and the old keys can be deleted.

use std::time::Duration;

use anyhow::Context;
use ecoscan_redis::{
    Conn, Redis, Settings,
    redis::{self, Script},
};
use tokio::sync::Notify;

use self::scripts::{
    ACK_SCRIPT, ADD_CHUNK, ADD_SCRIPT, CLAIM_SCRIPT, CROWDED, FAN_OUT, PARTS, PARTS_READ_AT_ONCE,
    REMOVE_ALL_SCRIPT, SEGMENT_US, SMALL,
};
use super::{Scheduler, SchedulerError};

mod scripts;

/// Connects to one Redis server at `url` (tests and tools; services use [`open`]).
pub(crate) async fn connect_single(url: &str) -> anyhow::Result<Redis> {
    Redis::connect(&Settings::single(url), "ecoscan-notification")
        .await
        .with_context(|| format!("failed to connect to redis at {url}"))
}

/// Members of a sorted set with their scores, as `ZRANGE … WITHSCORES` returns them.
type Scored = Vec<(String, f64)>;

/// [`Scheduler`] on Redis sorted sets; see the module docs.
pub struct RedisScheduler {
    conn: Conn,
    /// The waiting segments, scored by their earliest member.
    waiting_key: String,
    /// The live claims' parts, scored by lease deadline.
    leases_key: String,
    /// Waiting segments that were claim parts once (a lease ran out).
    returned_key: String,
    /// Entries neither delivered nor acknowledged.
    count_key: String,
    /// The crowded seconds: second → levels of extra segments.
    crowded_key: String,
    /// What every waiting segment's key starts with (its second of due time follows).
    segment_prefix: String,
    /// What every claim part's key starts with (the claim's id and the part's number follow).
    part_prefix: String,
    claim: Script,
    ack: Script,
    add: Script,
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
            waiting_key: format!("{prefix}{{notif}}:waiting"),
            leases_key: format!("{prefix}{{notif}}:leases"),
            returned_key: format!("{prefix}{{notif}}:returned"),
            count_key: format!("{prefix}{{notif}}:count"),
            crowded_key: format!("{prefix}{{notif}}:crowded"),
            segment_prefix: format!("{prefix}{{notif}}:s:"),
            part_prefix: format!("{prefix}{{notif}}:part:"),
            claim: Script::new(CLAIM_SCRIPT),
            ack: Script::new(ACK_SCRIPT),
            add: Script::new(ADD_SCRIPT),
            poll,
            added: Notify::new(),
        }
    }

    /// The keys that list everything else (the waiting index, the live parts, the returned
    /// segments), the count and the crowded seconds: [`Self::remove_all`] removes them and what
    /// they list.
    pub fn keys(&self) -> [&str; 5] {
        [
            &self.waiting_key,
            &self.leases_key,
            &self.returned_key,
            &self.count_key,
            &self.crowded_key,
        ]
    }

    /// Removes every key of this scheduler: each segment and part, their lists and the count
    /// (benchmarks and tools cleaning up after themselves; `UNLINK`, so a million members are
    /// freed off Redis's main thread).
    pub async fn remove_all(&self) -> Result<(), SchedulerError> {
        let _: i64 = Script::new(REMOVE_ALL_SCRIPT)
            .key(&self.waiting_key)
            .key(&self.leases_key)
            .key(&self.returned_key)
            .key(&self.count_key)
            .key(&self.crowded_key)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(SchedulerError::redis("remove the scheduler's keys"))?;
        Ok(())
    }

    /// Entries waiting plus entries claimed and not yet acknowledged (one counter, kept by the
    /// scripts that add and acknowledge).
    pub async fn backlog(&self) -> Result<u64, SchedulerError> {
        let n: Option<i64> = redis::cmd("GET")
            .arg(&self.count_key)
            .query_async(&mut self.conn.clone())
            .await
            .map_err(SchedulerError::redis("read the scheduled backlog"))?;
        Ok(n.map_or(0, |n| u64::try_from(n).unwrap_or(0)))
    }

    /// Adds many entries at once, leaving any already waiting in its segment as it is, without
    /// looking for them in claims (a claimed entry is added again; [`Scheduler::add_missing`]
    /// does not do that). For filling a schedule quickly (the benchmarks).
    pub async fn add_many(&self, entries: &[(String, i64)]) -> Result<(), SchedulerError> {
        self.add_entries(entries, false)
            .await
            .map_err(SchedulerError::redis("add scheduled notifications"))?;
        Ok(())
    }

    /// Runs the add script over `entries`, [`ADD_CHUNK`] at a time; `check` skips ids that are
    /// waiting or claimed. Returns how many it added.
    async fn add_entries(
        &self,
        entries: &[(String, i64)],
        check: bool,
    ) -> redis::RedisResult<usize> {
        let mut added = 0;
        for chunk in entries.chunks(ADD_CHUNK) {
            let mut call = self.add.key(&self.waiting_key);
            call.key(&self.leases_key)
                .key(&self.returned_key)
                .key(&self.count_key)
                .key(&self.crowded_key)
                .arg(&self.segment_prefix)
                .arg(if check { "1" } else { "0" })
                .arg(SEGMENT_US)
                .arg(CROWDED)
                .arg(FAN_OUT);
            for (id, due) in chunk {
                call.arg(*due).arg(id);
            }
            let n: usize = call.invoke_async(&mut self.conn.clone()).await?;
            added += n;
        }
        if added > 0 {
            self.added.notify_one();
        }
        Ok(added)
    }

    /// Acknowledges `ids`: out of the claims holding them and out of the returned segments,
    /// atomically. Had a lease run out meanwhile, the entry went back to waiting as part of its
    /// returned segment, and it needs no second round either.
    async fn remove(&self, ids: &[&str]) -> Result<(), SchedulerError> {
        let _: i64 = self
            .ack
            .key(&self.leases_key)
            .key(&self.returned_key)
            .key(&self.count_key)
            .key(&self.waiting_key)
            .arg(ids)
            .invoke_async(&mut self.conn.clone())
            .await
            .map_err(SchedulerError::redis("acknowledge delivered notifications"))?;
        Ok(())
    }

    /// Runs the claim script and reads the new claim's first parts in one round trip (the members
    /// leave Redis as plain replies, not through Lua, which costs more than the claim itself
    /// for 2,000 of them), and any further parts in a second. After a Redis restart the script
    /// is loaded again and the pipeline resent.
    async fn claim_and_read(
        &self,
        now_us: i64,
        max: usize,
        deadline_us: i64,
    ) -> redis::RedisResult<Vec<String>> {
        let part_prefix = format!("{}{}:", self.part_prefix, uuid::Uuid::new_v4().simple());
        let mut invocation = self.claim.key(&self.waiting_key);
        invocation
            .key(&self.leases_key)
            .key(&self.returned_key)
            .arg(now_us)
            .arg(max)
            .arg(deadline_us)
            .arg(&part_prefix)
            .arg(PARTS)
            .arg(SMALL);
        let read = |parts: std::ops::Range<usize>, pipe: &mut redis::Pipeline| {
            for n in parts {
                pipe.cmd("ZRANGE")
                    .arg(format!("{part_prefix}{n}"))
                    .arg(0)
                    .arg(-1);
            }
        };
        let mut pipe = redis::pipe();
        pipe.invoke_script(&invocation);
        read(0..PARTS_READ_AT_ONCE, &mut pipe);
        let mut conn = self.conn.clone();
        let (count, first): (usize, Vec<Vec<String>>) = {
            let mut replies: Vec<redis::Value> = match pipe.query_async(&mut conn).await {
                Err(e)
                    if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                {
                    invocation.load_async(&mut conn).await?;
                    pipe.query_async(&mut conn).await
                }
                result => result,
            }?;
            let rest = replies.split_off(1.min(replies.len()));
            let count = match replies.pop() {
                Some(v) => redis::from_redis_value(v)?,
                None => 0,
            };
            (count, redis::from_redis_value(redis::Value::Array(rest))?)
        };
        let mut ids = first.concat();
        if count > PARTS_READ_AT_ONCE {
            let mut pipe = redis::pipe();
            read(PARTS_READ_AT_ONCE..count, &mut pipe);
            let rest: Vec<Vec<String>> = pipe.query_async(&mut conn).await?;
            ids.extend(rest.into_iter().flatten());
        }
        Ok(ids)
    }

    /// The earliest due time or lease deadline, if anything is waiting.
    async fn next_at(&self) -> Result<Option<i64>, SchedulerError> {
        let mut pipe = redis::pipe();
        pipe.cmd("ZRANGE")
            .arg(&self.waiting_key)
            .arg(0)
            .arg(0)
            .arg("WITHSCORES")
            .cmd("ZRANGE")
            .arg(&self.leases_key)
            .arg(0)
            .arg(0)
            .arg("WITHSCORES");
        let (due, leases): (Scored, Scored) = pipe
            .query_async(&mut self.conn.clone())
            .await
            .map_err(SchedulerError::redis("read the next due time"))?;
        #[allow(clippy::cast_possible_truncation)]
        Ok(due.into_iter().chain(leases).map(|(_, s)| s as i64).min())
    }
}

#[async_trait::async_trait]
impl Scheduler for RedisScheduler {
    async fn backlog(&self) -> Result<u64, SchedulerError> {
        RedisScheduler::backlog(self).await
    }

    async fn add_missing(&self, entries: &[(String, i64)]) -> Result<usize, SchedulerError> {
        self.add_entries(entries, true)
            .await
            .map_err(SchedulerError::redis("restore scheduled notifications"))
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
