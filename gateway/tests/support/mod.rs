//! Test doubles of the upstream services (in-test tonic servers on 127.0.0.1:0), a running
//! gateway in front of them, and a small SSE parser.

#![allow(dead_code)]

use std::{
    collections::HashMap,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
};

use ecoscan_common::{
    identity::caller,
    testing::{Spawned, spawn},
};
use ecoscan_gateway::Config;
use ecoscan_proto::v1::{
    CancelRequest, CancelResponse, Character, Classification, CreateUploadRequest,
    CreateUploadResponse, ErrorInfo, EvaluateRequest, EvaluateResponse, EventStatus,
    GetCallRequest, GetCallResponse, GetResultRequest, GetResultResponse, JobStatus,
    ListOwnedRequest, ListOwnedResponse, ListRequest, ListResponse, Notification, NotifyRequest,
    NotifyResponse, OwnedCharacter, PutUploadRequest, PutUploadResponse, RecordRequest,
    RecordResponse, RecordStreamRequest, RecordStreamResponse, RewardDecision, ScanEvent,
    ScanRequest, ScanResponse, ScanResult, ScheduleRequest, ScheduleResponse, Stage, SubmitRequest,
    SubmitResponse, SubscribeRequest, SubscribeResponse, UsageRequest, UsageResponse, UsageRow,
    WatchRequest, WatchResponse,
    analytics_service_server::{AnalyticsService, AnalyticsServiceServer},
    notification_service_server::{NotificationService, NotificationServiceServer},
    reward_service_server::{RewardService, RewardServiceServer},
    scan_event::Payload,
    scan_service_server::{ScanService, ScanServiceServer},
};
use tokio::sync::Notify;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming, service::Routes};

/// A job the fake ingest knows as finished successfully.
pub const DONE_JOB: &str = "11111111-1111-4111-8111-111111111111";
/// A job the fake ingest knows as running (stage vision).
pub const RUNNING_JOB: &str = "22222222-2222-4222-8222-222222222222";
/// A job the fake ingest knows as failed in vision.
pub const FAILED_JOB: &str = "33333333-3333-4333-8333-333333333333";
/// A job whose `GetResult` waits until the test opens the gate.
pub const SLOW_JOB: &str = "44444444-4444-4444-8444-444444444444";
/// The id the fake ingest gives every new job.
pub const NEW_JOB: &str = "55555555-5555-4555-8555-555555555555";
/// A job the fake ingest does not know.
pub const UNKNOWN_JOB: &str = "66666666-6666-4666-8666-666666666666";
/// The id the fake ingest gives every new upload.
pub const NEW_UPLOAD: &str = "88888888-8888-4888-8888-888888888888";
/// A declared size for which the fake ingest answers an upload that has expired already.
pub const EXPIRED_UPLOAD_SIZE: u64 = 13;

/// A job whose watch ingest refuses because its Redis does not answer.
pub const STORE_DOWN_JOB: &str = "77777777-7777-4777-8777-777777777777";

/// What the fakes saw.
#[derive(Default)]
pub struct Calls {
    pub submit: AtomicUsize,
    pub scan: AtomicUsize,
    pub watch: AtomicUsize,
    pub get_result: AtomicUsize,
    pub last_submit: Mutex<Option<SubmitRequest>>,
    pub last_watch: Mutex<Option<WatchRequest>>,
    /// `x-user-id` metadata of the last call to any fake.
    pub last_user: Mutex<Option<String>>,
    /// The acting user (`x-user-id` metadata) of the last call of each RPC, by RPC name
    /// ("submit", "scan", "watch", "get_result", "list_owned", "schedule", "subscribe", "list").
    pub users: Mutex<HashMap<&'static str, String>>,
    /// `traceparent` metadata of the last `Submit`.
    pub last_traceparent: Mutex<Option<String>>,
    pub last_usage: Mutex<Option<UsageRequest>>,
    pub last_schedule: Mutex<Option<ScheduleRequest>>,
    pub last_list: Mutex<Option<ListRequest>>,
    pub last_put_upload: Mutex<Option<PutUploadRequest>>,
}

impl Calls {
    pub fn submits(&self) -> usize {
        self.submit.load(Ordering::SeqCst) + self.scan.load(Ordering::SeqCst)
    }

    /// The acting user of the last call of `rpc`.
    pub fn user_of(&self, rpc: &str) -> Option<String> {
        self.users.lock().unwrap().get(rpc).cloned()
    }

    fn saw<T>(&self, req: &Request<T>) {
        let user = meta(req, "x-user-id");
        *self.last_user.lock().unwrap() = user;
    }

    /// Records a call of `rpc` and returns its acting user, read from the metadata as the real
    /// services read it: UNAUTHENTICATED without one.
    fn acting_user<T>(&self, rpc: &'static str, req: &Request<T>) -> Result<String, Status> {
        self.saw(req);
        let user = caller(req.metadata()).map_err(Status::from)?;
        self.users.lock().unwrap().insert(rpc, user.clone());
        Ok(user)
    }
}

fn meta<T>(req: &Request<T>, key: &str) -> Option<String> {
    req.metadata()
        .get(key)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

fn event(
    n: u64,
    job: &str,
    stage: Stage,
    status: EventStatus,
    payload: Option<Payload>,
) -> ScanEvent {
    ScanEvent {
        event_id: format!("1700000000000-{n}"),
        job_id: job.to_owned(),
        seq: n + 1,
        stage: stage as i32,
        status: status as i32,
        progress: n as f32 / 6.0,
        message: format!("step {n}"),
        ts: Some(ecoscan_proto::now()),
        trace_id: "0af7651916cd43dd8448eb211c80319c".to_owned(),
        payload,
        offset: 0,
    }
}

/// The events of a job that succeeds: queued, vision, answer deltas, reward, done.
pub fn success_events(job: &str) -> Vec<ScanEvent> {
    use EventStatus as S;
    vec![
        event(0, job, Stage::Queued, S::Completed, None),
        event(1, job, Stage::Vision, S::Started, None),
        event(
            2,
            job,
            Stage::Vision,
            S::Completed,
            Some(Payload::Classification(Classification {
                major_category: "재활용폐기물".into(),
                middle_category: "무색페트병".into(),
                minor_category: "음료PET병".into(),
                confidence: 0.9,
                provider: "mock".into(),
                ..Classification::default()
            })),
        ),
        event(
            3,
            job,
            Stage::Answer,
            S::Delta,
            Some(Payload::Delta("Rinse ".into())),
        ),
        event(
            4,
            job,
            Stage::Answer,
            S::Delta,
            Some(Payload::Delta("the bottle.".into())),
        ),
        event(
            5,
            job,
            Stage::Reward,
            S::Completed,
            Some(Payload::Reward(RewardDecision {
                eligible: true,
                newly_granted: true,
                character: Some(character()),
                reason: "granted".into(),
            })),
        ),
        // ingest's `done` of a successful job carries no payload: the gateway builds the
        // result URL itself.
        event(6, job, Stage::Done, S::Completed, None),
    ]
}

fn failed_events(job: &str) -> Vec<ScanEvent> {
    vec![
        event(0, job, Stage::Queued, EventStatus::Completed, None),
        event(1, job, Stage::Vision, EventStatus::Started, None),
        event(
            2,
            job,
            Stage::Vision,
            EventStatus::Failed,
            Some(Payload::Error(error_info())),
        ),
        // ingest ends every failed job with a `done` event carrying the error.
        event(
            3,
            job,
            Stage::Done,
            EventStatus::Failed,
            Some(Payload::Error(error_info())),
        ),
    ]
}

fn error_info() -> ErrorInfo {
    ErrorInfo {
        code: "UNAVAILABLE".into(),
        http_status: 503,
        message: "the vision service is unavailable".into(),
        retryable: true,
    }
}

fn character() -> Character {
    Character {
        code: "char-petty".into(),
        name_ko: "페티".into(),
        name_en: "Petty".into(),
        middle_category: "무색페트병".into(),
        ..Character::default()
    }
}

fn seq_of(event_id: &str) -> Option<u64> {
    event_id.split_once('-').and_then(|(_, n)| n.parse().ok())
}

fn stream_of<T: Send + 'static>(items: Vec<Result<T, Status>>) -> EventStream<T> {
    Box::pin(tokio_stream::iter(items))
}

fn overloaded(hint: &str) -> Option<Status> {
    match hint {
        "overload" => {
            // As ingest sends it: its ErrorInfo reason, a RetryInfo, and the trailer.
            let mut s = ecoscan_common::reasons::status(
                tonic::Code::ResourceExhausted,
                "backlog is full",
                ecoscan_common::reasons::Reason::BacklogFull,
                &[("backlog", "100".into())],
                Some(std::time::Duration::from_secs(7)),
            );
            s.metadata_mut().insert("retry-after", "7".parse().unwrap());
            Some(s)
        }
        "overload-no-delay" => Some(Status::resource_exhausted("backlog is full")),
        // As ingest refuses a field: INVALID_FIELD and a BadRequest naming it.
        "bad-field" => Some(ecoscan_common::reasons::invalid_field(
            "locale",
            "locale \"fr\" is not supported; use \"ko\" or \"en\"",
        )),
        "store-down" => Some(store_down()),
        _ => None,
    }
}

/// What ingest answers a submit or a new watch while its Redis does not answer (its circuit
/// is open).
fn store_down() -> Status {
    let mut s = ecoscan_common::reasons::status(
        tonic::Code::Unavailable,
        "redis is not answering (timed out); try again in 1 s",
        ecoscan_common::reasons::Reason::StoreUnavailable,
        &[("store", "redis".into()), ("fault", "timed_out".into())],
        Some(std::time::Duration::from_secs(1)),
    );
    s.metadata_mut().insert("retry-after", "1".parse().unwrap());
    s
}

#[derive(Clone)]
pub struct FakeIngest {
    calls: Arc<Calls>,
    gate: Arc<Notify>,
}

#[tonic::async_trait]
impl ScanService for FakeIngest {
    async fn submit(
        &self,
        req: Request<SubmitRequest>,
    ) -> Result<Response<SubmitResponse>, Status> {
        self.calls.submit.fetch_add(1, Ordering::SeqCst);
        self.calls.acting_user("submit", &req)?;
        *self.calls.last_traceparent.lock().unwrap() = meta(&req, "traceparent");
        let msg = req.into_inner();
        let overload = overloaded(&msg.hint);
        let duplicate = msg.idempotency_key == "repeat";
        *self.calls.last_submit.lock().unwrap() = Some(msg);
        if let Some(s) = overload {
            return Err(s);
        }
        Ok(Response::new(SubmitResponse {
            job_id: NEW_JOB.into(),
            status: JobStatus::Queued as i32,
            duplicate,
        }))
    }

    type ScanStream = EventStream<ScanResponse>;

    async fn scan(&self, req: Request<ScanRequest>) -> Result<Response<Self::ScanStream>, Status> {
        self.calls.scan.fetch_add(1, Ordering::SeqCst);
        self.calls.acting_user("scan", &req)?;
        let msg = SubmitRequest::from(req.into_inner());
        let overload = overloaded(&msg.hint);
        *self.calls.last_submit.lock().unwrap() = Some(msg);
        // Refused inside the stream, as a worker would: the gateway must still answer 503.
        if let Some(s) = overload {
            return Ok(Response::new(stream_of(vec![Err(s)])));
        }
        let events = success_events(NEW_JOB)
            .into_iter()
            .map(|event| {
                Ok(ScanResponse {
                    event: Some(event),
                    resync: None,
                })
            })
            .collect();
        Ok(Response::new(stream_of(events)))
    }

    type WatchStream = EventStream<WatchResponse>;

    async fn watch(
        &self,
        req: Request<WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        self.calls.watch.fetch_add(1, Ordering::SeqCst);
        self.calls.acting_user("watch", &req)?;
        let msg = req.into_inner();
        *self.calls.last_watch.lock().unwrap() = Some(msg.clone());
        // An id of another job (here: any id of the year 2286), refused as the real ingest
        // does, a moment later, so that other clients can join the feed meanwhile.
        if msg.after_event_id.starts_with("9999999999999-") {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            return Err(Status::invalid_argument(format!(
                "event id {} is not an event of job {}",
                msg.after_event_id, msg.job_id
            )));
        }
        if msg.job_id == STORE_DOWN_JOB {
            return Err(store_down());
        }
        let events = match msg.job_id.as_str() {
            DONE_JOB => success_events(DONE_JOB),
            FAILED_JOB => failed_events(FAILED_JOB),
            RUNNING_JOB => {
                // Two events, then the stream breaks.
                let mut items: Vec<_> = success_events(RUNNING_JOB)
                    .into_iter()
                    .take(2)
                    .map(|event| {
                        Ok(WatchResponse {
                            event: Some(event),
                            resync: None,
                        })
                    })
                    .collect();
                items.push(Err(Status::internal("redis: connection reset by peer")));
                return Ok(Response::new(stream_of(items)));
            }
            _ => return Err(Status::not_found(format!("job {} not found", msg.job_id))),
        };
        let after = seq_of(&msg.after_event_id);
        // As the real ingest does: a resume at or past the end of a finished job gets the
        // job's end again, at the log's final id.
        let last = events.last().cloned();
        let mut events: Vec<ScanEvent> = events
            .into_iter()
            .filter(|e| after.is_none_or(|a| seq_of(&e.event_id).unwrap() > a))
            .collect();
        if events.is_empty() {
            events.extend(last);
        }
        let items = events
            .into_iter()
            .map(|event| {
                Ok(WatchResponse {
                    event: Some(event),
                    resync: None,
                })
            })
            .collect();
        Ok(Response::new(stream_of(items)))
    }

    async fn create_upload(
        &self,
        req: Request<CreateUploadRequest>,
    ) -> Result<Response<CreateUploadResponse>, Status> {
        self.calls.acting_user("create_upload", &req)?;
        let msg = req.into_inner();
        let now = std::time::SystemTime::now();
        let expires_at = if msg.size_bytes == EXPIRED_UPLOAD_SIZE {
            now - std::time::Duration::from_secs(5)
        } else {
            now + std::time::Duration::from_secs(600)
        };
        // As ingest with the embedded store: no presigned URL, the gateway makes its own.
        Ok(Response::new(CreateUploadResponse {
            upload_id: NEW_UPLOAD.into(),
            upload_url: String::new(),
            headers: HashMap::new(),
            expires_at: Some(ecoscan_proto::timestamp(expires_at)),
            content_type: msg.content_type,
            size_bytes: msg.size_bytes,
        }))
    }

    async fn put_upload(
        &self,
        req: Request<PutUploadRequest>,
    ) -> Result<Response<PutUploadResponse>, Status> {
        self.calls.acting_user("put_upload", &req)?;
        *self.calls.last_put_upload.lock().unwrap() = Some(req.into_inner());
        Ok(Response::new(PutUploadResponse {
            expires_at: Some(ecoscan_proto::now()),
        }))
    }

    async fn get_result(
        &self,
        req: Request<GetResultRequest>,
    ) -> Result<Response<GetResultResponse>, Status> {
        self.calls.get_result.fetch_add(1, Ordering::SeqCst);
        self.calls.acting_user("get_result", &req)?;
        let job_id = req.into_inner().job_id;
        let base = ScanResult {
            job_id: job_id.clone(),
            user_id: "local".into(),
            // A job's own time: the same on every read, as ingest answers it.
            created_at: Some(ecoscan_proto::timestamp(
                std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000),
            )),
            ..ScanResult::default()
        };
        let result = match job_id.as_str() {
            DONE_JOB => ScanResult {
                status: JobStatus::Succeeded as i32,
                stage: Stage::Done as i32,
                classification: Some(Classification {
                    major_category: "재활용폐기물".into(),
                    ..Classification::default()
                }),
                reward: Some(RewardDecision {
                    eligible: true,
                    character: Some(character()),
                    ..RewardDecision::default()
                }),
                ..base
            },
            RUNNING_JOB => ScanResult {
                status: JobStatus::Running as i32,
                stage: Stage::Vision as i32,
                ..base
            },
            FAILED_JOB => ScanResult {
                status: JobStatus::Failed as i32,
                stage: Stage::Vision as i32,
                error: Some(error_info()),
                ..base
            },
            SLOW_JOB => {
                self.gate.notified().await;
                ScanResult {
                    status: JobStatus::Queued as i32,
                    stage: Stage::Queued as i32,
                    ..base
                }
            }
            _ => return Err(Status::not_found(format!("job {job_id} not found"))),
        };
        Ok(Response::new(GetResultResponse {
            result: Some(result),
        }))
    }
}

#[derive(Clone)]
pub struct FakeReward {
    calls: Arc<Calls>,
}

#[tonic::async_trait]
impl RewardService for FakeReward {
    async fn evaluate(
        &self,
        _req: Request<EvaluateRequest>,
    ) -> Result<Response<EvaluateResponse>, Status> {
        Err(Status::unimplemented("not used by the gateway"))
    }

    async fn list_owned(
        &self,
        req: Request<ListOwnedRequest>,
    ) -> Result<Response<ListOwnedResponse>, Status> {
        let user = self.calls.acting_user("list_owned", &req)?;
        Ok(Response::new(ListOwnedResponse {
            characters: vec![OwnedCharacter {
                character: Some(character()),
                acquired_at: Some(ecoscan_proto::now()),
                job_id: format!("job-of-{user}"),
            }],
        }))
    }

    async fn list_catalogue(
        &self,
        _req: Request<ecoscan_proto::v1::ListCatalogueRequest>,
    ) -> Result<Response<ecoscan_proto::v1::ListCatalogueResponse>, Status> {
        // The real catalogue is tested through the real reward service (services/suite).
        Err(Status::unimplemented("not used by these tests"))
    }

    async fn get_character(
        &self,
        _req: Request<ecoscan_proto::v1::GetCharacterRequest>,
    ) -> Result<Response<ecoscan_proto::v1::GetCharacterResponse>, Status> {
        Err(Status::unimplemented("not used by these tests"))
    }
}

#[derive(Clone)]
pub struct FakeNotification {
    calls: Arc<Calls>,
}

pub fn notification(id: &str, user: &str) -> Notification {
    Notification {
        id: id.into(),
        user_id: user.into(),
        kind: "scan_completed".into(),
        title: "Your scan is ready".into(),
        body: "Petty joined you".into(),
        ..Notification::default()
    }
}

#[tonic::async_trait]
impl NotificationService for FakeNotification {
    async fn notify(
        &self,
        _req: Request<NotifyRequest>,
    ) -> Result<Response<NotifyResponse>, Status> {
        Err(Status::unimplemented("not used by the gateway"))
    }

    async fn schedule(
        &self,
        req: Request<ScheduleRequest>,
    ) -> Result<Response<ScheduleResponse>, Status> {
        let user_id = self.calls.acting_user("schedule", &req)?;
        let msg = req.into_inner();
        *self.calls.last_schedule.lock().unwrap() = Some(msg.clone());
        Ok(Response::new(ScheduleResponse {
            notification: Some(Notification {
                id: "n-1".into(),
                user_id,
                kind: msg.kind,
                title: msg.title,
                body: msg.body,
                due_at: msg.due_at,
                status: 1,
                ..Notification::default()
            }),
        }))
    }

    async fn cancel(
        &self,
        _req: Request<CancelRequest>,
    ) -> Result<Response<CancelResponse>, Status> {
        Err(Status::unimplemented("not used by the gateway"))
    }

    type SubscribeStream = EventStream<SubscribeResponse>;

    async fn subscribe(
        &self,
        req: Request<SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let user = self.calls.acting_user("subscribe", &req)?;
        // One notification, then the stream stays open as a live inbox does.
        let first = tokio_stream::iter(vec![Ok(SubscribeResponse {
            notification: Some(notification("n-1", &user)),
        })]);
        Ok(Response::new(Box::pin(
            first.chain(tokio_stream::pending()),
        )))
    }

    async fn list(&self, req: Request<ListRequest>) -> Result<Response<ListResponse>, Status> {
        let user = self.calls.acting_user("list", &req)?;
        let msg = req.into_inner();
        *self.calls.last_list.lock().unwrap() = Some(msg);
        Ok(Response::new(ListResponse {
            notifications: vec![notification("n-1", &user)],
        }))
    }
}

#[derive(Clone)]
pub struct FakeAnalytics {
    calls: Arc<Calls>,
}

#[tonic::async_trait]
impl AnalyticsService for FakeAnalytics {
    async fn record(
        &self,
        _req: Request<RecordRequest>,
    ) -> Result<Response<RecordResponse>, Status> {
        Err(Status::unimplemented("not used by the gateway"))
    }

    async fn record_stream(
        &self,
        _req: Request<Streaming<RecordStreamRequest>>,
    ) -> Result<Response<RecordStreamResponse>, Status> {
        Err(Status::unimplemented("not used by the gateway"))
    }

    async fn usage(&self, req: Request<UsageRequest>) -> Result<Response<UsageResponse>, Status> {
        self.calls.saw(&req);
        let msg = req.into_inner();
        *self.calls.last_usage.lock().unwrap() = Some(msg);
        Ok(Response::new(UsageResponse {
            since: msg.since,
            until: msg.until,
            rows: vec![UsageRow {
                service: "vision".into(),
                model: "mock".into(),
                calls: 3,
                ..UsageRow::default()
            }],
        }))
    }

    async fn get_call(
        &self,
        _req: Request<GetCallRequest>,
    ) -> Result<Response<GetCallResponse>, Status> {
        Err(Status::unimplemented("not used by the gateway"))
    }
}

/// The fakes behind one server, and a gateway in front of them.
pub struct Env {
    /// `http://127.0.0.1:PORT` of the gateway.
    pub base: String,
    /// `http://127.0.0.1:PORT` of the gateway's admin listener (`/metrics`, `/readyz`).
    pub admin: String,
    pub calls: Arc<Calls>,
    /// Releases a `GetResult` of [`SLOW_JOB`].
    pub gate: Arc<Notify>,
    pub http: reqwest::Client,
    pub backend: Spawned,
    pub gateway: Spawned,
}

impl Env {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// A URL on the admin listener.
    pub fn admin_url(&self, path: &str) -> String {
        format!("{}{path}", self.admin)
    }
}

pub async fn start() -> Env {
    start_with(|c| c).await
}

/// The HS256 secret of the gateways [`start_with`] runs.
pub const SECRET: &str = "kq3Zx9LrT0vYp2WmB7nHc4JdF8sG1aE6-test-only";

/// The user the test client names in `X-User-Id` when a request names none (what the gateway's
/// default user used to be).
pub const DEFAULT_USER: &str = "local";

/// A token the gateways of [`start_with`] accept, for `user` (with the admin role if `admin`).
pub fn token(user: &str, admin: bool) -> String {
    ecoscan_gateway::mint_token(
        SECRET,
        user,
        admin,
        "",
        "",
        std::time::Duration::from_secs(600),
    )
    .unwrap()
}

/// Settings for a gateway the tests reach over loopback: tokens signed with [`SECRET`], and
/// header mode (`loopback`), which most tests use to name their users: they are about
/// something else than authentication (`tests/edge.rs` is about that, and turns it off).
pub fn test_config(c: Config) -> Config {
    Config {
        auth: ecoscan_gateway::AuthConfig {
            hs256_secret: Some(SECRET.into()),
            trust_header: ecoscan_gateway::TrustHeader::Loopback,
            ..Default::default()
        },
        ..c
    }
}

/// Starts the fakes and a gateway whose config `tweak` may change (its URLs point at the fakes).
pub async fn start_with(tweak: impl FnOnce(Config) -> Config) -> Env {
    let calls = Arc::new(Calls::default());
    let gate = Arc::new(Notify::new());
    let routes = Routes::new(ScanServiceServer::new(FakeIngest {
        calls: calls.clone(),
        gate: gate.clone(),
    }))
    .add_service(RewardServiceServer::new(FakeReward {
        calls: calls.clone(),
    }))
    .add_service(NotificationServiceServer::new(FakeNotification {
        calls: calls.clone(),
    }))
    .add_service(AnalyticsServiceServer::new(FakeAnalytics {
        calls: calls.clone(),
    }));
    let backend = spawn(|l, s| {
        ecoscan_common::server::serve(
            routes,
            &[
                "ecoscan.v1.ScanService",
                "ecoscan.v1.RewardService",
                "ecoscan.v1.NotificationService",
                "ecoscan.v1.AnalyticsService",
            ],
            l,
            s,
        )
    })
    .await;
    let uri = backend.uri();
    let config = tweak(test_config(Config {
        ingest_url: uri.clone(),
        reward_url: uri.clone(),
        analytics_url: uri.clone(),
        notification_url: uri,
        ..Config::default()
    }));
    let admin = ecoscan_common::server::listen(([127, 0, 0, 1], 0).into()).expect("bind admin");
    let admin_base = format!("http://{}", admin.local_addr().unwrap());
    let gateway = spawn(|l, s| ecoscan_gateway::serve_with_admin(config, l, Some(admin), s)).await;
    Env {
        base: gateway.uri(),
        admin: admin_base,
        calls,
        gate,
        http: reqwest::Client::builder()
            .default_headers(
                [(
                    reqwest::header::HeaderName::from_static("x-user-id"),
                    reqwest::header::HeaderValue::from_static(DEFAULT_USER),
                )]
                .into_iter()
                .collect(),
            )
            .build()
            .unwrap(),
        backend,
        gateway,
    }
}

/// One parsed SSE event.
#[derive(Debug, Default, Clone)]
pub struct SseEvent {
    pub id: Option<String>,
    pub event: Option<String>,
    pub data: String,
}

impl SseEvent {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.data).unwrap_or_else(|e| panic!("bad data {:?}: {e}", self.data))
    }

    pub fn name(&self) -> &str {
        self.event.as_deref().unwrap_or("message")
    }
}

/// Parses an SSE body into events (comments are dropped).
pub fn parse_sse(body: &str) -> Vec<SseEvent> {
    let mut out = Vec::new();
    for block in body.split("\n\n") {
        let mut ev = SseEvent::default();
        let mut any = false;
        for line in block.lines() {
            if line.starts_with(':') || line.is_empty() {
                continue;
            }
            let (field, value) = line.split_once(':').unwrap_or((line, ""));
            let value = value.strip_prefix(' ').unwrap_or(value);
            any = true;
            match field {
                "id" => ev.id = Some(value.to_owned()),
                "event" => ev.event = Some(value.to_owned()),
                "data" => {
                    if !ev.data.is_empty() {
                        ev.data.push('\n');
                    }
                    ev.data.push_str(value);
                }
                _ => {}
            }
        }
        if any {
            out.push(ev);
        }
    }
    out
}

/// The smallest valid-looking PNG prefix; the gateway only sniffs the magic bytes.
pub fn png(len: usize) -> Vec<u8> {
    let mut v = b"\x89PNG\r\n\x1a\n".to_vec();
    v.resize(len.max(8), 0);
    v
}

/// A multipart/form-data body (reqwest's multipart feature is not enabled in the workspace):
/// `(name, filename, bytes)` per part; returns the content type and the body.
pub fn multipart(parts: &[(&str, Option<&str>, &[u8])]) -> (String, Vec<u8>) {
    let boundary = "ecoscan-test-boundary-7d3f";
    let mut body = Vec::new();
    for (name, filename, bytes) in parts {
        body.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
        match filename {
            Some(f) => body.extend_from_slice(
                format!(
                    "Content-Disposition: form-data; name=\"{name}\"; filename=\"{f}\"\r\n\
                     Content-Type: application/octet-stream\r\n\r\n"
                )
                .as_bytes(),
            ),
            None => body.extend_from_slice(
                format!("Content-Disposition: form-data; name=\"{name}\"\r\n\r\n").as_bytes(),
            ),
        }
        body.extend_from_slice(bytes);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}
