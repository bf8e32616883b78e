//! The pipeline on a Redis that misbehaves: a job with two queue entries (a requeue raced the
//! sweeper), Redis losing every entry mid-scan (restarted empty), refusing a submission's
//! first event (out of memory), and not answering at all (stopped) while a watcher resumes at
//! a finished job's end. Ingest runs on in-test stage services; Redis is a private
//! `redis-server` of the test's own.

mod support;

use std::{collections::HashMap, time::Duration};

use ecoscan_common::client::request_as;
use ecoscan_ingest::store::{Job, QueueEntry};
use ecoscan_proto::v1::{JobStatus, ScanEvent, Stage, WatchRequest};
use ecoscan_redis::testing::PrivateRedis;
use support::*;
use tokio_stream::StreamExt;

type Ingest = ecoscan_proto::v1::scan_service_client::ScanServiceClient<
    ecoscan_common::client::TracedChannel,
>;

/// [`eventually`] for the rows of all of `jobs` at once: until `check` holds for every one.
async fn eventually_every_job(
    env: &Env,
    jobs: &[String],
    within: Duration,
    what: &str,
    check: impl Fn(&Job) -> bool,
) {
    eventually(within, what, async || {
        for id in jobs {
            let row = env.stores.jobs.get(id).await.unwrap().unwrap();
            if !check(&row) {
                return false;
            }
        }
        true
    })
    .await;
}

/// A job that has two queue entries: the worker of one is fenced off by the claim of the
/// other, and drops its own entry, so the job finishes with nothing left in the queue. Were
/// the fenced worker's entry left claimed, it would come back when its lease ran out (here
/// an hour) and fence the job's owner in turn, until the job was dead-lettered.
async fn a_fenced_worker_drops_its_own_queue_entry(redis: Option<&PrivateRedis>) {
    let stages = Stages {
        answer_delay: Duration::from_secs(2),
        ..Stages::new(None)
    };
    let env = start_with(
        stages,
        |c| {
            c.redis = redis.map(PrivateRedis::settings);
            c.lease = Duration::from_secs(3600);
        },
        |s| s,
    )
    .await;
    let job_id = submit_png(&env).await;
    env.stores
        .queue
        .enqueue(QueueEntry {
            job_id: job_id.clone(),
            carrier: HashMap::new(),
            deliveries: 0,
            enqueued_at: std::time::SystemTime::now(),
        })
        .await
        .unwrap();

    let events = watch_all(&env, &job_id).await;
    assert_eq!(
        events.last().map(|e| e.stage),
        Some(Stage::Done as i32),
        "the job finishes"
    );
    eventually(
        Duration::from_secs(30),
        "both of the job's queue entries are gone",
        async || env.stores.queue.backlog().await.unwrap() == 0,
    )
    .await;
    let row = env.stores.jobs.get(&job_id).await.unwrap().unwrap();
    assert_eq!(row.status, JobStatus::Succeeded);
    assert_eq!(row.attempts, 2, "one run per entry, no more");
}

#[tokio::test]
async fn a_fenced_worker_drops_its_own_entry_on_the_memory_queue() {
    a_fenced_worker_drops_its_own_queue_entry(None).await;
}

#[tokio::test]
async fn a_fenced_worker_drops_its_own_entry_on_the_redis_queue() {
    let redis = PrivateRedis::start().await;
    a_fenced_worker_drops_its_own_queue_entry(Some(&redis)).await;
}

/// A watcher that resumes with its last position whenever its stream ends without the job's
/// end (as an SSE client does), and follows a resync's position (a log that lost its data
/// announces the gap); returns every event it got.
async fn follow(ingest: Ingest, job_id: String) -> Vec<ScanEvent> {
    let mut got: Vec<ScanEvent> = Vec::new();
    let mut after = String::new();
    loop {
        let request = request_as(
            WatchRequest {
                job_id: job_id.clone(),
                after_event_id: after.clone(),
            },
            Duration::from_secs(120),
            "u1",
        );
        if let Ok(stream) = ingest.clone().watch(request).await {
            let mut stream = stream.into_inner();
            while let Some(Ok(msg)) = stream.next().await {
                let ev = match (msg.event, msg.resync) {
                    (Some(ev), None) => ev,
                    (None, Some(gap)) => {
                        if !gap.event_id.is_empty() {
                            after = gap.event_id;
                        }
                        continue;
                    }
                    other => panic!("a message carries an event or a resync: {other:?}"),
                };
                let end = ev.stage == Stage::Done as i32;
                after.clone_from(&ev.event_id);
                got.push(ev);
                if end {
                    return got;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Redis restarts empty while every job is in its answer stage: the queue notices that its
/// consumer group is gone and the sweeper puts every unfinished job back at once, without
/// waiting for its grace (an hour here), so each job is claimed again, resumes from its last
/// checkpoint and finishes; and its watchers, resuming with their last id, get its end.
#[tokio::test]
async fn every_unfinished_job_resumes_at_once_after_redis_lost_its_data() {
    let mut redis = PrivateRedis::start().await;
    let stages = Stages {
        answer_delay: Duration::from_secs(4),
        ..Stages::new(None)
    };
    let env = start_with(
        stages,
        |c| {
            c.redis = Some(redis.settings());
            // Renewed every second: a worker learns within a second that its lease is gone.
            c.lease = Duration::from_secs(3);
            c.sweep_grace = Duration::from_secs(3600);
            c.sweep_interval = Duration::from_secs(3600);
        },
        |s| s,
    )
    .await;
    let mut jobs = Vec::new();
    for _ in 0..4 {
        jobs.push(submit_png(&env).await);
    }
    let watchers: Vec<_> = jobs
        .iter()
        .map(|id| tokio::spawn(follow(env.ingest.clone(), id.clone())))
        .collect();
    eventually_every_job(
        &env,
        &jobs,
        Duration::from_secs(60),
        "every job reaches its answer stage",
        |row| row.stage == Stage::Answer,
    )
    .await;

    redis.kill();
    redis.start_again().await;

    eventually_every_job(
        &env,
        &jobs,
        Duration::from_secs(60),
        "every job finishes after Redis lost its data, without the sweeper's grace",
        |row| row.status == JobStatus::Succeeded,
    )
    .await;
    for (id, watcher) in jobs.iter().zip(watchers) {
        let events = tokio::time::timeout(Duration::from_secs(60), watcher)
            .await
            .expect("every watcher gets its job's end")
            .unwrap();
        let ids: Vec<ecoscan_ingest::store::EventId> =
            events.iter().map(|e| e.event_id.parse().unwrap()).collect();
        assert!(
            ids.windows(2).all(|w| w[0] < w[1]),
            "job {id}: ids strictly increase: {ids:?}"
        );
        let ends = events
            .iter()
            .filter(|e| e.stage == Stage::Done as i32)
            .count();
        assert_eq!(ends, 1, "job {id}: one end");
        let row = env.stores.jobs.get(id).await.unwrap().unwrap();
        assert!(row.attempts >= 2, "job {id} was claimed again");
    }
}

/// A submission whose `queued` event Redis refused (out of memory) fails with its row
/// written and nothing dispatched; the caller's repeat with the same idempotency key
/// dispatches that job at once, rather than leaving it to wait for the sweeper's grace.
#[tokio::test]
async fn a_repeat_of_a_submission_redis_refused_dispatches_its_job() {
    let redis = PrivateRedis::start().await;
    let env = start_with(
        Stages::new(None),
        |c| {
            c.redis = Some(redis.settings());
            c.sweep_grace = Duration::from_secs(3600);
        },
        |s| s,
    )
    .await;
    let client = redis::Client::open(redis.url()).unwrap();
    let mut admin = client.get_multiplexed_async_connection().await.unwrap();
    let set_maxmemory = async |conn: &mut redis::aio::MultiplexedConnection, bytes: u64| {
        redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg(bytes)
            .query_async::<()>(conn)
            .await
            .unwrap();
    };
    let submit = || {
        let mut ingest = env.ingest.clone();
        async move {
            ingest
                .submit(request_as(
                    ecoscan_proto::v1::SubmitRequest {
                        image: PNG.to_vec(),
                        idempotency_key: "the-same-photo".into(),
                        ..Default::default()
                    },
                    Duration::from_secs(10),
                    "u1",
                ))
                .await
        }
    };

    set_maxmemory(&mut admin, 1).await;
    let refused = submit().await.expect_err("Redis refuses the queued event");
    set_maxmemory(&mut admin, 0).await;
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");

    let repeat = submit().await.expect("the repeat is accepted").into_inner();
    assert!(repeat.duplicate, "the same job: {repeat:?}");
    let events = tokio::time::timeout(Duration::from_secs(30), watch_all(&env, &repeat.job_id))
        .await
        .expect("the job runs without waiting for the sweeper");
    assert_eq!(events.first().map(|e| e.stage), Some(Stage::Queued as i32));
    assert_eq!(events.last().map(|e| e.stage), Some(Stage::Done as i32));
}

/// Redis stops answering (SIGSTOP: connections stay open, nothing comes back); a watcher that
/// resumes at a finished job's final event, or past it, gets the end at once from the job's
/// row, which recorded the final event's position, instead of waiting on the log.
#[tokio::test]
async fn a_resume_at_a_finished_jobs_end_is_answered_while_redis_does_not_answer() {
    let redis = PrivateRedis::start().await;
    let env = start_with(
        Stages::new(None),
        |c| c.redis = Some(redis.settings()),
        |s| s,
    )
    .await;
    let job_id = submit_png(&env).await;
    let events = watch_all(&env, &job_id).await;
    let done = events.last().expect("the end").clone();
    assert_eq!(done.stage, Stage::Done as i32);
    // The final event's position reaches the row just after the log took it.
    eventually(
        Duration::from_secs(10),
        "the row records its end's position",
        async || env.stores.jobs.get(&job_id).await.unwrap().unwrap().end_seq == Some(done.seq),
    )
    .await;

    redis.pause();
    let past = ecoscan_ingest::store::EventId::of(&job_id, done.seq + 5).to_string();
    for after in [done.event_id.clone(), past] {
        let request = request_as(
            WatchRequest {
                job_id: job_id.clone(),
                after_event_id: after.clone(),
            },
            Duration::from_secs(10),
            "u1",
        );
        let got = tokio::time::timeout(Duration::from_secs(3), async {
            let mut stream = env.ingest.clone().watch(request).await?.into_inner();
            let mut got = Vec::new();
            while let Some(msg) = stream.next().await {
                got.push(msg?);
            }
            Ok::<_, tonic::Status>(got)
        })
        .await
        .expect("the end comes at once, not after Redis")
        .expect("the watch succeeds");
        assert_eq!(got.len(), 1, "after {after}: only the end: {got:?}");
        let end = got[0].event.as_ref().expect("an event");
        assert_eq!(
            (end.event_id.as_str(), end.seq, end.stage),
            (done.event_id.as_str(), done.seq, Stage::Done as i32),
            "after {after}"
        );
    }
    redis.resume();
}
