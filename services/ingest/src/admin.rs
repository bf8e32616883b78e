//! `ScanAdminService`: the operators' view of dead-lettered jobs (list, requeue). Every call
//! needs the admin role in the request metadata.

use std::time::SystemTime;

use ecoscan_common::identity::is_admin;
use ecoscan_proto::v1::{
    DeadLetter, EventStatus, ListDeadLettersRequest, ListDeadLettersResponse,
    RequeueDeadLetterRequest, RequeueDeadLetterResponse, Stage,
    scan_admin_service_server::ScanAdminService,
};
use tonic::{Request, Response, Status};

use crate::{
    error::Error,
    event::event,
    metrics::IngestMetrics,
    service::result_of,
    store::{QueueEntry, Stores},
};

/// Dead letters per page when the caller does not say, and at most.
const DEFAULT_PAGE: u32 = 50;
const MAX_PAGE: u32 = 1000;

pub struct AdminApi {
    stores: Stores,
    metrics: IngestMetrics,
}

impl AdminApi {
    pub fn new(stores: Stores, metrics: IngestMetrics) -> Self {
        Self { stores, metrics }
    }
}

fn require_admin<T>(request: &Request<T>) -> Result<(), Error> {
    if is_admin(request.metadata()) {
        Ok(())
    } else {
        Err(Error::NotAdmin)
    }
}

#[tonic::async_trait]
impl ScanAdminService for AdminApi {
    #[tracing::instrument(skip_all)]
    async fn list_dead_letters(
        &self,
        request: Request<ListDeadLettersRequest>,
    ) -> Result<Response<ListDeadLettersResponse>, Status> {
        require_admin(&request)?;
        let req = request.into_inner();
        let limit = match req.limit {
            0 => DEFAULT_PAGE,
            n => n.min(MAX_PAGE),
        };
        let before = req.before.as_ref().map(ecoscan_proto::to_system_time);
        let jobs = self
            .stores
            .jobs
            .dead_letters(before, limit)
            .await
            .map_err(Error::from)?;
        Ok(Response::new(ListDeadLettersResponse {
            dead_letters: jobs
                .into_iter()
                .map(|job| DeadLetter {
                    attempts: job.attempts,
                    dead_at: job.dead_at.map(ecoscan_proto::timestamp),
                    job: Some(result_of(job)),
                })
                .collect(),
        }))
    }

    #[tracing::instrument(skip_all, fields(job.id = %request.get_ref().job_id))]
    async fn requeue_dead_letter(
        &self,
        request: Request<RequeueDeadLetterRequest>,
    ) -> Result<Response<RequeueDeadLetterResponse>, Status> {
        require_admin(&request)?;
        let job_id = request.into_inner().job_id;
        if uuid::Uuid::parse_str(&job_id).is_err() {
            return Err(
                Error::invalid("job_id", format!("job_id {job_id:?} is not a job id")).into(),
            );
        }
        let Some(job) = self
            .stores
            .jobs
            .requeue(&job_id)
            .await
            .map_err(Error::from)?
        else {
            return Err(
                match self.stores.jobs.get(&job_id).await.map_err(Error::from)? {
                    Some(_) => Error::NotDeadLettered(job_id),
                    None => Error::JobNotFound(job_id),
                }
                .into(),
            );
        };
        // The operator's request is a trace of its own; a link joins it to the scan it
        // restarts (whose trace the rerun goes on in, from the job's carrier), so a search by
        // `job.id` finds the requeue beside the scan in Jaeger.
        ecoscan_common::telemetry::link_to_carrier(&tracing::Span::current(), &job.trace_carrier);
        // The job's log starts again, so that its watchers see the new run only; then a
        // worker picks it up and resumes at its first stage without a checkpoint.
        self.stores
            .events
            .restart(event(
                &job.id,
                Stage::Queued,
                EventStatus::Completed,
                0.0,
                "requeued by an operator",
                None,
            ))
            .await
            .map_err(Error::from)?;
        self.stores
            .queue
            .enqueue(QueueEntry {
                job_id: job.id.clone(),
                carrier: job.trace_carrier.clone(),
                deliveries: 0,
                enqueued_at: SystemTime::now(),
            })
            .await
            .map_err(Error::from)?;
        self.metrics.requeued();
        tracing::info!(job.id = %job.id, "dead-lettered job requeued");
        Ok(Response::new(RequeueDeadLetterResponse {
            job: Some(result_of(job)),
        }))
    }
}
