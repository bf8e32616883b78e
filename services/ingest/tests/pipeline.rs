//! The pipeline against in-test stage services on a real socket: resuming at the first stage
//! without a checkpoint, failing a job cleanly, and shedding load.

mod support;

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use bytes::Bytes;
use ecoscan_common::client::request_as;
use ecoscan_ingest::{
    Stores,
    error::StoreError,
    store::{Lease, Queue, QueueEntry, jobs::Checkpoint},
};
use ecoscan_proto::v1::{
    DisposalRules, EventStatus, JobStatus, ScanEvent, Stage, SubmitRequest, WatchRequest,
};
use support::*;
use tokio_stream::StreamExt;
use tonic::Code;

#[tokio::test]
async fn a_resumed_job_runs_only_the_stages_without_a_checkpoint() {
    let env = start(None, |_| {}).await;
    // A job that got through vision and rule before its worker died.
    let job = insert_with_image(&env, "images/aa/photo").await;
    env.stores
        .jobs
        .mark_running(&job.id, 0, Stage::Vision)
        .await
        .unwrap();
    env.stores
        .jobs
        .checkpoint(
            &job.id,
            0,
            Checkpoint::Classification(classification()),
            Some(Stage::Rule),
        )
        .await
        .unwrap();
    env.stores
        .jobs
        .checkpoint(
            &job.id,
            0,
            Checkpoint::Rules(DisposalRules::default()),
            Some(Stage::Answer),
        )
        .await
        .unwrap();
    env.stores
        .queue
        .enqueue(QueueEntry {
            job_id: job.id.clone(),
            carrier: HashMap::new(),
            deliveries: 1,
            enqueued_at: std::time::SystemTime::now(),
        })
        .await
        .unwrap();

    let events = watch_all(&env, &job.id).await;

    assert_eq!(env.stages.count("vision"), 0, "vision had a checkpoint");
    assert_eq!(env.stages.count("rule"), 0, "rule had a checkpoint");
    assert_eq!(env.stages.count("answer"), 1);
    assert_eq!(env.stages.count("reward"), 1);
    assert_eq!(env.stages.count("notify"), 1, "the owner is told once");
    let stages: Vec<i32> = events.iter().map(|e| e.stage).collect();
    assert_eq!(stages.last(), Some(&(Stage::Done as i32)));
    // The log had nothing of the checkpointed stages (the previous worker stopped before
    // appending): the resumed worker sends their stored outputs, once each, before going on.
    for stage in [Stage::Vision, Stage::Rule, Stage::Answer, Stage::Reward] {
        let completed: Vec<&ScanEvent> = events
            .iter()
            .filter(|e| e.stage == stage as i32 && e.status == EventStatus::Completed as i32)
            .collect();
        assert_eq!(completed.len(), 1, "{stage:?} completes once: {events:?}");
    }
    assert_eq!(
        events[0].payload,
        Some(ecoscan_proto::v1::scan_event::Payload::Classification(
            classification()
        )),
        "the stored classification, not a new one"
    );
    assert!(
        !events
            .iter()
            .any(|e| e.stage == Stage::Vision as i32 && e.status == EventStatus::Started as i32),
        "vision does not run again"
    );
    let text: String = events
        .iter()
        .filter(|e| e.status == EventStatus::Delta as i32)
        .filter_map(|e| match &e.payload {
            Some(ecoscan_proto::v1::scan_event::Payload::Delta(d)) => Some(d.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        text, "Remove the label, rinse, crush.",
        "coalesced deltas keep every character in order"
    );
    let row = env.stores.jobs.get(&job.id).await.unwrap().unwrap();
    assert_eq!(row.status, JobStatus::Succeeded);
    assert!(row.answer.is_some() && row.reward.is_some());
}

#[tokio::test]
async fn a_stage_that_fails_for_good_fails_the_job_with_its_error() {
    let env = start(Some(Code::InvalidArgument), |_| {}).await;
    let job_id = submit_png(&env).await;

    let events = watch_all(&env, &job_id).await;
    let last = events.last().unwrap();
    assert_eq!(last.stage, Stage::Done as i32);
    assert_eq!(last.status, EventStatus::Failed as i32);
    let failed_stage = events
        .iter()
        .find(|e| e.stage == Stage::Vision as i32 && e.status == EventStatus::Failed as i32)
        .expect("a vision failed event");
    assert!(
        failed_stage.message.contains("the photo shows no object"),
        "{}",
        failed_stage.message
    );
    assert_eq!(
        env.stages.count("vision"),
        1,
        "INVALID_ARGUMENT is not retried"
    );
    assert_eq!(env.stages.count("rule"), 0);

    let result = result_of(&env, &job_id).await;
    assert_eq!(result.status, JobStatus::Failed as i32);
    assert_eq!(
        result.stage,
        Stage::Vision as i32,
        "the result says where it failed"
    );
    let error = result.error.unwrap();
    assert_eq!(error.code, "INVALID_ARGUMENT");
    assert_eq!(error.http_status, 400);
    assert!(!error.retryable);
}

#[tokio::test]
async fn a_transient_stage_failure_is_retried() {
    let env = start(Some(Code::Unavailable), |c| c.stage_retries = 2).await;
    let job_id = submit_png(&env).await;
    let events = watch_all(&env, &job_id).await;
    assert_eq!(env.stages.count("vision"), 3, "one call and two retries");
    let last = events.last().unwrap();
    match &last.payload {
        Some(ecoscan_proto::v1::scan_event::Payload::Error(e)) => {
            assert_eq!(e.code, "UNAVAILABLE");
            assert!(e.retryable);
        }
        other => panic!("expected an error payload, got {other:?}"),
    }
}

#[tokio::test]
async fn a_scans_model_is_checked_at_submit_kept_on_its_row_and_sent_to_both_stages() {
    let env = start(None, |c| {
        c.offered_models = ecoscan_common::models::OfferedModels::parse("small,big").unwrap();
    })
    .await;
    let submit = |model: &str| {
        let mut ingest = env.ingest.clone();
        let model = model.to_owned();
        async move {
            ingest
                .submit(request_as(
                    SubmitRequest {
                        image: PNG.to_vec(),
                        idempotency_key: format!("key-{model}"),
                        model,
                        ..Default::default()
                    },
                    Duration::from_secs(10),
                    "u1",
                ))
                .await
        }
    };

    // Not offered: INVALID_ARGUMENT naming the field and the offered models; nothing stored.
    let err = submit("huge").await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("small, big"), "{}", err.message());
    let bad = tonic_types::StatusExt::get_details_bad_request(&err).expect("a BadRequest");
    assert_eq!(bad.field_violations[0].field, "model");
    assert!(
        env.stores
            .jobs
            .find_by_idempotency_key("u1", "key-huge")
            .await
            .unwrap()
            .is_none(),
        "no job row"
    );

    // Offered: on the row, in the result, and in both model-calling stages' requests.
    let job_id = submit("big").await.unwrap().into_inner().job_id;
    let events = watch_all(&env, &job_id).await;
    assert_eq!(events.last().unwrap().status, EventStatus::Completed as i32);
    assert_eq!(result_of(&env, &job_id).await.model, "big");
    assert_eq!(
        *env.stages.models.lock().unwrap(),
        ["vision:big", "answer:big"]
    );

    // None: empty all the way, so each stage uses its configured model.
    let job_id = submit("").await.unwrap().into_inner().job_id;
    watch_all(&env, &job_id).await;
    assert_eq!(result_of(&env, &job_id).await.model, "");
    assert_eq!(
        env.stages.models.lock().unwrap()[2..],
        ["vision:", "answer:"]
    );
}

#[tokio::test]
async fn submit_sheds_load_past_the_backlog_and_stores_nothing() {
    let env = start(None, |c| {
        c.max_backlog = 0;
        c.retry_after = Duration::from_secs(7);
    })
    .await;
    let err = env
        .ingest
        .clone()
        .submit(request_as(
            SubmitRequest {
                image: PNG.to_vec(),
                idempotency_key: "k".into(),
                ..Default::default()
            },
            Duration::from_secs(10),
            "u1",
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert_eq!(err.metadata().get("retry-after").unwrap(), "7");
    assert!(err.message().contains("try again"), "{}", err.message());
    assert!(
        env.stores
            .jobs
            .find_by_idempotency_key("u1", "k")
            .await
            .unwrap()
            .is_none(),
        "no job row"
    );
    let images = env.dir.path().join("objects").join("images");
    assert!(
        !images.exists() || std::fs::read_dir(&images).unwrap().next().is_none(),
        "no image stored"
    );
    assert_eq!(env.stores.queue.backlog().await.unwrap(), 0);
}

/// A queue that takes every job's first lease away, as when its worker stalled past the lease
/// and another worker reclaimed the job: `extend` says the lease is lost.
struct LosesFirstLease(Arc<dyn Queue>);

#[async_trait::async_trait]
impl Queue for LosesFirstLease {
    async fn enqueue(&self, entry: QueueEntry) -> Result<(), StoreError> {
        self.0.enqueue(entry).await
    }
    async fn claim_many(
        &self,
        lease: Duration,
        wait: Duration,
        max: usize,
    ) -> Result<Vec<Lease>, StoreError> {
        self.0.claim_many(lease, wait, max).await
    }
    async fn extend_many(&self, leases: &[Lease], by: Duration) -> Result<Vec<bool>, StoreError> {
        let mut kept = self.0.extend_many(leases, by).await?;
        for (lease, kept) in leases.iter().zip(kept.iter_mut()) {
            if lease.entry.deliveries == 0 {
                *kept = false;
            }
        }
        Ok(kept)
    }
    async fn ack(&self, lease: &Lease) -> Result<(), StoreError> {
        self.0.ack(lease).await
    }
    async fn backlog(&self) -> Result<u64, StoreError> {
        self.0.backlog().await
    }
    async fn queued(&self, job_ids: &[String]) -> Result<HashSet<String>, StoreError> {
        self.0.queued(job_ids).await
    }
    async fn reserve_requeue(
        &self,
        job_id: &str,
        hold: Duration,
        holder: &str,
    ) -> Result<bool, StoreError> {
        self.0.reserve_requeue(job_id, hold, holder).await
    }
    async fn release(&self, leases: &[Lease]) -> Result<(), StoreError> {
        self.0.release(leases).await
    }
}

/// A worker that finds its lease lost stops: the job's new owner alone finishes it, so its log
/// shows each stage completed once and one `done`, never two workers racing to the end.
#[tokio::test]
async fn a_worker_that_lost_its_lease_stops_and_leaves_the_job_to_the_new_owner() {
    let stages = Stages {
        answer_delay: Duration::from_millis(1200),
        ..Stages::new(None)
    };
    let env = start_with(
        stages,
        |c| c.lease = Duration::from_millis(300),
        |s| Stores {
            queue: Arc::new(LosesFirstLease(s.queue.clone())),
            ..s
        },
    )
    .await;
    let job_id = submit_png(&env).await;
    let watched = watch_all(&env, &job_id).await;
    assert_eq!(
        watched.last().map(|e| e.stage),
        Some(Stage::Done as i32),
        "{watched:#?}"
    );
    // Every worker that touched the job is done with it once the queue is empty.
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    while env.stores.queue.backlog().await.unwrap() > 0 {
        assert!(
            tokio::time::Instant::now() < until,
            "the job was acknowledged"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A stale worker would have finished before its successor: it started the answer (which
    // takes as long for both) 300 ms earlier, so by now everything it wrote is in the log.
    assert_eq!(
        env.stages.count("answer"),
        2,
        "the first worker was writing the answer when it lost the job"
    );
    let log = env.stores.events.read_after(&job_id, None).await.unwrap();
    let count = |stage: Stage, status: EventStatus| {
        log.iter()
            .filter(|e| e.stage == stage as i32 && e.status == status as i32)
            .count()
    };
    assert_eq!(
        count(Stage::Answer, EventStatus::Completed),
        1,
        "only the new owner completed the answer: {log:#?}"
    );
    assert_eq!(
        count(Stage::Done, EventStatus::Completed),
        1,
        "one done event: {log:#?}"
    );
    assert_eq!(
        log.last().map(|e| e.stage),
        Some(Stage::Done as i32),
        "nothing after done: {log:#?}"
    );
    let row = env.stores.jobs.get(&job_id).await.unwrap().unwrap();
    assert_eq!(row.status, JobStatus::Succeeded);
    assert_eq!(
        row.attempts, 2,
        "run by the first worker, then by its successor"
    );
}

/// The whole pipeline on the production stores (`infra/services.sh` starts them): job rows in
/// PostgreSQL (a schema of its own), event log and queue in Redis (a key prefix of its own),
/// images in S3 (a bucket of its own); everything is removed at the end.
#[tokio::test]
async fn a_scan_completes_on_redis_postgres_and_s3() {
    let id = uuid::Uuid::new_v4().simple().to_string();
    let redis_url =
        std::env::var("TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let db_url = std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let s3_endpoint =
        std::env::var("TEST_S3_ENDPOINT").unwrap_or_else(|_| "http://127.0.0.1:9000".into());
    let schema = format!("t_{id}");
    ecoscan_ingest::store::PgJobStore::connect_in_schema(&db_url, Some(&schema))
        .await
        .unwrap_or_else(|e| panic!("postgresql at {db_url} (TEST_DATABASE_URL) is unreachable: {e}; start it with infra/services.sh"))
        .close()
        .await;
    let s3 = ecoscan_ingest::store::S3Config {
        endpoint: s3_endpoint,
        bucket: format!("t-{id}"),
        region: "us-east-1".into(),
        credentials: Some(("test".into(), "test".into())),
        key_prefix: String::new(),
    };
    let prefix = format!("t:{id}:");
    let env = {
        let (s3, prefix, schema) = (s3.clone(), prefix.clone(), schema.clone());
        start(None, move |c| {
            let sep = if db_url.contains('?') { '&' } else { '?' };
            c.database_url = format!("{db_url}{sep}options=-c%20search_path%3D{schema}");
            c.redis = Some(ecoscan_redis::Settings::single(redis_url));
            c.redis_prefix = prefix;
            c.s3 = Some(s3);
            // The kept rows of running jobs go only when the Redis feed says their job moved.
            c.hub.pending.max_age = Duration::from_secs(3600);
        })
        .await
    };
    let env = std::sync::Arc::new(env);

    let job_id = submit_png(&env).await;
    // A client polling the result while the scan runs, as the gateway's `202` invites.
    let poller = {
        let (env, job_id) = (env.clone(), job_id.clone());
        tokio::spawn(async move {
            while result_of(&env, &job_id).await.status != JobStatus::Succeeded as i32 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let events = watch_all(&env, &job_id).await;
    assert_eq!(events.first().unwrap().stage, Stage::Queued as i32);
    assert_eq!(events.last().unwrap().stage, Stage::Done as i32);
    assert_eq!(
        result_of(&env, &job_id).await.status,
        JobStatus::Succeeded as i32,
        "the result asked for once the stream ended is the finished one"
    );
    tokio::time::timeout(Duration::from_secs(30), poller)
        .await
        .expect("the poller sees the job finish")
        .unwrap();
    assert!(
        events.windows(2).all(|w| w[0].seq + 1 == w[1].seq),
        "every event once, in order"
    );
    let row = env.stores.jobs.get(&job_id).await.unwrap().unwrap();
    assert_eq!(row.status, JobStatus::Succeeded);
    assert_eq!(
        env.stores
            .objects
            .get(&row.image_key)
            .await
            .unwrap()
            .unwrap(),
        Bytes::from_static(PNG),
        "the image is in the bucket"
    );
    // The worker acknowledges its entry once the job's log is closed, a moment after the
    // watcher got the final event.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while env.stores.queue.backlog().await.unwrap() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(env.stores.queue.backlog().await.unwrap(), 0, "acknowledged");

    // Resuming from an event id replays exactly what follows it.
    let mid = &events[events.len() / 2];
    let mut stream = env
        .ingest
        .clone()
        .watch(request_as(
            WatchRequest {
                job_id: job_id.clone(),
                after_event_id: mid.event_id.clone(),
            },
            Duration::from_secs(30),
            "u1",
        ))
        .await
        .unwrap()
        .into_inner();
    let mut replayed = Vec::new();
    while let Some(ev) = stream.next().await {
        replayed.push(ev.unwrap().event.unwrap().seq);
    }
    assert_eq!(
        replayed,
        events
            .iter()
            .filter(|e| e.seq > mid.seq)
            .map(|e| e.seq)
            .collect::<Vec<_>>()
    );

    // Stop ingest first, so no worker recreates the queue after the keys are deleted.
    let Ok(Env {
        stores, _servers, ..
    }) = std::sync::Arc::try_unwrap(env)
    else {
        panic!("the poller holds no copy of the harness any more");
    };
    for server in _servers.into_iter().rev() {
        server.stop().await.unwrap();
    }
    drop(stores);
    ecoscan_objects::S3ObjectStore::connect(s3)
        .await
        .unwrap()
        .delete_bucket()
        .await
        .unwrap();
    let mut raw = redis::Client::open(
        std::env::var("TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into()),
    )
    .unwrap()
    .get_multiplexed_async_connection()
    .await
    .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut raw)
        .await
        .unwrap();
    if !keys.is_empty() {
        redis::cmd("DEL")
            .arg(&keys)
            .query_async::<()>(&mut raw)
            .await
            .unwrap();
    }
    use sqlx::Connection;
    let db_url = std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let mut conn = sqlx::PgConnection::connect(&db_url).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&mut conn)
        .await
        .unwrap();
}
