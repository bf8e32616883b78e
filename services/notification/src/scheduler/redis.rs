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

use super::{Scheduler, SchedulerError};

/// Due time covered by one waiting segment: a second. Finer means more keys and more parts per
/// claim; coarser, that the segment of the current second (copied, not renamed, because only
/// part of it is due) is larger.
const SEGMENT_US: i64 = 1_000_000;

/// Most parts in one claim: bounds what an acknowledgement looks through.
const PARTS: usize = 24;

/// Parts read in the claim's own round trip (one `ZRANGE` each, an absent part empty); a claim
/// with more has the rest read in a second. A claim of a few due members, what a delivery loop
/// keeping up makes over and over, has one part: reading all [`PARTS`] every time cost
/// `notification-delivery` about 0.2 ms of p50.
const PARTS_READ_AT_ONCE: usize = 4;

/// Segments with fewer members are copied into the claim rather than renamed into a part of
/// their own, so a sparse schedule does not spend the claim's parts on one or two members each.
const SMALL: usize = 32;

/// Segments of one second hold at most about this many members before the second is *crowded*:
/// later adds for it spread over more segments (see [`ADD_SCRIPT`]), so that a second every
/// notification of a campaign shares is still claimed by renaming, not member by member.
const CROWDED: usize = 1024;

/// Segments a crowded second's first extra level has; each further level has four times more.
const FAN_OUT: usize = 16;

/// Adds each member of ARGV to a segment of its second of due time, lists a new segment in the
/// waiting index (KEYS[1]) or lowers its score, and counts what it added (KEYS[4]). KEYS[2] = the
/// live parts, KEYS[3] = the returned segments, KEYS[5] = the crowded seconds (second → levels).
/// ARGV[1] = the segment key prefix, ARGV[2] = 1 to skip ids that are waiting or claimed, ARGV[3]
/// = the width of a second in µs, ARGV[4] = [`CROWDED`], ARGV[5] = [`FAN_OUT`], then pairs: due
/// time, id. Returns how many it added.
///
/// A second's members go to its segment `<second>` until that holds [`CROWDED`]; the second then
/// has a level 1 of [`FAN_OUT`] segments `<second>:1:<h>`, `h` from a hash of the id, until one
/// of those fills, then a level 2 four times wider, and so on (`HINCRBY` of the second's field in
/// KEYS[5]; a field is left behind once the second is delivered, a few bytes per crowded second).
/// So an id is found again by looking at one segment per level of its second: the check looks
/// there (due times do not change), then in every live part and returned segment for the ids not
/// found, one `ZMSCORE` each. One script, so a claim cannot move a member between the check and
/// the add, and two replicas restoring the same entries add each once.
const ADD_SCRIPT: &str = r"
local W, L, R, C, X = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local seg_prefix, check = ARGV[1], ARGV[2] == '1'
local width, crowded, fan = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local levels = {}
local function second(due)
  return string.format('%.0f', math.floor(tonumber(due) / width))
end
local function levels_of(sec)
  if levels[sec] == nil then
    levels[sec] = tonumber(redis.call('HGET', X, sec) or '0')
  end
  return levels[sec]
end
local function segment(sec, level, id)
  if level == 0 then return seg_prefix .. sec end
  local h = tonumber(string.sub(redis.sha1hex(id), 1, 8), 16) % (fan * 4 ^ (level - 1))
  return seg_prefix .. sec .. ':' .. level .. ':' .. string.format('%.0f', h)
end
local function waiting(sec, id)
  for level = 0, levels_of(sec) do
    if redis.call('ZSCORE', segment(sec, level, id), id) then return true end
  end
  return false
end
local todo = {}
for i = 6, #ARGV, 2 do
  if not (check and waiting(second(ARGV[i]), ARGV[i + 1])) then
    todo[#todo + 1] = i
  end
end
if check and #todo > 0 then
  local held = {}
  for _, list in ipairs({L, R}) do
    for _, seg in ipairs(redis.call('ZRANGE', list, 0, -1)) do
      local ids = {}
      for _, i in ipairs(todo) do
        if not held[i] then ids[#ids + 1] = ARGV[i + 1] end
      end
      if #ids == 0 then break end
      local scores = redis.call('ZMSCORE', seg, unpack(ids))
      local k = 0
      for _, i in ipairs(todo) do
        if not held[i] then
          k = k + 1
          if scores[k] then held[i] = true end
        end
      end
    end
  end
  local left = {}
  for _, i in ipairs(todo) do
    if not held[i] then left[#left + 1] = i end
  end
  todo = left
end
local added = 0
for _, i in ipairs(todo) do
  local due, id = ARGV[i], ARGV[i + 1]
  local sec = second(due)
  local level = levels_of(sec)
  local seg = segment(sec, level, id)
  if redis.call('ZADD', seg, 'NX', due, id) == 1 then
    added = added + 1
    redis.call('ZADD', W, 'LT', due, seg)
    if redis.call('ZCARD', seg) >= crowded then
      levels[sec] = redis.call('HINCRBY', X, sec, 1)
    end
  end
end
if added > 0 then
  redis.call('INCRBY', C, added)
end
return added
";

/// Claims up to ARGV[2] members due at ARGV[1] under the lease deadline ARGV[3], into parts named
/// ARGV[4] followed by 0, 1, … (at most ARGV[5] of them); segments with fewer than ARGV[6]
/// members are copied rather than renamed. First, parts whose lease ran out (KEYS[2]) go back
/// to the waiting index (KEYS[1]) and the returned segments (KEYS[3]). Returns how many parts the
/// claim has; the caller reads them in the same round trip.
///
/// A segment whose members are all due and that fits is renamed into a part: no member is
/// touched. Otherwise its due members are copied: into a new part by `ZRANGESTORE` (one command)
/// when the claim has no copy part yet, through this script into the copy part after that, then
/// removed from the segment by rank (`ZREMRANGEBYRANK 0 n-1`: a range from `-inf` is the lowest
/// ranks, and the script runs atomically). A segment left with members is scored by its new
/// earliest one, so the index always says when something is next due.
const CLAIM_SCRIPT: &str = r"
local W, L, R = KEYS[1], KEYS[2], KEYS[3]
local now_arg, left, deadline, part_prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local now, parts_max, small = tonumber(now_arg), tonumber(ARGV[5]), tonumber(ARGV[6])
local slice, page_size = 500, 32

for _, seg in ipairs(redis.call('ZRANGE', L, '-inf', now_arg, 'BYSCORE', 'LIMIT', 0, 4 * parts_max)) do
  redis.call('ZREM', L, seg)
  local first = redis.call('ZRANGE', seg, 0, 0, 'WITHSCORES')
  if first[1] then
    redis.call('ZADD', W, first[2], seg)
    redis.call('ZADD', R, 0, seg)
  end
end

local parts, copy = 0, nil
local function new_part()
  local key = part_prefix .. parts
  parts = parts + 1
  redis.call('ZADD', L, deadline, key)
  return key
end
local function forget(seg)
  redis.call('ZREM', W, seg)
  redis.call('ZREM', R, seg)
end

-- A page of segments at a time: the claim usually ends within the first few, and each one
-- fetched is a string into Lua. Every segment looked at leaves the due range (renamed, emptied,
-- or scored by a member not yet due) unless the claim is full, so the next page starts at 0.
-- The page count is capped all the same: a script that never ends would stop Redis.
local done, pages = false, 0
while left > 0 and not done and pages < 1000 do
  pages = pages + 1
  local page = redis.call('ZRANGE', W, '-inf', now_arg, 'BYSCORE', 'LIMIT', 0, page_size)
  done = #page < page_size
  for _, seg in ipairs(page) do
    if left <= 0 then break end
    local n = redis.call('ZCARD', seg)
    local whole = n >= small and n <= left and parts < parts_max - 1
      and tonumber(redis.call('ZRANGE', seg, -1, -1, 'WITHSCORES')[2]) <= now
    if n == 0 then
      forget(seg)
    elseif whole then
      redis.call('RENAME', seg, new_part())
      forget(seg)
      left = left - n
    elseif copy == nil and parts < parts_max then
      copy = new_part()
      local k = redis.call('ZRANGESTORE', copy, seg, '-inf', now_arg, 'BYSCORE', 'LIMIT', 0, left)
      if k > 0 then
        redis.call('ZREMRANGEBYRANK', seg, 0, k - 1)
        left = left - k
      end
    elseif copy ~= nil then
      local members = redis.call('ZRANGE', seg, '-inf', now_arg, 'BYSCORE', 'LIMIT', 0, left, 'WITHSCORES')
      local k = #members / 2
      for i = 1, #members, 2 * slice do
        local add = {}
        for j = i, math.min(i + 2 * slice - 1, #members), 2 do
          add[#add + 1] = members[j + 1]
          add[#add + 1] = members[j]
        end
        redis.call('ZADD', copy, unpack(add))
      end
      if k > 0 then
        redis.call('ZREMRANGEBYRANK', seg, 0, k - 1)
        left = left - k
      end
    else
      done = true
      break
    end
    if n > 0 and not whole then
      local first = redis.call('ZRANGE', seg, 0, 0, 'WITHSCORES')
      if first[1] then
        redis.call('ZADD', W, 'XX', first[2], seg)
      else
        forget(seg)
      end
    end
  end
end
if copy ~= nil and redis.call('EXISTS', copy) == 0 then
  redis.call('ZREM', L, copy)
end
return parts
";

/// Acknowledges the ids in ARGV: out of the live parts that hold them (KEYS[1], oldest first,
/// stopping once every id is found), then out of the returned segments (KEYS[2]: a lease that ran
/// out put them back), and out of the count (KEYS[3]). An emptied part or segment is dropped from
/// its list (and from the waiting index, KEYS[4]).
const ACK_SCRIPT: &str = r"
local L, R, C, W = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local slice = 500
local left = #ARGV
local removed = 0
for _, list in ipairs({L, R}) do
  for _, seg in ipairs(redis.call('ZRANGE', list, 0, -1)) do
    if left <= 0 then break end
    for i = 1, #ARGV, slice do
      local n = redis.call('ZREM', seg, unpack(ARGV, i, math.min(i + slice - 1, #ARGV)))
      left = left - n
      removed = removed + n
    end
    if redis.call('EXISTS', seg) == 0 then
      redis.call('ZREM', list, seg)
      if list == R then redis.call('ZREM', W, seg) end
    end
  end
end
if removed > 0 then
  redis.call('DECRBY', C, removed)
end
return removed
";

/// Removes every segment, part and list of this scheduler, and the count (benchmarks and tools
/// cleaning up; `UNLINK`, so a million members are freed off Redis's main thread).
const REMOVE_ALL_SCRIPT: &str = r"
for _, list in ipairs({KEYS[1], KEYS[2]}) do
  local keys = redis.call('ZRANGE', list, 0, -1)
  for i = 1, #keys, 500 do
    redis.call('UNLINK', unpack(keys, i, math.min(i + 499, #keys)))
  end
end
return redis.call('UNLINK', unpack(KEYS))
";

/// Members per add script call when many are added at once.
const ADD_CHUNK: usize = 1000;

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
