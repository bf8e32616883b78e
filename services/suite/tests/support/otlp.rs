//! A real OTLP/gRPC endpoint inside the test: a tonic server implementing the collector's
//! `opentelemetry.proto.collector.trace.v1.TraceService`, keeping every span it receives.

#![allow(dead_code)]

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use axum::response::IntoResponse as _;
use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
        trace_service_server::{TraceService, TraceServiceServer},
    },
    common::v1::{AnyValue, KeyValue, any_value::Value as Any},
};
use serde_json::Value;
use tokio_stream::wrappers::TcpListenerStream;

/// One received span, flattened for assertions.
#[derive(Clone, Debug)]
pub struct Span {
    /// `service.name` of the resource it came with.
    pub service: String,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    pub name: String,
    /// `SpanKind` as a number (2 server, 3 client).
    pub kind: i32,
    pub start_ns: u64,
    pub end_ns: u64,
    pub attributes: HashMap<String, Value>,
    pub events: Vec<Event>,
    /// Linked spans as `(trace id, span id)`.
    pub links: Vec<(String, String)>,
    /// `Status.code`: 0 unset, 1 ok, 2 error.
    pub status_code: i32,
    /// `Status.message`: the description of an error status ("" when none).
    pub status_message: String,
    pub resource: HashMap<String, Value>,
}

#[derive(Clone, Debug)]
pub struct Event {
    pub name: String,
    pub attributes: HashMap<String, Value>,
}

impl Span {
    /// A string attribute, or "" when absent.
    pub fn attr(&self, key: &str) -> &str {
        self.attributes
            .get(key)
            .and_then(Value::as_str)
            .unwrap_or_default()
    }
}

#[derive(Clone, Default)]
struct Store(Arc<Mutex<Vec<Span>>>);

#[tonic::async_trait]
impl TraceService for Store {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.keep(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

impl Store {
    fn keep(&self, request: ExportTraceServiceRequest) {
        let mut received = Vec::new();
        for rs in request.resource_spans {
            let resource = attrs(rs.resource.map(|r| r.attributes).unwrap_or_default());
            let service = resource
                .get("service.name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            for ss in rs.scope_spans {
                for s in ss.spans {
                    received.push(Span {
                        service: service.clone(),
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent_span_id: hex(&s.parent_span_id),
                        name: s.name,
                        kind: s.kind,
                        start_ns: s.start_time_unix_nano,
                        end_ns: s.end_time_unix_nano,
                        attributes: attrs(s.attributes),
                        events: s
                            .events
                            .into_iter()
                            .map(|e| Event {
                                name: e.name,
                                attributes: attrs(e.attributes),
                            })
                            .collect(),
                        links: s
                            .links
                            .into_iter()
                            .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                            .collect(),
                        status_code: s.status.as_ref().map_or(0, |st| st.code),
                        status_message: s.status.map(|st| st.message).unwrap_or_default(),
                        resource: resource.clone(),
                    });
                }
            }
        }
        self.0.lock().expect("span store lock").extend(received);
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn attrs(kvs: Vec<KeyValue>) -> HashMap<String, Value> {
    kvs.into_iter()
        .map(|kv| (kv.key, kv.value.map_or(Value::Null, value)))
        .collect()
}

fn value(v: AnyValue) -> Value {
    match v.value {
        Some(Any::StringValue(s)) => Value::String(s),
        Some(Any::BoolValue(b)) => Value::Bool(b),
        Some(Any::IntValue(i)) => Value::from(i),
        Some(Any::DoubleValue(d)) => Value::from(d),
        Some(Any::ArrayValue(a)) => Value::Array(a.values.into_iter().map(value).collect()),
        Some(other) => Value::String(format!("{other:?}")),
        None => Value::Null,
    }
}

/// The running receiver; stops when dropped.
pub struct Receiver {
    pub addr: SocketAddr,
    store: Store,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Receiver {
    /// Listens on `127.0.0.1:<ephemeral>` for OTLP over HTTP with protobuf bodies
    /// (`POST /v1/traces`).
    pub async fn start_http() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the otlp receiver");
        let addr = listener.local_addr().expect("receiver address");
        let store = Store::default();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let kept = store.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| {
                let kept = kept.clone();
                async move {
                    use prost::Message as _;
                    match ExportTraceServiceRequest::decode(body) {
                        Ok(req) => {
                            kept.keep(req);
                            (
                                [(axum::http::header::CONTENT_TYPE, "application/x-protobuf")],
                                ExportTraceServiceResponse {
                                    partial_success: None,
                                }
                                .encode_to_vec(),
                            )
                                .into_response()
                        }
                        Err(e) => {
                            (axum::http::StatusCode::BAD_REQUEST, e.to_string()).into_response()
                        }
                    }
                }
            }),
        );
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = rx.await;
                })
                .await;
        });
        Self {
            addr,
            store,
            shutdown: Some(tx),
        }
    }

    /// Listens on `127.0.0.1:<ephemeral>` for OTLP over gRPC.
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the otlp receiver");
        let addr = listener.local_addr().expect("receiver address");
        let store = Store::default();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let svc = TraceServiceServer::new(store.clone());
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                    let _ = rx.await;
                })
                .await;
        });
        Self {
            addr,
            store,
            shutdown: Some(tx),
        }
    }

    /// `http://127.0.0.1:PORT`, for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        self.store.0.lock().expect("span store lock").clone()
    }

    /// Polls until `ready` holds for the spans received (or `timeout` passes), then returns
    /// them. Export is batched, so spans trickle in after the request that made them returns.
    pub async fn wait_for(&self, timeout: Duration, ready: impl Fn(&[Span]) -> bool) -> Vec<Span> {
        let deadline = Instant::now() + timeout;
        loop {
            let spans = self.spans();
            if ready(&spans) || Instant::now() > deadline {
                return spans;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}
