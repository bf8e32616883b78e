//! Delivering scheduled notifications as they fall due: claim from the scheduler, mark the rows
//! delivered, publish to live subscribers, acknowledge.

use std::{sync::Arc, time::Duration};

use ecoscan_common::CancellationToken;
use ecoscan_proto::v1::Notification;

use crate::{
    hub::Fanout, metrics::NotificationMetrics, scheduler::Scheduler, store::NotificationStore,
};
use crate::{now_us, service::to_proto};

/// Due notifications claimed per scheduler round.
const CLAIM_BATCH: usize = 2000;
/// Claimed notifications marked, published and acknowledged together: large enough that a batch
/// costs the database and Redis one round trip each, small enough that the first of a claim is
/// not held back long by the rest.
const DELIVERY_BATCH: usize = 250;
/// Longest the delivery loop sleeps without looking at the scheduler.
const MAX_IDLE: Duration = Duration::from_secs(60);

/// Delivers scheduled notifications as they fall due until `stop` is cancelled.
pub(crate) async fn deliver_due(
    store: Arc<dyn NotificationStore>,
    scheduler: Arc<dyn Scheduler>,
    fanout: Arc<Fanout>,
    metrics: NotificationMetrics,
    lease: Duration,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        let claimed = match scheduler.claim_due(now_us(), CLAIM_BATCH, lease).await {
            Ok(claimed) => claimed,
            Err(e) => {
                tracing::error!(error = ?e, "failed to claim due notifications");
                Vec::new()
            }
        };
        for batch in claimed.chunks(DELIVERY_BATCH) {
            deliver_batch(&*store, &*scheduler, &fanout, &metrics, batch).await;
        }
        if claimed.len() == CLAIM_BATCH {
            continue;
        }
        tokio::select! {
            () = stop.cancelled() => break,
            () = scheduler.wait(MAX_IDLE) => {}
        }
    }
}

/// Delivers one batch of claimed ids: one statement marks them delivered (only those still
/// scheduled: a cancelled or already delivered one drops out), one round trip publishes them, one
/// acknowledges them. A batch that fails to be marked is not acknowledged: its leases run out
/// and a later round retries it.
// A root span per batch: the delivery loop lives as long as the process, and a trace of it all
// would never end.
#[tracing::instrument(name = "deliver due notifications", parent = None, skip_all, fields(notification.count = ids.len()))]
async fn deliver_batch(
    store: &dyn NotificationStore,
    scheduler: &dyn Scheduler,
    fanout: &Fanout,
    metrics: &NotificationMetrics,
    ids: &[String],
) {
    let now = now_us();
    let rows = match store.mark_delivered_many(ids, now).await {
        Ok(rows) => rows,
        Err(e) => {
            tracing::error!(count = ids.len(), error = ?e, "failed to deliver due notifications");
            return;
        }
    };
    // The batch carries notifications scheduled by requests traced on their own: a link to
    // each (the messaging conventions' batch links), so a scheduled reminder's story reads from
    // the request that asked for it to the batch that delivered it.
    ecoscan_common::telemetry::link_to_each(
        &tracing::Span::current(),
        rows.iter().filter_map(|row| {
            let carrier = [("traceparent".to_owned(), row.trace_parent.clone()?)];
            ecoscan_common::telemetry::carrier_span_context(&carrier.into())
        }),
    );
    if rows.len() < ids.len() {
        // Cancelled, or delivered by an earlier claim: nothing to do for those.
        tracing::debug!(
            skipped = ids.len() - rows.len(),
            "due notifications no longer scheduled"
        );
    }
    let notifications: Vec<Notification> = rows
        .into_iter()
        .map(|row| {
            if let Some(due) = row.due_at_us {
                let late_us = u64::try_from(now.saturating_sub(due)).unwrap_or(0);
                metrics.delivery_lag(Duration::from_micros(late_us));
            }
            to_proto(row)
        })
        .collect();
    for n in &notifications {
        metrics.delivered(&n.kind);
    }
    // A failure is logged, not retried: the notifications are in the inbox already, and a live
    // stream is best-effort by design.
    match fanout.publish_many(&notifications).await {
        Ok(receivers) => {
            for (n, subscribers) in notifications.iter().zip(receivers) {
                tracing::debug!(id = %n.id, user_id = %n.user_id, subscribers, "scheduled notification delivered");
            }
        }
        Err(e) => {
            tracing::error!(count = notifications.len(), error = ?e, "failed to publish notifications to live subscribers");
        }
    }
    tracing::info!(
        delivered = notifications.len(),
        "scheduled notifications delivered"
    );
    if let Err(e) = scheduler.ack_many(ids).await {
        tracing::warn!(count = ids.len(), error = ?e, "failed to acknowledge delivered notifications");
    }
}
