//! Conformance suites for ingest's store traits. Each suite is a function over the trait object;
//! every implementation runs all of them: the embedded ones, and the production ones against the
//! servers `infra/services.sh` starts (`TEST_REDIS_URL`, `TEST_DATABASE_URL`; each test uses
//! its own Redis key prefix or PostgreSQL schema and removes it at the end).

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::{Duration, SystemTime},
};

use ecoscan_common::CancellationToken;
use ecoscan_ingest::{
    Stores,
    error::StoreError,
    hub::{Hub, HubConfig, HubItem},
    store::{
        EventId, EventLog, Feed, FeedItem, JobStore, Lease, LocalObjectStore, MemoryEventLog,
        MemoryQueue, NewJob, PgJobStore, Queue, QueueEntry, RUN_SPAN, RedisEventLog, RedisQueue,
        SqliteJobStore, Upload, jobs::Checkpoint,
    },
    sweeper::{sweep_as, sweep_once},
};
use ecoscan_proto::v1::{
    Classification, DisposalRules, ErrorInfo, EventStatus, JobStatus, ScanEvent, Stage,
};
use ecoscan_redis::{
    Redis, Settings, redis,
    testing::{PrivateCluster, PrivateRedis},
};

/// The next event of `job` on `feed`, skipping resyncs (a feed says one when it starts).
async fn next_event(feed: &mut Box<dyn Feed>, job: &str) -> ScanEvent {
    let got = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match feed.recv(&|j| j == job).await {
                Some(FeedItem::Event(ev, _)) => return *ev,
                Some(FeedItem::Resync | FeedItem::Fence { .. }) => {}
                None => panic!("the feed stopped"),
            }
        }
    })
    .await;
    got.expect("an event of the job within 10 s on the feed")
}

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
    let mut feed = log.feed().await.unwrap();

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

    let first = next_event(&mut feed, &job).await;
    assert_eq!(
        first.event_id,
        ids[0].to_string(),
        "the feed carries appended events in order"
    );

    // A job's log takes one final event, however many workers finish it at once.
    let finishes = (0..4).map(|_| log.append_final(ev(&job, Stage::Done)));
    let appended: Vec<ScanEvent> = futures::future::join_all(finishes)
        .await
        .into_iter()
        .filter_map(|r| r.unwrap())
        .collect();
    assert_eq!(
        appended.len(),
        1,
        "one final event is appended: {appended:?}"
    );
    assert_eq!(appended[0].seq, 6, "numbered like any event");
    assert!(
        log.append_final(ev(&job, Stage::Done))
            .await
            .unwrap()
            .is_none()
    );
    let done: Vec<ScanEvent> = log
        .read_after(&job, None)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.stage == Stage::Done as i32)
        .collect();
    assert_eq!(done.len(), 1, "one done event in the log: {done:?}");
    assert_eq!(done[0].event_id, appended[0].event_id);

    assert_eq!(
        log.last_id(&job).await.unwrap().map(|id| id.to_string()),
        Some(appended[0].event_id.clone()),
        "the last id is the final event's"
    );
    assert!(log.last_id("no-such-job").await.unwrap().is_none());
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

    fence_conformance(log.as_ref()).await;
}

/// Appends carry their claim's epoch: once a newer claim raised the job's fence, an older
/// claim's appends (final ones too) are refused, and an operator's restart starts the log again.
async fn fence_conformance(log: &dyn EventLog) {
    let fenced = |r: Result<ScanEvent, StoreError>| matches!(r, Err(StoreError::Fenced { .. }));
    let job = uuid::Uuid::now_v7().to_string();
    log.fence(&job, 1).await.unwrap();
    // A claim that finds no log numbers from 1, or (Redis: it may have lost the log) from a
    // new run's base.
    let base = log.append_as(ev(&job, Stage::Vision), 1).await.unwrap().seq - 1;
    assert!(base == 0 || base == RUN_SPAN, "numbered from {base}");
    // The job is claimed again.
    log.fence(&job, 2).await.unwrap();
    assert!(fenced(log.append_as(ev(&job, Stage::Vision), 1).await));
    assert!(matches!(
        log.append_final_as(ev(&job, Stage::Done), 1).await,
        Err(StoreError::Fenced { .. })
    ));
    assert!(
        matches!(log.fence(&job, 1).await, Err(StoreError::Fenced { .. })),
        "a fence never goes down"
    );
    log.fence(&job, 2).await.unwrap();
    let kept = log.append_as(ev(&job, Stage::Rule), 2).await.unwrap();
    assert_eq!(kept.seq, base + 2, "the refused appends left no trace");
    let after_first: Vec<u64> = log
        .read_after(&job, Some(EventId::of(&job, base + 1)))
        .await
        .unwrap()
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(
        after_first,
        [base + 2],
        "a resume across claims gets exactly what follows"
    );
    assert_eq!(
        log.last_id(&job).await.unwrap(),
        Some(EventId::of(&job, base + 2))
    );

    // A claim of a job whose log does not exist (yet, or any more) fences older writers too.
    let fresh = uuid::Uuid::now_v7().to_string();
    log.fence(&fresh, 2).await.unwrap();
    assert!(fenced(log.append_as(ev(&fresh, Stage::Vision), 1).await));
    assert!(log.read_after(&fresh, None).await.unwrap().is_empty());
    assert_eq!(log.last_id(&fresh).await.unwrap(), None);
    let first = log.append_as(ev(&fresh, Stage::Vision), 2).await.unwrap();
    assert!([1, 2 * RUN_SPAN + 1].contains(&first.seq), "{}", first.seq);
    log.expire(&fresh, Duration::ZERO).await.unwrap();
    let last = log
        .append_final_as(ev(&job, Stage::Done), 2)
        .await
        .unwrap()
        .expect("the current claim finishes the log");
    assert_eq!(log.read_after(&job, None).await.unwrap().len(), 3);

    // Requeued by an operator: the log starts again, ids keep increasing, and the new run
    // (a newer claim) can finish it again.
    let restarted = log.restart(ev(&job, Stage::Queued)).await.unwrap();
    assert!(
        restarted.event_id.parse::<EventId>().unwrap() > last.event_id.parse::<EventId>().unwrap(),
        "ids keep increasing across a restart"
    );
    let events = log.read_after(&job, None).await.unwrap();
    assert_eq!(events.len(), 1, "only the new run: {events:?}");
    assert_eq!(events[0].event_id, restarted.event_id);
    log.fence(&job, 3).await.unwrap();
    assert!(fenced(log.append_as(ev(&job, Stage::Vision), 2).await));
    log.append_as(ev(&job, Stage::Vision), 3).await.unwrap();
    assert!(
        log.append_final_as(ev(&job, Stage::Done), 3)
            .await
            .unwrap()
            .is_some(),
        "the new run has its own final event"
    );
    log.expire(&job, Duration::ZERO).await.unwrap();
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
    let lease = Duration::from_millis(200);
    let b = queue.claim(lease, Duration::ZERO).await.unwrap().unwrap();
    assert_eq!(b.entry.job_id, "b");
    assert_eq!(
        queue
            .queued(&["a".into(), "b".into(), "z".into()])
            .await
            .unwrap(),
        HashSet::from(["b".to_owned()]),
        "a claimed entry is still queued; an acknowledged one is not"
    );
    let again = queue
        .claim(lease, Duration::from_secs(10))
        .await
        .unwrap()
        .expect("the expired lease is reclaimed");
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
    assert!(queue.queued(&["c".into()]).await.unwrap().is_empty());
}

fn new_job(user: &str, key: Option<&str>) -> NewJob {
    NewJob {
        id: uuid::Uuid::now_v7().to_string(),
        user_id: user.into(),
        image_key: "images/ab/abcdef".into(),
        content_type: "image/png".into(),
        hint: "bottle".into(),
        locale: "ko".into(),
        model: String::new(),
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

    let claimed = jobs.claim(&job.id, Stage::Vision).await.unwrap().unwrap();
    assert_eq!(claimed.lease_epoch, 1, "the first claim is epoch 1");
    assert_eq!(claimed.attempts, 1);
    assert_eq!(
        (claimed.status, claimed.stage),
        (JobStatus::Running, Stage::Vision),
        "a queued job is claimed running at the first stage"
    );
    assert!(
        jobs.claim(&uuid::Uuid::now_v7().to_string(), Stage::Vision)
            .await
            .unwrap()
            .is_none()
    );
    let epoch = claimed.lease_epoch;
    let c = Classification {
        major_category: "재활용폐기물".into(),
        middle_category: "무색페트병".into(),
        ..Default::default()
    };
    jobs.checkpoint(
        &job.id,
        epoch,
        Checkpoint::Classification(c.clone()),
        Some(Stage::Rule),
    )
    .await
    .unwrap();
    let got = jobs.get(&job.id).await.unwrap().unwrap();
    assert_eq!(
        (got.status, got.stage),
        (JobStatus::Running, Stage::Rule),
        "the checkpoint marks the next stage running"
    );
    let other = Classification {
        major_category: "일반종량제폐기물".into(),
        ..Default::default()
    };
    jobs.checkpoint(
        &job.id,
        epoch,
        Checkpoint::Classification(other),
        Some(Stage::Answer),
    )
    .await
    .unwrap();
    let got = jobs.get(&job.id).await.unwrap().unwrap();
    assert_eq!(got.status, JobStatus::Running);
    assert_eq!(got.attempts, 1);
    assert_eq!(got.classification, Some(c), "the first checkpoint is kept");
    assert_eq!(
        got.stage,
        Stage::Rule,
        "a second checkpoint of a stage changes nothing, its next stage included"
    );
    // Without a next stage (the last one's), the stage stays.
    jobs.checkpoint(
        &job.id,
        epoch,
        Checkpoint::Rules(DisposalRules::default()),
        None,
    )
    .await
    .unwrap();
    let got = jobs.get(&job.id).await.unwrap().unwrap();
    assert_eq!(got.stage, Stage::Rule);
    assert_eq!(got.rules, Some(DisposalRules::default()));

    let err = ErrorInfo {
        code: "UNAVAILABLE".into(),
        http_status: 503,
        message: "x".into(),
        retryable: true,
    };
    let ended = jobs
        .finish(&job.id, epoch, JobStatus::Failed, Some(err.clone()))
        .await
        .unwrap()
        .expect("the first finish returns the row it ended");
    assert!(
        jobs.finish(&job.id, epoch, JobStatus::Succeeded, None)
            .await
            .unwrap()
            .is_none(),
        "a second finish changes nothing and returns no row"
    );
    let got = jobs.get(&job.id).await.unwrap().unwrap();
    assert_eq!(got, ended, "finish returned the row as stored");
    assert_eq!(got.status, JobStatus::Failed, "a terminal status is final");
    assert_eq!(got.error, Some(err));
    assert_eq!(
        got.stage,
        Stage::Rule,
        "a failed job keeps the stage it failed at"
    );
    assert!(got.finished_at.is_some());
    // Claiming a finished job again (a worker that must append its final event) leaves its
    // status and stage as they are.
    let again = jobs.claim(&job.id, Stage::Vision).await.unwrap().unwrap();
    assert_eq!(
        (again.status, again.stage, again.lease_epoch),
        (JobStatus::Failed, Stage::Rule, epoch + 1)
    );
    assert!(
        jobs.get(&uuid::Uuid::now_v7().to_string())
            .await
            .unwrap()
            .is_none()
    );

    let later = SystemTime::now() + Duration::from_secs(60);
    let left: HashSet<String> = jobs
        .unfinished(later, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|j| j.id)
        .collect();
    assert_eq!(
        left,
        HashSet::from([other_user.id.clone()]),
        "only jobs not yet terminal are unfinished"
    );
    assert!(
        jobs.unfinished(SystemTime::UNIX_EPOCH + Duration::from_secs(1), 100)
            .await
            .unwrap()
            .is_empty(),
        "jobs created after the cut-off are left alone"
    );

    fencing_conformance(jobs.as_ref()).await;
    dead_letter_conformance(jobs.as_ref()).await;

    // The model a scan chose is kept with it (and an empty one stays empty).
    let (chosen, _) = jobs
        .insert(NewJob {
            model: "gemini/gemini-2.0-flash".into(),
            ..new_job("u1", None)
        })
        .await
        .unwrap();
    assert_eq!(chosen.model, "gemini/gemini-2.0-flash");
    let read = jobs.get(&chosen.id).await.unwrap().unwrap();
    assert_eq!(read.model, "gemini/gemini-2.0-flash");
    assert_eq!(job.model, "");
}

fn fenced(r: Result<(), StoreError>) -> bool {
    matches!(r, Err(StoreError::Fenced { .. }))
}

/// A worker whose claim was taken over cannot write: every write carries its epoch.
async fn fencing_conformance(jobs: &dyn JobStore) {
    let (job, _) = jobs.insert(new_job("u3", None)).await.unwrap();
    let first = jobs.claim(&job.id, Stage::Vision).await.unwrap().unwrap();
    jobs.mark_running(&job.id, first.lease_epoch, Stage::Vision)
        .await
        .unwrap();
    // The lease was lost; another worker claims the job.
    let second = jobs.claim(&job.id, Stage::Vision).await.unwrap().unwrap();
    assert_eq!(second.lease_epoch, first.lease_epoch + 1);
    assert_eq!(second.attempts, 2, "each claim counts one attempt");

    let stale = Classification {
        major_category: "stale".into(),
        ..Default::default()
    };
    assert!(fenced(
        jobs.checkpoint(
            &job.id,
            first.lease_epoch,
            Checkpoint::Classification(stale),
            Some(Stage::Rule),
        )
        .await
    ));
    assert!(fenced(
        jobs.mark_running(&job.id, first.lease_epoch, Stage::Rule)
            .await
    ));
    assert!(matches!(
        jobs.finish(&job.id, first.lease_epoch, JobStatus::Succeeded, None)
            .await,
        Err(StoreError::Fenced { .. })
    ));
    let err = ErrorInfo {
        code: "INTERNAL".into(),
        http_status: 500,
        message: "stale".into(),
        retryable: false,
    };
    assert!(fenced(
        jobs.dead_letter(&job.id, first.lease_epoch, err, "attempts")
            .await
    ));
    let got = jobs.get(&job.id).await.unwrap().unwrap();
    assert_eq!(got.classification, None, "the stale checkpoint was refused");
    assert_eq!(
        (got.status, got.stage),
        (JobStatus::Running, Stage::Vision),
        "and so was its next stage"
    );
    assert!(got.dead_at.is_none());

    // The current claim writes.
    let current = Classification {
        major_category: "current".into(),
        ..Default::default()
    };
    jobs.checkpoint(
        &job.id,
        second.lease_epoch,
        Checkpoint::Classification(current.clone()),
        Some(Stage::Rule),
    )
    .await
    .unwrap();
    jobs.finish(&job.id, second.lease_epoch, JobStatus::Succeeded, None)
        .await
        .unwrap();
    let got = jobs.get(&job.id).await.unwrap().unwrap();
    assert_eq!(got.classification, Some(current));
    assert_eq!(got.status, JobStatus::Succeeded);
    assert_eq!(got.stage, Stage::Done);

    // The final event's position, once the log took it.
    assert_eq!(got.end_seq, None);
    jobs.set_end_seq(&job.id, 21).await.unwrap();
    assert_eq!(jobs.get(&job.id).await.unwrap().unwrap().end_seq, Some(21));
    // Only a finished job has an end.
    let (running, _) = jobs.insert(new_job("u1", None)).await.unwrap();
    jobs.set_end_seq(&running.id, 5).await.unwrap();
    assert_eq!(jobs.get(&running.id).await.unwrap().unwrap().end_seq, None);
}

/// Poison jobs are set aside, listed newest first, and an operator can requeue them.
async fn dead_letter_conformance(jobs: &dyn JobStore) {
    let err = |m: &str| ErrorInfo {
        code: "INTERNAL".into(),
        http_status: 500,
        message: m.into(),
        retryable: false,
    };
    let mut dead = Vec::new();
    for i in 0..3 {
        let (job, _) = jobs.insert(new_job("u4", None)).await.unwrap();
        let claimed = jobs.claim(&job.id, Stage::Vision).await.unwrap().unwrap();
        if i == 0 {
            jobs.checkpoint(
                &job.id,
                claimed.lease_epoch,
                Checkpoint::Rules(DisposalRules::default()),
                Some(Stage::Answer),
            )
            .await
            .unwrap();
        }
        // Each with the kind it was set aside for, which the dead-letter schedule reads.
        let kind = if i == 0 { "attempts" } else { "store" };
        jobs.dead_letter(
            &job.id,
            claimed.lease_epoch,
            err(&format!("poison {i}")),
            kind,
        )
        .await
        .unwrap();
        // A later finish changes nothing: the first terminal status stands.
        jobs.finish(&job.id, claimed.lease_epoch, JobStatus::Succeeded, None)
            .await
            .unwrap();
        let got = jobs.get(&job.id).await.unwrap().unwrap();
        assert_eq!(got.status, JobStatus::Failed);
        assert_eq!(got.error, Some(err(&format!("poison {i}"))));
        assert!(got.dead_at.is_some() && got.finished_at.is_some());
        assert_eq!(got.dead_reason.as_deref(), Some(kind));
        assert_eq!(got.auto_requeues, 0);
        dead.push(got);
        // Distinct times, so the order is defined (the stores keep milliseconds).
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Another failed, not dead-lettered, job is not listed.
    let (plain, _) = jobs.insert(new_job("u4", None)).await.unwrap();
    let c = jobs.claim(&plain.id, Stage::Vision).await.unwrap().unwrap();
    jobs.finish(
        &plain.id,
        c.lease_epoch,
        JobStatus::Failed,
        Some(err("plain")),
    )
    .await
    .unwrap();

    let listed: Vec<String> = jobs
        .dead_letters(None, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|j| j.id)
        .filter(|id| dead.iter().any(|d| &d.id == id))
        .collect();
    let newest_first: Vec<String> = dead.iter().rev().map(|j| j.id.clone()).collect();
    assert_eq!(listed, newest_first);
    assert!(
        !jobs
            .dead_letters(None, 100)
            .await
            .unwrap()
            .iter()
            .any(|j| j.id == plain.id)
    );
    assert_eq!(
        jobs.get(&plain.id).await.unwrap().unwrap().dead_reason,
        None,
        "a plain failure is no dead letter"
    );
    // Paging back in time: before the newest one's time, the two older ones.
    let page: Vec<String> = jobs
        .dead_letters(dead[2].dead_at, 100)
        .await
        .unwrap()
        .into_iter()
        .map(|j| j.id)
        .filter(|id| dead.iter().any(|d| &d.id == id))
        .collect();
    assert_eq!(page, vec![dead[1].id.clone(), dead[0].id.clone()]);
    assert_eq!(jobs.dead_letters(None, 1).await.unwrap().len(), 1);

    // Requeue: back to queued, attempts reset, checkpoints kept, no longer listed; the old
    // run's end is no longer the job's.
    jobs.set_end_seq(&dead[0].id, 9).await.unwrap();
    let back = jobs.requeue(&dead[0].id, true).await.unwrap().unwrap();
    assert_eq!(back.status, JobStatus::Queued);
    assert_eq!(back.attempts, 0);
    assert_eq!(back.end_seq, None);
    assert_eq!(back.dead_reason, None);
    assert_eq!(back.auto_requeues, 1, "the schedule's requeue counts");
    assert!(back.dead_at.is_none() && back.error.is_none() && back.finished_at.is_none());
    assert_eq!(
        back.rules,
        Some(DisposalRules::default()),
        "checkpoints are kept"
    );
    assert!(
        jobs.requeue(&dead[0].id, false).await.unwrap().is_none(),
        "a job not dead-lettered is not requeued"
    );
    assert!(jobs.requeue(&plain.id, true).await.unwrap().is_none());
    // An operator's requeue starts the schedule's count over.
    let by_operator = jobs.requeue(&dead[1].id, false).await.unwrap().unwrap();
    assert_eq!(by_operator.auto_requeues, 0);
    assert!(
        !jobs
            .dead_letters(None, 100)
            .await
            .unwrap()
            .iter()
            .any(|j| j.id == dead[0].id)
    );
    // The requeued job runs again under a new claim.
    let again = jobs
        .claim(&dead[0].id, Stage::Vision)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (again.status, again.stage),
        (JobStatus::Running, Stage::Vision),
        "a requeued job is claimed like a new one"
    );
    assert!(again.lease_epoch > dead[0].lease_epoch);
    jobs.finish(&dead[0].id, again.lease_epoch, JobStatus::Succeeded, None)
        .await
        .unwrap();
    assert_eq!(
        jobs.get(&dead[0].id).await.unwrap().unwrap().status,
        JobStatus::Succeeded
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

fn upload(user: &str, expires_at: SystemTime) -> Upload {
    let id = uuid::Uuid::new_v4().to_string();
    Upload {
        object_key: format!("uploads/{id}"),
        id,
        user_id: user.into(),
        content_type: "image/png".into(),
        size_bytes: 12_345,
        // Whole microseconds, as the store keeps times.
        created_at: SystemTime::UNIX_EPOCH + Duration::from_micros(1_764_640_800_123_456),
        expires_at,
        job_id: None,
    }
}

/// Direct uploads: recorded and read back as they were, submitted (claimed) once, given back
/// by the job that claimed them only, listed once expired, deleted once.
async fn upload_conformance(jobs: &dyn JobStore) {
    let at = |s| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
    let early = upload("u1", at(1_800_000_000));
    let late = upload("u2", at(1_800_000_600));
    jobs.create_upload(&early).await.unwrap();
    jobs.create_upload(&late).await.unwrap();
    assert_eq!(
        jobs.get_upload(&early.id).await.unwrap().as_ref(),
        Some(&early)
    );
    assert!(jobs.get_upload("missing").await.unwrap().is_none());
    assert!(
        jobs.create_upload(&early).await.is_err(),
        "an id is recorded once"
    );

    assert!(jobs.claim_upload(&early.id, "job-a").await.unwrap());
    assert!(
        !jobs.claim_upload(&early.id, "job-b").await.unwrap(),
        "submitted once"
    );
    jobs.release_upload(&early.id, "job-b").await.unwrap();
    assert_eq!(
        jobs.get_upload(&early.id)
            .await
            .unwrap()
            .unwrap()
            .job_id
            .as_deref(),
        Some("job-a"),
        "only the job that claimed it gives it back"
    );
    jobs.release_upload(&early.id, "job-a").await.unwrap();
    assert_eq!(
        jobs.get_upload(&early.id).await.unwrap().unwrap().job_id,
        None
    );
    assert!(jobs.claim_upload(&early.id, "job-c").await.unwrap());
    assert!(!jobs.claim_upload("missing", "job-c").await.unwrap());

    let expired = |before, limit| jobs.expired_uploads(at(before), limit);
    assert!(expired(1_800_000_000, 10).await.unwrap().is_empty());
    let ids = |v: Vec<Upload>| v.into_iter().map(|u| u.id).collect::<Vec<_>>();
    assert_eq!(
        ids(expired(1_800_000_001, 10).await.unwrap()),
        std::slice::from_ref(&early.id)
    );
    assert_eq!(
        ids(expired(1_900_000_000, 10).await.unwrap()),
        [early.id.clone(), late.id.clone()],
        "oldest first, submitted or not"
    );
    assert_eq!(
        ids(expired(1_900_000_000, 1).await.unwrap()),
        std::slice::from_ref(&early.id)
    );

    assert!(jobs.delete_upload(&early.id).await.unwrap());
    assert!(
        !jobs.delete_upload(&early.id).await.unwrap(),
        "deleted once"
    );
    assert!(jobs.get_upload(&early.id).await.unwrap().is_none());
    assert!(jobs.delete_upload(&late.id).await.unwrap());
    assert!(expired(1_900_000_000, 10).await.unwrap().is_empty());
}

#[tokio::test]
async fn sqlite_upload_store_conforms() {
    let dir = tempfile::tempdir().unwrap();
    upload_conformance(&SqliteJobStore::open_in(dir.path()).await.unwrap()).await;
}

// The object store (local directory and S3) has its suite where it is defined:
// `services/objects/tests/conformance.rs`.

// ---------------------------------------------------------------------------------------------
// Production implementations, against the servers `infra/services.sh` starts.

fn redis_url() -> String {
    std::env::var("TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

fn database_url() -> String {
    std::env::var("TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// This test's own Redis keys (`t:<uuid>:…`) and connection name, on the shared server
/// (`TEST_REDIS_URL`, keys deleted at the end) or on a private three-master Cluster.
struct RedisScope {
    prefix: String,
    redis: Redis,
    url: String,
    cluster: Option<PrivateCluster>,
}

impl RedisScope {
    async fn new() -> Self {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let url = redis_url();
        let redis = Redis::connect(&Settings::single(&url), &format!("test-{id}"))
            .await
            .unwrap_or_else(|e| {
                panic!("redis at {url} (TEST_REDIS_URL) is unreachable: {e}; start it with infra/services.sh")
            });
        Self {
            prefix: format!("t:{id}:"),
            redis,
            url,
            cluster: None,
        }
    }

    /// A private Redis Cluster of three masters, for this test alone.
    async fn cluster() -> Self {
        let cluster = PrivateCluster::start().await;
        let id = uuid::Uuid::new_v4().simple().to_string();
        let redis = Redis::connect(&cluster.settings(), &format!("test-{id}"))
            .await
            .expect("connect to the private cluster");
        Self {
            prefix: format!("t:{id}:"),
            redis,
            url: cluster.urls()[0].clone(),
            cluster: Some(cluster),
        }
    }

    async fn raw(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap()
    }

    /// Connections named after this test, as Redis sees them.
    async fn connections(&self) -> usize {
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(&mut self.raw().await)
            .await
            .unwrap();
        let name = format!(" name={} ", self.redis.name());
        list.lines().filter(|l| l.contains(&name)).count()
    }

    async fn cleanup(self) {
        if self.cluster.is_some() {
            // The cluster's processes go with it.
            return;
        }
        let mut raw = self.raw().await;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*", self.prefix))
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
    }
}

/// This test's own PostgreSQL schema; dropped at the end.
struct PgScope {
    schema: String,
    store: PgJobStore,
}

impl PgScope {
    async fn new() -> Self {
        let schema = format!("t_{}", uuid::Uuid::new_v4().simple());
        let url = database_url();
        let store = PgJobStore::connect_in_schema(&url, Some(&schema))
            .await
            .unwrap_or_else(|e| {
                panic!("postgresql at {url} (TEST_DATABASE_URL) is unreachable: {e}; start it with infra/services.sh")
            });
        Self { schema, store }
    }

    async fn cleanup(self) {
        use sqlx::Connection;
        self.store.close().await;
        let mut conn = sqlx::PgConnection::connect(&database_url()).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA {} CASCADE",
            self.schema
        )))
        .execute(&mut conn)
        .await
        .unwrap();
    }
}

#[tokio::test]
async fn redis_event_log_conforms() {
    let scope = RedisScope::new().await;
    let log = RedisEventLog::open(&scope.redis, &scope.prefix, 100);
    event_log_conformance(Arc::new(log)).await;
    scope.cleanup().await;
}

#[tokio::test]
async fn redis_cluster_event_log_conforms() {
    let scope = RedisScope::cluster().await;
    let log = RedisEventLog::open(&scope.redis, &scope.prefix, 100);
    event_log_conformance(Arc::new(log)).await;
    scope.cleanup().await;
}

#[tokio::test]
async fn redis_event_log_trims_to_about_max_len_events_per_job() {
    let scope = RedisScope::new().await;
    let log = RedisEventLog::open(&scope.redis, &scope.prefix, 10);
    for _ in 0..500 {
        log.append(ev("j", Stage::Answer)).await.unwrap();
    }
    let kept = log.read_after("j", None).await.unwrap();
    // `MAXLEN ~` trims whole nodes: at least max_len, far fewer than appended.
    assert!(
        (10..500).contains(&kept.len()),
        "kept {} events",
        kept.len()
    );
    assert_eq!(kept.last().unwrap().seq, 500, "seq keeps counting");
    scope.cleanup().await;
}

/// Events appended by one process reach the feed of another, whichever shard the job is on.
async fn feeds_reach_other_processes(scope: &RedisScope, settings: Settings) {
    let writer = RedisEventLog::open(&scope.redis, &scope.prefix, 100);
    let other = Redis::connect(&settings, "test-reader").await.unwrap();
    let reader = RedisEventLog::open(&other, &scope.prefix, 100);
    let mut feed = reader.feed().await.unwrap();
    for _ in 0..8 {
        let job = uuid::Uuid::now_v7().to_string();
        let before = writer.append(ev(&job, Stage::Queued)).await.unwrap();
        let appended = writer.append(ev(&job, Stage::Vision)).await.unwrap();
        let first = next_event(&mut feed, &job).await;
        assert_eq!(first.event_id, before.event_id);
        let got = next_event(&mut feed, &job).await;
        assert_eq!(got.event_id, appended.event_id);
        assert_eq!(got.seq, 2);
        assert_eq!(got.job_id, job);
    }
}

/// Two processes writing one job's log (a worker that lost its lease and the one that took
/// it over) cannot fork it: the stale writer's append is refused, and after it has read the
/// log's end again it appends after the other's events.
async fn a_stale_writer_cannot_fork_a_log(scope: &RedisScope, settings: Settings) {
    let a = RedisEventLog::open(&scope.redis, &scope.prefix, 100);
    let other = Redis::connect(&settings, "test-second-writer")
        .await
        .unwrap();
    let b = RedisEventLog::open(&other, &scope.prefix, 100);
    let job = uuid::Uuid::now_v7().to_string();
    assert_eq!(a.append(ev(&job, Stage::Vision)).await.unwrap().seq, 1);
    assert_eq!(b.append(ev(&job, Stage::Vision)).await.unwrap().seq, 2);
    let refused = a.append(ev(&job, Stage::Vision)).await;
    assert!(
        matches!(refused, Err(StoreError::Conflict(_))),
        "the stale writer is refused: {refused:?}"
    );
    assert_eq!(a.append(ev(&job, Stage::Vision)).await.unwrap().seq, 3);
    let seqs: Vec<u64> = a
        .read_after(&job, None)
        .await
        .unwrap()
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(seqs, [1, 2, 3], "one log, no event twice");
}

/// Appends are sent by the script's SHA: a Redis that restarted empty (no scripts cached)
/// answers `NOSCRIPT` once, the script is loaded again, and appends go on.
#[tokio::test]
async fn redis_event_log_appends_after_a_restarted_redis_lost_its_scripts() {
    let mut server = PrivateRedis::start().await;
    let redis = Redis::connect(&server.settings(), "test-restart")
        .await
        .unwrap();
    let log = RedisEventLog::open(&redis, "t:", 100);
    let first = uuid::Uuid::now_v7().to_string();
    assert_eq!(log.append(ev(&first, Stage::Queued)).await.unwrap().seq, 1);

    server.kill();
    server.start_again().await;
    let job = uuid::Uuid::now_v7().to_string();
    // The first tries may meet the reconnecting connection; the script is what is tested.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let appended = loop {
        match log.append(ev(&job, Stage::Queued)).await {
            Ok(e) => break e,
            Err(_) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("appends did not resume after the restart: {e}"),
        }
    };
    assert_eq!(appended.seq, 1);
    let kept: Vec<u64> = log
        .read_after(&job, None)
        .await
        .unwrap()
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(kept, [1]);
}

#[tokio::test]
async fn redis_event_log_refuses_a_stale_writer() {
    let scope = RedisScope::new().await;
    a_stale_writer_cannot_fork_a_log(&scope, Settings::single(redis_url())).await;
    scope.cleanup().await;
}

#[tokio::test]
async fn redis_cluster_event_log_refuses_a_stale_writer() {
    let scope = RedisScope::cluster().await;
    let settings = scope.cluster.as_ref().unwrap().settings();
    a_stale_writer_cannot_fork_a_log(&scope, settings).await;
    scope.cleanup().await;
}

/// A worker that claims a job goes on from the end of its log whoever wrote it (the fence
/// tells it where the end is), and a writer that guessed a new log for a job whose log exists
/// goes on from its end too.
async fn a_claim_goes_on_from_the_logs_end(scope: &RedisScope, settings: Settings) {
    let submitter = RedisEventLog::open(&scope.redis, &scope.prefix, 100);
    let other = Redis::connect(&settings, "test-claimer").await.unwrap();
    let worker = RedisEventLog::open(&other, &scope.prefix, 100);
    let job = uuid::Uuid::now_v7().to_string();
    for want in 1..=3 {
        let got = submitter.append(ev(&job, Stage::Queued)).await.unwrap();
        assert_eq!(got.seq, want);
    }
    worker.fence(&job, 1).await.unwrap();
    let next = worker.append_as(ev(&job, Stage::Vision), 1).await.unwrap();
    assert_eq!(next.seq, 4, "the claim goes on after the three events");
    assert!(
        matches!(
            submitter.append(ev(&job, Stage::Queued)).await,
            Err(StoreError::Fenced { .. })
        ),
        "the writer before the claim is fenced"
    );
    // A third process writing before any claim on a log it does not know: its guess (a new
    // log) is refused by the log and it goes on from the end.
    let third_conn = Redis::connect(&settings, "test-third").await.unwrap();
    let third = RedisEventLog::open(&third_conn, &scope.prefix, 100);
    let other_job = uuid::Uuid::now_v7().to_string();
    submitter
        .append(ev(&other_job, Stage::Queued))
        .await
        .unwrap();
    let appended = third.append(ev(&other_job, Stage::Vision)).await.unwrap();
    assert_eq!(appended.seq, 2);
    let seqs: Vec<u64> = worker
        .read_after(&job, None)
        .await
        .unwrap()
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(seqs, [1, 2, 3, 4], "one log, no event twice");
}

#[tokio::test]
async fn redis_event_log_claims_go_on_from_the_logs_end() {
    let scope = RedisScope::new().await;
    a_claim_goes_on_from_the_logs_end(&scope, Settings::single(redis_url())).await;
    scope.cleanup().await;
}

#[tokio::test]
async fn redis_event_log_says_when_redis_refuses_an_append() {
    let scope = RedisScope::new().await;
    // One shard, so the test knows the key.
    let log = RedisEventLog::with_settings(
        &scope.redis,
        &ecoscan_ingest::store::redis::EventLogSettings {
            prefix: scope.prefix.clone(),
            max_len: 100,
            shards: 1,
            ..Default::default()
        },
    );
    let job = uuid::Uuid::now_v7().to_string();
    let key = format!("{}scan:{{s0}}:{job}:events", scope.prefix);
    // The job's stream key holds something else (say, an operator's slip): the append is
    // refused with a message saying so, not taken for another writer's event.
    redis::cmd("SET")
        .arg(&key)
        .arg("not a stream")
        .query_async::<()>(&mut scope.redis.conn())
        .await
        .unwrap();
    match log.append(ev(&job, Stage::Queued)).await {
        Err(StoreError::Unavailable(message)) => {
            assert!(message.contains("refused"), "{message}");
        }
        other => panic!("expected Unavailable, got {other:?}"),
    }
    scope.cleanup().await;
}

#[tokio::test]
async fn redis_cluster_event_log_claims_go_on_from_the_logs_end() {
    let scope = RedisScope::cluster().await;
    let settings = scope.cluster.as_ref().unwrap().settings();
    a_claim_goes_on_from_the_logs_end(&scope, settings).await;
    scope.cleanup().await;
}

#[tokio::test]
async fn redis_event_log_feeds_a_watcher_events_appended_by_another_process() {
    let scope = RedisScope::new().await;
    feeds_reach_other_processes(&scope, Settings::single(redis_url())).await;
    scope.cleanup().await;
}

#[tokio::test]
async fn redis_cluster_event_log_feeds_every_shard_to_another_process() {
    let scope = RedisScope::cluster().await;
    let settings = scope.cluster.as_ref().unwrap().settings();
    feeds_reach_other_processes(&scope, settings).await;
    scope.cleanup().await;
}

#[tokio::test]
async fn redis_queue_conforms() {
    let scope = RedisScope::new().await;
    let queue = RedisQueue::open(&scope.redis, &scope.prefix, "c1")
        .await
        .unwrap();
    queue_conformance(Arc::new(queue)).await;
    scope.cleanup().await;
}

#[tokio::test]
async fn redis_cluster_queue_conforms() {
    let scope = RedisScope::cluster().await;
    let queue = RedisQueue::open(&scope.redis, &scope.prefix, "c1")
        .await
        .unwrap();
    queue_conformance(Arc::new(queue)).await;
    scope.cleanup().await;
}

/// Released leases are taken by the next claimer at once, long before they would run out.
async fn released_leases_are_claimed_at_once(first: Arc<dyn Queue>, next: Arc<dyn Queue>) {
    for i in 0..3 {
        first.enqueue(entry(&format!("r{i}"))).await.unwrap();
    }
    let held = first
        .claim_many(Duration::from_secs(3600), Duration::from_secs(5), 3)
        .await
        .unwrap();
    assert_eq!(held.len(), 3);
    // Nothing is claimable while the leases hold.
    assert!(
        first
            .claim(Duration::from_secs(3600), Duration::from_millis(50))
            .await
            .unwrap()
            .is_none()
    );
    first.release(&held[..2]).await.unwrap();
    let mut again: Vec<String> = next
        .claim_many(Duration::from_secs(3600), Duration::from_secs(5), 3)
        .await
        .unwrap()
        .into_iter()
        .map(|l| {
            assert_eq!(l.entry.deliveries, 1, "a release counts as a delivery");
            l.entry.job_id
        })
        .collect();
    again.sort();
    assert_eq!(
        again,
        ["r0", "r1"],
        "the released two, not the one still held"
    );
    first.release(&[]).await.unwrap();
}

#[tokio::test]
async fn memory_queue_hands_released_leases_to_the_next_claim() {
    let queue: Arc<dyn Queue> = Arc::new(MemoryQueue::new());
    released_leases_are_claimed_at_once(queue.clone(), queue).await;
}

#[tokio::test]
async fn redis_queue_hands_released_leases_to_another_process() {
    let scope = RedisScope::new().await;
    let first = RedisQueue::open(&scope.redis, &scope.prefix, "c1")
        .await
        .unwrap();
    let next = RedisQueue::open(&scope.redis, &scope.prefix, "c2")
        .await
        .unwrap();
    released_leases_are_claimed_at_once(Arc::new(first), Arc::new(next)).await;
    scope.cleanup().await;
}

/// Many leases renew in one round trip; only the holder's current deliveries are kept.
async fn leases_renew_in_batches(queue: Arc<dyn Queue>) {
    for i in 0..5 {
        queue.enqueue(entry(&format!("b{i}"))).await.unwrap();
    }
    let lease = Duration::from_secs(5);
    let held = queue.claim_many(lease, Duration::ZERO, 10).await.unwrap();
    assert_eq!(held.len(), 5, "a batch claim takes every ready entry");
    let kept = queue.extend_many(&held, lease).await.unwrap();
    assert_eq!(kept, vec![true; 5]);
    queue.ack(&held[2]).await.unwrap();
    let kept = queue.extend_many(&held, lease).await.unwrap();
    assert_eq!(
        kept,
        vec![true, true, false, true, true],
        "an acknowledged lease is gone"
    );
    for l in held.iter().filter(|l| l.id != held[2].id) {
        queue.ack(l).await.unwrap();
    }
    assert_eq!(queue.backlog().await.unwrap(), 0);
}

#[tokio::test]
async fn memory_queue_renews_leases_in_batches() {
    leases_renew_in_batches(Arc::new(MemoryQueue::new())).await;
}

#[tokio::test]
async fn redis_queue_renews_leases_in_batches() {
    let scope = RedisScope::new().await;
    let queue = RedisQueue::open(&scope.redis, &scope.prefix, "c1")
        .await
        .unwrap();
    leases_renew_in_batches(Arc::new(queue)).await;
    scope.cleanup().await;
}

/// A renewal that reaches Redis later than its sender waited for it — its connection given up
/// on, its bytes delivered when the network healed (issue 52) — renews nothing, judged by
/// Redis's own clock: the entry has been idle longer than any renewal sent in time can see.
#[tokio::test]
async fn redis_queue_ignores_a_renewal_that_arrives_after_its_sender_gave_up() {
    let scope = RedisScope::new().await;
    let settings = Settings::single(&scope.url).with_response_timeout(Duration::from_millis(300));
    let redis = Redis::connect(&settings, "test-late-renewal")
        .await
        .unwrap();
    let queue = RedisQueue::open(&redis, &scope.prefix, "c1").await.unwrap();
    queue.enqueue(entry("late")).await.unwrap();
    let lease = Duration::from_secs(30);
    let held = queue.claim(lease, Duration::ZERO).await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;

    // What Redis sees of a renewal sent just after a confirmed one and delivered a second
    // later: the entry idle 1 s, more than the 0.3 s its sender would have waited.
    let late = Lease {
        renewed: tokio::time::Instant::now(),
        ..held.clone()
    };
    assert!(
        !queue.extend(&late, lease).await.unwrap(),
        "a late renewal is refused"
    );
    // It reset nothing: the entry is as idle as before, so another one is refused as well.
    assert!(
        !queue.extend(&late, lease).await.unwrap(),
        "the first one reset the idle time"
    );
    // A renewal sent in time (its bound runs from the claim) renews.
    assert!(
        queue.extend(&held, lease).await.unwrap(),
        "a renewal in time is kept"
    );
    scope.cleanup().await;
}

/// A process that is gone leaves its consumer behind; once it holds nothing and has been idle
/// long enough, the living remove it, so the group does not grow with every restart.
#[tokio::test]
async fn redis_queue_forgets_the_consumers_of_processes_that_are_gone() {
    let scope = RedisScope::new().await;
    let dead = RedisQueue::open(&scope.redis, &scope.prefix, "dead")
        .await
        .unwrap();
    let alive = RedisQueue::open(&scope.redis, &scope.prefix, "alive")
        .await
        .unwrap();
    dead.enqueue(entry("j1")).await.unwrap();
    let lease = Duration::from_millis(200);
    let _lost = dead.claim(lease, Duration::ZERO).await.unwrap().unwrap();
    let consumers = || async {
        let infos: Vec<redis::Value> = redis::cmd("XINFO")
            .arg("CONSUMERS")
            .arg(format!("{}scan:dispatch", scope.prefix))
            .arg("ingest")
            .query_async(&mut scope.raw().await)
            .await
            .unwrap();
        infos.len()
    };
    assert_eq!(
        alive.forget_idle_claimers(Duration::ZERO).await.unwrap(),
        0,
        "a consumer holding an entry stays"
    );
    let taken = alive
        .claim(lease, Duration::from_secs(10))
        .await
        .unwrap()
        .expect("reclaimed after the lease");
    alive.ack(&taken).await.unwrap();
    assert_eq!(consumers().await, 2);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        alive
            .forget_idle_claimers(Duration::from_secs(3600))
            .await
            .unwrap(),
        0,
        "not idle long enough"
    );
    assert_eq!(
        alive
            .forget_idle_claimers(Duration::from_millis(20))
            .await
            .unwrap(),
        1
    );
    assert_eq!(consumers().await, 1, "only the living consumer is left");
    scope.cleanup().await;
}

#[tokio::test]
async fn redis_queue_hands_a_dead_consumers_entry_to_another_process() {
    let scope = RedisScope::new().await;
    let dead = RedisQueue::open(&scope.redis, &scope.prefix, "dead")
        .await
        .unwrap();
    let alive = RedisQueue::open(&scope.redis, &scope.prefix, "alive")
        .await
        .unwrap();
    dead.enqueue(entry("j1")).await.unwrap();
    let lease = Duration::from_millis(200);
    let lost = dead.claim(lease, Duration::ZERO).await.unwrap().unwrap();
    let taken = alive
        .claim(lease, Duration::from_secs(10))
        .await
        .unwrap()
        .expect("reclaimed after the lease");
    assert_eq!(taken.entry.job_id, "j1");
    assert_eq!(taken.entry.deliveries, 1);
    assert!(
        !dead.extend(&lost, lease).await.unwrap(),
        "the dead lease is lost"
    );
    alive.ack(&taken).await.unwrap();
    assert_eq!(alive.backlog().await.unwrap(), 0);
    scope.cleanup().await;
}

#[tokio::test]
async fn redis_queue_recovers_when_its_stream_and_group_vanish() {
    let scope = RedisScope::new().await;
    let queue = RedisQueue::open(&scope.redis, &scope.prefix, "c1")
        .await
        .unwrap();
    queue.enqueue(entry("j1")).await.unwrap();
    let held = queue
        .claim(Duration::from_secs(5), Duration::ZERO)
        .await
        .unwrap()
        .unwrap();
    // What a Redis restart without persistence does to this queue.
    redis::cmd("DEL")
        .arg(format!("{}scan:dispatch", scope.prefix))
        .query_async::<()>(&mut scope.raw().await)
        .await
        .unwrap();
    assert!(!queue.extend(&held, Duration::from_secs(5)).await.unwrap());
    queue.ack(&held).await.unwrap();
    queue.enqueue(entry("j2")).await.unwrap();
    let next = queue
        .claim(Duration::from_secs(5), Duration::from_secs(10))
        .await
        .unwrap()
        .expect("the group is recreated and new entries flow");
    assert_eq!(next.entry.job_id, "j2");
    queue.ack(&next).await.unwrap();
    scope.cleanup().await;
}

#[tokio::test]
async fn postgres_job_store_conforms() {
    let scope = PgScope::new().await;
    job_store_conformance(Arc::new(scope.store.clone())).await;
    scope.cleanup().await;
}

#[tokio::test]
async fn postgres_upload_store_conforms() {
    let scope = PgScope::new().await;
    upload_conformance(&scope.store).await;
    scope.cleanup().await;
}

#[tokio::test]
async fn postgres_migrations_apply_once_and_again_without_change() {
    let scope = PgScope::new().await;
    // A second start (or `ecoscan-ingest migrate`) on a migrated schema is a no-op.
    let again = PgJobStore::connect_in_schema(&database_url(), Some(&scope.schema))
        .await
        .unwrap();
    let (job, _) = again.insert(new_job("u", None)).await.unwrap();
    assert!(scope.store.get(&job.id).await.unwrap().is_some());
    again.close().await;
    scope.cleanup().await;
}

/// Unfinished jobs missing from the queue go back on it; queued, young and finished ones don't.
async fn sweeper_conformance(stores: Stores) {
    let (missing, _) = stores.jobs.insert(new_job("u", None)).await.unwrap();
    let (present, _) = stores.jobs.insert(new_job("u", None)).await.unwrap();
    stores.queue.enqueue(entry(&present.id)).await.unwrap();
    let (done, _) = stores.jobs.insert(new_job("u", None)).await.unwrap();
    stores
        .jobs
        .finish(&done.id, 0, JobStatus::Succeeded, None)
        .await
        .unwrap();

    assert_eq!(
        sweep_once(&stores, Duration::from_secs(3600))
            .await
            .unwrap(),
        0,
        "jobs younger than the grace period are left alone"
    );
    // Rows carry millisecond timestamps: let the clock pass them.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(sweep_once(&stores, Duration::ZERO).await.unwrap(), 1);
    let ids = [missing.id.clone(), present.id.clone(), done.id.clone()];
    assert_eq!(
        stores.queue.queued(&ids).await.unwrap(),
        HashSet::from([missing.id.clone(), present.id.clone()])
    );
    assert_eq!(
        sweep_once(&stores, Duration::ZERO).await.unwrap(),
        0,
        "a second pass finds everything queued"
    );
    assert_eq!(stores.queue.backlog().await.unwrap(), 2);
    for _ in 0..2 {
        let l = stores
            .queue
            .claim(Duration::from_secs(5), Duration::from_secs(5))
            .await
            .unwrap()
            .unwrap();
        stores.queue.ack(&l).await.unwrap();
    }
}

/// Claims the queue's next entry, which is `job_id`'s, and acknowledges it.
async fn take_next(queue: &dyn Queue, job_id: &str) {
    let l = queue
        .claim(Duration::from_secs(5), Duration::from_secs(5))
        .await
        .unwrap()
        .expect("an entry");
    assert_eq!(l.entry.job_id, job_id);
    queue.ack(&l).await.unwrap();
}

/// Sweepers of two replicas that find the same lost job at once put it back once.
async fn concurrent_sweepers_requeue_once(stores: Stores, other: Arc<dyn Queue>) {
    let (lost, _) = stores.jobs.insert(new_job("u", None)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let twin = Stores {
        queue: other,
        ..stores.clone()
    };
    let (a, b) = tokio::join!(
        sweep_once(&stores, Duration::ZERO),
        sweep_once(&twin, Duration::ZERO)
    );
    assert_eq!(a.unwrap() + b.unwrap(), 1, "one of the two re-enqueued it");
    assert_eq!(stores.queue.backlog().await.unwrap(), 1);
    take_next(stores.queue.as_ref(), &lost.id).await;
    // A reservation is one job's and one holder's: another job is not held back by it, nor
    // its own holder, which reserves it again.
    let hold = Duration::from_secs(5);
    assert!(stores.queue.reserve_requeue("x", hold, "a").await.unwrap());
    assert!(!twin.queue.reserve_requeue("x", hold, "b").await.unwrap());
    assert!(twin.queue.reserve_requeue("y", hold, "b").await.unwrap());
    assert!(twin.queue.reserve_requeue("x", hold, "a").await.unwrap());

    // A pass that reserved a job and then could not enqueue it (Redis refused the write:
    // `OOM`, a restart) leaves its reservation behind: the same sweeper's next pass puts the
    // job back; another sweeper's does not.
    let (stuck, _) = stores.jobs.insert(new_job("u", None)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(
        stores
            .queue
            .reserve_requeue(&stuck.id, Duration::from_secs(30), "sweeper-a")
            .await
            .unwrap()
    );
    assert_eq!(
        sweep_as(&twin, Duration::ZERO, "sweeper-b").await.unwrap(),
        0,
        "another sweeper holds it"
    );
    assert_eq!(
        sweep_as(&stores, Duration::ZERO, "sweeper-a")
            .await
            .unwrap(),
        1,
        "the sweeper that reserved it puts it back"
    );
    take_next(stores.queue.as_ref(), &stuck.id).await;
}

#[tokio::test]
async fn concurrent_sweepers_on_redis_requeue_a_lost_job_once() {
    let redis = RedisScope::new().await;
    let pg = PgScope::new().await;
    let dir = tempfile::tempdir().unwrap();
    let queue = |name: &'static str| {
        let (r, p) = (redis.redis.clone(), redis.prefix.clone());
        async move { Arc::new(RedisQueue::open(&r, &p, name).await.unwrap()) as Arc<dyn Queue> }
    };
    concurrent_sweepers_requeue_once(
        Stores {
            jobs: Arc::new(pg.store.clone()),
            events: Arc::new(RedisEventLog::open(&redis.redis, &redis.prefix, 10)),
            queue: queue("c1").await,
            objects: Arc::new(LocalObjectStore::open(dir.path()).await.unwrap()),
        },
        queue("c2").await,
    )
    .await;
    pg.cleanup().await;
    redis.cleanup().await;
}

#[tokio::test]
async fn concurrent_sweepers_on_the_embedded_stores_requeue_a_lost_job_once() {
    let dir = tempfile::tempdir().unwrap();
    let queue: Arc<dyn Queue> = Arc::new(MemoryQueue::new());
    concurrent_sweepers_requeue_once(
        Stores {
            jobs: Arc::new(SqliteJobStore::open_in(dir.path()).await.unwrap()),
            events: Arc::new(MemoryEventLog::new(10)),
            queue: queue.clone(),
            objects: Arc::new(LocalObjectStore::open(dir.path()).await.unwrap()),
        },
        queue,
    )
    .await;
}

#[tokio::test]
async fn sweeper_requeues_lost_jobs_on_the_embedded_stores() {
    let dir = tempfile::tempdir().unwrap();
    sweeper_conformance(Stores {
        jobs: Arc::new(SqliteJobStore::open_in(dir.path()).await.unwrap()),
        events: Arc::new(MemoryEventLog::new(10)),
        queue: Arc::new(MemoryQueue::new()),
        objects: Arc::new(LocalObjectStore::open(dir.path()).await.unwrap()),
    })
    .await;
}

#[tokio::test]
async fn sweeper_requeues_lost_jobs_on_redis_and_postgres() {
    let redis = RedisScope::new().await;
    let pg = PgScope::new().await;
    let dir = tempfile::tempdir().unwrap();
    sweeper_conformance(Stores {
        jobs: Arc::new(pg.store.clone()),
        events: Arc::new(RedisEventLog::open(&redis.redis, &redis.prefix, 10)),
        queue: Arc::new(
            RedisQueue::open(&redis.redis, &redis.prefix, "c1")
                .await
                .unwrap(),
        ),
        objects: Arc::new(LocalObjectStore::open(dir.path()).await.unwrap()),
    })
    .await;
    pg.cleanup().await;
    redis.cleanup().await;
}

#[tokio::test]
async fn the_hub_serves_200_watchers_over_a_fixed_number_of_redis_connections() {
    let scope = RedisScope::new().await;
    let dir = tempfile::tempdir().unwrap();
    let log: Arc<dyn EventLog> = Arc::new(RedisEventLog::open(&scope.redis, &scope.prefix, 100));
    let stores = Stores {
        jobs: Arc::new(SqliteJobStore::open_in(dir.path()).await.unwrap()),
        events: log.clone(),
        queue: Arc::new(
            RedisQueue::open(&scope.redis, &scope.prefix, "c1")
                .await
                .unwrap(),
        ),
        objects: Arc::new(LocalObjectStore::open(dir.path()).await.unwrap()),
    };
    let shutdown = CancellationToken::new();
    let hub = Hub::start(stores, HubConfig::default(), shutdown.clone())
        .await
        .unwrap();
    let before = scope.connections().await;
    assert!(
        (1..=4).contains(&before),
        "{before} connections for the process"
    );

    let jobs: Vec<String> = (0..200).map(|_| uuid::Uuid::now_v7().to_string()).collect();
    let mut subs = Vec::new();
    for job in &jobs {
        subs.push(hub.subscribe(job));
    }
    assert_eq!(hub.watchers(), 200);
    assert_eq!(
        scope.connections().await,
        before,
        "watchers never open connections"
    );

    // Every watcher still gets its own job's events.
    for job in &jobs {
        log.append(ev(job, Stage::Vision)).await.unwrap();
    }
    for (job, sub) in jobs.iter().zip(subs.iter_mut()) {
        let got = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match sub.recv().await.unwrap() {
                    HubItem::Event(ev, _) => return ev,
                    HubItem::Resync | HubItem::Fence(_) => {}
                }
            }
        })
        .await
        .expect("each watcher receives its job's event");
        assert_eq!(&got.job_id, job);
    }
    assert_eq!(scope.connections().await, before);
    drop(subs);
    assert_eq!(hub.watchers(), 0);
    shutdown.cancel();
    scope.cleanup().await;
}

#[tokio::test]
async fn redis_stores_recover_when_their_connections_are_killed() {
    let scope = RedisScope::new().await;
    let log = RedisEventLog::open(&scope.redis, &scope.prefix, 100);
    let queue = RedisQueue::open(&scope.redis, &scope.prefix, "c1")
        .await
        .unwrap();
    let job = uuid::Uuid::now_v7().to_string();
    let mut feed = log.feed().await.unwrap();
    // Make sure the queue's blocking connection is in use before it is killed.
    assert!(
        queue
            .claim(Duration::from_secs(5), Duration::from_millis(300))
            .await
            .unwrap()
            .is_none()
    );

    // What a Redis restart looks like to the client: every connection drops.
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut scope.raw().await)
        .await
        .unwrap();
    let name = format!(" name={} ", scope.redis.name());
    for line in list.lines().filter(|l| l.contains(&name)) {
        let id = line.split(' ').find_map(|f| f.strip_prefix("id=")).unwrap();
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("ID")
            .arg(id)
            .query_async::<()>(&mut scope.raw().await)
            .await
            .unwrap();
    }

    // Commands fail until the connections are back, then everything works again: events
    // appended once the feed has subscribed again reach it (what was published while it was
    // down is not delivered live; watchers read it from the log).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the log or its feed never recovered"
        );
        let Ok(appended) = log.append(ev(&job, Stage::Vision)).await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let got = tokio::time::timeout(Duration::from_millis(500), async {
            loop {
                match feed.recv(&|j| j == job).await {
                    Some(FeedItem::Event(ev, _)) if ev.event_id == appended.event_id => return *ev,
                    Some(_) => {}
                    None => panic!("the feed stopped"),
                }
            }
        })
        .await;
        if let Ok(got) = got {
            assert_eq!(got.seq, appended.seq);
            break;
        }
    }

    queue.enqueue(entry("after")).await.unwrap();
    let claimed = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the queue never recovered"
        );
        if let Ok(Some(l)) = queue
            .claim(Duration::from_secs(5), Duration::from_millis(300))
            .await
        {
            break l;
        }
    };
    assert_eq!(claimed.entry.job_id, "after");
    queue.ack(&claimed).await.unwrap();
    scope.cleanup().await;
}

/// A writer whose claim went stale publishes its events beside their `XADD`s, so the feed
/// carries one the stream refused; the newer claim's fence marker precedes it, and a watcher
/// drops it: it gets the newer writer's event with that seq, never the refused one.
async fn a_watcher_never_gets_an_event_its_log_refused(scope: &RedisScope, settings: Settings) {
    use futures::StreamExt as _;

    let dir = tempfile::tempdir().unwrap();
    let jobs: Arc<dyn JobStore> = Arc::new(SqliteJobStore::open_in(dir.path()).await.unwrap());
    let (job, _) = jobs.insert(new_job("u1", None)).await.unwrap();
    let stores = Stores {
        jobs: jobs.clone(),
        events: Arc::new(RedisEventLog::open(&scope.redis, &scope.prefix, 100)),
        queue: Arc::new(MemoryQueue::new()),
        objects: Arc::new(LocalObjectStore::open(dir.path()).await.unwrap()),
    };
    let shutdown = CancellationToken::new();
    let hub = Hub::start(stores, HubConfig::default(), shutdown.clone())
        .await
        .unwrap();
    // Two workers in two processes: `old` lost the job to `new`.
    let old = RedisEventLog::open(&scope.redis, &scope.prefix, 100);
    let other = Redis::connect(&settings, "test-new-worker").await.unwrap();
    let new = RedisEventLog::open(&other, &scope.prefix, 100);
    let with = |stage, message: &str| ScanEvent {
        message: message.into(),
        ..ev(&job.id, stage)
    };

    old.append(with(Stage::Queued, "queued")).await.unwrap();
    old.fence(&job.id, 1).await.unwrap();
    old.append_as(with(Stage::Vision, "first claim"), 1)
        .await
        .unwrap();
    let mut watch = hub.watch(job.clone(), None, None);
    let mut next = async || {
        tokio::time::timeout(Duration::from_secs(10), watch.next())
            .await
            .expect("an event within 10 s")
            .expect("the watch goes on")
            .expect("no error")
            .into_event()
            .expect("an event, not a resync")
    };
    assert_eq!(next().await.seq, 1);
    assert_eq!(next().await.seq, 2);

    new.fence(&job.id, 2).await.unwrap();
    let refused = old.append_as(with(Stage::Vision, "stale"), 1).await;
    assert!(
        matches!(refused, Err(StoreError::Fenced { .. })),
        "the stale writer is refused: {refused:?}"
    );
    let current = new
        .append_as(with(Stage::Vision, "second claim"), 2)
        .await
        .unwrap();
    assert_eq!(current.seq, 3, "the refused event took no number");
    new.append_final_as(with(Stage::Done, "done"), 2)
        .await
        .unwrap()
        .expect("the final event");

    let third = next().await;
    assert_eq!(
        (third.seq, third.message.as_str()),
        (3, "second claim"),
        "the watcher gets the event the log took"
    );
    let last = next().await;
    assert_eq!((last.seq, last.message.as_str()), (4, "done"));
    shutdown.cancel();
}

#[tokio::test]
async fn redis_watchers_never_get_an_event_the_log_refused() {
    let scope = RedisScope::new().await;
    a_watcher_never_gets_an_event_its_log_refused(&scope, Settings::single(redis_url())).await;
    scope.cleanup().await;
}

#[tokio::test]
async fn redis_cluster_watchers_never_get_an_event_the_log_refused() {
    let scope = RedisScope::cluster().await;
    let settings = scope.cluster.as_ref().unwrap().settings();
    a_watcher_never_gets_an_event_its_log_refused(&scope, settings).await;
    scope.cleanup().await;
}
