//! Faults that must end a job rather than wedge it: poison jobs are dead-lettered (and an
//! operator can list and requeue them), and a stage stream that stalls is cut by its idle
//! deadline. Real sockets, in-test stage services, embedded stores.

mod support;

use std::{collections::HashMap, time::Duration};

use bytes::Bytes;
use ecoscan_common::client::{as_admin, request_as};
use ecoscan_ingest::{Config, store::QueueEntry};
use ecoscan_proto::v1::{
    EventStatus, JobStatus, ListDeadLettersRequest, RequeueDeadLetterRequest, ScanEvent, Stage,
    scan_event::Payload,
};
use support::*;
use tonic::Code;

/// A job row and its queue entry, as `Submit` leaves them, for an image stored at `image_key`
/// (or not stored at all).
async fn insert_queued(env: &Env, image_key: &str) -> String {
    let (job, _) = env.stores.jobs.insert(new_job(image_key)).await.unwrap();
    enqueue(env, &job.id).await;
    job.id
}

async fn enqueue(env: &Env, job_id: &str) {
    env.stores
        .queue
        .enqueue(QueueEntry {
            job_id: job_id.into(),
            carrier: HashMap::new(),
            deliveries: 0,
            enqueued_at: std::time::SystemTime::now(),
        })
        .await
        .unwrap();
}

/// Ingest on `stages` (its config changed by `tweak`) with one scan of the test PNG, watched
/// to its end: the harness, the job's id and every event of the job.
async fn scan_through(
    stages: Stages,
    tweak: impl FnOnce(&mut Config),
) -> (Env, String, Vec<ScanEvent>) {
    let env = start_with(stages, tweak, |s| s).await;
    let job_id = submit_png(&env).await;
    let events = watch_all(&env, &job_id).await;
    (env, job_id, events)
}

fn error_of(event: &ScanEvent) -> &ecoscan_proto::v1::ErrorInfo {
    match &event.payload {
        Some(Payload::Error(e)) => e,
        other => panic!("expected an error payload, got {other:?}"),
    }
}

#[tokio::test]
async fn a_job_whose_image_is_gone_is_dead_lettered_and_an_operator_can_requeue_it() {
    let env = start(None, |_| {}).await;
    let key = "images/zz/gone";
    let job_id = insert_queued(&env, key).await;

    // The job ends (it does not retry forever): failed, with the final event.
    let events = watch_all(&env, &job_id).await;
    let last = events.last().unwrap();
    assert_eq!(last.stage, Stage::Done as i32, "{events:#?}");
    let error = error_of(last);
    assert_eq!(error.code, "INTERNAL");
    assert!(!error.retryable);
    assert!(
        error.message.contains("set aside for an operator"),
        "{}",
        error.message
    );
    assert!(
        !error.message.contains(key),
        "the user is not told storage details: {}",
        error.message
    );
    assert_eq!(env.stages.count("vision"), 0, "no stage ran");
    let row = env.stores.jobs.get(&job_id).await.unwrap().unwrap();
    assert_eq!(row.status, JobStatus::Failed);
    assert!(row.dead_at.is_some());

    // Only an admin sees the dead letters.
    let refused = env
        .admin
        .clone()
        .list_dead_letters(request_as(
            ListDeadLettersRequest::default(),
            Duration::from_secs(10),
            "u1",
        ))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied);
    let listed = env
        .admin
        .clone()
        .list_dead_letters(as_admin(ListDeadLettersRequest::default()))
        .await
        .unwrap()
        .into_inner()
        .dead_letters;
    assert_eq!(listed.len(), 1);
    let dead = &listed[0];
    assert_eq!(dead.job.as_ref().unwrap().job_id, job_id);
    assert_eq!(dead.attempts, 1);
    assert!(dead.dead_at.is_some());

    // Bad requeues say what is wrong.
    let bad = env
        .admin
        .clone()
        .requeue_dead_letter(as_admin(RequeueDeadLetterRequest {
            job_id: "nope".into(),
        }))
        .await
        .unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    let unknown = env
        .admin
        .clone()
        .requeue_dead_letter(as_admin(RequeueDeadLetterRequest {
            job_id: uuid::Uuid::now_v7().to_string(),
        }))
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);

    // The operator puts the image back and requeues: the job runs again and succeeds, and
    // its watchers see the new run only.
    env.stores
        .objects
        .put(key, Bytes::from_static(PNG))
        .await
        .unwrap();
    let requeued = env
        .admin
        .clone()
        .requeue_dead_letter(as_admin(RequeueDeadLetterRequest {
            job_id: job_id.clone(),
        }))
        .await
        .unwrap()
        .into_inner()
        .job
        .unwrap();
    assert_eq!(requeued.status, JobStatus::Queued as i32);
    let events = watch_all(&env, &job_id).await;
    let last = events.last().unwrap();
    assert_eq!(last.stage, Stage::Done as i32);
    assert_eq!(last.status, EventStatus::Completed as i32, "{events:#?}");
    assert!(
        !events
            .iter()
            .any(|e| matches!(e.payload, Some(Payload::Error(_)))),
        "the old run's failure is not replayed: {events:#?}"
    );
    assert_eq!(env.stages.count("vision"), 1);
    let row = env.stores.jobs.get(&job_id).await.unwrap().unwrap();
    assert_eq!(row.status, JobStatus::Succeeded);
    assert!(row.dead_at.is_none());

    // A job that is not dead-lettered cannot be requeued.
    let again = env
        .admin
        .clone()
        .requeue_dead_letter(as_admin(RequeueDeadLetterRequest { job_id }))
        .await
        .unwrap_err();
    assert_eq!(again.code(), Code::FailedPrecondition);
}

#[tokio::test]
async fn a_job_delivered_more_often_than_the_limit_is_dead_lettered() {
    let env = start(None, |c| c.max_attempts = 3).await;
    let job = insert_with_image(&env, "images/ab/crashes").await;
    // Three workers claimed it and died (a job that crashes its worker every time).
    for _ in 0..3 {
        env.stores
            .jobs
            .claim(&job.id, Stage::Vision)
            .await
            .unwrap()
            .unwrap();
    }
    enqueue(&env, &job.id).await;

    let events = watch_all(&env, &job.id).await;
    let error = error_of(events.last().unwrap());
    assert!(
        error.message.contains("started 3 times"),
        "{}",
        error.message
    );
    assert_eq!(
        env.stages.count("vision"),
        0,
        "the fourth delivery runs nothing"
    );
    let row = env.stores.jobs.get(&job.id).await.unwrap().unwrap();
    assert_eq!(row.status, JobStatus::Failed);
    assert!(row.dead_at.is_some());
}

#[tokio::test]
async fn the_schedule_retries_a_job_that_kept_dying_and_never_a_poison_input() {
    let env = start(None, |c| {
        c.max_attempts = 2;
        c.dead_letter_retry = "attempts:1x200ms".parse().unwrap();
        c.dead_letter_interval = Duration::from_millis(50);
    })
    .await;
    // Two workers claimed it and died: the next delivery sets it aside (`attempts`), and the
    // schedule puts it back once; with the crash behind it, it runs to the end.
    let recovers = insert_with_image(&env, "images/ab/recovers").await;
    for _ in 0..2 {
        env.stores
            .jobs
            .claim(&recovers.id, Stage::Vision)
            .await
            .unwrap()
            .unwrap();
    }
    enqueue(&env, &recovers.id).await;
    // An image that is gone (`store`): a poison input, which the schedule never retries.
    let poison = insert_queued(&env, "images/zz/gone").await;

    let mut row = env.stores.jobs.get(&recovers.id).await.unwrap().unwrap();
    for _ in 0..600 {
        if row.status == JobStatus::Succeeded {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        row = env.stores.jobs.get(&recovers.id).await.unwrap().unwrap();
    }
    assert_eq!(row.status, JobStatus::Succeeded, "{row:?}");
    assert_eq!(row.auto_requeues, 1, "requeued once, by the schedule");
    assert!(row.dead_at.is_none() && row.dead_reason.is_none());
    assert_eq!(
        env.stages.count("vision"),
        1,
        "it ran once, after the requeue"
    );

    // Several passes later the poison input is still set aside, never requeued.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let poison = env.stores.jobs.get(&poison).await.unwrap().unwrap();
    assert_eq!(poison.status, JobStatus::Failed);
    assert_eq!(poison.dead_reason.as_deref(), Some("store"));
    assert_eq!(poison.auto_requeues, 0);
    assert!(poison.dead_at.is_some());
}

#[tokio::test]
async fn a_stage_stream_that_stalls_is_cut_by_its_idle_deadline() {
    let stages = Stages {
        answer_stalls: true,
        ..Stages::new(None)
    };
    let (env, job_id, events) = scan_through(stages, |c| {
        c.stage_idle_timeout = Duration::from_millis(300);
        c.stage_retries = 1;
    })
    .await;
    let last = events.last().unwrap();
    let error = error_of(last);
    assert_eq!(error.code, "DEADLINE_EXCEEDED", "{events:#?}");
    assert!(error.message.contains("answer"), "{}", error.message);
    assert_eq!(env.stages.count("answer"), 2, "one call and one retry");
    assert_eq!(env.stages.count("reward"), 0);
    let result = result_of(&env, &job_id).await;
    assert_eq!(result.status, JobStatus::Failed as i32);
    assert_eq!(result.stage, Stage::Answer as i32);
}

#[tokio::test]
async fn a_stage_that_keeps_sending_is_cut_by_its_total_deadline() {
    // Answer thinks for 2 s before its first message: longer than the whole stage may take.
    let stages = Stages {
        answer_delay: Duration::from_secs(2),
        ..Stages::new(None)
    };
    let (env, _, events) = scan_through(stages, |c| {
        c.stage_timeout = Duration::from_millis(400);
        c.stage_retries = 0;
    })
    .await;
    let error = error_of(events.last().unwrap());
    assert_eq!(error.code, "DEADLINE_EXCEEDED", "{events:#?}");
    assert_eq!(env.stages.count("answer"), 1);
}
