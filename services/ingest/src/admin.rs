//! `ScanAdminService`: the operators' view of dead-lettered jobs (list, requeue). Every call
//! needs the admin role in the request metadata.

use ecoscan_common::identity::is_admin;
use ecoscan_proto::v1::{
    DeadLetter, ListDeadLettersRequest, ListDeadLettersResponse, RequeueDeadLetterRequest,
    RequeueDeadLetterResponse, scan_admin_service_server::ScanAdminService,
};
use tonic::{Request, Response, Status};

use crate::{error::Error, metrics::IngestMetrics, service::result_of, store::Stores};

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
        let requeued = crate::dead_letters::requeue(
            &self.stores,
            &self.metrics,
            &job_id,
            crate::dead_letters::RequeuedBy::Operator,
        )
        .await
        .map_err(Error::from)?;
        let Some(job) = requeued else {
            return Err(
                match self.stores.jobs.get(&job_id).await.map_err(Error::from)? {
                    Some(_) => Error::NotDeadLettered(job_id),
                    None => Error::JobNotFound(job_id),
                }
                .into(),
            );
        };
        tracing::info!(job.id = %job.id, by = "operator", "dead-lettered job requeued");
        Ok(Response::new(RequeueDeadLetterResponse {
            job: Some(result_of(job)),
        }))
    }
}
