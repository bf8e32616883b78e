//! `ScanService`: intake (`Submit`, `Scan`), watching (`Watch`) and results (`GetResult`).

use std::{pin::Pin, sync::Arc};

use bytes::Bytes;
use ecoscan_common::CancellationToken;
use ecoscan_common::{
    identity::caller,
    limits::{MAX_HINT_CHARS, MAX_IDEMPOTENCY_KEY_BYTES},
    server::call_timeout,
};
use ecoscan_proto::v1::{
    CreateUploadRequest, CreateUploadResponse, EventStatus, GetResultRequest, GetResultResponse,
    JobStatus, PutUploadRequest, PutUploadResponse, ScanRequest, ScanResponse, ScanResult, Stage,
    SubmitRequest, SubmitResponse, WatchRequest, WatchResponse, scan_service_server::ScanService,
};
use sha2::{Digest, Sha256};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

use crate::{
    Config,
    error::Error,
    event::{Watched, event},
    fetch::ImageFetcher,
    hub::Hub,
    image,
    metrics::IngestMetrics,
    pending::Lookup,
    store::{EventId, Job, NewJob, QueueEntry, Stores},
    uploads::Uploads,
};

pub struct ScanApi {
    inner: Arc<Inner>,
}

struct Inner {
    config: Config,
    stores: Stores,
    hub: Hub,
    fetcher: ImageFetcher,
    uploads: Uploads,
    metrics: IngestMetrics,
    shutdown: CancellationToken,
}

type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

impl ScanApi {
    pub fn new(
        config: Config,
        stores: Stores,
        hub: Hub,
        metrics: IngestMetrics,
        shutdown: CancellationToken,
    ) -> Self {
        let fetcher = ImageFetcher::new(&config);
        let uploads = Uploads::new(
            stores.clone(),
            metrics.clone(),
            config.upload_ttl,
            config.max_image_bytes,
        );
        Self {
            inner: Arc::new(Inner {
                config,
                stores,
                hub,
                fetcher,
                uploads,
                metrics,
                shutdown,
            }),
        }
    }
}

/// The acting user (see `ecoscan_common::identity`), recorded on the RPC's span.
fn user_of<T>(req: &Request<T>) -> Result<String, Error> {
    let user = caller(req.metadata())?;
    tracing::Span::current().record("user.id", user.as_str());
    Ok(user)
}

fn parse_job_id(id: &str) -> Result<String, Error> {
    uuid::Uuid::parse_str(id)
        .map(|u| u.to_string())
        .map_err(|_| Error::invalid("job_id", format!("job id {id:?} is not a UUID")))
}

impl Inner {
    /// [`Self::accept`], counted: jobs accepted, and scans refused by reason.
    async fn submit(&self, user_id: String, req: SubmitRequest) -> Result<(Job, bool), Error> {
        let accepted = self.accept(user_id, req).await;
        match &accepted {
            Ok((_, true)) => self.metrics.submitted(),
            Ok((_, false)) => {}
            Err(Error::Overloaded { .. } | Error::FetchBusy { .. }) => {
                self.metrics.rejected("overloaded");
            }
            Err(Error::InvalidArgument { .. } | Error::ImageFetch) => {
                self.metrics.rejected("invalid");
            }
            Err(_) => {}
        }
        accepted
    }

    async fn accept(&self, user_id: String, req: SubmitRequest) -> Result<(Job, bool), Error> {
        if self.shutdown.is_cancelled() {
            return Err(Error::ShuttingDown);
        }
        let locale = match req.locale.as_str() {
            "" | "ko" => "ko",
            "en" => "en",
            other => {
                return Err(Error::invalid(
                    "locale",
                    format!("locale {other:?} is not supported; use \"ko\" or \"en\""),
                ));
            }
        };
        if req.hint.chars().count() > MAX_HINT_CHARS {
            return Err(Error::invalid(
                "hint",
                format!("hint is longer than {MAX_HINT_CHARS} characters"),
            ));
        }
        if req.idempotency_key.len() > MAX_IDEMPOTENCY_KEY_BYTES {
            return Err(Error::invalid(
                "idempotency_key",
                format!("idempotency_key is longer than {MAX_IDEMPOTENCY_KEY_BYTES} bytes"),
            ));
        }
        // Refused here, before anything is stored, rather than by vision once the job runs.
        self.config
            .offered_models
            .choose(&req.model)
            .map_err(|e| Error::invalid("model", e.to_string()))?;
        if !req.model.is_empty() {
            tracing::Span::current().record("gen_ai.request.model", req.model.as_str());
        }
        // A store known to be down refuses the scan now, not after its timeout.
        self.stores.check()?;
        let idempotency_key =
            (!req.idempotency_key.is_empty()).then(|| req.idempotency_key.clone());
        if let Some(key) = &idempotency_key
            && let Some(job) = self
                .stores
                .jobs
                .find_by_idempotency_key(&user_id, key)
                .await?
        {
            return self.repeat(job).await;
        }

        // Shed load before doing any work, so a refused scan leaves nothing behind.
        let backlog = self.stores.queue.backlog().await?;
        if backlog >= self.config.max_backlog {
            return Err(Error::Overloaded {
                backlog,
                retry_after: self.config.retry_after,
            });
        }

        let max = self.config.max_image_bytes;
        let sources = [
            &req.image[..],
            req.image_url.as_bytes(),
            req.upload_id.as_bytes(),
        ]
        .iter()
        .filter(|s| !s.is_empty())
        .count();
        if sources > 1 {
            return Err(Error::invalid(
                if req.upload_id.is_empty() {
                    "image_url"
                } else {
                    "upload_id"
                },
                "send one of `image`, `image_url` and `upload_id`, not two",
            ));
        }
        let job_id = uuid::Uuid::now_v7().to_string();
        let (bytes, content_type, upload): (Bytes, &'static str, _) = if sources == 0 {
            return Err(Error::invalid(
                "image",
                "image is empty; send the photo's bytes in `image`, a URL in `image_url`, or a \
                 direct upload in `upload_id`",
            ));
        } else if !req.upload_id.is_empty() {
            let photo = self.uploads.photo(&user_id, &req.upload_id).await?;
            // Claimed before anything is written: of two submits of one upload, one goes on.
            self.uploads.claim(&photo.upload, &job_id).await?;
            (photo.bytes, photo.content_type, Some(photo.upload))
        } else {
            let bytes: Bytes = if req.image.is_empty() {
                self.fetcher.fetch(&req.image_url).await?
            } else {
                req.image.into()
            };
            let content_type = image::validate(&bytes, &req.content_type, max)?;
            (bytes, content_type, None)
        };

        let stored = self
            .store_job(
                bytes,
                NewJob {
                    id: job_id.clone(),
                    user_id,
                    // Set by `store_job`, which stores the image under it.
                    image_key: String::new(),
                    content_type: content_type.to_owned(),
                    hint: req.hint,
                    locale: locale.to_owned(),
                    model: req.model,
                    idempotency_key,
                    trace_carrier: ecoscan_common::telemetry::current_carrier(),
                },
            )
            .await;
        let (job, inserted) = match (stored, &upload) {
            (Ok((job, true)), Some(upload)) => {
                self.uploads.submitted(upload).await;
                (job, true)
            }
            // Not made (a store failed, or a concurrent submit with the same idempotency key
            // made the job): the upload is not used up.
            (Ok((job, false)), Some(upload)) => {
                self.uploads.release(upload, &job_id).await;
                (job, false)
            }
            (Err(e), Some(upload)) => {
                self.uploads.release(upload, &job_id).await;
                return Err(e);
            }
            (stored, None) => stored?,
        };
        if !inserted {
            return self.repeat(job).await;
        }
        self.dispatch(&job).await?;
        tracing::info!(job.id = %job.id, "scan accepted");
        Ok((job, true))
    }

    /// Stores the photo (content-addressed: the same photo sent twice is stored once) and the
    /// job's row; `false` when the idempotency key's job existed already (that job returned).
    async fn store_job(&self, bytes: Bytes, mut job: NewJob) -> Result<(Job, bool), Error> {
        let digest = hex(&Sha256::digest(&bytes));
        job.image_key = format!("images/{}/{digest}", &digest[..2]);
        self.stores.objects.put(&job.image_key, bytes).await?;
        Ok(self.stores.jobs.insert(job).await?)
    }

    /// A new job's `queued` event, then its queue entry (in this order: a claim fences the
    /// log, after which the `queued` event would be refused).
    async fn dispatch(&self, job: &Job) -> Result<(), Error> {
        self.stores
            .events
            .append(event(
                &job.id,
                Stage::Queued,
                EventStatus::Completed,
                0.0,
                "scan accepted",
                None,
            ))
            .await?;
        self.stores.queue.enqueue(QueueEntry::for_job(job)).await?;
        Ok(())
    }

    /// A repeat of a submission (its idempotency key was used already): the first job. A job
    /// whose first submission failed after its row was written (the event log refused its
    /// `queued` event: Redis out of memory, restarting) was never dispatched; the repeat
    /// dispatches it now instead of leaving it to the sweeper's grace.
    async fn repeat(&self, job: Job) -> Result<(Job, bool), Error> {
        if job.status == JobStatus::Queued
            && job.attempts == 0
            && self.stores.events.last_id(&job.id).await?.is_none()
        {
            tracing::info!(job.id = %job.id, "dispatching a repeated submission's job that never was");
            self.dispatch(&job).await?;
        }
        Ok((job, false))
    }

    async fn job_for(&self, job_id: &str, user_id: &str) -> Result<Job, Error> {
        let id = parse_job_id(job_id)?;
        owned_by(self.stores.jobs.get(&id).await?, id, user_id)
    }

    /// [`Self::job_for`] for `GetResult`: a running job's row as the hub keeps it until the
    /// next item of the job comes through the feed (see [`crate::pending`]), else from the
    /// store.
    async fn result_for(&self, job_id: &str, user_id: &str) -> Result<Job, Error> {
        let id = parse_job_id(job_id)?;
        let pending = self.hub.pending();
        let slot = match pending.lookup(&id) {
            Lookup::Hit(job) => {
                self.metrics.result_read("kept");
                return owned_by(Some(Job::clone(&job)), id, user_id);
            }
            Lookup::Miss(slot) => slot,
        };
        self.metrics.result_read("store");
        let row = self.stores.jobs.get(&id).await;
        if let Some(slot) = slot {
            pending.fill(slot, row.as_ref().ok().and_then(Option::as_ref));
        }
        owned_by(row?, id, user_id)
    }
}

/// The row when `user_id` owns it. Another user's job is reported as missing: its existence is
/// not theirs to know.
fn owned_by(row: Option<Job>, id: String, user_id: &str) -> Result<Job, Error> {
    match row {
        Some(job) if job.user_id == user_id => Ok(job),
        _ => Err(Error::JobNotFound(id)),
    }
}

/// A resume position must be one of the job's own: every id of a job starts with the job's
/// time (`<T>-`, see [`EventId::of`]). An id of another job would resume at a position that
/// means nothing here.
fn check_position(job_id: &str, after: EventId) -> Result<(), Error> {
    let own = EventId::of(job_id, 0);
    if after.ms == own.ms {
        Ok(())
    } else {
        Err(Error::invalid(
            "after_event_id",
            format!(
                "event id {after} is not an event of job {job_id}: its ids start with \"{}-\"; \
                 resume with an id this job's stream sent, or without one",
                own.ms
            ),
        ))
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

pub(crate) fn result_of(job: Job) -> ScanResult {
    ScanResult {
        job_id: job.id,
        user_id: job.user_id,
        status: job.status as i32,
        stage: job.stage as i32,
        classification: job.classification,
        rules: job.rules,
        answer: job.answer,
        reward: job.reward,
        error: job.error,
        created_at: Some(ecoscan_proto::timestamp(job.created_at)),
        finished_at: job.finished_at.map(ecoscan_proto::timestamp),
        hint: job.hint,
        locale: job.locale,
        model: job.model,
    }
}

#[tonic::async_trait]
impl ScanService for ScanApi {
    #[tracing::instrument(skip_all, fields(job.id, user.id, gen_ai.request.model))]
    async fn submit(
        &self,
        request: Request<SubmitRequest>,
    ) -> Result<Response<SubmitResponse>, Status> {
        let user = user_of(&request)?;
        let (job, inserted) = self.inner.submit(user, request.into_inner()).await?;
        tracing::Span::current().record("job.id", job.id.as_str());
        Ok(Response::new(SubmitResponse {
            job_id: job.id,
            status: job.status as i32,
            duplicate: !inserted,
        }))
    }

    type ScanStream = EventStream<ScanResponse>;

    #[tracing::instrument(skip_all, fields(job.id, user.id, gen_ai.request.model))]
    async fn scan(
        &self,
        request: Request<ScanRequest>,
    ) -> Result<Response<Self::ScanStream>, Status> {
        let user = user_of(&request)?;
        let lifetime = call_timeout(request.metadata());
        let (job, _) = self.inner.submit(user, request.into_inner().into()).await?;
        tracing::Span::current().record("job.id", job.id.as_str());
        let events = self.inner.hub.watch(job, None, lifetime);
        Ok(Response::new(Box::pin(events.map(|item| {
            item.map(|watched| match watched {
                Watched::Event(event) => ScanResponse {
                    event: Some(event),
                    resync: None,
                },
                Watched::Resync(resync) => ScanResponse {
                    event: None,
                    resync: Some(resync),
                },
            })
        }))))
    }

    type WatchStream = EventStream<WatchResponse>;

    #[tracing::instrument(skip_all, fields(job.id = %request.get_ref().job_id, user.id))]
    async fn watch(
        &self,
        request: Request<WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let user = user_of(&request)?;
        let lifetime = call_timeout(request.metadata());
        let req = request.into_inner();
        let after = if req.after_event_id.is_empty() {
            None
        } else {
            Some(
                req.after_event_id
                    .parse::<EventId>()
                    .map_err(|e| Error::invalid("after_event_id", e))?,
            )
        };
        // Not refused while a store's circuit is open, unlike a submit: a watch, new or a
        // resume, waits for the store and gets the job's end as soon as it answers. Refused for
        // the circuit's probe interval, a resume after a store blip came later than the event
        // contract's "the end within 1 s of a resume" (the history checker caught it).
        let job = self.inner.job_for(&req.job_id, &user).await?;
        if let Some(after) = after {
            check_position(&job.id, after)?;
        }
        // A watch is a request (and a trace) of its own: linked to the job's, one story.
        ecoscan_common::telemetry::link_to_carrier(&tracing::Span::current(), &job.trace_carrier);
        let events = self.inner.hub.watch(job, after, lifetime);
        Ok(Response::new(Box::pin(events.map(|item| {
            item.map(|watched| match watched {
                Watched::Event(event) => WatchResponse {
                    event: Some(event),
                    resync: None,
                },
                Watched::Resync(resync) => WatchResponse {
                    event: None,
                    resync: Some(resync),
                },
            })
        }))))
    }

    #[tracing::instrument(skip_all, fields(upload.id, user.id))]
    async fn create_upload(
        &self,
        request: Request<CreateUploadRequest>,
    ) -> Result<Response<CreateUploadResponse>, Status> {
        let user = user_of(&request)?;
        if self.inner.shutdown.is_cancelled() {
            return Err(Error::ShuttingDown.into());
        }
        let res = self
            .inner
            .uploads
            .create(user, request.into_inner())
            .await?;
        tracing::Span::current().record("upload.id", res.upload_id.as_str());
        Ok(Response::new(res))
    }

    #[tracing::instrument(skip_all, fields(upload.id = %request.get_ref().upload_id, user.id))]
    async fn put_upload(
        &self,
        request: Request<PutUploadRequest>,
    ) -> Result<Response<PutUploadResponse>, Status> {
        let user = user_of(&request)?;
        if self.inner.shutdown.is_cancelled() {
            return Err(Error::ShuttingDown.into());
        }
        let res = self.inner.uploads.put(&user, request.into_inner()).await?;
        Ok(Response::new(res))
    }

    #[tracing::instrument(skip_all, fields(job.id = %request.get_ref().job_id, user.id))]
    async fn get_result(
        &self,
        request: Request<GetResultRequest>,
    ) -> Result<Response<GetResultResponse>, Status> {
        let user = user_of(&request)?;
        let job = self
            .inner
            .result_for(&request.get_ref().job_id, &user)
            .await?;
        Ok(Response::new(GetResultResponse {
            result: Some(result_of(job)),
        }))
    }
}
