//! The event log on a Redis that misbehaves, as a watcher sees it: Redis refusing an append
//! (`OOM` under `maxmemory`, `WRONGTYPE`), Redis losing the log mid-job (`FLUSHALL`), a job
//! with more events than a small trim window, and a Cluster slot moving under a job's feed.
//! Each runs on a private `redis-server` (or three-master Cluster) of its own, never the
//! shared one, with a hub and a watcher as ingest runs them.

mod support;

use std::{pin::Pin, sync::Arc, time::Duration};

use ecoscan_common::CancellationToken;
use ecoscan_ingest::{
    Config, Stores,
    event::Watched,
    hub::{Hub, HubConfig},
    pending::Lookup,
    store::{
        EventId, EventLog, Job, JobStore, LocalObjectStore, MemoryQueue, RUN_SPAN, RedisEventLog,
        SqliteJobStore,
        redis::{DEFAULT_FEED_SHARDS, shard_of},
    },
};
use ecoscan_proto::v1::{EventStatus, ScanEvent, Stage};
use ecoscan_redis::{
    Redis, redis,
    testing::{PrivateCluster, PrivateRedis},
};
use futures::{Stream, StreamExt as _};
use support::{eventually, new_job};
use tonic::Status;

type Watch = Pin<Box<dyn Stream<Item = Result<Watched, Status>> + Send>>;

/// A hub over a Redis log and SQLite rows, with one job; the test's writers append to its log.
struct Setup {
    server: PrivateRedis,
    redis: Redis,
    hub: Hub,
    jobs: Arc<dyn JobStore>,
    job: Job,
    shutdown: CancellationToken,
    _dir: tempfile::TempDir,
}

/// One feed shard, so a test knows the job's keys.
fn log_on(redis: &Redis) -> RedisEventLog {
    RedisEventLog::with_settings(
        redis,
        &ecoscan_ingest::store::redis::EventLogSettings {
            prefix: "t:".into(),
            max_len: 1000,
            shards: 1,
            ..Default::default()
        },
    )
}

impl Setup {
    async fn start() -> Self {
        let server = PrivateRedis::start().await;
        let redis = Redis::connect(&server.settings(), "test-hub")
            .await
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let jobs: Arc<dyn JobStore> = Arc::new(SqliteJobStore::open_in(dir.path()).await.unwrap());
        let (job, _) = jobs.insert(new_job("images/ab/abcdef")).await.unwrap();
        let stores = Stores {
            jobs: jobs.clone(),
            events: Arc::new(log_on(&redis)),
            queue: Arc::new(MemoryQueue::new()),
            objects: Arc::new(LocalObjectStore::open(dir.path()).await.unwrap()),
        };
        let shutdown = CancellationToken::new();
        // No quiet-spell reads of the log: what a watcher gets here, it gets from the feed or
        // from the reads a gap or a resync makes.
        let config = HubConfig {
            idle_check: Duration::from_secs(600),
            ..HubConfig::default()
        };
        let hub = Hub::start(stores, config, shutdown.clone()).await.unwrap();
        Self {
            server,
            redis,
            hub,
            jobs,
            job,
            shutdown,
            _dir: dir,
        }
    }

    /// A writer in a process of its own (its own connections).
    async fn writer(&self, name: &str) -> RedisEventLog {
        let redis = Redis::connect(&self.server.settings(), name).await.unwrap();
        log_on(&redis)
    }

    /// A writer that appended the job's `queued` event, claimed it (epoch 1) and appended one
    /// vision event saying `message`: seqs 1 and 2.
    async fn claimed_writer(&self, name: &str, message: &str) -> RedisEventLog {
        let writer = self.writer(name).await;
        writer
            .append(self.ev(Stage::Queued, "queued"))
            .await
            .unwrap();
        writer.fence(&self.job.id, 1).await.unwrap();
        writer
            .append_as(self.ev(Stage::Vision, message), 1)
            .await
            .unwrap();
        writer
    }

    fn ev(&self, stage: Stage, message: &str) -> ScanEvent {
        ScanEvent {
            job_id: self.job.id.clone(),
            stage: stage as i32,
            status: EventStatus::Progress as i32,
            message: message.into(),
            ..Default::default()
        }
    }

    /// The job's row claimed (epoch 1, the claim [`Self::claimed_writer`] fenced the log for)
    /// and finished: the worker's `finish`, before it appends the final event.
    async fn finish_row(&self) -> Job {
        let claimed = self
            .jobs
            .claim(&self.job.id, Stage::Vision)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(claimed.lease_epoch, 1);
        self.jobs
            .finish(
                &self.job.id,
                1,
                ecoscan_proto::v1::JobStatus::Succeeded,
                None,
            )
            .await
            .unwrap()
            .expect("the row finishes")
    }

    /// Every event of the job's log, as (seq, stage), as a reader of the log gets them.
    async fn logged(&self) -> Vec<(u64, i32)> {
        let reader = self.writer("test-reader").await;
        reader
            .read_after(&self.job.id, None)
            .await
            .unwrap()
            .iter()
            .map(|ev| (ev.seq, ev.stage))
            .collect()
    }

    fn events_key(&self) -> String {
        format!("t:scan:{{s0}}:{}:events", self.job.id)
    }

    async fn command(&self, cmd: &mut redis::Cmd) {
        cmd.query_async::<()>(&mut self.redis.conn()).await.unwrap();
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// The watcher's next event; a `resync` announcement (a gap said, not skipped) is passed over:
/// these tests are about which events arrive.
async fn next(watch: &mut Watch) -> ScanEvent {
    loop {
        let item = tokio::time::timeout(Duration::from_secs(20), watch.next())
            .await
            .expect("the watcher gets the event within 20 s")
            .expect("the watch goes on")
            .expect("no error");
        if let Some(event) = item.into_event() {
            return event;
        }
    }
}

/// A writer's append that Redis refuses for a reason of its own (not a stale id) is not
/// published: the watcher never gets it, and gets the event that takes its seq afterwards.
async fn a_refused_event_never_reaches_a_watcher(
    refuse: impl AsyncFnOnce(&Setup),
    allow: impl AsyncFnOnce(&Setup),
) {
    let setup = Setup::start().await;
    let writer = setup.claimed_writer("test-worker", "first").await;
    let mut watch = setup.hub.watch(setup.job.clone(), None, None);
    assert_eq!(next(&mut watch).await.seq, 1);
    assert_eq!(next(&mut watch).await.seq, 2);

    refuse(&setup).await;
    let refused = writer
        .append_as(setup.ev(Stage::Vision, "refused"), 1)
        .await;
    assert!(refused.is_err(), "Redis refused the append: {refused:?}");
    allow(&setup).await;
    let taken = writer
        .append_as(setup.ev(Stage::Vision, "taken"), 1)
        .await
        .unwrap();
    assert_eq!(taken.seq, 3, "the refused event took no number");
    writer
        .append_final_as(setup.ev(Stage::Done, "done"), 1)
        .await
        .unwrap()
        .expect("the final event");

    let third = next(&mut watch).await;
    assert_eq!(
        (third.seq, third.message.as_str()),
        (3, "taken"),
        "the watcher gets the event the log holds, never the refused one"
    );
    let last = next(&mut watch).await;
    assert_eq!((last.seq, last.message.as_str()), (4, "done"));
}

#[tokio::test]
async fn an_event_redis_refused_under_maxmemory_never_reaches_a_watcher() {
    a_refused_event_never_reaches_a_watcher(
        // Every write is over the limit; `PUBLISH` is not a write and goes through.
        async |s| {
            s.command(redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(1))
                .await;
        },
        async |s| {
            s.command(redis::cmd("CONFIG").arg("SET").arg("maxmemory").arg(0))
                .await;
        },
    )
    .await;
}

#[tokio::test]
async fn an_event_redis_refused_as_the_wrong_type_never_reaches_a_watcher() {
    a_refused_event_never_reaches_a_watcher(
        // The job's stream key holds something else for a moment (an operator's slip).
        async |s| {
            s.command(redis::cmd("DEL").arg(s.events_key())).await;
            s.command(redis::cmd("SET").arg(s.events_key()).arg("not a stream"))
                .await;
        },
        async |s| s.command(redis::cmd("DEL").arg(s.events_key())).await,
    )
    .await;
}

/// Redis loses a running job's log (`FLUSHALL` here; a restart without persistence alike), and
/// the job is claimed again: the new claim's events are numbered past every seq the lost run
/// gave, so a watcher that saw the lost events gets the new ones (live, and on a resume from
/// its last id), where numbering from 1 would make it drop them as seen.
#[tokio::test]
async fn a_claim_after_redis_lost_the_log_does_not_silence_its_watchers() {
    let setup = Setup::start().await;
    let first = setup.writer("test-first-worker").await;
    first
        .append(setup.ev(Stage::Queued, "queued"))
        .await
        .unwrap();
    first.fence(&setup.job.id, 1).await.unwrap();
    for n in 0..4 {
        first
            .append_as(setup.ev(Stage::Vision, &format!("lost {n}")), 1)
            .await
            .unwrap();
    }
    let mut watch = setup.hub.watch(setup.job.clone(), None, None);
    let mut seen = None;
    for want in 1..=5 {
        let ev = next(&mut watch).await;
        assert_eq!(ev.seq, want);
        seen = Some(ev);
    }
    let seen: EventId = seen.unwrap().event_id.parse().unwrap();

    setup.command(&mut redis::cmd("FLUSHALL")).await;
    let second = setup.writer("test-second-worker").await;
    second.fence(&setup.job.id, 2).await.unwrap();
    let resumed = second
        .append_as(setup.ev(Stage::Vision, "second run"), 2)
        .await
        .unwrap();
    assert_eq!(resumed.seq, 2 * RUN_SPAN + 1, "a new run");

    let got = next(&mut watch).await;
    assert_eq!(
        (got.seq, got.message.as_str()),
        (resumed.seq, "second run"),
        "the live watcher gets the new run's event"
    );
    let mut again = setup.hub.watch(setup.job.clone(), Some(seen), None);
    let got = next(&mut again).await;
    assert_eq!(
        got.event_id, resumed.event_id,
        "a resume from the last id seen before the loss gets it too"
    );
    assert!(got.event_id.parse::<EventId>().unwrap() > seen);

    // A third claim of the new run goes on from its end, and a claim that finds the new run
    // still empty goes on from its base: never back to 1.
    let third = setup.writer("test-third-worker").await;
    third.fence(&setup.job.id, 3).await.unwrap();
    let next_event = third
        .append_as(setup.ev(Stage::Rule, "third"), 3)
        .await
        .unwrap();
    assert_eq!(next_event.seq, resumed.seq + 1);
    setup.command(&mut redis::cmd("FLUSHALL")).await;
    third.fence(&setup.job.id, 4).await.unwrap();
    third.fence(&setup.job.id, 5).await.unwrap();
    let after_empty = third
        .append_as(setup.ev(Stage::Rule, "fifth"), 5)
        .await
        .unwrap();
    assert_eq!(
        after_empty.seq,
        4 * RUN_SPAN + 1,
        "the empty run of claim 4 kept its numbering for claim 5"
    );
}

/// A claimed writer that does not know its job's log (not the process that raised the fence)
/// and finds it gone (Redis lost it since) numbers a new run, as a fence would, never from 1:
/// a watcher that saw the lost events would otherwise take the new ones for events it has.
#[tokio::test]
async fn a_claimed_writer_that_finds_the_log_gone_numbers_a_new_run() {
    let setup = Setup::start().await;
    setup.claimed_writer("test-first-worker", "lost").await;
    setup.command(&mut redis::cmd("FLUSHALL")).await;
    // Another process of the same claim's writer: it never fenced, so it knows no seq.
    let stranger = setup.writer("test-unfenced-writer").await;
    let ev = stranger
        .append_as(setup.ev(Stage::Vision, "after the loss"), 1)
        .await
        .unwrap();
    assert_eq!(ev.seq, RUN_SPAN + 1, "a new run above every lost seq");
}

/// A job's log keeps every event a resume from its start needs, with the default settings,
/// even for a job with many more events than any scan has (the old window of 2,048 dropped
/// the oldest, and a resume from them skipped events in silence).
#[tokio::test]
async fn a_jobs_log_keeps_every_event_with_the_default_settings() {
    let server = PrivateRedis::start().await;
    let redis = Redis::connect(&server.settings(), "test-long-job")
        .await
        .unwrap();
    let config = Config::default();
    let log = RedisEventLog::with_settings(
        &redis,
        &ecoscan_ingest::store::redis::EventLogSettings {
            prefix: "t:".into(),
            linger: Duration::ZERO,
            ..config.event_log()
        },
    );
    let job = uuid::Uuid::now_v7().to_string();
    let events = 5_000;
    log.fence(&job, 1).await.unwrap();
    let mut first = None;
    for n in 0..events {
        let ev = ScanEvent {
            job_id: job.clone(),
            stage: Stage::Answer as i32,
            status: EventStatus::Delta as i32,
            message: format!("{n}"),
            ..Default::default()
        };
        let stored = log.append_as(ev, 1).await.unwrap();
        first.get_or_insert(stored.seq);
    }
    let kept = log.read_after(&job, None).await.unwrap();
    assert_eq!(kept.len(), events, "every event is kept");
    assert_eq!(kept[0].seq, first.unwrap());
    assert_eq!(kept[0].message, "0");
}

/// On a Redis Cluster, the slot of a job's feed shard moves to another master while a watcher
/// follows the job (an operator resharding): the hub's subscription is dropped by the old
/// owner, subscribes again on the new one and resyncs, so the watcher gets every later event
/// live — without it, only its 10-minute quiet-spell read (set here) would find them.
#[tokio::test]
async fn a_watcher_follows_its_job_when_the_feeds_slot_moves() {
    let cluster = PrivateCluster::start().await;
    let redis = Redis::connect(&cluster.settings(), "test-hub")
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let jobs: Arc<dyn JobStore> = Arc::new(SqliteJobStore::open_in(dir.path()).await.unwrap());
    let (job, _) = jobs.insert(new_job("images/ab/abcdef")).await.unwrap();
    let log = Arc::new(RedisEventLog::open(&redis, "t:", 1000));
    let stores = Stores {
        jobs,
        events: log.clone(),
        queue: Arc::new(MemoryQueue::new()),
        objects: Arc::new(LocalObjectStore::open(dir.path()).await.unwrap()),
    };
    let shutdown = CancellationToken::new();
    let config = HubConfig {
        idle_check: Duration::from_secs(600),
        ..HubConfig::default()
    };
    let hub = Hub::start(stores, config, shutdown.clone()).await.unwrap();
    let ev = |message: &str| ScanEvent {
        job_id: job.id.clone(),
        stage: Stage::Vision as i32,
        status: EventStatus::Progress as i32,
        message: message.into(),
        ..Default::default()
    };
    log.append(ev("queued")).await.unwrap();
    log.fence(&job.id, 1).await.unwrap();
    let mut watch = hub.watch(job.clone(), None, None);
    assert_eq!(next(&mut watch).await.seq, 1);

    let shard = shard_of(&job.id, DEFAULT_FEED_SHARDS);
    let channel = format!("t:scan:{{s{shard}}}:feed");
    let (slot, from, to) = cluster.move_slot_of(&channel).await;
    assert_ne!(from, to, "slot {slot} moved");
    for n in 0..3 {
        log.append_as(ev(&format!("after the move {n}")), 1)
            .await
            .unwrap();
    }
    for want in 2..=4 {
        let got = next(&mut watch).await;
        assert_eq!(got.seq, want, "the watcher gets every event after the move");
    }
    shutdown.cancel();
}

/// Whether the hub keeps `id`'s row; a miss leaves no reservation to fill.
fn kept(hub: &Hub, id: &str) -> bool {
    match hub.pending().lookup(id) {
        Lookup::Hit(_) => true,
        Lookup::Miss(slot) => {
            if let Some(slot) = slot {
                hub.pending().fill(slot, None);
            }
            false
        }
    }
}

fn keep(hub: &Hub, job: &Job) {
    match hub.pending().lookup(&job.id) {
        Lookup::Miss(Some(slot)) => hub.pending().fill(slot, Some(job)),
        other => panic!("job {} could not be kept: {other:?}", job.id),
    }
    assert!(kept(hub, &job.id));
}

/// The rows `GetResult` keeps for running jobs go as the Redis feed brings an event of their
/// job, and all of them when the feed's connection is renewed (Pub/Sub dropped whatever was
/// published meanwhile, so any kept row may be old).
#[tokio::test]
async fn kept_rows_go_with_their_jobs_events_and_all_of_them_when_the_feed_reconnects() {
    let setup = Setup::start().await;
    let hub = &setup.hub;
    let other = Job {
        id: uuid::Uuid::now_v7().to_string(),
        ..setup.job.clone()
    };
    let writer = setup.writer("test-writer").await;
    // Once the feed has subscribed (its first subscription announces a resync, which forgets
    // every row), an event of the job drops its row.
    keep(hub, &setup.job);
    writer
        .append(setup.ev(Stage::Queued, "queued"))
        .await
        .unwrap();
    eventually(Duration::from_secs(30), "the feed subscribed", async || {
        !kept(hub, &setup.job.id)
    })
    .await;

    keep(hub, &setup.job);
    keep(hub, &other);
    writer
        .append(setup.ev(Stage::Vision, "started"))
        .await
        .unwrap();
    eventually(
        Duration::from_secs(30),
        "the job's event drops its row",
        async || !kept(hub, &setup.job.id),
    )
    .await;
    assert!(kept(hub, &other.id), "an event of another job leaves a row");

    keep(hub, &setup.job);
    setup
        .command(redis::cmd("CLIENT").arg("KILL").arg("TYPE").arg("pubsub"))
        .await;
    eventually(
        Duration::from_secs(30),
        "the renewed feed forgets every row",
        async || !kept(hub, &setup.job.id) && !kept(hub, &other.id),
    )
    .await;
    // Kept again, and dropped by the job's next event as before: the renewed feed carries it.
    keep(hub, &other);
    writer
        .append(ScanEvent {
            job_id: other.id.clone(),
            ..setup.ev(Stage::Queued, "queued")
        })
        .await
        .unwrap();
    eventually(
        Duration::from_secs(30),
        "the renewed feed drops a row",
        async || !kept(hub, &other.id),
    )
    .await;
}

/// The job finished (its row) and Redis lost its log before the worker appended the final
/// event (the worker's append failed: `WRONGTYPE`, a restart, a deleted key). A watcher that
/// finds the row finished without its end closes the log itself, as a claim would: the final
/// event goes in the log (a new run's numbering, which nobody could have foreseen), the row
/// records it, and every watcher — the one resuming and the one following live — ends with
/// that one event; the worker's late append, and a later claim's, add nothing. A watcher
/// that guessed the end's position instead stood it at its own last event's id, an id the log
/// had given another event.
#[tokio::test]
async fn a_watcher_closes_the_log_of_a_finished_job_whose_final_event_redis_lost() {
    let setup = Setup::start().await;
    let writer = setup.claimed_writer("test-worker", "first").await;
    let mut live = setup.hub.watch(setup.job.clone(), None, None);
    assert_eq!(next(&mut live).await.seq, 1);
    assert_eq!(next(&mut live).await.seq, 2);
    let row = setup.finish_row().await;
    setup
        .command(redis::cmd("DEL").arg(setup.events_key()))
        .await;

    let resumed_at = EventId::of(&setup.job.id, 2);
    let mut resumed = setup.hub.watch(row.clone(), Some(resumed_at), None);
    let end = next(&mut resumed).await;
    assert_eq!(end.stage, Stage::Done as i32);
    assert_eq!(end.seq, RUN_SPAN + 1, "the log lost: a new run's numbering");
    assert_eq!(
        setup.logged().await,
        vec![(end.seq, Stage::Done as i32)],
        "the end stands where the log holds it"
    );
    let live_end = next(&mut live).await;
    assert_eq!(
        live_end.event_id, end.event_id,
        "the live watcher ends with the same event"
    );
    let recorded = setup.jobs.get(&setup.job.id).await.unwrap().unwrap();
    assert_eq!(recorded.end_seq, Some(end.seq), "the row records it");

    // The worker's append, late, and a later claim's find the log closed.
    let late = writer
        .append_final_as(setup.ev(Stage::Done, "late"), 1)
        .await
        .unwrap();
    assert!(late.is_none(), "one final event: {late:?}");
    let claim = setup.writer("test-next-claim").await;
    claim.fence(&setup.job.id, 2).await.unwrap();
    let again = claim
        .append_final_as(setup.ev(Stage::Done, "again"), 2)
        .await
        .unwrap();
    assert!(again.is_none(), "one final event: {again:?}");
    assert_eq!(setup.logged().await, vec![(end.seq, Stage::Done as i32)]);

    // A resume at the end, after all this, gets that end from the row at once.
    let mut at_end = setup
        .hub
        .watch(recorded, Some(end.event_id.parse().unwrap()), None);
    assert_eq!(next(&mut at_end).await.event_id, end.event_id);
}

/// The moment between the row finishing and the log taking the final event: a watcher that
/// comes then appends the final event where the worker would (right after the log's last
/// event), and the worker's own append finds it there.
#[tokio::test]
async fn a_watcher_between_the_row_finishing_and_the_final_event_ends_with_the_logs_end() {
    let setup = Setup::start().await;
    let writer = setup.claimed_writer("test-worker", "first").await;
    let row = setup.finish_row().await;
    let mut watch = setup
        .hub
        .watch(row, Some(EventId::of(&setup.job.id, 2)), None);
    let end = next(&mut watch).await;
    assert_eq!((end.seq, end.stage), (3, Stage::Done as i32));
    let late = writer
        .append_final_as(setup.ev(Stage::Done, "late"), 1)
        .await
        .unwrap();
    assert!(late.is_none(), "one final event: {late:?}");
    let logged = setup.logged().await;
    assert_eq!(logged.last(), Some(&(3, Stage::Done as i32)));
    assert_eq!(logged.len(), 3);
}

/// A watcher that finds the row finished while a newer claim holds the job (its fence is
/// raised, the row it read is older) is refused the append; it waits for the final event that
/// claim appends, and ends with it.
#[tokio::test]
async fn a_watcher_fenced_off_by_a_newer_claim_ends_with_that_claims_final_event() {
    let setup = Setup::start().await;
    setup.claimed_writer("test-worker", "first").await;
    let row = setup.finish_row().await;
    let claim = setup.writer("test-next-claim").await;
    claim.fence(&setup.job.id, 2).await.unwrap();
    let mut watch = setup
        .hub
        .watch(row, Some(EventId::of(&setup.job.id, 2)), None);
    // The watcher's append is refused, and it waits.
    let waited = tokio::time::timeout(Duration::from_millis(300), watch.next()).await;
    assert!(
        waited.is_err(),
        "nothing before the claim appends: {waited:?}"
    );
    let appended = claim
        .append_final_as(setup.ev(Stage::Done, "from the claim"), 2)
        .await
        .unwrap()
        .expect("the claim's final event");
    let end = next(&mut watch).await;
    assert_eq!(
        (end.event_id.as_str(), end.message.as_str()),
        (appended.event_id.as_str(), "from the claim")
    );
    assert_eq!(setup.logged().await.len(), 3, "one final event");
}
