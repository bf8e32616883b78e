//! The Lua scripts of the Redis stores but the batch append's (in `append.rs`, beside its
//! one use): a claim's fence, an operator's restart of a log, and the dispatch queue's lease
//! checks. Each runs atomically on the one slot its keys share.

use ecoscan_redis::redis::Script;

use crate::store::events::RUN_SPAN;

/// Raises a job's fence (KEYS[1]) to the epoch ARGV[1] unless a newer claim raised it
/// further, and moves the last id of the job's stream (KEYS[2]) to `<ARGV[2]>-<last seq>`,
/// ARGV[2] being `T + epoch`: the stream then refuses every id an older claim's writer would
/// give its next event (their millisecond part is lower), so an append need not read the
/// fence. Then it publishes the fence marker ARGV[4] on the feed channel KEYS[3] with the
/// command ARGV[3] (writers of an earlier release published an older claim's events beside
/// their `XADD`s, and the marker, ahead of any of them the stream refused, tells the hubs to
/// drop those). Returns the seq the log's numbering stands at, so that the new writer knows
/// where to go on without a second round trip; `-1` when fenced (a newer claim exists, or a
/// writer of a newer epoch appended already).
///
/// A job without a stream — Redis lost it (a restart without persistence, `FLUSHALL`, a
/// failover that had not caught up), or it expired — gets an empty one whose numbering starts
/// a **new run** at ARGV[5] = `epoch × RUN_SPAN` ([`run_base`]), above every seq an earlier
/// claim can have given (each run has far fewer than [`RUN_SPAN`] events): a watcher that saw
/// the lost events sees the new run's as a gap, reads the log and gets them, where numbering
/// from 1 would make it drop them as seen. An empty stream that exists is such a new run
/// nobody appended to yet: its numbering (the stream's last-generated id) goes on.
pub(super) const RAISE_FENCE: &str = r"
if tonumber(ARGV[1]) < tonumber(redis.call('GET', KEYS[1]) or '0') then return -1 end
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local id
if #last > 0 then
  id = last[1][1]
elseif redis.call('EXISTS', KEYS[2]) == 1 then
  local info = redis.call('XINFO', 'STREAM', KEYS[2])
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then id = info[i + 1] end
  end
else
  redis.call('XADD', KEYS[2], 'MAXLEN', 0, ARGV[2] .. '-' .. ARGV[5], 'ev', '')
  id = ARGV[2] .. '-' .. ARGV[5]
end
local ms, n = string.match(id, '^(%d+)-(%d+)$')
if tonumber(ms) > tonumber(ARGV[2]) then return -1 end
redis.call('XSETID', KEYS[2], ARGV[2] .. '-' .. n)
redis.call('SET', KEYS[1], ARGV[1])
redis.call(ARGV[3], KEYS[3], ARGV[4])
return tonumber(n)
";

/// Where the numbering of a log that claim `epoch` found gone starts.
pub(super) fn run_base(epoch: u64) -> u64 {
    epoch.saturating_mul(RUN_SPAN)
}

/// [`RAISE_FENCE`], with its SHA computed once.
pub(super) static FENCE_SCRIPT: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(RAISE_FENCE));

/// Starts a job's log again (an operator requeued it): empties the stream (it keeps its last
/// id, so ids go on increasing), forgets the final event, appends ARGV[2] with id ARGV[1] and
/// publishes it. KEYS: stream, `finished` key, channel. ARGV: id, message, publish command.
pub(super) const RESTART_LOG: &str = r"
redis.call('XTRIM', KEYS[1], 'MAXLEN', 0)
redis.call('DEL', KEYS[2])
redis.call('PERSIST', KEYS[1])
redis.call('XADD', KEYS[1], ARGV[1], 'ev', ARGV[2])
redis.call(ARGV[3], KEYS[3], #ARGV[2] .. ':' .. ARGV[2])
return 1
";

/// Extends leases: for each (id, delivery count, late-after ms) triple in ARGV after the group
/// and consumer, resets the entry's idle time with `XCLAIM … JUSTID` (which leaves the
/// delivery count alone), only while the same consumer holds the same delivery of it and the
/// entry has been idle no longer than late-after: an entry idle longer met a renewal that
/// arrived after its sender had given up on it (a connection abandoned on a timeout, its bytes
/// delivered when the network healed), which must not renew a lease its holder may have let go.
/// Returns 1 or 0 each.
pub(super) const EXTEND_MANY: &str = r"
local out = {}
for i = 3, #ARGV, 3 do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] and tonumber(p[1][4]) == tonumber(ARGV[i + 1])
    and tonumber(p[1][3]) <= tonumber(ARGV[i + 2]) then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
";

/// [`EXTEND_MANY`], with its SHA computed once.
pub(super) static EXTEND_MANY_SCRIPT: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(EXTEND_MANY));

/// Acknowledges and deletes the entry ARGV[3] only while the consumer ARGV[2] holds delivery
/// ARGV[4] of it (in the group ARGV[1]): a lease's own entry, not one claimed again since.
/// Returns 1 when it did, else 0.
pub(super) const ACK_HELD: &str = r"
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 1 and p[1][2] == ARGV[2] and tonumber(p[1][4]) == tonumber(ARGV[4]) then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
  redis.call('XDEL', KEYS[1], ARGV[3])
  return 1
end
return 0
";

/// [`ACK_HELD`], with its SHA computed once.
pub(super) static ACK_HELD_SCRIPT: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(ACK_HELD));

/// Removes the group's consumers (but ARGV[2], the caller) that hold nothing and have been
/// idle for ARGV[3] ms: processes that are gone. Atomic, so a consumer cannot claim an entry
/// between the check and its removal (removing a consumer drops its pending entries).
pub(super) const FORGET_IDLE: &str = r"
local removed = 0
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if f['name'] ~= ARGV[2] and tonumber(f['pending']) == 0 and tonumber(f['idle']) >= tonumber(ARGV[3]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
    removed = removed + 1
  end
end
return removed
";

/// [`FORGET_IDLE`], with its SHA computed once.
pub(super) static FORGET_IDLE_SCRIPT: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(FORGET_IDLE));

/// Reserves KEYS[1] (a job's re-enqueue) for holder ARGV[1], for ARGV[2] ms: 1 when it was
/// free or the holder's own (its hold renewed), 0 when another holds it.
pub(super) const RESERVE_REQUEUE: &str = r"
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
";

/// [`RESERVE_REQUEUE`], with its SHA computed once.
pub(super) static RESERVE_REQUEUE_SCRIPT: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(RESERVE_REQUEUE));
