//! The compose file and the collector configuration in `infra/` stay runnable: every service of
//! the suite has its container, each sends its spans to the collector, and the collector forwards
//! them to Jaeger; Prometheus scrapes every service and Grafana is provisioned with it and the
//! dashboards. (Docker itself is not available to the tests; this checks what YAML can.)

use std::path::PathBuf;

use ecoscan::Service;
use serde_yaml::Value;

fn infra(file: &str) -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../infra")
        .join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let mut value: Value =
        serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{file} is not valid YAML: {e}"));
    value.apply_merge().expect("merge keys resolve");
    value
}

fn str_of<'a>(v: &'a Value, path: &[&str]) -> &'a str {
    let mut cur = v;
    for key in path {
        cur = &cur[*key];
    }
    cur.as_str()
        .unwrap_or_else(|| panic!("{path:?} is not a string: {cur:?}"))
}

#[test]
fn compose_runs_every_service_with_its_stores_and_tracing() {
    let compose = infra("compose.yaml");
    let services = &compose["services"];
    for store in ["redis", "postgres", "minio", "otel-collector", "jaeger"] {
        assert!(
            services[store].is_mapping(),
            "{store} missing from compose.yaml"
        );
    }
    for service in Service::ALL {
        let name = service.name();
        let s = &services[name];
        assert!(s.is_mapping(), "{name} missing from compose.yaml");
        assert_eq!(
            s["command"],
            serde_yaml::from_str::<Value>(&format!("[serve, {name}]")).unwrap(),
            "{name} runs as its own process"
        );
        let env = &s["environment"];
        assert_eq!(
            str_of(env, &["OTEL_EXPORTER_OTLP_ENDPOINT"]),
            "http://otel-collector:4317"
        );
        let addr = str_of(env, &[service.addr_var()]);
        assert!(
            addr.starts_with("0.0.0.0:"),
            "{name} listens on every interface of its container: {addr}"
        );
        assert!(
            s["build"]["dockerfile"].as_str() == Some("infra/Dockerfile"),
            "{name} is built from infra/Dockerfile"
        );
    }
    assert_eq!(
        services["jaeger"]["ports"][0].as_str(),
        Some("16686:16686"),
        "Jaeger's UI on 16686"
    );
    let mount = services["otel-collector"]["volumes"][0]
        .as_str()
        .expect("collector config mount");
    assert!(mount.starts_with("./otel-collector.yaml:"), "{mount}");
    assert!(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../infra/Dockerfile")
            .exists(),
        "infra/Dockerfile exists"
    );
}

#[test]
fn the_collector_receives_otlp_and_forwards_traces_to_jaeger() {
    let config = infra("otel-collector.yaml");
    assert_eq!(
        str_of(
            &config,
            &["receivers", "otlp", "protocols", "grpc", "endpoint"]
        ),
        "0.0.0.0:4317"
    );
    let pipeline = &config["service"]["pipelines"]["traces"];
    assert_eq!(pipeline["receivers"][0].as_str(), Some("otlp"));
    let exporters: Vec<&str> = pipeline["exporters"]
        .as_sequence()
        .expect("exporters")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(exporters.contains(&"otlp/jaeger"), "{exporters:?}");
    assert_eq!(
        str_of(&config, &["exporters", "otlp/jaeger", "endpoint"]),
        "jaeger:4317"
    );
    for p in pipeline["processors"].as_sequence().expect("processors") {
        let p = p.as_str().expect("processor name");
        assert!(
            config["processors"][p].is_mapping(),
            "processor {p} is configured"
        );
    }
}

#[test]
fn the_collector_has_a_logs_pipeline_for_otlp_logs() {
    let config = infra("otel-collector.yaml");
    let logs = &config["service"]["pipelines"]["logs"];
    assert_eq!(logs["receivers"][0].as_str(), Some("otlp"), "{logs:?}");
    for exporter in logs["exporters"].as_sequence().expect("exporters") {
        let e = exporter.as_str().expect("exporter name");
        assert!(
            config["exporters"][e].is_mapping(),
            "exporter {e} is configured"
        );
    }
}

#[test]
fn compose_runs_prometheus_scraping_every_service_and_grafana_provisioned_with_it() {
    let compose = infra("compose.yaml");
    let services = &compose["services"];
    let mounts = |name: &str| -> Vec<String> {
        services[name]["volumes"]
            .as_sequence()
            .unwrap_or_else(|| panic!("{name} has volumes"))
            .iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect()
    };
    assert!(
        mounts("prometheus")
            .iter()
            .any(|m| m.starts_with("./prometheus:/etc/prometheus")),
        "{:?}",
        mounts("prometheus")
    );
    for dir in [
        "./grafana/provisioning:/etc/grafana/provisioning",
        "./grafana/dashboards:/var/lib/grafana/dashboards",
    ] {
        assert!(
            mounts("grafana").iter().any(|m| m.starts_with(dir)),
            "grafana mounts {dir}"
        );
    }

    // Every service is scraped where it listens in compose (its /metrics is on that port; the
    // gateway's on its admin port).
    let prometheus = infra("prometheus/prometheus.yml");
    let targets: Vec<&str> = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
        .as_sequence()
        .expect("targets")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for service in Service::ALL {
        let name = service.name();
        // The gateway's /metrics is on its admin listener, apart from the public API.
        let var = match service {
            Service::Gateway => "GATEWAY_ADMIN_ADDR",
            _ => service.addr_var(),
        };
        let addr = str_of(&services[name]["environment"], &[var]);
        let port = addr.rsplit(':').next().expect("port");
        assert!(
            targets.contains(&format!("{name}:{port}").as_str()),
            "{name}:{port} scraped: {targets:?}"
        );
    }
    assert_eq!(
        prometheus["rule_files"][0].as_str(),
        Some("alerts.yml"),
        "the alerts are evaluated"
    );

    // Grafana's data source is the compose Prometheus, under the uid the dashboards use.
    let datasources = infra("grafana/provisioning/datasources/prometheus.yaml");
    let ds = &datasources["datasources"][0];
    assert_eq!(ds["url"].as_str(), Some("http://prometheus:9090"));
    let uid = ds["uid"].as_str().expect("uid");
    let providers = infra("grafana/provisioning/dashboards/ecoscan.yaml");
    assert_eq!(
        str_of(&providers["providers"][0], &["options", "path"]),
        "/var/lib/grafana/dashboards"
    );
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../infra/grafana/dashboards");
    for entry in std::fs::read_dir(&dir).expect("dashboards") {
        let path = entry.expect("dashboard").path();
        let text = std::fs::read_to_string(&path).expect("read dashboard");
        assert!(
            text.contains(&format!("\"uid\": \"{uid}\"")),
            "{} queries the provisioned data source",
            path.display()
        );
    }
}
