//! Conformance suites for ingest's store traits. Each suite is a function over the trait object;
//! every implementation (embedded today; Redis/PostgreSQL/S3 alongside them) runs all of them.

use std::{collections::HashMap, sync::Arc, time::Duration};

use bytes::Bytes;
use ecoscan_ingest::store::{
    EventId, EventLog, JobStore, LocalObjectStore, MemoryEventLog, MemoryQueue, NewJob,
    ObjectStore, Queue, QueueEntry, SqliteJobStore, jobs::Checkpoint,
};
use ecoscan_proto::v1::{Classification, ErrorInfo, EventStatus, JobStatus, ScanEvent, Stage};

fn ev(job: &str, stage: Stage) -> ScanEvent {
    ScanEvent {
        job_id: job.into(),
        stage: stage as i32,
        status: EventStatus::Progress as i32,
        ..Default::default()
    }
}

async fn event_log_conformance(log: Arc<dyn EventLog>) {
    let job = uuid::Uuid::now_v7().to_string();
    let other = uuid::Uuid::now_v7().to_string();
    let mut feed = log.feed();

    let mut ids = Vec::new();
    for i in 0..5 {
        let stored = log.append(ev(&job, Stage::Vision)).await.unwrap();
        assert_eq!(stored.seq, i + 1, "seq counts from 1 per job");
        ids.push(
            stored
                .event_id
                .parse::<EventId>()
                .expect("stored ids parse"),
        );
    }
    log.append(ev(&other, Stage::Rule)).await.unwrap();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids increase: {ids:?}");

    let all = log.read_after(&job, None).await.unwrap();
    assert_eq!(all.len(), 5, "only this job's events");
    let after = log.read_after(&job, Some(ids[1])).await.unwrap();
    assert_eq!(
        after.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![3, 4, 5],
        "exactly the events after the id"
    );
    assert!(log.read_after(&job, Some(ids[4])).await.unwrap().is_empty());
    assert!(
        log.read_after("no-such-job", None)
            .await
            .unwrap()
            .is_empty()
    );

    let first = tokio::time::timeout(Duration::from_secs(5), feed.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        first.event_id,
        ids[0].to_string(),
        "the feed carries appended events in order"
    );

    log.expire(&job, Duration::ZERO).await.unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    log.expire(&other, Duration::from_secs(60)).await.unwrap();
    assert!(
        log.read_after(&job, None).await.unwrap().is_empty(),
        "an expired log is gone"
    );
    assert_eq!(
        log.read_after(&other, None).await.unwrap().len(),
        1,
        "other logs stay"
    );
}

#[test]
fn event_ids_parse_and_reject_malformed_input() {
    assert_eq!("17-3".parse::<EventId>().unwrap(), EventId { ms: 17, n: 3 });
    for bad in [
        "", "17", "-3", "17-", "a-1", "1-b", "1-2-3", "17 - 3", "+1-2",
    ] {
        assert!(
            bad.parse::<EventId>().is_err(),
            "{bad:?} should be rejected"
        );
    }
}

fn entry(job: &str) -> QueueEntry {
    QueueEntry {
        job_id: job.into(),
        carrier: HashMap::from([(
            "traceparent".into(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
        )]),
        deliveries: 0,
        enqueued_at: std::time::SystemTime::now(),
    }
}

async fn queue_conformance(queue: Arc<dyn Queue>) {
    assert!(
        queue
            .claim(Duration::from_secs(5), Duration::from_millis(10))
            .await
            .unwrap()
            .is_none()
    );
    queue.enqueue(entry("a")).await.unwrap();
    queue.enqueue(entry("b")).await.unwrap();
    assert_eq!(queue.backlog().await.unwrap(), 2);

    let a = queue
        .claim(Duration::from_secs(5), Duration::ZERO)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(a.entry.job_id, "a", "first in, first out");
    assert_eq!(
        a.entry.carrier.get("traceparent").map(String::as_str),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    queue.ack(&a).await.unwrap();
    assert_eq!(queue.backlog().await.unwrap(), 1);

    // A lease that runs out hands the entry to the next claimer, counted as a redelivery.
    let b = queue
        .claim(Duration::from_millis(50), Duration::ZERO)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(b.entry.job_id, "b");
    let again = queue
        .claim(Duration::from_secs(5), Duration::from_secs(5))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(again.entry.job_id, "b");
    assert_eq!(again.entry.deliveries, 1);
    assert!(
        !queue.extend(&b, Duration::from_secs(5)).await.unwrap(),
        "the old lease is lost"
    );
    assert!(queue.extend(&again, Duration::from_secs(5)).await.unwrap());
    queue.ack(&again).await.unwrap();
    assert_eq!(queue.backlog().await.unwrap(), 0);

    // A claim that waits wakes up for an entry enqueued meanwhile.
    let q = queue.clone();
    let waiter = tokio::spawn(async move {
        q.claim(Duration::from_secs(5), Duration::from_secs(10))
            .await
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    queue.enqueue(entry("c")).await.unwrap();
    let c = waiter
        .await
        .unwrap()
        .unwrap()
        .expect("waiting claim receives the entry");
    assert_eq!(c.entry.job_id, "c");
    queue.ack(&c).await.unwrap();
}

fn new_job(user: &str, key: Option<&str>) -> NewJob {
    NewJob {
        id: uuid::Uuid::now_v7().to_string(),
        user_id: user.into(),
        image_key: "images/ab/abcdef".into(),
        content_type: "image/png".into(),
        hint: "bottle".into(),
        locale: "ko".into(),
        idempotency_key: key.map(str::to_owned),
        trace_carrier: HashMap::new(),
    }
}

async fn job_store_conformance(jobs: Arc<dyn JobStore>) {
    let (job, inserted) = jobs.insert(new_job("u1", Some("k1"))).await.unwrap();
    assert!(inserted);
    assert_eq!(job.status, JobStatus::Queued);
    assert_eq!(job.stage, Stage::Queued);

    let (dup, inserted) = jobs.insert(new_job("u1", Some("k1"))).await.unwrap();
    assert!(!inserted, "same user and key is the same job");
    assert_eq!(dup.id, job.id);
    let (other_user, inserted) = jobs.insert(new_job("u2", Some("k1"))).await.unwrap();
    assert!(inserted, "keys are per user");
    assert_ne!(other_user.id, job.id);
    assert_eq!(
        jobs.find_by_idempotency_key("u1", "k1")
            .await
            .unwrap()
            .unwrap()
            .id,
        job.id
    );
    assert!(
        jobs.find_by_idempotency_key("u1", "nope")
            .await
            .unwrap()
            .is_none()
    );

    jobs.mark_running(&job.id, Stage::Vision, true)
        .await
        .unwrap();
    let c = Classification {
        major_category: "재활용폐기물".into(),
        middle_category: "무색페트병".into(),
        ..Default::default()
    };
    jobs.checkpoint(&job.id, Checkpoint::Classification(c.clone()))
        .await
        .unwrap();
    let other = Classification {
        major_category: "일반종량제폐기물".into(),
        ..Default::default()
    };
    jobs.checkpoint(&job.id, Checkpoint::Classification(other))
        .await
        .unwrap();
    let got = jobs.get(&job.id).await.unwrap().unwrap();
    assert_eq!(got.status, JobStatus::Running);
    assert_eq!(got.attempts, 1);
    assert_eq!(got.classification, Some(c), "the first checkpoint is kept");

    let err = ErrorInfo {
        code: "UNAVAILABLE".into(),
        http_status: 503,
        message: "x".into(),
        retryable: true,
    };
    jobs.finish(&job.id, JobStatus::Failed, Some(err.clone()))
        .await
        .unwrap();
    jobs.finish(&job.id, JobStatus::Succeeded, None)
        .await
        .unwrap();
    let got = jobs.get(&job.id).await.unwrap().unwrap();
    assert_eq!(got.status, JobStatus::Failed, "a terminal status is final");
    assert_eq!(got.error, Some(err));
    assert_eq!(
        got.stage,
        Stage::Vision,
        "a failed job keeps the stage it failed at"
    );
    assert!(got.finished_at.is_some());
    assert!(
        jobs.get(&uuid::Uuid::now_v7().to_string())
            .await
            .unwrap()
            .is_none()
    );
}

async fn object_store_conformance(objects: Arc<dyn ObjectStore>) {
    objects
        .put("images/ab/one", Bytes::from_static(b"\x89PNG"))
        .await
        .unwrap();
    assert_eq!(
        objects.get("images/ab/one").await.unwrap().unwrap(),
        Bytes::from_static(b"\x89PNG")
    );
    objects
        .put("images/ab/one", Bytes::from_static(b"two"))
        .await
        .unwrap();
    assert_eq!(
        objects.get("images/ab/one").await.unwrap().unwrap(),
        Bytes::from_static(b"two")
    );
    assert!(objects.get("images/ab/missing").await.unwrap().is_none());
    assert!(
        objects.put("../escape", Bytes::new()).await.is_err(),
        "keys cannot leave the store"
    );
}

#[tokio::test]
async fn memory_event_log_conforms() {
    event_log_conformance(Arc::new(MemoryEventLog::new(100))).await;
}

#[tokio::test]
async fn memory_event_log_keeps_at_most_max_len_events_per_job() {
    let log = MemoryEventLog::new(3);
    for _ in 0..5 {
        log.append(ev("j", Stage::Answer)).await.unwrap();
    }
    let kept = log.read_after("j", None).await.unwrap();
    assert_eq!(
        kept.iter().map(|e| e.seq).collect::<Vec<_>>(),
        vec![3, 4, 5]
    );
}

#[tokio::test]
async fn memory_queue_conforms() {
    queue_conformance(Arc::new(MemoryQueue::new())).await;
}

#[tokio::test]
async fn sqlite_job_store_conforms() {
    let dir = tempfile::tempdir().unwrap();
    job_store_conformance(Arc::new(SqliteJobStore::open_in(dir.path()).await.unwrap())).await;
}

#[tokio::test]
async fn local_object_store_conforms() {
    let dir = tempfile::tempdir().unwrap();
    object_store_conformance(Arc::new(LocalObjectStore::open(dir.path()).await.unwrap())).await;
}
