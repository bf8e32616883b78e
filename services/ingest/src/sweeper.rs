//! The sweeper: puts back on the queue every job whose row is not terminal but whose queue
//! entry is gone (Redis restarted without persistence, the embedded queue lived in a process
//! that stopped, or a crash fell between inserting the row and enqueueing). The row is the
//! truth; the queue is only how workers find work. A loss the queue notices itself (Redis
//! lost the consumer group) is swept at once; the periodic pass, for jobs older than its
//! grace, catches the rest.

use std::time::{Duration, SystemTime};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::{
    error::StoreError,
    store::{QueueEntry, Stores},
};

/// Rows read per page, and pages per pass (the rest waits for the next pass).
const PAGE: u32 = 1000;
const MAX_PAGES: usize = 10;
/// The shortest a re-enqueue reservation lasts: long enough for the entry to be in the queue,
/// where other sweepers see it, before the reservation lapses.
const MIN_HOLD: Duration = Duration::from_secs(30);

/// One pass: re-enqueues unfinished jobs older than `grace` that have no queue entry. Returns
/// how many were re-enqueued. A sweeper of its own: what it reserves ([`sweep_as`]) holds off
/// every other pass for a while.
pub async fn sweep_once(stores: &Stores, grace: Duration) -> Result<usize, StoreError> {
    sweep_as(stores, grace, &uuid::Uuid::new_v4().to_string()).await
}

/// [`sweep_once`] as sweeper `holder`: the re-enqueue reservations it made at an earlier pass
/// whose enqueue failed are its own, and it puts those jobs back now.
// A trace of its own per pass, named for what it does (its statements were context-free
// `SELECT scan_jobs` traces before); a job it re-enqueues goes on in the trace of the request
// that submitted it, from the job's carrier.
#[tracing::instrument(name = "sweep unfinished jobs", parent = None, skip_all)]
pub async fn sweep_as(stores: &Stores, grace: Duration, holder: &str) -> Result<usize, StoreError> {
    let mut before = SystemTime::now()
        .checked_sub(grace)
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let mut requeued = 0;
    for _ in 0..MAX_PAGES {
        let jobs = stores.jobs.unfinished(before, PAGE).await?;
        let Some(oldest) = jobs.iter().map(|j| j.created_at).min() else {
            break;
        };
        let ids: Vec<String> = jobs.iter().map(|j| j.id.clone()).collect();
        let present = stores.queue.queued(&ids).await?;
        for job in jobs.iter().filter(|j| !present.contains(&j.id)) {
            // It may have finished (and left the queue) since the page was read.
            match stores.jobs.get(&job.id).await? {
                Some(row) if !row.is_terminal() => {}
                _ => continue,
            }
            // Another replica's sweeper found it too and is putting it back.
            if !stores
                .queue
                .reserve_requeue(&job.id, grace.max(MIN_HOLD), holder)
                .await?
            {
                continue;
            }
            stores.queue.enqueue(QueueEntry::for_job(job)).await?;
            tracing::warn!(job.id = %job.id, "re-enqueued an unfinished job whose queue entry was gone");
            requeued += 1;
        }
        if jobs.len() < PAGE as usize {
            break;
        }
        before = oldest;
    }
    Ok(requeued)
}

/// How long the sweeper waits before trying again a pass after a loss that failed (Redis may
/// still be coming back).
const RETRY_AFTER_LOSS: Duration = Duration::from_secs(1);

/// Runs [`sweep_once`] every `interval` until `shutdown`, and at once, without the grace,
/// whenever the queue says it lost its entries ([`crate::store::Queue::lost`]: Redis lost
/// its data): every unfinished job resumes within moments then, not after the grace. A job
/// being submitted meanwhile may so get two entries; the second claim fences the first, and
/// the fenced worker drops its entry (`Queue::ack_held`).
pub fn spawn(
    stores: Stores,
    interval: Duration,
    grace: Duration,
    shutdown: CancellationToken,
) -> JoinHandle<()> {
    // One holder for the task's life: a pass that failed after reserving a job (its enqueue
    // refused) is followed by one that may put the job back.
    let holder = uuid::Uuid::new_v4().to_string();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval.max(Duration::from_millis(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let after_loss = tokio::select! {
                () = shutdown.cancelled() => break,
                _ = tick.tick() => false,
                () = stores.queue.lost() => true,
            };
            let grace = if after_loss { Duration::ZERO } else { grace };
            loop {
                match sweep_as(&stores, grace, &holder).await {
                    Ok(0) => {}
                    Ok(n) if after_loss => tracing::warn!(
                        requeued = n,
                        "sweeper re-enqueued every unfinished job after the queue lost its entries"
                    ),
                    Ok(n) => tracing::info!(requeued = n, "sweeper re-enqueued jobs"),
                    Err(e) if after_loss => {
                        tracing::warn!(error = %e, "sweeper pass after a queue loss failed; trying again");
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            () = tokio::time::sleep(RETRY_AFTER_LOSS) => continue,
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "sweeper pass failed"),
                }
                break;
            }
        }
    })
}
