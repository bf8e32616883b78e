//! `/metrics` of the gateway and of every service after one scan: each answers on its own port
//! (gRPC services on the gRPC port) with its own series only, and the documented series carry
//! the values the scan must have produced.

mod common;

use std::{collections::HashMap, net::SocketAddr, time::Duration};

use common::{TestSuite, image_form, read_sse};

/// One sample of a Prometheus text scrape.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: HashMap<String, String>,
    value: f64,
}

/// Parses the Prometheus text format, enough for our series (no escaped quotes in values).
fn parse(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').expect("`series value`");
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => (name, rest.strip_suffix('}').expect("closing brace")),
                None => (series, ""),
            };
            let labels = labels
                .split("\",")
                .filter(|p| !p.is_empty())
                .map(|p| {
                    let (k, v) = p.split_once("=\"").expect("label=\"value\"");
                    (k.to_owned(), v.trim_end_matches('"').to_owned())
                })
                .collect();
            Sample {
                name: name.to_owned(),
                labels,
                value: value.parse().expect("numeric value"),
            }
        })
        .collect()
}

/// A service's scrape.
struct Scrape {
    service: &'static str,
    samples: Vec<Sample>,
    text: String,
}

impl Scrape {
    /// Sum of the samples of `name` having all of `labels` (`None` when there is none).
    fn sum(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let matching: Vec<f64> = self
            .samples
            .iter()
            .filter(|s| s.name == name)
            .filter(|s| {
                labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).is_some_and(|x| x == v))
            })
            .map(|s| s.value)
            .collect();
        (!matching.is_empty()).then(|| matching.iter().sum())
    }

    #[track_caller]
    fn assert_eq(&self, name: &str, labels: &[(&str, &str)], want: f64) {
        let got = self.sum(name, labels);
        assert_eq!(
            got,
            Some(want),
            "{}: {name}{labels:?}\n{}",
            self.service,
            self.text
        );
    }

    #[track_caller]
    fn assert_at_least(&self, name: &str, labels: &[(&str, &str)], min: f64) {
        let got = self.sum(name, labels);
        assert!(
            got.is_some_and(|v| v >= min),
            "{}: {name}{labels:?} = {got:?}, want >= {min}\n{}",
            self.service,
            self.text
        );
    }
}

async fn scrape(suite: &TestSuite, service: &'static str, addr: SocketAddr) -> Scrape {
    let res = suite
        .http
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .expect("scrape answers");
    assert_eq!(res.status(), 200, "{service} /metrics");
    let ct = res.headers()["content-type"].to_str().unwrap().to_owned();
    assert!(ct.starts_with("text/plain"), "{service} content type {ct}");
    let text = res.text().await.unwrap();
    let samples = parse(&text);
    Scrape {
        service,
        samples,
        text,
    }
}

/// Scrapes until `ready` holds (values that settle just after the scan: reports reaching
/// analytics, streams being released), failing after a deadline.
async fn scrape_until(
    suite: &TestSuite,
    service: &'static str,
    addr: SocketAddr,
    ready: impl Fn(&Scrape) -> bool,
) -> Scrape {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let s = scrape(suite, service, addr).await;
        if ready(&s) || tokio::time::Instant::now() >= deadline {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn every_service_and_the_gateway_expose_the_documented_series_after_a_scan() {
    let suite = TestSuite::start().await;
    let a = suite.running.addrs;

    // One job: submitted (unary Submit), then streamed by the same idempotency key (Scan).
    let res = suite
        .http
        .post(suite.url("/api/v1/scan"))
        .header("x-user-id", "metrics-user")
        .header("idempotency-key", "metrics-scan-1")
        .multipart(image_form("투명 페트병 pet bottle"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 202);
    let res = suite
        .http
        .post(suite.url("/api/v1/scan/completion"))
        .header("x-user-id", "metrics-user")
        .header("idempotency-key", "metrics-scan-1")
        .multipart(image_form("투명 페트병 pet bottle"))
        .send()
        .await
        .unwrap();
    let events = read_sse(res).await;
    assert_eq!(events.last().map(|e| e.event.as_str()), Some("ready"));

    let gateway = scrape_until(&suite, "gateway", a.gateway_admin, |s| {
        s.sum("gateway_sse_connections", &[]) == Some(0.0)
    })
    .await;
    let ingest = scrape_until(&suite, "ingest", a.ingest, |s| {
        s.sum("ingest_hub_watchers", &[]) == Some(0.0)
            && s.sum("ingest_dispatch_backlog", &[]) == Some(0.0)
            && s.sum("rpc_server_in_flight", &[]) == Some(0.0)
    })
    .await;
    let analytics = scrape_until(&suite, "analytics", a.analytics, |s| {
        s.sum("analytics_calls_recorded_total", &[])
            .is_some_and(|n| n >= 2.0)
    })
    .await;
    let vision = scrape(&suite, "vision", a.vision).await;
    let answer = scrape(&suite, "answer", a.answer).await;
    let rule = scrape(&suite, "rule", a.rule).await;
    let reward = scrape(&suite, "reward", a.reward).await;
    let notification = scrape(&suite, "notification", a.notification).await;

    // Each registry is the service's own: every series carries its service label.
    for s in [
        &gateway,
        &ingest,
        &analytics,
        &vision,
        &answer,
        &rule,
        &reward,
        &notification,
    ] {
        assert!(!s.samples.is_empty(), "{} has no series", s.service);
        for sample in &s.samples {
            assert_eq!(
                sample.labels.get("service").map(String::as_str),
                Some(s.service),
                "{sample:?}"
            );
        }
    }

    // Gateway: RED per route template, SSE streams closed again.
    let completion = [("route", "/api/v1/scan/completion"), ("method", "POST")];
    gateway.assert_eq(
        "http_server_requests_total",
        &[completion[0], completion[1], ("status", "200")],
        1.0,
    );
    gateway.assert_eq(
        "http_server_requests_total",
        &[
            ("route", "/api/v1/scan"),
            ("method", "POST"),
            ("status", "202"),
        ],
        1.0,
    );
    gateway.assert_eq("http_server_duration_seconds_count", &completion, 1.0);
    gateway.assert_eq("gateway_sse_connections", &[], 0.0);

    // ingest: RED per RPC, one job accepted and succeeded, every stage timed, nothing left.
    let submit = ("method", "ecoscan.v1.ScanService/Submit");
    ingest.assert_eq("rpc_server_requests_total", &[submit, ("code", "OK")], 1.0);
    ingest.assert_eq("rpc_server_duration_seconds_count", &[submit], 1.0);
    ingest.assert_at_least(
        "rpc_server_requests_total",
        &[("method", "ecoscan.v1.ScanService/Scan")],
        1.0,
    );
    ingest.assert_eq("rpc_server_in_flight", &[], 0.0);
    ingest.assert_eq("ingest_jobs_submitted_total", &[], 1.0);
    ingest.assert_eq("ingest_jobs_total", &[("status", "succeeded")], 1.0);
    assert_eq!(
        ingest.sum("ingest_jobs_total", &[("status", "failed")]),
        None
    );
    assert_eq!(ingest.sum("ingest_submit_rejected_total", &[]), None);
    ingest.assert_eq("ingest_dispatch_lag_seconds_count", &[], 1.0);
    for stage in ["vision", "rule", "answer", "reward"] {
        ingest.assert_eq(
            "ingest_stage_duration_seconds_count",
            &[("stage", stage), ("outcome", "ok")],
            1.0,
        );
    }
    ingest.assert_eq("ingest_dispatch_backlog", &[], 0.0);
    ingest.assert_eq("ingest_hub_watchers", &[], 0.0);
    // No direct upload here: every outcome is there from the start, at 0.
    for outcome in ["created", "stored", "submitted", "refused", "expired"] {
        ingest.assert_eq("ingest_uploads_total", &[("outcome", outcome)], 0.0);
    }
    // Health checks and scrapes are not RPCs of ours.
    assert!(!ingest.text.contains("grpc.health"), "{}", ingest.text);

    // vision and answer: model calls, tokens both ways, latency; no report dropped.
    let mock = [("provider", "mock"), ("model", "mock")];
    for (s, operation) in [(&vision, "classify"), (&answer, "answer")] {
        let op = ("operation", operation);
        s.assert_eq(
            "llm_calls_total",
            &[mock[0], mock[1], op, ("status", "ok")],
            1.0,
        );
        for direction in ["input", "output"] {
            s.assert_at_least(
                "llm_tokens_total",
                &[mock[0], op, ("direction", direction)],
                1.0,
            );
        }
        s.assert_eq("llm_call_duration_seconds_count", &[mock[0], op], 1.0);
        s.assert_eq("llm_reports_dropped_total", &[], 0.0);
    }
    answer.assert_eq("llm_time_to_first_token_seconds_count", &[], 1.0);
    vision.assert_at_least(
        "rpc_server_requests_total",
        &[("method", "ecoscan.v1.VisionService/Classify")],
        1.0,
    );

    // rule, reward, notification, analytics: their domain series.
    rule.assert_eq("rule_lookups_total", &[], 1.0);
    reward.assert_eq("reward_decisions_total", &[("reason", "granted")], 1.0);
    reward.assert_eq(
        "rpc_server_requests_total",
        &[
            ("method", "ecoscan.v1.RewardService/Evaluate"),
            ("code", "OK"),
        ],
        1.0,
    );
    notification.assert_eq(
        "notification_delivered_total",
        &[("kind", "scan_completed")],
        1.0,
    );
    notification.assert_eq("notification_scheduled_backlog", &[], 0.0);
    notification.assert_eq("notification_subscribers", &[], 0.0);
    analytics.assert_at_least("analytics_calls_recorded_total", &[], 2.0);
    analytics.assert_at_least("analytics_batch_rows_count", &[], 1.0);
    analytics.assert_at_least("analytics_commit_duration_seconds_count", &[], 1.0);
    analytics.assert_at_least(
        "rpc_server_requests_total",
        &[
            ("method", "ecoscan.v1.AnalyticsService/RecordStream"),
            ("code", "OK"),
        ],
        1.0,
    );
}

/// The metric names a PromQL text refers to: ours all start with a service's or a layer's
/// prefix (`up` is Prometheus's own).
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    const PREFIXES: [&str; 9] = [
        "rpc_server_",
        "http_server_",
        "gateway_",
        "ingest_",
        "llm_",
        "analytics_",
        "reward_",
        "rule_",
        "notification_",
    ];
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut names = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(start) = rest.find(|c: char| c.is_ascii_alphabetic() || c == '_') {
        let preceded = text[..text.len() - rest.len() + start]
            .chars()
            .next_back()
            .is_some_and(is_name);
        let token_len = rest[start..]
            .find(|c: char| !is_name(c))
            .unwrap_or(rest.len() - start);
        let token = &rest[start..start + token_len];
        if !preceded && PREFIXES.iter().any(|p| token.starts_with(p)) {
            names.insert(token.to_owned());
        }
        rest = &rest[start + token_len..];
    }
    names
}

/// Every query of every dashboard (`infra/grafana/dashboards/*.json`) and every alert
/// expression (`infra/prometheus/alerts.yml`), as text.
fn monitoring_queries() -> Vec<(String, String)> {
    let infra = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../infra");
    let mut out = Vec::new();
    let dashboards = infra.join("grafana/dashboards");
    for entry in std::fs::read_dir(&dashboards).expect("infra/grafana/dashboards") {
        let path = entry.expect("dashboard").path();
        if path.extension().is_some_and(|e| e == "json") {
            let text = std::fs::read_to_string(&path).expect("read dashboard");
            let json: serde_json::Value = serde_json::from_str(&text).expect("dashboard JSON");
            let mut queries = Vec::new();
            collect_exprs(&json, &mut queries);
            assert!(!queries.is_empty(), "{} has no query", path.display());
            let file = path.file_name().unwrap().to_string_lossy().into_owned();
            out.extend(queries.into_iter().map(|q| (file.clone(), q)));
        }
    }
    let alerts: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(infra.join("prometheus/alerts.yml")).expect("alerts.yml"),
    )
    .expect("alerts YAML");
    for group in alerts["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            let name = rule["alert"].as_str().expect("alert name").to_owned();
            out.push((name, rule["expr"].as_str().expect("expr").to_owned()));
        }
    }
    out
}

/// The `expr` of every target and the `query` of every variable in a dashboard.
fn collect_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("expr" | "query" | "definition", serde_json::Value::String(q)) => {
                        out.push(q.clone());
                    }
                    _ => collect_exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| collect_exprs(v, out)),
        _ => {}
    }
}

#[test]
fn metric_names_are_read_from_promql() {
    let names = metric_names(
        r#"histogram_quantile(0.95, sum by (le) (rate(ingest_dispatch_lag_seconds_bucket{service="ingest"}[5m]))) > 10 and rule_lookups_total and my_rule_x and up == 0"#,
    );
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        ["ingest_dispatch_lag_seconds_bucket", "rule_lookups_total"]
    );
}

/// The series an ingest on Redis (`TEST_REDIS_URL`, a key prefix of its own) and PostgreSQL
/// (`TEST_DATABASE_URL`, a schema of its own) exports: the suite's services run on embedded
/// stores, which have no `store_up` or pool.
async fn ingest_on_production_stores(suite: &TestSuite) -> Vec<String> {
    let dir = tempfile::tempdir().expect("temp dir");
    let redis_url = std::env::var("TEST_REDIS_URL")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| "redis://127.0.0.1:6379".to_owned());
    let prefix = format!(
        "t:metrics:{}:",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let schema = ecoscan_sql::testing::PgSchema::create().await;
    let config = ecoscan_ingest::Config {
        database_url: schema.url.clone(),
        object_dir: dir.path().join("objects"),
        redis: Some(ecoscan_redis::Settings::single(redis_url.clone())),
        redis_prefix: prefix.clone(),
        ..Default::default()
    };
    let stores = ecoscan_ingest::Stores::from_config(&config)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "ingest on redis at {redis_url} and postgresql ({e:#}); start them with \
                 infra/services.sh"
            )
        });
    let ingest = ecoscan_common::testing::spawn(move |l, sd| {
        ecoscan_ingest::serve_with(config, stores, l, sd)
    })
    .await;
    let names = scrape(suite, "ingest", ingest.addr)
        .await
        .samples
        .into_iter()
        .map(|s| s.name)
        .collect();
    let client = redis::Client::open(redis_url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    ecoscan_redis::unlink_prefixed(&mut conn, &prefix)
        .await
        .unwrap();
    names
}

#[tokio::test]
async fn every_metric_a_dashboard_or_alert_names_is_one_the_services_export() {
    let suite = TestSuite::start().await;
    let a = suite.running.addrs;
    // A scan makes every labelled family appear; a refused submit the intake rejections.
    let res = suite
        .http
        .post(suite.url("/api/v1/scan/completion"))
        .header("x-user-id", "dashboards")
        .multipart(image_form("투명 페트병 pet bottle"))
        .send()
        .await
        .unwrap();
    let events = read_sse(res).await;
    assert_eq!(events.last().map(|e| e.event.as_str()), Some("ready"));
    let mut ingest = ecoscan_proto::v1::scan_service_client::ScanServiceClient::new(
        ecoscan_common::client::channel(&format!("http://{}", a.ingest)).unwrap(),
    );
    let refused = ingest
        .submit(ecoscan_common::client::request_as(
            ecoscan_proto::v1::SubmitRequest::default(),
            Duration::from_secs(10),
            "dashboards",
        ))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);

    // What every service exports, once the reports reached analytics.
    let mut exported = std::collections::BTreeSet::new();
    for (service, addr) in [
        ("gateway", a.gateway_admin),
        ("ingest", a.ingest),
        ("vision", a.vision),
        ("rule", a.rule),
        ("answer", a.answer),
        ("reward", a.reward),
        ("notification", a.notification),
    ] {
        exported.extend(
            scrape(&suite, service, addr)
                .await
                .samples
                .into_iter()
                .map(|s| s.name),
        );
    }
    let analytics = scrape_until(&suite, "analytics", a.analytics, |s| {
        s.sum("analytics_batch_rows_count", &[])
            .is_some_and(|n| n >= 1.0)
    })
    .await;
    exported.extend(analytics.samples.into_iter().map(|s| s.name));
    // The series only a store reached over the network has (`store_up`, its pool, …): ingest
    // on Redis and PostgreSQL.
    exported.extend(ingest_on_production_stores(&suite).await);

    let queries = monitoring_queries();
    assert!(
        queries.len() > 20,
        "dashboards and alerts found: {queries:?}"
    );
    let mut unknown = Vec::new();
    for (source, query) in &queries {
        for name in metric_names(query) {
            if !exported.contains(&name) {
                unknown.push(format!("{source}: {name}"));
            }
        }
    }
    assert!(
        unknown.is_empty(),
        "metrics named by a dashboard or alert that no service exports:\n{}\n\nexported: {exported:?}",
        unknown.join("\n")
    );
}
