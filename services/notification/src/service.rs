//! The `NotificationService` RPCs over any store and scheduler.

use std::{sync::Arc, time::Duration};

use ecoscan_common::{
    CancellationToken,
    identity::{IdentityError, caller, valid_user_id},
};
use ecoscan_proto::v1::{
    CancelRequest, CancelResponse, ListRequest, ListResponse, Notification, NotificationStatus,
    NotifyRequest, NotifyResponse, ScheduleRequest, ScheduleResponse, SubscribeRequest,
    SubscribeResponse, notification_service_server::NotificationService,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::{
    error::Error,
    hub::{Ended, Fanout, Hub},
    metrics::NotificationMetrics,
    reconcile::Kick,
    scheduler::Scheduler,
    store::{CancelOutcome, NotificationRow, NotificationStore},
};
use crate::{now_us, ts_to_us, us_to_ts};

/// `List` returns this many when the request gives no limit.
pub const DEFAULT_LIST_LIMIT: u32 = 50;
/// `List` never returns more than this many; larger limits are clamped.
pub const MAX_LIST_LIMIT: u32 = 500;
/// How far ahead a notification may be scheduled.
pub const MAX_SCHEDULE_AHEAD: Duration = Duration::from_secs(365 * 24 * 3600);

/// Publishes a stored notification to live subscribers. A failure is logged, not returned: the
/// notification is in the inbox already, and a live stream is best-effort by design.
pub(crate) async fn publish(
    fanout: &Fanout,
    metrics: &NotificationMetrics,
    n: &Notification,
) -> usize {
    metrics.delivered(&n.kind);
    match fanout.publish(n).await {
        Ok(receivers) => receivers,
        Err(e) => {
            tracing::error!(id = %n.id, error = ?e, "failed to publish a notification to live subscribers");
            0
        }
    }
}

/// The NotificationService implementation over any [`NotificationStore`] and [`Scheduler`].
pub struct Notifications {
    store: Arc<dyn NotificationStore>,
    scheduler: Arc<dyn Scheduler>,
    /// Where `Subscribe` streams attach.
    hub: Arc<Hub>,
    /// Where delivered notifications are published (this hub, or every replica's).
    fanout: Arc<Fanout>,
    /// Ends live streams when the server shuts down, so draining does not wait on them.
    shutdown: CancellationToken,
    metrics: NotificationMetrics,
    /// Asks for a reconcile sweep when adding to the scheduler failed.
    reconcile: Kick,
}

impl Notifications {
    /// Counts deliveries in `metrics` (registered with [`NotificationMetrics::register`]).
    #[must_use]
    pub fn with_metrics(mut self, metrics: NotificationMetrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Asks the reconcile loop listening on `kick` for a sweep whenever adding a scheduled
    /// notification to the scheduler fails (see [`reconcile::run`]).
    #[must_use]
    pub fn with_reconcile(mut self, kick: Kick) -> Self {
        self.reconcile = kick;
        self
    }

    /// A service over `store` and `scheduler`, streaming from `hub` and publishing through
    /// `fanout`.
    pub fn new(
        store: Arc<dyn NotificationStore>,
        scheduler: Arc<dyn Scheduler>,
        hub: Arc<Hub>,
        fanout: Arc<Fanout>,
        shutdown: CancellationToken,
    ) -> Self {
        Self {
            store,
            scheduler,
            hub,
            fanout,
            shutdown,
            metrics: NotificationMetrics::default(),
            reconcile: Kick::default(),
        }
    }

    /// Stores and delivers a notification now; a repeat of a dedupe key returns the first one
    /// and publishes nothing.
    pub async fn notify(&self, user_id: &str, req: NotifyRequest) -> Result<Notification, Error> {
        check_user_and_title(user_id, &req.title)?;
        let now = now_us();
        let row = NotificationRow {
            id: uuid::Uuid::now_v7().to_string(),
            user_id: user_id.to_owned(),
            kind: req.kind,
            title: req.title,
            body: req.body,
            job_id: req.job_id,
            dedupe_key: dedupe_key(req.dedupe_key),
            status: crate::store::Status::Delivered,
            due_at_us: None,
            created_at_us: now,
            delivered_at_us: Some(now),
            // Delivered inside the request that made it: its trace is this one.
            trace_parent: None,
        };
        let (row, inserted) = self.store.insert(row).await?;
        let n = to_proto(row);
        if inserted {
            let subscribers = publish(&self.fanout, &self.metrics, &n).await;
            tracing::info!(id = %n.id, subscribers, "notification delivered");
        } else {
            tracing::info!(id = %n.id, "deduplicated notification");
        }
        Ok(n)
    }

    /// Stores a notification for delivery at its due time (at once when that has passed).
    ///
    /// The stored row is the commitment: once it is written the call succeeds, even when adding
    /// it to the scheduler fails (Redis down): a reconcile sweep adds it once Redis answers
    /// again, and it is delivered then, late. A repeat of a dedupe key returns the first
    /// notification and, while that one is still scheduled, adds it to the scheduler again if
    /// the scheduler lost it (a caller retrying after an error gets its notification back on
    /// the schedule at once).
    pub async fn schedule(
        &self,
        user_id: &str,
        req: ScheduleRequest,
    ) -> Result<Notification, Error> {
        check_user_and_title(user_id, &req.title)?;
        let due = ts_to_us(&req.due_at.ok_or(Error::MissingDueAt)?);
        let now = now_us();
        let max_ahead = i64::try_from(MAX_SCHEDULE_AHEAD.as_micros()).expect("a year fits in i64");
        if due > now.saturating_add(max_ahead) {
            return Err(Error::DueTooFar);
        }
        let row = NotificationRow {
            id: uuid::Uuid::now_v7().to_string(),
            user_id: user_id.to_owned(),
            kind: req.kind,
            title: req.title,
            body: req.body,
            job_id: String::new(),
            dedupe_key: dedupe_key(req.dedupe_key),
            status: crate::store::Status::Scheduled,
            due_at_us: Some(due),
            created_at_us: now,
            delivered_at_us: None,
            // The delivery, due later in a trace of its own, links back to this request.
            trace_parent: ecoscan_common::telemetry::current_carrier().remove("traceparent"),
        };
        let (row, inserted) = self.store.insert(row).await?;
        if !inserted {
            tracing::info!(id = %row.id, "deduplicated schedule");
            if row.status == crate::store::Status::Scheduled
                && let Some(due) = row.due_at_us
            {
                let restored = self.add_to_scheduler(&row.id, due).await;
                if restored {
                    self.metrics.reconciled(1);
                    tracing::warn!(id = %row.id, "a retried schedule put its notification back on the schedule");
                }
            }
            return Ok(to_proto(row));
        }
        if due <= now {
            // Already due: deliver it in this call, through the same guarded update the
            // scheduler uses.
            let delivered = self.store.mark_delivered(&row.id, now).await?;
            if let Some(row) = delivered {
                let n = to_proto(row);
                let subscribers = publish(&self.fanout, &self.metrics, &n).await;
                tracing::info!(id = %n.id, subscribers, "past-due notification delivered at once");
                return Ok(n);
            }
        }
        self.add_to_scheduler(&row.id, due).await;
        tracing::info!(id = %row.id, due_at_us = due, "notification scheduled");
        Ok(to_proto(row))
    }

    /// Adds the scheduled row `id` to the scheduler unless it is there already (waiting or
    /// claimed); returns whether it added it. A failure is logged and leaves it to the reconcile
    /// sweep, asked for at once.
    async fn add_to_scheduler(&self, id: &str, due: i64) -> bool {
        match self.scheduler.add_missing(&[(id.to_owned(), due)]).await {
            Ok(added) => added > 0,
            Err(e) => {
                tracing::warn!(id, error = ?e, "failed to add a scheduled notification to the scheduler; a reconcile sweep will");
                self.reconcile.sweep_soon();
                false
            }
        }
    }

    /// Cancels a scheduled notification of `user_id`; cancelling one twice is not an error.
    pub async fn cancel(&self, user_id: &str, req: CancelRequest) -> Result<Notification, Error> {
        check_user(user_id)?;
        if req.id.trim().is_empty() {
            return Err(Error::EmptyId);
        }
        match self.store.cancel(&req.id, user_id).await? {
            CancelOutcome::Cancelled(row) | CancelOutcome::AlreadyCancelled(row) => {
                Ok(to_proto(row))
            }
            CancelOutcome::AlreadyDelivered(row) => Err(Error::AlreadyDelivered(row.id)),
            // Another user's notification is indistinguishable from an unknown one.
            CancelOutcome::NotFound => Err(Error::NotFound(req.id)),
        }
    }

    /// `user_id`'s inbox, newest first.
    pub async fn list(&self, user_id: &str, req: ListRequest) -> Result<Vec<Notification>, Error> {
        check_user(user_id)?;
        let limit = match req.limit {
            0 => DEFAULT_LIST_LIMIT,
            n => n.min(MAX_LIST_LIMIT),
        };
        let rows = self.store.list(user_id, limit).await?;
        Ok(rows.into_iter().map(to_proto).collect())
    }
}

fn check_user(user_id: &str) -> Result<(), Error> {
    if valid_user_id(user_id) {
        Ok(())
    } else {
        Err(Error::Identity(IdentityError::Invalid))
    }
}

fn check_user_and_title(user_id: &str, title: &str) -> Result<(), Error> {
    check_user(user_id)?;
    if title.trim().is_empty() {
        return Err(Error::EmptyTitle);
    }
    Ok(())
}

fn dedupe_key(key: String) -> Option<String> {
    (!key.trim().is_empty()).then_some(key)
}

pub(crate) fn to_proto(row: NotificationRow) -> Notification {
    let status = match row.status {
        crate::store::Status::Scheduled => NotificationStatus::Scheduled,
        crate::store::Status::Delivered => NotificationStatus::Delivered,
        crate::store::Status::Cancelled => NotificationStatus::Cancelled,
    };
    Notification {
        id: row.id,
        user_id: row.user_id,
        kind: row.kind,
        title: row.title,
        body: row.body,
        due_at: row.due_at_us.map(us_to_ts),
        created_at: Some(us_to_ts(row.created_at_us)),
        delivered_at: row.delivered_at_us.map(us_to_ts),
        status: status as i32,
        job_id: row.job_id,
    }
}

/// The user the call acts for (see `ecoscan_common::identity`), recorded on the RPC's span.
fn acting_user<T>(request: &Request<T>) -> Result<String, Error> {
    let user = caller(request.metadata())?;
    tracing::Span::current().record("user.id", user.as_str());
    Ok(user)
}

#[tonic::async_trait]
impl NotificationService for Notifications {
    #[tracing::instrument(skip_all, fields(user.id, notification.kind = %request.get_ref().kind))]
    async fn notify(
        &self,
        request: Request<NotifyRequest>,
    ) -> Result<Response<NotifyResponse>, Status> {
        let user = acting_user(&request)?;
        let n = Notifications::notify(self, &user, request.into_inner()).await?;
        Ok(Response::new(NotifyResponse {
            notification: Some(n),
        }))
    }

    #[tracing::instrument(skip_all, fields(user.id, notification.kind = %request.get_ref().kind))]
    async fn schedule(
        &self,
        request: Request<ScheduleRequest>,
    ) -> Result<Response<ScheduleResponse>, Status> {
        let user = acting_user(&request)?;
        let n = Notifications::schedule(self, &user, request.into_inner()).await?;
        Ok(Response::new(ScheduleResponse {
            notification: Some(n),
        }))
    }

    #[tracing::instrument(skip_all, fields(notification.id = %request.get_ref().id, user.id))]
    async fn cancel(
        &self,
        request: Request<CancelRequest>,
    ) -> Result<Response<CancelResponse>, Status> {
        let user = acting_user(&request)?;
        let n = Notifications::cancel(self, &user, request.into_inner()).await?;
        tracing::info!("notification cancelled");
        Ok(Response::new(CancelResponse {
            notification: Some(n),
        }))
    }

    type SubscribeStream = ReceiverStream<Result<SubscribeResponse, Status>>;

    /// Streams the user's notifications delivered from now on. A subscriber that falls more than
    /// the subscriber buffer behind gets RESOURCE_EXHAUSTED; server shutdown ends it with
    /// UNAVAILABLE.
    #[tracing::instrument(skip_all, fields(user.id))]
    async fn subscribe(
        &self,
        request: Request<SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let user_id = acting_user(&request)?;
        // Subscribed before the response goes out: whatever is delivered after the caller sees
        // the stream open reaches it.
        let mut sub = self.hub.subscribe(&user_id);
        let (tx, rx) = mpsc::channel(16);
        let shutdown = self.shutdown.clone();
        tokio::spawn(
            async move {
                tracing::info!("subscriber joined");
                loop {
                    let item = tokio::select! {
                        () = tx.closed() => break,
                        () = shutdown.cancelled() => Err(Error::ShuttingDown),
                        r = sub.recv() => r.map_err(|Ended::Lagged(n)| Error::SubscriberLagged(n)),
                    };
                    let last = item.is_err();
                    if let Ok(n) = &item {
                        tracing::info!(id = %n.id, "notification streamed");
                    } else {
                        tracing::warn!(error = ?item.as_ref().err(), "ending subscription");
                    }
                    let sent = tokio::select! {
                        // A final status still goes out when there is room for it.
                        biased;
                        r = tx.send(item.map(|n| SubscribeResponse { notification: Some(n) }).map_err(Status::from)) => r.is_ok(),
                        () = shutdown.cancelled() => false,
                    };
                    if last || !sent {
                        break;
                    }
                }
                tracing::info!("subscriber left");
            }
            .in_current_span(),
        );
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    #[tracing::instrument(skip_all, fields(user.id, notification.limit = request.get_ref().limit))]
    async fn list(&self, request: Request<ListRequest>) -> Result<Response<ListResponse>, Status> {
        let user = acting_user(&request)?;
        let notifications = Notifications::list(self, &user, request.into_inner()).await?;
        Ok(Response::new(ListResponse { notifications }))
    }
}
