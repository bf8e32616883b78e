#![allow(dead_code, unused_imports)] // Each test binary uses its own part of these helpers.

//! The ingest test harness: in-test stage services on a real socket that count their calls,
//! ingest started on them, and helpers to submit and watch a scan.

use std::{
    collections::{HashMap, HashSet},
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use ecoscan_common::{client::request_as, identity::caller, testing::spawn};
use ecoscan_ingest::{
    Config, Stores,
    error::StoreError,
    store::{Job, Lease, NewJob, Queue, QueueEntry, jobs::Checkpoint},
};
use ecoscan_proto::v1::{
    Answer, CancelRequest, CancelResponse, Character, Classification, ClassifyRequest,
    ClassifyResponse, DisposalRules, EvaluateRequest, EvaluateResponse, EventStatus,
    GenerateRequest, GenerateResponse, GetResultRequest, JobStatus, ListCategoriesRequest,
    ListCategoriesResponse, ListOwnedRequest, ListOwnedResponse, ListRequest, ListResponse,
    LookupRequest, LookupResponse, Notification, NotifyRequest, NotifyResponse, RewardDecision,
    ScanEvent, ScanResult, ScheduleRequest, ScheduleResponse, Stage, SubmitRequest,
    SubscribeRequest, SubscribeResponse, WatchRequest, answer_service_server, classify_response,
    generate_response, lookup_response, notification_service_server, reward_service_server,
    rule_service_server, scan_admin_service_client::ScanAdminServiceClient,
    scan_service_client::ScanServiceClient, vision_service_server,
};
use tokio_stream::{Stream, StreamExt};
use tonic::{Code, Request, Response, Status};

pub const PNG: &[u8] = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR";

pub type BoxStream<T> = std::pin::Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

pub fn stream_of<T: Send + 'static>(items: Vec<T>) -> BoxStream<T> {
    Box::pin(tokio_stream::iter(items.into_iter().map(Ok)))
}

/// Stage services that count their calls; vision can be told to fail.
#[derive(Clone, Default)]
pub struct Stages {
    pub calls: Arc<HashMap<&'static str, AtomicUsize>>,
    pub vision_fails_with: Option<Code>,
    /// How long answer thinks before it writes.
    pub answer_delay: Duration,
    /// Answer sends its first delta and then nothing, never ending its stream.
    pub answer_stalls: bool,
    /// Answer's first call streams two deltas, waits `answer_break_after`, then breaks
    /// (UNAVAILABLE, as a model stream cut mid-answer surfaces); later calls answer in full.
    pub answer_breaks_once: bool,
    pub answer_break_after: Duration,
    /// The `model` of every vision and answer call, as `"<stage>:<model>"`, in order.
    pub models: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Stages {
    pub fn new(vision_fails_with: Option<Code>) -> Self {
        let calls = ["vision", "rule", "answer", "reward", "notify"]
            .into_iter()
            .map(|k| (k, AtomicUsize::new(0)))
            .collect();
        Self {
            calls: Arc::new(calls),
            vision_fails_with,
            answer_delay: Duration::ZERO,
            answer_stalls: false,
            answer_breaks_once: false,
            answer_break_after: Duration::from_millis(400),
            models: Arc::default(),
        }
    }

    fn hit(&self, name: &str) {
        self.calls[name].fetch_add(1, Ordering::SeqCst);
    }

    fn saw_model(&self, stage: &str, model: &str) {
        self.models.lock().unwrap().push(format!("{stage}:{model}"));
    }

    pub fn count(&self, name: &str) -> usize {
        self.calls[name].load(Ordering::SeqCst)
    }
}

/// The acting user of a call, from its `x-user-id` metadata, as the real services read it.
pub fn acting_user<T>(req: &Request<T>) -> Result<String, Status> {
    caller(req.metadata()).map_err(|e| Status::invalid_argument(e.to_string()))
}

pub fn classification() -> Classification {
    Classification {
        major_category: "재활용폐기물".into(),
        middle_category: "무색페트병".into(),
        minor_category: "음료PET병".into(),
        item_name: "페트병".into(),
        confidence: 0.9,
        provider: "test".into(),
        ..Default::default()
    }
}

#[tonic::async_trait]
impl vision_service_server::VisionService for Stages {
    type ClassifyStream = BoxStream<ClassifyResponse>;
    async fn classify(
        &self,
        req: Request<ClassifyRequest>,
    ) -> Result<Response<Self::ClassifyStream>, Status> {
        self.hit("vision");
        self.saw_model("vision", &req.get_ref().model);
        assert_eq!(req.get_ref().image, PNG, "vision receives the stored image");
        if let Some(code) = self.vision_fails_with {
            return Err(Status::new(code, "the photo shows no object"));
        }
        Ok(Response::new(stream_of(vec![ClassifyResponse {
            event: Some(classify_response::Event::Classification(classification())),
        }])))
    }
}

#[tonic::async_trait]
impl rule_service_server::RuleService for Stages {
    type LookupStream = BoxStream<LookupResponse>;
    async fn lookup(
        &self,
        _: Request<LookupRequest>,
    ) -> Result<Response<Self::LookupStream>, Status> {
        self.hit("rule");
        Ok(Response::new(stream_of(vec![LookupResponse {
            event: Some(lookup_response::Event::Rules(DisposalRules {
                recyclable: true,
                ..Default::default()
            })),
        }])))
    }
    async fn list_categories(
        &self,
        _: Request<ListCategoriesRequest>,
    ) -> Result<Response<ListCategoriesResponse>, Status> {
        Ok(Response::new(ListCategoriesResponse::default()))
    }
}

#[tonic::async_trait]
impl answer_service_server::AnswerService for Stages {
    type GenerateStream = BoxStream<GenerateResponse>;
    async fn generate(
        &self,
        req: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        self.hit("answer");
        self.saw_model("answer", &req.get_ref().model);
        let first_call = self.count("answer") == 1;
        assert!(req.get_ref().classification.is_some() && req.get_ref().rules.is_some());
        tokio::time::sleep(self.answer_delay).await;
        let delta = |d: &str| GenerateResponse {
            event: Some(generate_response::Event::Delta(d.into())),
        };
        if self.answer_breaks_once && first_call {
            let wait = self.answer_break_after;
            let first = stream_of(vec![delta("Rinse it. "), delta("Remove the label. ")]);
            let broken = futures::stream::once(async move {
                tokio::time::sleep(wait).await;
                Err(Status::unavailable("the model's stream broke off"))
            });
            return Ok(Response::new(Box::pin(first.chain(broken))));
        }
        if self.answer_stalls {
            let first = stream_of(vec![delta("Remove the label, ")]);
            return Ok(Response::new(Box::pin(
                first.chain(tokio_stream::pending()),
            )));
        }
        Ok(Response::new(stream_of(vec![
            delta("Remove the label, "),
            delta("rinse, "),
            delta("crush."),
            GenerateResponse {
                event: Some(generate_response::Event::Answer(Answer {
                    text: "Remove the label, rinse, crush.".into(),
                    ..Default::default()
                })),
            },
        ])))
    }
}

#[tonic::async_trait]
impl reward_service_server::RewardService for Stages {
    async fn evaluate(
        &self,
        req: Request<EvaluateRequest>,
    ) -> Result<Response<EvaluateResponse>, Status> {
        // Ingest evaluates for the job's owner, in the metadata.
        acting_user(&req)?;
        self.hit("reward");
        Ok(Response::new(EvaluateResponse {
            decision: Some(RewardDecision {
                eligible: true,
                newly_granted: true,
                character: Some(Character {
                    code: "char-petty".into(),
                    ..Default::default()
                }),
                reason: "granted".into(),
            }),
        }))
    }
    async fn list_owned(
        &self,
        req: Request<ListOwnedRequest>,
    ) -> Result<Response<ListOwnedResponse>, Status> {
        acting_user(&req)?;
        Ok(Response::new(ListOwnedResponse::default()))
    }
    async fn list_catalogue(
        &self,
        _req: Request<ecoscan_proto::v1::ListCatalogueRequest>,
    ) -> Result<Response<ecoscan_proto::v1::ListCatalogueResponse>, Status> {
        Err(Status::unimplemented("ingest never asks for the catalogue"))
    }
    async fn get_character(
        &self,
        _req: Request<ecoscan_proto::v1::GetCharacterRequest>,
    ) -> Result<Response<ecoscan_proto::v1::GetCharacterResponse>, Status> {
        Err(Status::unimplemented("ingest never asks for a character"))
    }
}

#[tonic::async_trait]
impl notification_service_server::NotificationService for Stages {
    async fn notify(
        &self,
        req: Request<NotifyRequest>,
    ) -> Result<Response<NotifyResponse>, Status> {
        // Ingest notifies the job's owner, in the metadata.
        let user_id = acting_user(&req)?;
        self.hit("notify");
        assert_eq!(req.get_ref().kind, "scan_completed");
        Ok(Response::new(NotifyResponse {
            notification: Some(Notification {
                user_id,
                ..Default::default()
            }),
        }))
    }
    async fn schedule(
        &self,
        _: Request<ScheduleRequest>,
    ) -> Result<Response<ScheduleResponse>, Status> {
        Err(Status::unimplemented("not used by ingest"))
    }
    async fn cancel(&self, _: Request<CancelRequest>) -> Result<Response<CancelResponse>, Status> {
        Err(Status::unimplemented("not used by ingest"))
    }
    type SubscribeStream = BoxStream<SubscribeResponse>;
    async fn subscribe(
        &self,
        _: Request<SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        Err(Status::unimplemented("not used by ingest"))
    }
    async fn list(&self, _: Request<ListRequest>) -> Result<Response<ListResponse>, Status> {
        Err(Status::unimplemented("not used by ingest"))
    }
}

pub struct Env {
    pub stages: Stages,
    pub stores: Stores,
    pub ingest: ScanServiceClient<ecoscan_common::client::TracedChannel>,
    pub admin: ScanAdminServiceClient<ecoscan_common::client::TracedChannel>,
    pub dir: tempfile::TempDir,
    pub _servers: Vec<ecoscan_common::testing::Spawned>,
}

pub async fn start(vision_fails_with: Option<Code>, tweak: impl FnOnce(&mut Config)) -> Env {
    start_with(Stages::new(vision_fails_with), tweak, |s| s).await
}

/// [`start`] with given stage services, and stores `wrap` may replace.
pub async fn start_with(
    stages: Stages,
    tweak: impl FnOnce(&mut Config),
    wrap: impl FnOnce(Stores) -> Stores,
) -> Env {
    let s = stages.clone();
    let upstream = spawn(move |l, sd| async move {
        let routes =
            tonic::service::Routes::new(vision_service_server::VisionServiceServer::new(s.clone()))
                .add_service(rule_service_server::RuleServiceServer::new(s.clone()))
                .add_service(answer_service_server::AnswerServiceServer::new(s.clone()))
                .add_service(reward_service_server::RewardServiceServer::new(s.clone()))
                .add_service(notification_service_server::NotificationServiceServer::new(
                    s,
                ));
        ecoscan_common::server::serve(routes, &[], l, sd).await
    })
    .await;

    let dir = tempfile::tempdir().unwrap();
    let up = upstream.uri();
    let mut config = Config {
        vision_url: up.clone(),
        rule_url: up.clone(),
        answer_url: up.clone(),
        reward_url: up.clone(),
        notification_url: up,
        database_url: format!(
            "sqlite://{}?mode=rwc",
            dir.path().join("ingest.db").display()
        ),
        object_dir: dir.path().join("objects"),
        max_in_flight: 4,
        stage_retries: 1,
        ..Config::default()
    };
    tweak(&mut config);
    // The stores the configuration selects: embedded unless a test points it at servers.
    let stores = wrap(Stores::from_config(&config).await.unwrap());
    let st = stores.clone();
    let ingest = spawn(move |l, sd| ecoscan_ingest::serve_with(config, st, l, sd)).await;
    let channel = ecoscan_common::client::channel(&ingest.uri()).unwrap();
    Env {
        stages,
        stores,
        ingest: ScanServiceClient::new(channel.clone()),
        admin: ScanAdminServiceClient::new(channel),
        dir,
        _servers: vec![upstream, ingest],
    }
}

/// Polls `check` every 100 ms until it holds, for at most `within`; panics with `what`.
pub async fn eventually<F: AsyncFn() -> bool>(within: Duration, what: &str, check: F) {
    let deadline = tokio::time::Instant::now() + within;
    while !check().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} (waited {within:?})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A new job of `u1` for the image under `image_key` (a fresh id, the rest plain).
pub fn new_job(image_key: &str) -> NewJob {
    NewJob {
        id: uuid::Uuid::now_v7().to_string(),
        user_id: "u1".into(),
        image_key: image_key.into(),
        content_type: "image/png".into(),
        hint: String::new(),
        locale: "en".into(),
        model: String::new(),
        idempotency_key: None,
        trace_carrier: HashMap::new(),
    }
}

/// A job row of `u1` for the test PNG, stored under `image_key` first: what `Submit` leaves
/// before it enqueues, for tests that put the job in a state of their own before it runs.
pub async fn insert_with_image(env: &Env, image_key: &str) -> Job {
    env.stores
        .objects
        .put(image_key, Bytes::from_static(PNG))
        .await
        .unwrap();
    let (job, _) = env.stores.jobs.insert(new_job(image_key)).await.unwrap();
    job
}

/// Submits the test PNG as `u1` and returns the job id.
pub async fn submit_png(env: &Env) -> String {
    try_submit_png(env, Duration::from_secs(10))
        .await
        .expect("submit accepts the test image")
}

/// Submits the test PNG as `u1` with a call deadline of `deadline`: the job id, or the status
/// ingest refused it with.
pub async fn try_submit_png(env: &Env, deadline: Duration) -> Result<String, tonic::Status> {
    env.ingest
        .clone()
        .submit(request_as(
            SubmitRequest {
                image: PNG.to_vec(),
                ..Default::default()
            },
            deadline,
            "u1",
        ))
        .await
        .map(|r| r.into_inner().job_id)
}

/// The job's result as `u1` reads it over `GetResult`.
pub async fn result_of(env: &Env, job_id: &str) -> ScanResult {
    result_as(env, job_id, "u1")
        .await
        .expect("GetResult answers")
}

/// The job's result as `user` reads it over `GetResult`, or the status it gets.
pub async fn result_as(env: &Env, job_id: &str, user: &str) -> Result<ScanResult, Status> {
    env.ingest
        .clone()
        .get_result(request_as(
            GetResultRequest {
                job_id: job_id.into(),
            },
            Duration::from_secs(10),
            user,
        ))
        .await
        .map(|r| r.into_inner().result.expect("a result"))
}

pub async fn watch_all(env: &Env, job_id: &str) -> Vec<ScanEvent> {
    let mut stream = env
        .ingest
        .clone()
        .watch(request_as(
            WatchRequest {
                job_id: job_id.into(),
                ..Default::default()
            },
            Duration::from_secs(60),
            "u1",
        ))
        .await
        .unwrap()
        .into_inner();
    let mut events = Vec::new();
    let read = async {
        while let Some(ev) = stream.next().await {
            events.push(ev.unwrap().event.expect("every message carries an event"));
        }
    };
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .expect("the job finishes within 60 s");
    events
}
