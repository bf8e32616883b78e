//! The watch protocol: every `Watch` ends — with the job's final event, at once when it resumes
//! at or past the end of a finished job (from the row when the log has expired), or when its
//! lifetime runs out — and a watcher that misses live events catches up from the log.

mod support;

use std::{sync::Arc, time::Duration};

use ecoscan_common::client::request_as;
use ecoscan_ingest::{Stores, store::MemoryEventLog};
use ecoscan_proto::v1::{EventStatus, ScanEvent, Stage, WatchRequest};
use support::*;
use tokio_stream::StreamExt;
use tonic::{Code, Status};

/// A watch of `job_id` after `after`, read to its end (or its error), within `limit`.
async fn watch_from(
    env: &Env,
    job_id: &str,
    after: &str,
    limit: Duration,
) -> (Vec<ScanEvent>, Option<Status>) {
    let mut stream = env
        .ingest
        .clone()
        .watch(request_as(
            WatchRequest {
                job_id: job_id.into(),
                after_event_id: after.into(),
            },
            Duration::from_secs(60),
            "u1",
        ))
        .await
        .unwrap()
        .into_inner();
    let mut events = Vec::new();
    let mut error = None;
    let read = async {
        while let Some(item) = stream.next().await {
            match item {
                Ok(r) => events.push(r.event.expect("every message carries an event")),
                Err(status) => {
                    error = Some(status);
                    break;
                }
            }
        }
    };
    tokio::time::timeout(limit, read)
        .await
        .unwrap_or_else(|_| panic!("the watch after {after:?} did not end within {limit:?}"));
    (events, error)
}

fn is_done(ev: &ScanEvent) -> bool {
    ev.stage == Stage::Done as i32
}

#[tokio::test]
async fn a_resume_at_the_final_event_ends_at_once_with_the_jobs_end() {
    let env = start(None, |_| {}).await;
    let job = submit_png(&env).await;
    let events = watch_all(&env, &job).await;
    let done = events.last().unwrap();
    assert!(is_done(done));

    let (again, error) = watch_from(&env, &job, &done.event_id, Duration::from_secs(5)).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(again.len(), 1, "only the end: {again:?}");
    assert!(is_done(&again[0]));
    assert_eq!(again[0].status, EventStatus::Completed as i32);
    assert_eq!(
        again[0].event_id, done.event_id,
        "the final event's id, so a resume stays put"
    );
}

#[tokio::test]
async fn a_resume_past_the_end_of_a_finished_job_ends_at_once() {
    let env = start(None, |_| {}).await;
    let job = submit_png(&env).await;
    watch_all(&env, &job).await;
    let (again, error) = watch_from(&env, &job, "99999999999999-0", Duration::from_secs(5)).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(again.len(), 1);
    assert!(is_done(&again[0]));
}

#[tokio::test]
async fn a_resume_past_the_end_of_a_running_job_goes_on_to_its_end() {
    let stages = Stages {
        answer_delay: Duration::from_millis(1500),
        ..Stages::new(None)
    };
    let env = start_with(stages, |_| {}, |s| s).await;
    let job = submit_png(&env).await;
    let (events, error) = watch_from(&env, &job, "99999999999999-0", Duration::from_secs(30)).await;
    assert!(error.is_none(), "{error:?}");
    assert!(
        events.last().is_some_and(is_done),
        "the watch reaches the job's end: {events:?}"
    );
}

#[tokio::test]
async fn a_resume_of_a_job_whose_log_expired_ends_with_the_end_from_its_row() {
    let env = start(None, |_| {}).await;
    let job = submit_png(&env).await;
    let events = watch_all(&env, &job).await;
    env.stores
        .events
        .expire(&job, Duration::ZERO)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(5)).await;
    // Touch the log so the expired entry is swept.
    env.stores
        .events
        .expire("another-job", Duration::ZERO)
        .await
        .unwrap();
    for after in ["", events[2].event_id.as_str(), "99999999999999-0"] {
        let (again, error) = watch_from(&env, &job, after, Duration::from_secs(5)).await;
        assert!(error.is_none(), "{error:?}");
        assert_eq!(again.len(), 1, "after {after:?}: {again:?}");
        assert!(is_done(&again[0]));
        assert_eq!(again[0].status, EventStatus::Completed as i32);
    }
}

/// A feed that keeps one event for a reader that falls behind, and watchers that may fall one
/// event behind: nearly every live event is "lost" on the way, yet every watcher still gets
/// every event once, in order, and ends — from the log.
#[tokio::test]
async fn watchers_catch_up_from_the_log_when_the_feed_loses_events() {
    let env = start_with(
        Stages::new(None),
        |c| c.hub.watcher_buffer = 1,
        |s| Stores {
            events: Arc::new(MemoryEventLog::with_feed_capacity(2048, 1)),
            ..s
        },
    )
    .await;
    let mut watchers = tokio::task::JoinSet::new();
    let env = Arc::new(env);
    for _ in 0..4 {
        let job = submit_png(&env).await;
        for _ in 0..3 {
            let (env, job) = (env.clone(), job.clone());
            watchers.spawn(async move { (job.clone(), watch_all(&env, &job).await) });
        }
    }
    while let Some(watched) = watchers.join_next().await {
        let (job, events) = watched.unwrap();
        let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
        let expected: Vec<u64> = (1..=seqs.len() as u64).collect();
        assert_eq!(seqs, expected, "job {job}: every event once, in order");
        assert!(events.last().is_some_and(is_done), "job {job} ends");
    }
}

#[tokio::test]
async fn a_watch_ends_when_its_lifetime_runs_out_and_resumes_where_it_stopped() {
    let stages = Stages {
        answer_delay: Duration::from_millis(2500),
        ..Stages::new(None)
    };
    let env = start_with(
        stages,
        |c| c.hub.max_lifetime = Duration::from_millis(800),
        |s| s,
    )
    .await;
    let job = submit_png(&env).await;
    let (first, error) = watch_from(&env, &job, "", Duration::from_secs(10)).await;
    let error = error.expect("the stream ends with a status when its lifetime runs out");
    assert_eq!(error.code(), Code::DeadlineExceeded, "{error:?}");
    assert!(error.message().contains("reconnect with the last event id"));
    assert!(!first.iter().any(is_done), "ended before the job did");

    // Resuming from the last event received, as the gateway does, gets the rest.
    let mut all = first.clone();
    let mut after = first.last().map(|e| e.event_id.clone()).unwrap_or_default();
    for _ in 0..20 {
        let (more, _) = watch_from(&env, &job, &after, Duration::from_secs(10)).await;
        if let Some(last) = more.last() {
            after.clone_from(&last.event_id);
        }
        all.extend(more);
        if all.last().is_some_and(is_done) {
            break;
        }
    }
    let seqs: Vec<u64> = all.iter().map(|e| e.seq).collect();
    let expected: Vec<u64> = (1..=seqs.len() as u64).collect();
    assert_eq!(
        seqs, expected,
        "nothing lost or repeated across the resumes"
    );
    assert!(all.last().is_some_and(is_done));
}
