//! The watch protocol: every `Watch` ends — with the job's final event, at once when it resumes
//! at or past the end of a finished job (from the row when the log has expired), or when its
//! lifetime runs out — a watcher that misses live events catches up from the log, and a gap the
//! log can no longer fill is announced (a resync), never skipped.

mod support;

use std::{sync::Arc, time::Duration};

use ecoscan_common::client::request_as;
use ecoscan_ingest::{
    Stores,
    event::Watched,
    store::{EventId, MemoryEventLog},
};
use ecoscan_proto::v1::{
    EventStatus, JobStatus, ResyncReason, ScanEvent, ScanResult, Stage, WatchRequest,
    scan_event::Payload,
};
use support::*;
use tokio_stream::StreamExt;
use tonic::{Code, Status};

/// One message of a watch stream, as the hub hands it to the RPC.
type Msg = Watched;

/// A watch of `job_id` after `after`, read to its end (or its error), within `limit`.
async fn watch_msgs(
    env: &Env,
    job_id: &str,
    after: &str,
    limit: Duration,
) -> Result<(Vec<Msg>, Option<Status>), Status> {
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
        .await?
        .into_inner();
    let mut msgs = Vec::new();
    let mut error = None;
    let read = async {
        while let Some(item) = stream.next().await {
            match item {
                Ok(r) => msgs.push(match (r.event, r.resync) {
                    (Some(e), None) => Msg::Event(e),
                    (None, Some(r)) => Msg::Resync(r),
                    other => panic!("a message carries an event or a resync: {other:?}"),
                }),
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
    Ok((msgs, error))
}

/// [`watch_msgs`] of a stream that carries events only.
async fn watch_from(
    env: &Env,
    job_id: &str,
    after: &str,
    limit: Duration,
) -> (Vec<ScanEvent>, Option<Status>) {
    let (msgs, error) = watch_msgs(env, job_id, after, limit).await.unwrap();
    let events = msgs
        .into_iter()
        .map(|m| match m {
            Msg::Event(e) => e,
            Msg::Resync(r) => panic!("no resync expected after {after:?}: {r:?}"),
        })
        .collect();
    (events, error)
}

fn event(msg: &Msg) -> Option<&ScanEvent> {
    match msg {
        Msg::Event(e) => Some(e),
        Msg::Resync(_) => None,
    }
}

fn is_done(ev: &ScanEvent) -> bool {
    ev.stage == Stage::Done as i32
}

/// The id `<T>-<n>` of job `job_id` (its events' ids all start with the job's time).
fn id_of(job_id: &str, n: u64) -> String {
    EventId::of(job_id, n).to_string()
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
        (again[0].event_id.as_str(), again[0].seq),
        (done.event_id.as_str(), done.seq),
        "the end rebuilt from the row stands where the log's final event does (never seq 0)"
    );
}

#[tokio::test]
async fn a_resume_past_the_end_of_a_finished_job_ends_at_once_at_the_logs_end() {
    let env = start(None, |_| {}).await;
    let job = submit_png(&env).await;
    let events = watch_all(&env, &job).await;
    let done = events.last().unwrap();
    let (again, error) = watch_from(&env, &job, &id_of(&job, 999), Duration::from_secs(5)).await;
    assert!(error.is_none(), "{error:?}");
    assert_eq!(again.len(), 1);
    assert!(is_done(&again[0]));
    assert_eq!(
        (again[0].event_id.as_str(), again[0].seq),
        (done.event_id.as_str(), done.seq)
    );
}

#[tokio::test]
async fn a_resume_past_the_end_of_a_running_job_is_announced_and_goes_on_to_its_end() {
    let stages = Stages {
        answer_delay: Duration::from_millis(1500),
        ..Stages::new(None)
    };
    let env = start_with(stages, |_| {}, |s| s).await;
    let job = submit_png(&env).await;
    let (msgs, error) = watch_msgs(&env, &job, &id_of(&job, 999), Duration::from_secs(30))
        .await
        .unwrap();
    assert!(error.is_none(), "{error:?}");
    let Some(Msg::Resync(gap)) = msgs.first() else {
        panic!("a resync comes first: {msgs:?}");
    };
    assert_eq!(gap.reason, ResyncReason::PastEnd as i32);
    assert_eq!(gap.after_event_id, id_of(&job, 999));
    assert!(
        gap.seq >= 1 && gap.event_id == id_of(&job, gap.seq),
        "{gap:?}"
    );
    // Then the events after the position it names, in order, to the end.
    let seqs: Vec<u64> = msgs[1..]
        .iter()
        .map(|m| event(m).expect("events").seq)
        .collect();
    let expected: Vec<u64> = (gap.seq + 1..=gap.seq + seqs.len() as u64).collect();
    assert_eq!(seqs, expected, "{msgs:?}");
    assert!(msgs.last().and_then(event).is_some_and(is_done), "{msgs:?}");
}

#[tokio::test]
async fn a_resume_with_an_id_of_another_job_or_a_malformed_id_is_invalid_argument() {
    let env = start(None, |_| {}).await;
    let job = submit_png(&env).await;
    let other = submit_png(&env).await;
    watch_all(&env, &job).await;
    // Jobs submitted within the same millisecond share their time: make the other id's
    // time differ for sure.
    let foreign = format!("{}-2", EventId::of(&other, 0).ms + 1);
    for bad in [foreign.as_str(), "99999999999999-0", "12", "a-1"] {
        let status = watch_msgs(&env, &job, bad, Duration::from_secs(5))
            .await
            .expect_err("refused before streaming");
        assert_eq!(status.code(), Code::InvalidArgument, "{bad}: {status:?}");
        assert!(
            status.message().contains(bad),
            "the message names the id: {status:?}"
        );
    }
}

/// A job run to its end, whose log then expired: the environment, the job and its events.
async fn a_finished_job_whose_log_expired() -> (Env, String, Vec<ScanEvent>) {
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
    (env, job, events)
}

#[tokio::test]
async fn a_resume_of_a_job_whose_log_expired_says_so_and_ends_with_the_end_from_its_row() {
    let (env, job, events) = a_finished_job_whose_log_expired().await;
    let done = events.last().unwrap();
    for after in ["", events[2].event_id.as_str()] {
        let (msgs, error) = watch_msgs(&env, &job, after, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(error.is_none(), "{error:?}");
        assert_eq!(msgs.len(), 2, "after {after:?}: {msgs:?}");
        let Msg::Resync(gap) = &msgs[0] else {
            panic!("the gap is said first: {msgs:?}")
        };
        assert_eq!(gap.reason, ResyncReason::LogExpired as i32);
        assert_eq!(gap.after_event_id, after);
        let end = event(&msgs[1]).expect("then the end");
        assert!(is_done(end));
        assert_eq!(end.status, EventStatus::Completed as i32);
        // The row recorded where the log's final event stood: the end keeps that position,
        // and the resync names the one before it.
        assert_eq!(
            (end.event_id.as_str(), end.seq),
            (done.event_id.as_str(), done.seq)
        );
        assert_eq!(gap.event_id, id_of(&job, done.seq - 1));
    }
    // At or past the end: the end, at once.
    for after in [done.event_id.clone(), id_of(&job, 999)] {
        let (again, error) = watch_from(&env, &job, &after, Duration::from_secs(5)).await;
        assert!(error.is_none(), "{error:?}");
        assert_eq!(again.len(), 1, "after {after:?}: {again:?}");
        assert_eq!(
            (again[0].event_id.as_str(), again[0].seq),
            (done.event_id.as_str(), done.seq)
        );
    }
}

#[tokio::test]
async fn a_job_whose_row_has_no_end_position_gets_its_log_closed_after_it_expired() {
    // A row finished before the end's position was recorded (an earlier version, or a worker
    // whose final append failed): the watcher closes the log, as a claim would, with the final
    // event numbered as a new run (above every seq the expired log gave, never an id it gave
    // another event), and the row records it.
    let (env, job, events) = a_finished_job_whose_log_expired().await;
    let db = sqlx::SqlitePool::connect(&format!(
        "sqlite://{}",
        env.dir.path().join("ingest.db").display()
    ))
    .await
    .unwrap();
    sqlx::query("UPDATE scan_jobs SET end_seq = NULL")
        .execute(&db)
        .await
        .unwrap();
    let after = events[2].event_id.as_str();
    let (msgs, error) = watch_msgs(&env, &job, after, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(error.is_none(), "{error:?}");
    assert_eq!(msgs.len(), 2, "{msgs:?}");
    assert!(matches!(&msgs[0], Msg::Resync(g) if g.reason == ResyncReason::EventsLost as i32));
    let end = event(&msgs[1]).expect("then the end");
    assert!(is_done(end));
    assert_eq!(end.seq, ecoscan_ingest::store::RUN_SPAN + 1, "a new run");
    let row = env.stores.jobs.get(&job).await.unwrap().unwrap();
    assert_eq!(row.end_seq, Some(end.seq));
    let logged = env.stores.events.read_after(&job, None).await.unwrap();
    assert_eq!(logged.len(), 1, "{logged:?}");
    assert_eq!(logged[0].event_id, end.event_id);
}

#[tokio::test]
async fn a_gap_the_trimmed_log_cannot_fill_is_announced_not_skipped() {
    // A log that keeps 3 events per job: a whole job's log no longer fits.
    let env = start_with(
        Stages::new(None),
        |_| {},
        |s| Stores {
            events: Arc::new(MemoryEventLog::new(3)),
            ..s
        },
    )
    .await;
    let job = submit_png(&env).await;
    // Read to the end. On a busy machine the job may be past its third event before this
    // watch begins, so the gap may be announced here already; only the end matters.
    let (msgs, error) = watch_msgs(&env, &job, "", Duration::from_secs(60))
        .await
        .unwrap();
    assert!(error.is_none(), "{error:?}");
    let last = msgs.iter().rev().find_map(event).unwrap().clone();
    assert!(is_done(&last));
    // Now a resume from the first event, and a watch from the start, find the log begins
    // later.
    for after in [id_of(&job, 1), String::new()] {
        let (msgs, error) = watch_msgs(&env, &job, &after, Duration::from_secs(5))
            .await
            .unwrap();
        assert!(error.is_none(), "{error:?}");
        let Msg::Resync(gap) = &msgs[0] else {
            panic!("after {after:?}, the gap is said first: {msgs:?}")
        };
        assert_eq!(gap.reason, ResyncReason::EventsLost as i32);
        assert_eq!(gap.after_event_id, after);
        assert_eq!(
            gap.seq,
            last.seq - 3,
            "the stream goes on from the log's first event"
        );
        assert_eq!(gap.event_id, id_of(&job, gap.seq));
        let seqs: Vec<u64> = msgs[1..].iter().map(|m| event(m).unwrap().seq).collect();
        assert_eq!(seqs, [last.seq - 2, last.seq - 1, last.seq]);
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

#[tokio::test]
async fn a_watch_ends_ahead_of_its_callers_deadline_with_a_status() {
    let stages = Stages {
        answer_delay: Duration::from_millis(2500),
        ..Stages::new(None)
    };
    let env = start_with(stages, |_| {}, |s| s).await;
    let job = submit_png(&env).await;
    let deadline = Duration::from_millis(1200);
    let started = std::time::Instant::now();
    let mut stream = env
        .ingest
        .clone()
        .watch(request_as(
            WatchRequest {
                job_id: job.clone(),
                after_event_id: String::new(),
            },
            deadline,
            "u1",
        ))
        .await
        .expect("the watch starts")
        .into_inner();
    let mut end = None;
    while let Some(item) = stream.next().await {
        if let Err(status) = item {
            end = Some(status);
            break;
        }
    }
    let took = started.elapsed();
    let end = end.expect("the stream ends with a status, not a reset");
    assert_eq!(end.code(), Code::DeadlineExceeded, "{end:?}");
    assert!(
        end.message().contains("reconnect with the last event id"),
        "{end:?}"
    );
    assert!(
        took < deadline,
        "ended ahead of the caller's deadline, so the caller sees the status: {took:?}"
    );
}

/// The answer text a client builds from the events as the SSE contract in docs/api.md says: a stage event `started`
/// or `restarted` of answer empties it, and a delta keeps the first `offset` code points and
/// appends its text.
fn answer_from_deltas(events: &[ScanEvent]) -> String {
    let mut text: Vec<char> = Vec::new();
    for ev in events.iter().filter(|e| e.stage == Stage::Answer as i32) {
        match EventStatus::try_from(ev.status) {
            Ok(EventStatus::Started | EventStatus::Restarted) => text.clear(),
            Ok(EventStatus::Delta) => {
                let Some(Payload::Delta(d)) = &ev.payload else {
                    panic!("a delta event carries text: {ev:?}")
                };
                text.truncate(ev.offset as usize);
                text.extend(d.chars());
            }
            _ => {}
        }
    }
    text.into_iter().collect()
}

#[tokio::test]
async fn a_retried_answer_stage_announces_itself_and_its_deltas_give_the_stored_answer() {
    let stages = Stages {
        answer_breaks_once: true,
        ..Stages::new(None)
    };
    let env = start_with(
        stages,
        |c| c.delta_interval = Duration::from_millis(50),
        |s| s,
    )
    .await;
    let job = submit_png(&env).await;
    let events = watch_all(&env, &job).await;
    assert!(
        events
            .last()
            .is_some_and(|e| is_done(e) && e.status == EventStatus::Completed as i32)
    );
    assert_eq!(env.stages.count("answer"), 2, "the broken call was retried");

    let answer: Vec<&ScanEvent> = events
        .iter()
        .filter(|e| e.stage == Stage::Answer as i32)
        .collect();
    let statuses: Vec<i32> = answer.iter().map(|e| e.status).collect();
    let restarted = statuses
        .iter()
        .position(|s| *s == EventStatus::Restarted as i32)
        .unwrap_or_else(|| panic!("the retry is announced: {answer:#?}"));
    assert!(
        statuses[..restarted].contains(&(EventStatus::Delta as i32)),
        "the first attempt's text went out before it broke: {answer:#?}"
    );
    // The second run's deltas start again at 0.
    let first_after = answer[restarted..]
        .iter()
        .find(|e| e.status == EventStatus::Delta as i32)
        .expect("the second run streams");
    assert_eq!(first_after.offset, 0);

    let stored = result_of(&env, &job).await.answer.expect("an answer").text;
    assert_eq!(stored, "Remove the label, rinse, crush.");
    assert_eq!(answer_from_deltas(&events), stored);
}

#[tokio::test]
async fn a_watch_before_the_log_takes_its_final_event_appends_it_where_the_worker_would() {
    // The row finishes a moment before the log takes the final event (a task of its own, or the
    // next claim after a crash); a watcher in between closes the log itself. Made here by
    // hand: a finished row whose log stops at `vision started`.
    let env = start(None, |_| {}).await;
    let job = uuid::Uuid::now_v7().to_string();
    let jobs = &env.stores.jobs;
    jobs.insert(ecoscan_ingest::store::NewJob {
        id: job.clone(),
        ..new_job("none")
    })
    .await
    .unwrap();
    let claimed = jobs
        .claim(&job, Stage::Vision)
        .await
        .unwrap()
        .expect("the row");
    for (stage, status, message) in [
        (Stage::Queued, EventStatus::Completed, "scan accepted"),
        (Stage::Vision, EventStatus::Started, "vision started"),
    ] {
        env.stores
            .events
            .append(ecoscan_ingest::event::event(
                &job, stage, status, 0.0, message, None,
            ))
            .await
            .unwrap();
    }
    jobs.finish(
        &job,
        claimed.lease_epoch,
        ecoscan_proto::v1::JobStatus::Succeeded,
        None,
    )
    .await
    .unwrap();

    // Resumed at the log's last event, or past it: the end at once, appended by the first
    // watcher at the position after the last event, never at the id the log gave `vision
    // started`.
    for after in [id_of(&job, 2), id_of(&job, 9)] {
        let (events, error) = watch_from(&env, &job, &after, Duration::from_secs(5)).await;
        assert!(error.is_none(), "{error:?}");
        assert_eq!(events.len(), 1, "after {after:?}: only the end: {events:?}");
        assert!(is_done(&events[0]), "after {after:?}: {events:?}");
        assert_eq!(
            (events[0].event_id.as_str(), events[0].seq),
            (id_of(&job, 3).as_str(), 3),
            "after {after:?}: the end takes the final event's position"
        );
    }

    // The worker's own append, late, finds the final event there: the log holds one.
    let row = jobs.get(&job).await.unwrap().unwrap();
    assert_eq!(row.end_seq, Some(3), "the row records it");
    let appended = env
        .stores
        .events
        .append_final_as(
            ecoscan_ingest::event::terminal_event_from_row(&row),
            claimed.lease_epoch,
        )
        .await
        .unwrap();
    assert!(appended.is_none(), "one final event: {appended:?}");
    let logged = env.stores.events.read_after(&job, None).await.unwrap();
    assert_eq!(logged.len(), 3, "{logged:?}");
    assert_eq!(logged[2].event_id, id_of(&job, 3));
}

/// A `queued` event of `job_id`, appended as `Submit` appends it.
async fn append_event_of(env: &Env, job_id: &str) {
    env.stores
        .events
        .append(ecoscan_ingest::event::event(
            job_id,
            Stage::Queued,
            EventStatus::Completed,
            0.0,
            "scan accepted",
            None,
        ))
        .await
        .unwrap();
}

/// `GetResult` of a running job reads its row once and answers from it until the feed brings
/// an item of the job. A row changed without one (as a process that died between the row and
/// the log leaves it) is not seen until then: the row is read again once an event of the job
/// has come, and only then.
#[tokio::test]
async fn a_running_jobs_result_is_its_row_as_read_until_an_event_of_the_job_comes() {
    let env = start(None, |c| c.hub.pending.max_age = Duration::from_secs(3600)).await;
    let job = insert_with_image(&env, "images/kept").await;
    let other = insert_with_image(&env, "images/other").await;
    let status = |r: ScanResult| JobStatus::try_from(r.status).unwrap();
    assert_eq!(status(result_of(&env, &job.id).await), JobStatus::Queued);
    assert_eq!(status(result_of(&env, &other.id).await), JobStatus::Queued);

    for id in [&job.id, &other.id] {
        env.stores.jobs.claim(id, Stage::Vision).await.unwrap();
    }
    assert_eq!(
        status(result_of(&env, &job.id).await),
        JobStatus::Queued,
        "the row as it was read, no event of the job since"
    );
    // Another user asking for the kept row learns nothing of it.
    let theirs = result_as(&env, &job.id, "u2").await.unwrap_err();
    assert_eq!(theirs.code(), Code::NotFound);

    append_event_of(&env, &other.id).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while status(result_of(&env, &other.id).await) != JobStatus::Running {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the event of the job never made its row be read again"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The hub takes the feed in order: once the other job's event has been taken, this job,
    // which had none, still answers from its kept row.
    assert_eq!(status(result_of(&env, &job.id).await), JobStatus::Queued);
    let running = result_of(&env, &other.id).await;
    assert_eq!(running.stage, Stage::Vision as i32);
}

/// With `INGEST_PENDING_CACHE_MAX_AGE=0` every `GetResult` reads the row.
#[tokio::test]
async fn with_no_max_age_every_result_reads_the_row() {
    let env = start(None, |c| c.hub.pending.max_age = Duration::ZERO).await;
    let job = insert_with_image(&env, "images/unkept").await;
    assert_eq!(
        result_of(&env, &job.id).await.status,
        JobStatus::Queued as i32
    );
    env.stores.jobs.claim(&job.id, Stage::Vision).await.unwrap();
    assert_eq!(
        result_of(&env, &job.id).await.status,
        JobStatus::Running as i32
    );
}

/// A client that polls the result while the scan runs, then sees the scan end on its stream
/// and asks for the result at once, gets the finished one: the hub drops a job's kept row
/// before its watchers see the event that changed it.
#[tokio::test]
async fn a_result_asked_for_after_the_watch_saw_the_end_is_the_finished_one() {
    let mut stages = Stages::new(None);
    stages.answer_delay = Duration::from_millis(300);
    let env = Arc::new(
        start_with(
            stages,
            |c| c.hub.pending.max_age = Duration::from_secs(3600),
            |s| s,
        )
        .await,
    );
    for _ in 0..3 {
        let job = submit_png(&env).await;
        let poller = {
            let (env, job) = (env.clone(), job.clone());
            tokio::spawn(async move {
                let mut stages = std::collections::BTreeSet::new();
                loop {
                    let r = result_of(&env, &job).await;
                    stages.insert(r.stage);
                    if r.status == JobStatus::Succeeded as i32 {
                        return stages;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            })
        };
        let events = watch_all(&env, &job).await;
        assert!(events.last().is_some_and(is_done));
        let r = result_of(&env, &job).await;
        assert_eq!(r.status, JobStatus::Succeeded as i32, "job {job}");
        assert!(r.answer.is_some());
        let seen = tokio::time::timeout(Duration::from_secs(30), poller)
            .await
            .expect("the poller sees the job finish")
            .unwrap();
        assert!(
            seen.contains(&(Stage::Answer as i32)),
            "the poller saw the job at the answer stage: {seen:?}"
        );
    }
}
