//! Appending to the event log on Redis: appends gather into batches, and each batch is one
//! round trip (see the parent module's docs).

use std::time::Duration;

use ecoscan_redis::{
    Conn,
    redis::{self, RedisError, Script},
};

use crate::error::StoreError;

/// Appends a batch of the events that need checks in Redis — final events; the others go
/// unscripted ([`send_piped`]) — each to its job's stream, and publishes those the streams took together on one feed channel, in
/// one step. Each caller numbered its event and gave it its stream id
/// (`<T + epoch>-<seq>`): `XADD` refuses an id that is not past the stream's last one, so a
/// writer whose view of a log is stale (another wrote meanwhile) is refused instead of forking
/// the log, and its event is not published; and so is a writer that lost the job, since the
/// newer claim moved the stream's last id to its own, higher epoch ([`super::scripts::RAISE_FENCE`]). An
/// ordinary event is so one `XADD` and nothing else; the caller of a refused one reads the
/// fence to learn which of the two it was. A final event (its writer's epoch given) is checked
/// against the job's `fence` first (a fenced writer must not learn that the job is finished)
/// and appended only when its job has none yet (the `finished` key marks it). The appended
/// events are published as one message of `<length>:<message>` items. Returns per event: 1
/// appended, 0 the job's final event was there already, -1 refused by the stream, -2 fenced
/// (final events only), -3 `XADD` failed otherwise.
/// KEYS: per event its stream, and for a final event also its `finished` and `fence` keys;
/// then the channel to publish on. ARGV: max len, publish command, then per event: id,
/// message, and `''` or (final event) the writer's epoch.
/// Each message crosses the network once: the published batch is built here, not sent twice.
/// Called by its SHA (`EVALSHA`; loaded again after a `NOSCRIPT` from a restarted Redis), so
/// Redis neither receives nor hashes the body on every call. Per event it reads as little as
/// it can (three arguments, one key): the script's own work is most of an append's cost.
const APPEND_BATCH: &str = r"
local out, published, k, key = {}, {}, 0, 1
local maxlen = ARGV[1]
for i = 1, (#ARGV - 2) / 3 do
  local a = 3 * i
  local events, msg, epoch = KEYS[key], ARGV[a + 1], ARGV[a + 2]
  key = key + 1
  local r, finished = 1, nil
  if epoch ~= '' then
    finished = KEYS[key]
    local fence = KEYS[key + 1]
    key = key + 2
    if tonumber(epoch) < tonumber(redis.call('GET', fence) or '0') then
      r = -2
    elseif redis.call('EXISTS', finished) == 1 then
      r = 0
    end
  end
  if r == 1 then
    local added = redis.pcall('XADD', events, 'MAXLEN', '~', maxlen, ARGV[a], 'ev', msg)
    if type(added) == 'table' and added.err then
      if string.find(added.err, 'equal or smaller', 1, true) then r = -1 else r = -3 end
    else
      if finished then redis.call('SET', finished, '1') end
      published[k + 1] = #msg
      published[k + 2] = ':'
      published[k + 3] = msg
      k = k + 3
    end
  end
  out[i] = r
end
if k > 0 then redis.call(ARGV[2], KEYS[#KEYS], table.concat(published)) end
return out
";

/// [`APPEND_BATCH`], with its SHA computed once.
static APPEND_SCRIPT: std::sync::LazyLock<Script> =
    std::sync::LazyLock::new(|| Script::new(APPEND_BATCH));

/// Events in one batch at most.
pub(super) const MAX_BATCH: usize = 256;

/// One event waiting for its batch.
pub(super) struct PendingAppend {
    /// Which batch it may join: on a Cluster its shard (one slot per script call), else any.
    pub(super) group: u32,
    pub(super) events_key: String,
    pub(super) finished_key: String,
    pub(super) fence_key: String,
    pub(super) channel: String,
    pub(super) id: String,
    pub(super) message: Vec<u8>,
    pub(super) is_final: bool,
    pub(super) epoch: u64,
    pub(super) reply: tokio::sync::oneshot::Sender<Result<i64, StoreError>>,
}

impl PendingAppend {
    /// Whether it goes in the pipeline of [`send_piped`] rather than the script: every event
    /// but a final one, which needs the script's checks (the fence, the one final event).
    fn piped(&self) -> bool {
        !self.is_final
    }
}

/// Gathers appends into batches and sends each in one round trip; see [`send_batch`].
pub(super) async fn run_batches(
    conn: Conn,
    publish: &'static str,
    max_len: usize,
    linger: Duration,
    mut rx: tokio::sync::mpsc::Receiver<PendingAppend>,
) {
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while let Some(first) = rx.recv().await {
        batch.push(first);
        let until = tokio::time::Instant::now() + linger;
        while batch.len() < MAX_BATCH {
            match tokio::time::timeout_at(until, rx.recv()).await {
                Ok(Some(p)) => batch.push(p),
                Ok(None) | Err(_) => break,
            }
        }
        let mut groups: std::collections::HashMap<u32, Vec<PendingAppend>> =
            std::collections::HashMap::new();
        for p in batch.drain(..) {
            groups.entry(p.group).or_default().push(p);
        }
        // Sent without waiting: a job has one append in flight at a time, so batches may
        // overtake each other.
        for (_, group) in groups {
            tokio::spawn(send_batch(conn.clone(), publish, max_len, group));
        }
    }
}

async fn send_batch(conn: Conn, publish: &'static str, max_len: usize, batch: Vec<PendingAppend>) {
    let (scripted, piped): (Vec<_>, Vec<_>) = batch.into_iter().partition(|p| !p.piped());
    tokio::join!(
        send_scripted(conn.clone(), publish, max_len, scripted),
        send_piped(conn, publish, max_len, piped),
    );
}

/// Final events: one [`APPEND_BATCH`] call, which publishes only what
/// the streams took.
async fn send_scripted(
    mut conn: Conn,
    publish: &'static str,
    max_len: usize,
    batch: Vec<PendingAppend>,
) {
    if batch.is_empty() {
        return;
    }
    let mut call = APPEND_SCRIPT.prepare_invoke();
    for p in &batch {
        call.key(&p.events_key);
        if p.is_final {
            call.key(&p.finished_key).key(&p.fence_key);
        }
    }
    call.key(&batch[0].channel).arg(max_len).arg(publish);
    for p in &batch {
        call.arg(&p.id).arg(p.message.as_slice());
        if p.is_final {
            call.arg(p.epoch);
        } else {
            call.arg("");
        }
    }
    let results = call.invoke_async::<Vec<i64>>(&mut conn).await;
    reply(batch, results.map(|rs| rs.into_iter().map(Ok).collect()));
}

/// Every other event (all of a job's but its last): one pipeline
/// of an `XADD` per event, then one `PUBLISH` of the events the streams took, with no script.
/// A script costs Redis more than the commands it runs (its arguments become Lua strings,
/// each call from Lua is converted twice), about half of an event's Redis time when every
/// event went through one. The publish waits for the `XADD` answers, so an event any
/// `XADD` refused — a stale claim's id, and equally `OOM` under `maxmemory`, `WRONGTYPE`,
/// `READONLY`, a Cluster redirect out of retries — never reaches a hub: no watcher can be
/// given an event the log does not hold, nor then drop as a duplicate the real event that
/// later takes its seq. It costs a second round trip per batch, not Redis time (the same two
/// commands). The callers are answered only once the publish is sent and answered, so the
/// next event of a job (a job has one append in flight) is published after this one.
async fn send_piped(
    mut conn: Conn,
    publish: &'static str,
    max_len: usize,
    batch: Vec<PendingAppend>,
) {
    if batch.is_empty() {
        return;
    }
    let mut pipe = redis::pipe();
    pipe.ignore_errors();
    for p in &batch {
        pipe.cmd("XADD")
            .arg(&p.events_key)
            .arg("MAXLEN")
            .arg("~")
            .arg(max_len)
            .arg(&p.id)
            .arg("ev")
            .arg(p.message.as_slice());
    }
    let results = pipe
        .query_async::<Vec<redis::RedisResult<redis::Value>>>(&mut conn)
        .await;
    // The same answers as the script's for its ordinary events: 1 appended, -1 refused.
    let results: Result<Vec<Result<i64, StoreError>>, RedisError> = results.map(|rs| {
        rs.into_iter()
            .zip(&batch)
            .map(|(r, p)| match r {
                Ok(_) => Ok(1),
                Err(e) if e.to_string().contains("equal or smaller") => Ok(-1),
                Err(e) => Err(StoreError::Unavailable(format!(
                    "Redis refused to append event {} to {}: {e}",
                    p.id, p.events_key
                ))),
            })
            .collect()
    });
    if let Ok(results) = &results {
        let taken: Vec<&[u8]> = batch
            .iter()
            .zip(results)
            .filter(|(_, r)| matches!(r, Ok(1)))
            .map(|(p, _)| p.message.as_slice())
            .collect();
        if !taken.is_empty() {
            publish_taken(&mut conn, publish, &batch[0].channel, &taken).await;
        }
    }
    reply(batch, results);
}

/// Publishes events the streams took, as one message of `<length>:<message>` items (the
/// format of [`APPEND_BATCH`]'s publish: hubs take them as the log's). A publish that fails
/// loses nothing: the events are in the log, and watchers read it at the next gap in `seq`
/// (or after their quiet spell).
async fn publish_taken(conn: &mut Conn, publish: &str, channel: &str, taken: &[&[u8]]) {
    let mut feed = Vec::with_capacity(taken.iter().map(|m| m.len() + 8).sum());
    for message in taken {
        feed.extend_from_slice(format!("{}:", message.len()).as_bytes());
        feed.extend_from_slice(message);
    }
    if let Err(e) = redis::cmd(publish)
        .arg(channel)
        .arg(feed)
        .query_async::<()>(conn)
        .await
    {
        tracing::warn!(error = %e, channel, "failed to publish appended events; watchers catch up from the log");
    }
}

/// Answers each append of `batch`: with its own result, or every one with the call's error.
fn reply(batch: Vec<PendingAppend>, results: Result<Vec<Result<i64, StoreError>>, RedisError>) {
    match results {
        Ok(results) => {
            for (p, r) in batch.into_iter().zip(results) {
                let _ = p.reply.send(r);
            }
        }
        Err(e) => {
            for p in batch {
                let _ = p.reply.send(Err(e.clone().into()));
            }
        }
    }
}
