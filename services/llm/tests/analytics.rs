//! Every call, success or failure, reaches the analytics service.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use bytes::Bytes;
use ecoscan_common::testing::{Spawned, spawn};
use ecoscan_llm::{AnalyticsReporter, ClassifyInput, Llm, LlmConfig, Provider, TaxonomyPath};
use ecoscan_proto::v1::{
    CallStatus, GetCallRequest, GetCallResponse, LlmCall, RecordRequest, RecordResponse,
    RecordStreamRequest, RecordStreamResponse, UsageRequest, UsageResponse,
    analytics_service_server::{AnalyticsService, AnalyticsServiceServer},
};
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming, service::Routes};

#[derive(Clone, Default)]
struct Recorder {
    calls: Arc<Mutex<Vec<LlmCall>>>,
}

#[tonic::async_trait]
impl AnalyticsService for Recorder {
    async fn record(
        &self,
        req: Request<RecordRequest>,
    ) -> Result<Response<RecordResponse>, Status> {
        let call = req
            .into_inner()
            .call
            .ok_or_else(|| Status::invalid_argument("call is missing"))?;
        let call_id = call.call_id.clone();
        self.calls.lock().unwrap().push(call);
        Ok(Response::new(RecordResponse {
            call_id,
            duplicate: false,
        }))
    }

    async fn record_stream(
        &self,
        req: Request<Streaming<RecordStreamRequest>>,
    ) -> Result<Response<RecordStreamResponse>, Status> {
        let mut stream = req.into_inner();
        let mut recorded = 0;
        while let Some(item) = stream.next().await {
            let call = item?
                .call
                .ok_or_else(|| Status::invalid_argument("call is missing"))?;
            self.calls.lock().unwrap().push(call);
            recorded += 1;
        }
        Ok(Response::new(RecordStreamResponse {
            recorded,
            duplicates: 0,
        }))
    }

    async fn usage(&self, _: Request<UsageRequest>) -> Result<Response<UsageResponse>, Status> {
        Err(Status::unimplemented("not part of this test double"))
    }

    async fn get_call(
        &self,
        _: Request<GetCallRequest>,
    ) -> Result<Response<GetCallResponse>, Status> {
        Err(Status::unimplemented("not part of this test double"))
    }
}

async fn start_recorder() -> (Spawned, Recorder) {
    let recorder = Recorder::default();
    let svc = AnalyticsServiceServer::new(recorder.clone());
    let server = spawn(|l, s| {
        ecoscan_common::server::serve(Routes::new(svc), &["ecoscan.v1.AnalyticsService"], l, s)
    })
    .await;
    (server, recorder)
}

async fn wait_for_calls(recorder: &Recorder, n: usize) -> Vec<LlmCall> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let calls = recorder.calls.lock().unwrap().clone();
        if calls.len() >= n {
            return calls;
        }
        assert!(
            Instant::now() < deadline,
            "only {} of {n} calls arrived",
            calls.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A mock model that reports its calls to `reporter` as the vision service's.
fn mock_reporting_to(reporter: &AnalyticsReporter) -> Llm {
    Llm::new(
        LlmConfig {
            mock_latency: Duration::from_millis(5),
            ..LlmConfig::default()
        },
        "vision",
        Some(reporter.clone()),
    )
    .unwrap()
}

/// A loopback port nothing listens on (it was free a moment ago).
fn dead_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

fn input() -> ClassifyInput {
    ClassifyInput {
        job_id: "job-42".into(),
        image: Bytes::from(vec![7u8; 3000]),
        content_type: "image/jpeg".into(),
        hint: "newspaper".into(),
        taxonomy: vec![TaxonomyPath {
            major: "재활용폐기물".into(),
            middle: "종이".into(),
            minor: "신문지".into(),
            name_en: "Paper".into(),
        }],
        situation_tags: vec![],
        model: None,
    }
}

#[tokio::test]
async fn successful_and_failed_calls_are_both_reported() {
    let (server, recorder) = start_recorder().await;
    let reporter = AnalyticsReporter::new(&server.uri()).unwrap();
    let mock = mock_reporting_to(&reporter);
    let failing = Llm::new(
        LlmConfig {
            provider: Provider::OpenAi,
            base_url: format!("http://127.0.0.1:{}/v1", dead_port()),
            max_retries: 0,
            ..LlmConfig::default()
        },
        "vision",
        Some(reporter.clone()),
    )
    .unwrap();

    mock.classify(input()).await.unwrap();
    failing.classify(input()).await.unwrap_err();
    let calls = wait_for_calls(&recorder, 2).await;

    let ok = calls
        .iter()
        .find(|c| c.provider == "mock")
        .expect("mock call reported");
    assert_eq!(ok.status, CallStatus::Ok as i32);
    assert_eq!(
        (ok.service.as_str(), ok.operation.as_str()),
        ("vision", "classify")
    );
    assert_eq!(ok.job_id, "job-42");
    assert!(
        ok.input_tokens > 85,
        "image tokens missing: {}",
        ok.input_tokens
    );
    assert!(ok.started_at.is_some());
    assert_eq!(ok.trace_id.len(), 32);
    let id = uuid::Uuid::parse_str(&ok.call_id).unwrap();
    assert_eq!(id.get_version_num(), 7);
    assert!(
        ok.request_body
            .contains("data:image/jpeg;base64,<3000 bytes>")
    );
    assert!(ok.response_body.contains("\"mock\":true"));

    let err = calls
        .iter()
        .find(|c| c.provider == "openai")
        .expect("failed call reported");
    assert_eq!(err.status, CallStatus::Error as i32);
    assert!(err.error.contains("unreachable"), "{}", err.error);
    assert!(
        err.request_body.contains("<3000 bytes>"),
        "image not redacted"
    );
    assert!(
        !err.request_body.contains("BwcH"),
        "image bytes leaked into the report"
    );
    assert_eq!(reporter.dropped(), 0);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn a_full_buffer_drops_and_counts_instead_of_blocking() {
    ecoscan_common::telemetry::init_for_tests();
    // A current-thread runtime: the background sender cannot run between these reports.
    let reporter = AnalyticsReporter::with_buffer("http://127.0.0.1:9", 1).unwrap();

    for _ in 0..100 {
        reporter.report(LlmCall::default());
    }

    assert_eq!(reporter.dropped(), 99);
}

#[tokio::test]
async fn settled_returns_once_analytics_acknowledged_every_report_so_far() {
    let (server, recorder) = start_recorder().await;
    let reporter = AnalyticsReporter::new(&server.uri()).unwrap();
    let llm = mock_reporting_to(&reporter);
    for _ in 0..3 {
        llm.classify(input()).await.unwrap();
    }
    // No polling: when it returns true, analytics has all three already.
    assert!(llm.reports_settled(Duration::from_secs(30)).await);
    assert_eq!(recorder.calls.lock().unwrap().len(), 3);
    assert_eq!(reporter.sent(), 3);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn settled_gives_up_after_its_bound_while_analytics_is_unreachable() {
    let reporter = AnalyticsReporter::new(&format!("http://127.0.0.1:{}", dead_port())).unwrap();
    reporter.report(LlmCall::default());
    // The background task is still retrying: the wait ends at its bound, with false.
    assert!(!reporter.settled(Duration::from_millis(300)).await);
    assert_eq!(reporter.sent(), 0);
}
