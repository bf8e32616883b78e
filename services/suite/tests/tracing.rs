//! One trace per scan, end to end: every service runs as its own process (its own
//! `service.name`), exports OTLP/gRPC to a receiver inside the test, and a scan through the
//! gateway must come back as one well-formed trace spanning the gateway and all seven services.
//! The same holds for `ecoscan up`, where all eight share one process but each still exports
//! under its own resource.

mod common;
mod support;

use std::{
    collections::{HashMap, HashSet},
    time::Duration,
};

use common::{image_form, read_sse};
use ecoscan_proto::v1::{ListCategoriesRequest, rule_service_client::RuleServiceClient};
use support::{
    otlp::{Receiver, Span},
    processes::{Cluster, Service},
    up::Up,
};

const SERVICES: [&str; 8] = [
    "ecoscan-gateway",
    "ecoscan-ingest",
    "ecoscan-vision",
    "ecoscan-rule",
    "ecoscan-answer",
    "ecoscan-reward",
    "ecoscan-analytics",
    "ecoscan-notification",
];

/// Export is batched and asynchronous: spans can arrive well after the response.
const SPANS_DEADLINE: Duration = Duration::from_secs(30);

async fn cluster_exporting_to(receiver: &Receiver) -> Cluster {
    Cluster::builder()
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint())
        // Export every 100 ms instead of every 5 s, so the test does not wait for nothing.
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .start()
        .await
}

/// Runs one scan through `POST /api/v1/scan/completion` and returns its SSE events.
async fn scan(cluster: &Cluster, traceparent: Option<&str>) -> Vec<common::Sse> {
    scan_at(&cluster.gateway_url("/api/v1/scan/completion"), traceparent).await
}

/// [`scan`] at the gateway URL `url`.
async fn scan_at(url: &str, traceparent: Option<&str>) -> Vec<common::Sse> {
    let mut req = reqwest::Client::new()
        .post(url)
        .header("x-user-id", "tracer")
        .multipart(image_form("투명 페트병 pet bottle"));
    if let Some(tp) = traceparent {
        req = req
            .header("traceparent", tp)
            .header("baggage", "tenant=acme");
    }
    let events = read_sse(req.send().await.expect("scan request")).await;
    assert_eq!(
        events.last().map(|e| e.event.as_str()),
        Some("ready"),
        "the scan succeeds: {events:#?}"
    );
    events
}

/// The single trace id every SSE event of the scan carries.
fn trace_id_of(events: &[common::Sse]) -> String {
    let ids: HashSet<&str> = events
        .iter()
        .map(|e| e.data["trace_id"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        ids.len(),
        1,
        "every event of one scan has one trace id: {ids:?}"
    );
    let id = ids.into_iter().next().unwrap().to_owned();
    assert_eq!(id.len(), 32, "a W3C trace id: {id:?}");
    id
}

fn in_trace<'a>(spans: &'a [Span], trace_id: &str) -> Vec<&'a Span> {
    spans.iter().filter(|s| s.trace_id == trace_id).collect()
}

/// Whether everything a finished scan exports has arrived: a span from every service, the spans
/// the assertions look at, and every span's parent (export is per process and batched, so a
/// child can arrive before its parent).
fn complete(spans: &[Span], trace_id: &str) -> bool {
    let trace = in_trace(spans, trace_id);
    let services: HashSet<&str> = trace.iter().map(|s| s.service.as_str()).collect();
    let ids: HashSet<&str> = trace.iter().map(|s| s.span_id.as_str()).collect();
    let http = trace
        .iter()
        .find(|s| s.service == "ecoscan-gateway" && !s.attr("http.route").is_empty());
    SERVICES.iter().all(|s| services.contains(s))
        && http.is_some()
        && trace
            .iter()
            .filter(|s| http.is_none_or(|h| h.span_id != s.span_id))
            .all(|s| ids.contains(s.parent_span_id.as_str()))
        && trace
            .iter()
            .filter(|s| s.name.starts_with("stage "))
            .count()
            >= 4
        && trace.iter().any(|s| s.name == "process scan-jobs")
        && trace
            .iter()
            .filter(|s| s.attr("gen_ai.operation.name") == "chat")
            .count()
            >= 2
        && trace
            .iter()
            .any(|s| s.name == "ecoscan.v1.NotificationService/Notify")
        && trace
            .iter()
            .any(|s| s.service == "ecoscan-analytics" && s.kind == 2)
        && trace.iter().any(|s| !s.links.is_empty())
        && batch_linking(spans, &trace).is_some()
}

/// The analytics batch (a trace of its own) that links to a `Record` request of `trace`.
fn batch_linking<'a>(spans: &'a [Span], trace: &[&Span]) -> Option<&'a Span> {
    // The Record / RecordStream handlers' spans.
    let records: HashSet<&str> = trace
        .iter()
        .filter(|s| s.service == "ecoscan-analytics")
        .map(|s| s.span_id.as_str())
        .collect();
    spans.iter().find(|s| {
        s.name == "analytics.write_batch"
            && s.links
                .iter()
                .any(|(_, span)| records.contains(span.as_str()))
    })
}

fn describe(trace: &[&Span]) -> String {
    let mut lines: Vec<String> = trace
        .iter()
        .map(|s| {
            format!(
                "{} {} [{}] parent={}",
                s.service, s.name, s.span_id, s.parent_span_id
            )
        })
        .collect();
    lines.sort();
    lines.join("\n")
}

/// Every span's ancestors up to the root, by span id.
fn ancestors<'a>(span: &'a Span, by_id: &HashMap<&str, &'a Span>) -> Vec<&'a Span> {
    let mut out = Vec::new();
    let mut cur = span;
    while let Some(parent) = by_id.get(cur.parent_span_id.as_str()) {
        out.push(*parent);
        cur = parent;
        if out.len() > 64 {
            break;
        }
    }
    out
}

/// The one attribute vocabulary of every exported span: the OpenTelemetry conventions'
/// namespaces, and the project's own names, each listed once. A Jaeger tag search on
/// `job.id` finds every span of a job only if no span spells it `job_id`.
const VOCABULARY_PREFIXES: [&str; 19] = [
    // The OpenTelemetry conventions.
    "rpc.",
    "db.",
    "messaging.",
    "gen_ai.",
    "http.",
    "url.",
    "server.",
    "client.",
    "network.",
    "aws.",
    "code.",
    // The project's own, one namespace per subject.
    "job.",
    "llm.",
    "vision.",
    "rule.",
    "answer.",
    "reward.",
    "notification.",
    "analytics.",
];
const VOCABULARY: [&str; 2] = ["user.id", "error.type"];

/// Every attribute name on the spans of `trace` is in the vocabulary.
fn assert_attribute_vocabulary(trace: &[&Span]) {
    let mut outside: Vec<String> = trace
        .iter()
        .flat_map(|s| {
            s.attributes
                .keys()
                .filter(|k| {
                    !VOCABULARY.contains(&k.as_str())
                        && !VOCABULARY_PREFIXES.iter().any(|p| k.starts_with(p))
                })
                .map(move |k| format!("{k} (on {} {})", s.service, s.name))
        })
        .collect();
    outside.sort();
    outside.dedup();
    assert!(
        outside.is_empty(),
        "attribute names outside the vocabulary:\n{}",
        outside.join("\n")
    );
}

fn assert_well_formed_scan_trace(spans: &[Span], trace_id: &str, sse_events: usize) {
    let trace = in_trace(spans, trace_id);
    let tree = describe(&trace);
    assert_attribute_vocabulary(&trace);

    // Spans from the gateway and all seven services.
    let services: HashSet<&str> = trace.iter().map(|s| s.service.as_str()).collect();
    for s in SERVICES {
        assert!(
            services.contains(s),
            "no span from {s} in the trace:\n{tree}"
        );
    }

    // Every span's parent is in the trace, except the root: the gateway's request span.
    let by_id: HashMap<&str, &Span> = trace.iter().map(|s| (s.span_id.as_str(), *s)).collect();
    let http = trace
        .iter()
        .find(|s| s.service == "ecoscan-gateway" && !s.attr("http.route").is_empty())
        .unwrap_or_else(|| panic!("no gateway request span:\n{tree}"));
    for s in &trace {
        if s.span_id == http.span_id {
            continue;
        }
        assert!(
            by_id.contains_key(s.parent_span_id.as_str()),
            "the parent of {} {} is not in the trace:\n{tree}",
            s.service,
            s.name
        );
    }

    // The gateway's request span: route template, method, status, and one event per SSE message.
    assert_eq!(http.attr("http.route"), "/api/v1/scan/completion");
    assert_eq!(http.attr("http.request.method"), "POST");
    assert_eq!(
        http.attributes.get("http.response.status_code"),
        Some(&serde_json::json!(200)),
        "{http:#?}"
    );
    assert_eq!(http.name, "POST /api/v1/scan/completion");
    let sent: Vec<_> = http
        .events
        .iter()
        .filter(|e| e.name == "message" && e.attributes["rpc.message.type"] == "SENT")
        .collect();
    assert_eq!(
        sent.len(),
        sse_events,
        "one span event per SSE message on the gateway span: {:#?}",
        http.events
    );

    // The RPC span of ingest's Scan, a child of the gateway request.
    let scan_rpc = trace
        .iter()
        .find(|s| s.name == "ecoscan.v1.ScanService/Scan")
        .unwrap_or_else(|| panic!("no ScanService/Scan span:\n{tree}"));
    assert_eq!(scan_rpc.service, "ecoscan-ingest");
    assert_eq!(scan_rpc.kind, 2, "server span");
    assert_eq!(scan_rpc.attr("rpc.system"), "grpc");
    assert_eq!(scan_rpc.attr("rpc.service"), "ecoscan.v1.ScanService");
    assert_eq!(scan_rpc.attr("rpc.method"), "Scan");
    assert_eq!(
        scan_rpc.attributes.get("rpc.grpc.status_code"),
        Some(&serde_json::json!(0))
    );
    assert!(
        ancestors(scan_rpc, &by_id)
            .iter()
            .any(|a| a.span_id == http.span_id),
        "ScanService/Scan descends from the gateway request:\n{tree}"
    );
    let streamed = scan_rpc
        .events
        .iter()
        .filter(|e| e.name == "message" && e.attributes["rpc.message.type"] == "SENT")
        .count();
    assert_eq!(
        streamed, sse_events,
        "one span event per streamed message on ingest's side of the stream too"
    );

    // The worker's pipeline span is a child of the request that submitted the job.
    let pipeline = trace
        .iter()
        .find(|s| s.name == "process scan-jobs")
        .unwrap_or_else(|| panic!("no pipeline span:\n{tree}"));
    assert!(
        ancestors(pipeline, &by_id)
            .iter()
            .any(|a| a.span_id == scan_rpc.span_id),
        "the pipeline descends from the Scan request that submitted the job:\n{tree}"
    );

    // The queue's consumer side, by the messaging conventions: the job is the message.
    assert_eq!(
        pipeline.attr("messaging.operation.type"),
        "process",
        "{tree}"
    );
    assert_eq!(
        pipeline.attr("messaging.destination.name"),
        "scan-jobs",
        "{tree}"
    );
    assert_eq!(
        pipeline.attr("messaging.message.id"),
        pipeline.attr("job.id"),
        "{tree}"
    );

    // Stage spans, in order, with job id, stage and attempt, each calling its service.
    let mut stages: Vec<&&Span> = trace
        .iter()
        .filter(|s| s.name.starts_with("stage "))
        .collect();
    stages.sort_by_key(|s| s.start_ns);
    let names: Vec<&str> = stages.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        ["stage vision", "stage rule", "stage answer", "stage reward"]
    );
    let job_id = pipeline.attr("job.id");
    assert!(!job_id.is_empty(), "the pipeline span names its job");
    for (stage, service) in stages.iter().zip([
        "ecoscan.v1.VisionService",
        "ecoscan.v1.RuleService",
        "ecoscan.v1.AnswerService",
        "ecoscan.v1.RewardService",
    ]) {
        assert_eq!(stage.attr("job.id"), job_id);
        assert_eq!(
            stage.attr("job.stage"),
            stage.name.trim_start_matches("stage ")
        );
        assert_eq!(
            stage.attributes.get("job.attempt"),
            Some(&serde_json::json!(1))
        );
        assert!(
            trace.iter().any(|s| s.attr("rpc.service") == service
                && s.kind == 2
                && s.parent_span_id == stage.span_id),
            "{} calls {service} (a server span whose parent is the stage):\n{tree}",
            stage.name
        );
    }
    assert!(
        trace.iter().any(|s| s.service == "ecoscan-notification"
            && s.name == "ecoscan.v1.NotificationService/Notify"),
        "the owner is notified within the trace:\n{tree}"
    );

    // Store calls of note: the job row's insert, checkpoints and finish.
    let sql: Vec<&str> = trace
        .iter()
        .filter(|s| s.service == "ecoscan-ingest" && s.attr("db.system") == "sqlite")
        .map(|s| s.attr("db.operation.name"))
        .collect();
    assert!(
        sql.contains(&"INSERT") && sql.contains(&"UPDATE"),
        "job store spans with db.system and db.operation.name: {sql:?}\n{tree}"
    );
    // Named `{operation} {collection}`, the name its db.query.summary.
    for s in trace
        .iter()
        .filter(|s| s.attributes.contains_key("db.system.name"))
    {
        assert_eq!(
            s.attr("db.query.summary"),
            s.name,
            "a store span's summary is its name\n{tree}"
        );
    }

    // Model calls with the GenAI conventions, in vision and answer.
    let calls: Vec<&&Span> = trace
        .iter()
        .filter(|s| s.attr("gen_ai.operation.name") == "chat")
        .collect();
    let callers: HashSet<&str> = calls.iter().map(|s| s.service.as_str()).collect();
    assert_eq!(
        callers,
        HashSet::from(["ecoscan-vision", "ecoscan-answer"]),
        "one model call each in vision and answer:\n{tree}"
    );
    for call in &calls {
        assert_eq!(call.kind, 3, "client span");
        assert_eq!(call.attr("gen_ai.system"), "mock");
        assert!(!call.attr("gen_ai.request.model").is_empty());
        assert!(call.name.starts_with("chat "), "{}", call.name);
        for key in ["gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"] {
            assert!(
                call.attributes.get(key).and_then(|v| v.as_i64()) > Some(0),
                "{key} on {call:#?}"
            );
        }
    }
    let answer_call = calls
        .iter()
        .find(|s| s.service == "ecoscan-answer")
        .expect("answer's call");
    assert!(
        answer_call
            .attributes
            .get("gen_ai.server.time_to_first_token_ms")
            .and_then(|v| v.as_f64())
            > Some(0.0),
        "time to first token on the streamed call: {answer_call:#?}"
    );

    // Analytics receives each reported call in the scan's trace, and the report links the call.
    let record = trace
        .iter()
        .find(|s| s.service == "ecoscan-analytics" && s.kind == 2)
        .unwrap_or_else(|| panic!("no analytics server span:\n{tree}"));
    assert_eq!(record.attr("rpc.service"), "ecoscan.v1.AnalyticsService");
    let call_ids: HashSet<&str> = calls.iter().map(|s| s.span_id.as_str()).collect();
    assert!(
        trace.iter().any(|s| s
            .links
            .iter()
            .any(|(_, span)| call_ids.contains(span.as_str()))),
        "a report span links the model call it reports:\n{tree}"
    );
    // The batch that wrote them, a trace of its own, links to the request that handed them over.
    let batch = batch_linking(spans, &trace)
        .unwrap_or_else(|| panic!("no analytics batch links to the scan's Record calls:\n{tree}"));
    assert_ne!(batch.trace_id, trace_id, "the batch is a trace of its own");
}

#[tokio::test]
async fn a_scan_through_the_gateway_is_one_trace_across_every_service() {
    let receiver = Receiver::start().await;
    let cluster = cluster_exporting_to(&receiver).await;

    let events = scan(&cluster, None).await;
    let trace_id = trace_id_of(&events);
    let spans = receiver
        .wait_for(SPANS_DEADLINE, |s| complete(s, &trace_id))
        .await;

    let trace = in_trace(&spans, &trace_id);
    let roots: Vec<&&Span> = trace
        .iter()
        .filter(|s| s.parent_span_id.is_empty())
        .collect();
    assert_eq!(
        roots.len(),
        1,
        "one root span (the gateway request):\n{}",
        describe(&trace)
    );
    assert_eq!(roots[0].service, "ecoscan-gateway");
    assert_well_formed_scan_trace(&spans, &trace_id, events.len());
    // Background work (job store polls, sweeps, analytics commits) too, not only the scan.
    assert_attribute_vocabulary(&spans.iter().collect::<Vec<_>>());

    // Each process exports under its own resource: name, version and a per-process instance id.
    let mut instances = HashSet::new();
    for s in &trace {
        assert_eq!(s.resource["service.version"], env!("CARGO_PKG_VERSION"));
        instances.insert(
            s.resource["service.instance.id"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
    }
    assert_eq!(
        instances.len(),
        SERVICES.len(),
        "one instance id per process"
    );
}

/// Calls between services seen in `trace`: `(caller, callee)` for every span whose parent
/// belongs to another service.
fn service_edges<'a>(trace: &[&'a Span]) -> HashSet<(&'a str, &'a str)> {
    let by_id: HashMap<&str, &Span> = trace.iter().map(|s| (s.span_id.as_str(), *s)).collect();
    trace
        .iter()
        .filter_map(|s| {
            let parent = by_id.get(s.parent_span_id.as_str())?;
            (parent.service != s.service).then_some((parent.service.as_str(), s.service.as_str()))
        })
        .collect()
}

/// The calls a scan makes between services: the dependency graph a trace viewer draws.
const SCAN_EDGES: [(&str, &str); 8] = [
    ("ecoscan-gateway", "ecoscan-ingest"),
    ("ecoscan-ingest", "ecoscan-vision"),
    ("ecoscan-ingest", "ecoscan-rule"),
    ("ecoscan-ingest", "ecoscan-answer"),
    ("ecoscan-ingest", "ecoscan-reward"),
    ("ecoscan-ingest", "ecoscan-notification"),
    ("ecoscan-vision", "ecoscan-analytics"),
    ("ecoscan-answer", "ecoscan-analytics"),
];

#[tokio::test]
async fn in_ecoscan_up_each_service_exports_under_its_own_resource() {
    let receiver = Receiver::start().await;
    let endpoint = receiver.endpoint();
    let up = Up::start(&[
        ("GATEWAY_TRUST_USER_HEADER", "loopback"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ])
    .await;

    let events = scan_at(&up.gateway_url("/api/v1/scan/completion"), None).await;
    let trace_id = trace_id_of(&events);
    let spans = receiver
        .wait_for(SPANS_DEADLINE, |s| {
            complete(s, &trace_id) && {
                let edges = service_edges(&in_trace(s, &trace_id));
                SCAN_EDGES.iter().all(|e| edges.contains(e))
            }
        })
        .await;

    // The same well-formed trace as when each service is a process of its own: a span from
    // every service, each span's parent in the trace, stage spans calling their services.
    assert_well_formed_scan_trace(&spans, &trace_id, events.len());
    let trace = in_trace(&spans, &trace_id);
    let tree = describe(&trace);
    assert!(
        trace.iter().all(|s| SERVICES.contains(&s.service.as_str())),
        "every span of the scan belongs to one of the eight services, none to the suite:\n{tree}"
    );

    // Parent and child cross services where one calls the other: the dependency graph.
    let edges = service_edges(&trace);
    for edge in SCAN_EDGES {
        assert!(
            edges.contains(&edge),
            "{} calls {} (a span of the one is the parent of a span of the other); \
             edges: {edges:?}\n{tree}",
            edge.0,
            edge.1
        );
    }

    // Each service's spans come with its own resource, one per service; none carries the
    // routing mark.
    let mut resources: HashMap<&str, HashSet<String>> = HashMap::new();
    for s in &trace {
        assert_eq!(s.resource["service.name"], s.service.as_str());
        assert_eq!(s.resource["service.namespace"], "ecoscan");
        assert_eq!(s.resource["service.version"], env!("CARGO_PKG_VERSION"));
        assert!(!s.attributes.contains_key("ecoscan.service"), "{s:#?}");
        resources
            .entry(s.service.as_str())
            .or_default()
            .insert(s.resource["service.instance.id"].to_string());
    }
    assert_eq!(resources.len(), SERVICES.len(), "{resources:?}");
    assert!(
        resources.values().all(|ids| ids.len() == 1),
        "one resource per service: {resources:?}"
    );
}

#[tokio::test]
async fn a_scan_with_a_caller_traceparent_joins_the_callers_trace() {
    let receiver = Receiver::start().await;
    let cluster = cluster_exporting_to(&receiver).await;
    let caller_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";

    let events = scan(
        &cluster,
        Some(&format!("00-{caller_trace}-{caller_span}-01")),
    )
    .await;
    assert_eq!(
        trace_id_of(&events),
        caller_trace,
        "events carry the caller's trace id"
    );
    let spans = receiver
        .wait_for(SPANS_DEADLINE, |s| complete(s, caller_trace))
        .await;

    let trace = in_trace(&spans, caller_trace);
    let http = trace
        .iter()
        .find(|s| s.service == "ecoscan-gateway" && !s.attr("http.route").is_empty())
        .unwrap_or_else(|| panic!("no gateway request span:\n{}", describe(&trace)));
    assert_eq!(
        http.parent_span_id, caller_span,
        "the gateway request is a child of the caller's span"
    );
    assert_well_formed_scan_trace(&spans, caller_trace, events.len());
}

#[tokio::test]
async fn spans_export_over_http_protobuf_when_asked() {
    let receiver = Receiver::start_http().await;
    let cluster = Cluster::builder()
        .only(&[Service::Rule])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint())
        .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .start()
        .await;

    let mut rule = RuleServiceClient::new(
        ecoscan_common::client::channel(&cluster.uri(Service::Rule)).unwrap(),
    );
    rule.list_categories(ListCategoriesRequest {})
        .await
        .expect("list categories");

    let is_call = |s: &Span| s.name == "ecoscan.v1.RuleService/ListCategories";
    let spans = receiver
        .wait_for(SPANS_DEADLINE, |spans| spans.iter().any(is_call))
        .await;
    let call = spans
        .iter()
        .find(|s| is_call(s))
        .unwrap_or_else(|| panic!("no span arrived over http/protobuf: {spans:#?}"));
    assert_eq!(call.service, "ecoscan-rule");
    assert_eq!(call.attr("rpc.method"), "ListCategories");
}

/// A stand-in model provider that fails every call with a 500 and keeps the request headers.
async fn failing_model() -> (
    String,
    std::sync::Arc<std::sync::Mutex<Vec<axum::http::HeaderMap>>>,
) {
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = seen.clone();
    let app = axum::Router::new().fallback(move |headers: axum::http::HeaderMap| {
        let kept = kept.clone();
        async move {
            kept.lock().expect("headers lock").push(headers);
            (
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                r#"{"error": {"message": "the model is down"}}"#,
            )
        }
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the fake model");
    let url = format!("http://{}/v1", listener.local_addr().expect("address"));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, seen)
}

#[tokio::test]
async fn a_failed_model_call_marks_its_spans_as_errors_and_the_model_request_carries_the_trace() {
    let receiver = Receiver::start().await;
    let (model_url, model_requests) = failing_model().await;
    let cluster = Cluster::builder()
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint())
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env("LLM_PROVIDER", "openai")
        .env("LLM_BASE_URL", &model_url)
        .env("LLM_API_KEY", "test")
        .env("LLM_MAX_RETRIES", "0")
        .service_env(Service::Ingest, "INGEST_STAGE_RETRIES", "0")
        .start()
        .await;

    let res = reqwest::Client::new()
        .post(cluster.gateway_url("/api/v1/scan/completion"))
        .header("x-user-id", "tracer")
        .multipart(image_form("can"))
        .send()
        .await
        .expect("scan request");
    let events = read_sse(res).await;
    assert_eq!(
        events.last().map(|e| e.event.as_str()),
        Some("error"),
        "{events:#?}"
    );
    let trace_id = trace_id_of(&events);

    let failed_stage = |s: &Span| s.name == "stage vision" && s.status_code == 2;
    let spans = receiver
        .wait_for(SPANS_DEADLINE, |spans| {
            let trace = in_trace(spans, &trace_id);
            trace.iter().any(|s| failed_stage(s))
                && trace
                    .iter()
                    .any(|s| s.attr("gen_ai.operation.name") == "chat")
                && trace.iter().any(|s| s.service == "ecoscan-gateway")
        })
        .await;
    let trace = in_trace(&spans, &trace_id);
    let tree = describe(&trace);

    let call = trace
        .iter()
        .find(|s| s.attr("gen_ai.operation.name") == "chat")
        .unwrap_or_else(|| panic!("no model call span:\n{tree}"));
    assert_eq!(
        call.status_code, 2,
        "the failed model call is an error: {call:#?}"
    );
    assert!(!call.attr("error.type").is_empty(), "{call:#?}");
    assert_eq!(call.attr("gen_ai.system"), "openai");
    // The model server it called, by the conventions' client attributes.
    let model_port: i64 = model_url
        .trim_start_matches("http://127.0.0.1:")
        .trim_end_matches("/v1")
        .parse()
        .expect("the fake model's port");
    assert_eq!(call.attr("server.address"), "127.0.0.1", "{call:#?}");
    assert_eq!(
        call.attributes
            .get("server.port")
            .and_then(serde_json::Value::as_i64),
        Some(model_port),
        "{call:#?}"
    );
    assert!(
        trace.iter().any(|s| failed_stage(s)),
        "the vision stage span is an error:\n{tree}"
    );
    let classify = trace
        .iter()
        .find(|s| s.name == "ecoscan.v1.VisionService/Classify")
        .unwrap_or_else(|| panic!("no Classify span:\n{tree}"));
    assert_ne!(
        classify.attributes.get("rpc.grpc.status_code"),
        Some(&serde_json::json!(0)),
        "{classify:#?}"
    );
    assert!(!classify.attr("error.type").is_empty(), "{classify:#?}");

    // Every error span says why in its status, in plain words, and names the error's type.
    let errors: Vec<&&Span> = trace.iter().filter(|s| s.status_code == 2).collect();
    assert!(errors.len() >= 3, "call, Classify and stage fail:\n{tree}");
    for s in &errors {
        assert!(
            !s.status_message.is_empty() && !s.status_message.contains('%'),
            "a plain status message on {} {}: {s:#?}",
            s.service,
            s.name
        );
        assert!(!s.attr("error.type").is_empty(), "error.type on {s:#?}");
        assert!(
            !s.attributes.contains_key("otel.status_message"),
            "no stray status attribute: {s:#?}"
        );
    }
    assert_eq!(classify.status_code, 2, "{classify:#?}");
    assert!(
        classify.status_message.contains(' '),
        "Classify's status says why in words: {classify:#?}"
    );
    let stage = trace
        .iter()
        .find(|s| failed_stage(s))
        .expect("the failed stage");
    assert_eq!(
        stage.attr("error.type"),
        classify.attr("error.type"),
        "the stage fails with the code of its call: {stage:#?}"
    );

    // The model's HTTP request carried the call span's context.
    let requests = model_requests.lock().expect("headers lock").clone();
    assert_eq!(requests.len(), 1, "one request, no retries");
    let traceparent = requests[0]
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .expect("the model request has a traceparent");
    assert_eq!(
        traceparent,
        format!("00-{trace_id}-{}-01", call.span_id),
        "the model request is a child of the model call span"
    );
}

#[tokio::test]
async fn spans_still_queued_are_flushed_when_a_service_stops() {
    let receiver = Receiver::start().await;
    let mut cluster = Cluster::builder()
        .only(&[Service::Rule])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint())
        // Far longer than the test: only the flush at shutdown can deliver the span.
        .env("OTEL_BSP_SCHEDULE_DELAY", "600000")
        .start()
        .await;
    let mut rule = RuleServiceClient::new(
        ecoscan_common::client::channel(&cluster.uri(Service::Rule)).unwrap(),
    );
    rule.list_categories(ListCategoriesRequest {})
        .await
        .expect("list categories");
    drop(rule);
    assert!(
        receiver.spans().is_empty(),
        "nothing is exported before the batch is due"
    );

    assert!(
        cluster
            .terminate(Service::Rule, Duration::from_secs(20))
            .await,
        "rule stops cleanly on SIGTERM; its log:\n{}",
        cluster.logs(Service::Rule)
    );
    let spans = receiver.spans();
    assert!(
        spans
            .iter()
            .any(|s| s.name == "ecoscan.v1.RuleService/ListCategories"),
        "the span queued at shutdown was flushed: {spans:#?}"
    );
}

/// How a raw `Submit` over HTTP/2 ends: its status headers, or the stream reset.
enum RawEnd {
    Status(http::HeaderMap),
    Reset,
}

/// A `Submit` to ingest as raw HTTP/2 whose image never finishes arriving: the gRPC frame
/// announces 1000 bytes and 10 come. With `timeout` it carries `grpc-timeout`; with `leave_after`
/// the caller resets the stream then (it left) instead of waiting. Unless `signed` (a valid
/// identity assertion), it is a whole empty request with a forged one, which ingest refuses.
async fn stalled_submit(
    addr: std::net::SocketAddr,
    timeout: Option<&str>,
    leave_after: Option<Duration>,
    signed: bool,
) -> RawEnd {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (client, connection) = h2::client::handshake(tcp).await.expect("h2 handshake");
    tokio::spawn(connection);
    let mut client = client.ready().await.expect("h2 ready");
    let mut req = http::Request::post(format!("http://{addr}/ecoscan.v1.ScanService/Submit"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(t) = timeout {
        req = req.header("grpc-timeout", t);
    }
    let assertion = if signed {
        support::processes::use_identity_key();
        ecoscan_common::assertion::sign(Some("tracer"), false, "ecoscan.v1.ScanService")
    } else {
        "forged".to_owned()
    };
    req = req.header(ecoscan_common::assertion::ASSERTION_HEADER, assertion);
    let (response, mut body) = client
        .send_request(req.body(()).unwrap(), false)
        .expect("send the request");
    if signed {
        let mut frame = vec![0u8];
        frame.extend_from_slice(&1000u32.to_be_bytes());
        frame.extend_from_slice(&[0x0a, 0xe5, 0x07, 1, 2, 3, 4, 5, 6, 7]);
        body.send_data(bytes::Bytes::from(frame), false)
            .expect("send part of the image");
    } else {
        // Refused whatever it carries: an empty request, whole.
        body.send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), true)
            .expect("send the request");
    }
    if let Some(after) = leave_after {
        tokio::time::sleep(after).await;
        body.send_reset(h2::Reason::CANCEL);
        return RawEnd::Reset;
    }
    match tokio::time::timeout(Duration::from_secs(10), response).await {
        Ok(Ok(res)) => RawEnd::Status(res.headers().clone()),
        Ok(Err(_)) => RawEnd::Reset,
        Err(_) => panic!("no answer within 10 s"),
    }
}

/// `rpc_server_requests` of ingest's `Submit` ending in `code`, from its `/metrics`.
async fn submits_ending(cluster: &Cluster, code: &str) -> f64 {
    let text = reqwest::get(format!("{}/metrics", cluster.uri(Service::Ingest)))
        .await
        .expect("scrape ingest")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .filter(|l| {
            l.starts_with("rpc_server_requests")
                && l.contains("ScanService/Submit")
                && l.contains(&format!("code=\"{code}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn a_deadline_that_runs_out_while_the_image_is_read_is_deadline_exceeded_everywhere() {
    let receiver = Receiver::start().await;
    let cluster = cluster_exporting_to(&receiver).await;
    let addr = cluster.addr(Service::Ingest);

    // The wire: a status, DEADLINE_EXCEEDED, not a reset or CANCELLED.
    let started = std::time::Instant::now();
    let RawEnd::Status(headers) = stalled_submit(addr, Some("300m"), None, true).await else {
        panic!("the stream was reset instead of answered");
    };
    let status = tonic::Status::from_header_map(&headers).expect("a grpc-status");
    assert_eq!(status.code(), tonic::Code::DeadlineExceeded, "{status:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "at the deadline"
    );

    // The metric.
    assert_eq!(submits_ending(&cluster, "DEADLINE_EXCEEDED").await, 1.0);
    assert_eq!(submits_ending(&cluster, "CANCELLED").await, 0.0);

    // The span: an error that says why.
    let is_submit = |s: &Span| s.name == "ecoscan.v1.ScanService/Submit";
    let spans = receiver
        .wait_for(SPANS_DEADLINE, |s| s.iter().any(is_submit))
        .await;
    let submit = spans
        .iter()
        .find(|s| is_submit(s))
        .unwrap_or_else(|| panic!("no Submit span: {spans:#?}"));
    assert_eq!(submit.status_code, 2, "{submit:#?}");
    assert_eq!(
        submit.attr("error.type"),
        "DEADLINE_EXCEEDED",
        "{submit:#?}"
    );
    assert_eq!(
        submit.attributes.get("rpc.grpc.status_code"),
        Some(&serde_json::json!(4))
    );
    assert!(
        submit.status_message.contains("deadline"),
        "{}",
        submit.status_message
    );

    // The log, at `warn`.
    let logs = cluster.logs(Service::Ingest);
    let line = logs
        .lines()
        .find(|l| l.contains("call ended at its deadline"))
        .unwrap_or_else(|| panic!("no deadline line in ingest's log:\n{logs}"));
    assert!(line.contains("WARN"), "{line}");
}

#[tokio::test]
async fn a_caller_that_left_is_cancelled_and_refusals_are_logged_once_per_interval() {
    let receiver = Receiver::start().await;
    let cluster = cluster_exporting_to(&receiver).await;
    let addr = cluster.addr(Service::Ingest);

    // A caller that leaves while its image is read: CANCELLED, no error span, no deadline line.
    assert!(matches!(
        stalled_submit(addr, Some("5S"), Some(Duration::from_millis(200)), true).await,
        RawEnd::Reset
    ));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while submits_ending(&cluster, "CANCELLED").await < 1.0 && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(submits_ending(&cluster, "CANCELLED").await, 1.0);
    assert_eq!(submits_ending(&cluster, "DEADLINE_EXCEEDED").await, 0.0);
    let is_submit = |s: &Span| s.name == "ecoscan.v1.ScanService/Submit";
    let spans = receiver
        .wait_for(SPANS_DEADLINE, |s| s.iter().any(is_submit))
        .await;
    let submit = spans.iter().find(|s| is_submit(s)).expect("a Submit span");
    assert_ne!(
        submit.status_code, 2,
        "a caller that left is no error: {submit:#?}"
    );

    // Twenty refused calls: one line at `info`, the others held back and counted later.
    for _ in 0..20 {
        let RawEnd::Status(headers) = stalled_submit(addr, None, None, false).await else {
            panic!("an unsigned call is answered");
        };
        let status = tonic::Status::from_header_map(&headers).expect("a grpc-status");
        assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    }
    assert_eq!(submits_ending(&cluster, "UNAUTHENTICATED").await, 20.0);
    let logs = cluster.logs(Service::Ingest);
    let refused: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("call refused: no valid credentials"))
        .collect();
    assert_eq!(refused.len(), 1, "one line per interval:\n{logs}");
    assert!(refused[0].contains("INFO"), "{}", refused[0]);
    assert!(
        !logs.contains("call ended at its deadline"),
        "the caller that left is no deadline:\n{logs}"
    );
}

#[tokio::test]
async fn a_watch_of_a_submitted_scan_links_to_the_scans_trace() {
    let receiver = Receiver::start().await;
    let cluster = cluster_exporting_to(&receiver).await;
    let http = reqwest::Client::new();

    // Submit, then watch: two requests, so two traces, the way the demo page does it.
    let res = http
        .post(cluster.gateway_url("/api/v1/scan"))
        .header("x-user-id", "tracer")
        .multipart(image_form("can"))
        .send()
        .await
        .expect("submit");
    assert_eq!(res.status(), 202);
    let body: serde_json::Value = res.json().await.expect("submit body");
    let job_id = body["job_id"].as_str().expect("a job id").to_owned();
    let res = http
        .get(cluster.gateway_url(&format!("/api/v1/scan/{job_id}/events")))
        .header("x-user-id", "tracer")
        .send()
        .await
        .expect("watch");
    let events = read_sse(res).await;
    assert_eq!(events.last().map(|e| e.event.as_str()), Some("ready"));
    let scan_trace = trace_id_of(&events);

    // The scan's trace holds the Submit; the watch's trace, a Watch whose handler links to it.
    let is_watch = |s: &Span| s.service == "ecoscan-ingest" && s.name == "watch";
    let spans = receiver
        .wait_for(SPANS_DEADLINE, |spans| {
            spans
                .iter()
                .any(|s| is_watch(s) && s.trace_id != scan_trace && !s.links.is_empty())
                && spans
                    .iter()
                    .any(|s| s.name == "ecoscan.v1.ScanService/Submit")
        })
        .await;
    let submit = spans
        .iter()
        .find(|s| s.name == "ecoscan.v1.ScanService/Submit")
        .unwrap_or_else(|| panic!("no Submit span: {spans:#?}"));
    assert_eq!(
        submit.trace_id, scan_trace,
        "the scan's trace begins at its Submit"
    );
    let watch = spans
        .iter()
        .find(|s| is_watch(s) && s.trace_id != scan_trace && !s.links.is_empty())
        .unwrap_or_else(|| panic!("no linked watch span: {spans:#?}"));
    assert!(
        spans
            .iter()
            .any(|s| s.trace_id == watch.trace_id && s.name == "ecoscan.v1.ScanService/Watch"),
        "the handler's span is in the Watch call's trace"
    );
    let (linked_trace, linked_span) = &watch.links[0];
    assert_eq!(
        linked_trace, &scan_trace,
        "the watch links to the scan's trace"
    );
    assert!(
        spans
            .iter()
            .any(|s| &s.span_id == linked_span && s.trace_id == scan_trace),
        "the link names a span of the scan (the submitting request): {watch:#?}"
    );
    assert_eq!(watch.attr("job.id"), job_id);
}

/// A `traceparent` naming a span of a trace this test makes up (`seed` tells them apart).
fn made_up_parent(seed: u8) -> (String, String, String) {
    let trace = format!("4bf92f3577b34da6a3ce929d0e0e47{seed:02x}");
    let span = format!("00f067aa0ba902{seed:02x}");
    (format!("00-{trace}-{span}-01"), trace, span)
}

#[tokio::test]
async fn work_done_later_links_to_what_caused_it_a_requeue_and_a_scheduled_delivery() {
    support::processes::use_identity_key();
    let receiver = Receiver::start().await;
    let cluster = cluster_exporting_to(&receiver).await;

    // A dead letter as the pipeline leaves one (its image gone), of a scan whose trace is
    // known: written beside the cluster's ingest, in its SQLite database.
    let (scan_parent, scan_trace, scan_span) = made_up_parent(1);
    let jobs = ecoscan_ingest::store::SqliteJobStore::open(&format!(
        "sqlite://{}?mode=rwc",
        cluster.data_dir().join("ingest.db").display()
    ))
    .await
    .expect("open ingest's database");
    let (job, _) = ecoscan_ingest::store::JobStore::insert(
        &jobs,
        ecoscan_ingest::store::NewJob {
            id: uuid::Uuid::now_v7().to_string(),
            user_id: "tracer".into(),
            image_key: "images/zz/gone".into(),
            content_type: "image/png".into(),
            hint: String::new(),
            locale: "en".into(),
            model: String::new(),
            idempotency_key: None,
            trace_carrier: HashMap::from([("traceparent".to_owned(), scan_parent)]),
        },
    )
    .await
    .expect("insert a job");
    let error = ecoscan_proto::v1::ErrorInfo {
        code: "INTERNAL".into(),
        http_status: 500,
        message: "set aside for an operator".into(),
        retryable: false,
    };
    ecoscan_ingest::store::JobStore::dead_letter(&jobs, &job.id, job.lease_epoch, error, "store")
        .await
        .expect("dead-letter it");
    let mut admin = ecoscan_proto::v1::scan_admin_service_client::ScanAdminServiceClient::connect(
        cluster.uri(Service::Ingest),
    )
    .await
    .expect("connect to ingest");
    let mut request = tonic::Request::new(ecoscan_proto::v1::RequeueDeadLetterRequest {
        job_id: job.id.clone(),
    });
    request
        .metadata_mut()
        .insert("x-user-roles", "admin".parse().unwrap());
    ecoscan_common::assertion::attach(request.metadata_mut(), "ecoscan.v1.ScanAdminService");
    admin
        .requeue_dead_letter(request)
        .await
        .expect("an operator requeues the dead letter");

    // A notification scheduled a second ahead (one already due is delivered inside the
    // request, in its trace), in a request of a trace of the caller's.
    let (notify_parent, notify_trace, _) = made_up_parent(2);
    let res = reqwest::Client::new()
        .post(cluster.gateway_url("/api/v1/notifications"))
        .header("x-user-id", "tracer")
        .header("traceparent", &notify_parent)
        .json(&serde_json::json!({"title": "분리배출 하는 날", "delay_seconds": 1}))
        .send()
        .await
        .expect("schedule a notification");
    assert!(res.status().is_success(), "{}", res.status());

    let is_requeue = |s: &Span| s.service == "ecoscan-ingest" && s.name == "requeue_dead_letter";
    // (Its kind, `store`, is one the dead-letter schedule never retries: only the operator's
    // requeue can have restarted it.)
    let is_delivery =
        |s: &Span| s.service == "ecoscan-notification" && s.name == "deliver due notifications";
    let links_to = |s: &Span, trace: &str| s.links.iter().any(|(t, _)| t == trace);
    let spans = receiver
        .wait_for(SPANS_DEADLINE, |spans| {
            spans
                .iter()
                .any(|s| is_requeue(s) && links_to(s, &scan_trace))
                && spans
                    .iter()
                    .any(|s| is_delivery(s) && links_to(s, &notify_trace))
        })
        .await;

    // The operator's request is a trace of its own, linked to the very span the job's
    // carrier names.
    let requeue = spans.iter().find(|s| is_requeue(s)).unwrap();
    assert_ne!(requeue.trace_id, scan_trace, "{requeue:#?}");
    assert_eq!(
        requeue.links,
        [(scan_trace.clone(), scan_span.clone())],
        "{requeue:#?}"
    );
    assert_eq!(requeue.attr("job.id"), job.id);

    // The delivery batch, a root of its own, links to the span that scheduled the
    // notification: notification's Schedule handler, in the caller's trace.
    let delivery = spans
        .iter()
        .find(|s| is_delivery(s) && links_to(s, &notify_trace))
        .unwrap_or_else(|| {
            let notification: Vec<_> = spans
                .iter()
                .filter(|s| s.service == "ecoscan-notification")
                .map(|s| (&s.name, &s.trace_id, &s.links))
                .collect();
            panic!("no delivery links to trace {notify_trace}: {notification:#?}")
        });
    assert_ne!(delivery.trace_id, notify_trace);
    let (_, linked_span) = delivery
        .links
        .iter()
        .find(|(t, _)| *t == notify_trace)
        .unwrap();
    let scheduling = spans
        .iter()
        .find(|s| &s.span_id == linked_span)
        .unwrap_or_else(|| panic!("the linked span was exported: {delivery:#?}"));
    assert_eq!(
        scheduling.service, "ecoscan-notification",
        "{scheduling:#?}"
    );
    assert_eq!(scheduling.trace_id, notify_trace);
}
