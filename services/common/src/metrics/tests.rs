use super::*;

#[tokio::test]
async fn render_shows_registered_series_with_the_service_label() {
    let mut metrics = Metrics::new("rule");
    let lookups: Family<Labels1, Counter> = Family::default();
    metrics
        .registry()
        .register("rule_lookups", "lookups", lookups.clone());
    metrics.gauge_fn("rule_open", "open things", || 3);
    metrics.counter_fn("rule_dropped", "dropped things", || 7);
    lookups.get_or_create(&[("outcome", "item".into())]).inc();

    let text = metrics.render().await;

    assert!(text.contains("# TYPE rule_lookups_total counter"), "{text}");
    assert!(
        text.contains(r#"rule_lookups_total{service="rule",outcome="item"} 1"#),
        "{text}"
    );
    assert!(text.contains(r#"rule_open{service="rule"} 3"#), "{text}");
    assert!(
        text.contains(r#"rule_dropped_total{service="rule"} 7"#),
        "{text}"
    );
}

#[tokio::test]
async fn a_sample_is_read_before_encoding_and_served_with_its_age() {
    let mut metrics = Metrics::new("ingest");
    let backlog: Gauge = Gauge::default();
    metrics
        .registry()
        .register("ingest_backlog", "backlog", backlog.clone());
    let source = Arc::new(std::sync::atomic::AtomicI64::new(0));
    metrics.sample("ingest_backlog", {
        let source = source.clone();
        move || {
            let (backlog, source) = (backlog.clone(), source.clone());
            async move {
                backlog.set(source.load(std::sync::atomic::Ordering::Relaxed));
                true
            }
        }
    });
    source.store(5, std::sync::atomic::Ordering::Relaxed);

    let text = metrics.render().await;

    assert!(
        text.contains(r#"ingest_backlog{service="ingest"} 5"#),
        "{text}"
    );
    assert!(
        text.contains(r#"metrics_sample_age_seconds{service="ingest",sample="ingest_backlog"}"#),
        "{text}"
    );
}

/// A store that stopped answering: the scrape serves the last value at once, the stuck
/// read is not started again by every scrape, and the value's age says how old it is.
#[tokio::test]
async fn a_sample_that_does_not_answer_never_holds_a_scrape_up() {
    let mut metrics = Metrics::new("ingest");
    let backlog: Gauge = Gauge::default();
    metrics
        .registry()
        .register("ingest_backlog", "backlog", backlog.clone());
    let reads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stuck = Arc::new(std::sync::atomic::AtomicBool::new(false));
    metrics.sample("ingest_backlog", {
        let (reads, stuck) = (reads.clone(), stuck.clone());
        move || {
            let (backlog, reads, stuck) = (backlog.clone(), reads.clone(), stuck.clone());
            async move {
                let n = reads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if stuck.load(std::sync::atomic::Ordering::SeqCst) {
                    std::future::pending::<()>().await;
                }
                backlog.set(i64::try_from(n).unwrap() + 7);
                true
            }
        }
    });
    let text = metrics.render().await;
    assert!(
        text.contains(r#"ingest_backlog{service="ingest"} 7"#),
        "{text}"
    );

    stuck.store(true, std::sync::atomic::Ordering::SeqCst);
    for scrape in 0..3 {
        // The first scrape starts the stuck read and waits SAMPLE_WAIT for it; the ones after
        // find it still under way and do not wait again.
        let began = std::time::Instant::now();
        // Bounded by SAMPLE_WAIT; the generous timeout only keeps a failure from hanging.
        let text = tokio::time::timeout(std::time::Duration::from_secs(10), metrics.render())
            .await
            .expect("a scrape waited on a read that does not answer");
        assert!(
            text.contains(r#"ingest_backlog{service="ingest"} 7"#),
            "{text}"
        );
        if scrape > 0 {
            assert!(
                began.elapsed() < super::SAMPLE_WAIT,
                "scrape {scrape} waited {:?} on a read an earlier scrape started",
                began.elapsed()
            );
        }
    }
    assert_eq!(
        reads.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "one read at a time: the stuck one is not started again"
    );
}

/// A slow store (reads answered, each slower than the scrape's wait): after one read showed it,
/// scrapes stop waiting for the next and serve the last value at once.
#[tokio::test]
async fn a_slow_sample_is_not_waited_for_once_it_showed_itself_slow() {
    let mut metrics = Metrics::new("ingest");
    let backlog: Gauge = Gauge::default();
    metrics
        .registry()
        .register("ingest_backlog", "backlog", backlog.clone());
    metrics.sample("ingest_backlog", move || {
        let backlog = backlog.clone();
        async move {
            tokio::time::sleep(super::SAMPLE_WAIT * 2).await;
            backlog.inc();
            true
        }
    });
    metrics.render().await;
    // The first read ends (slow), then each scrape starts a new one without waiting for it.
    tokio::time::sleep(super::SAMPLE_WAIT * 3).await;
    for _ in 0..2 {
        let began = std::time::Instant::now();
        let text = metrics.render().await;
        assert!(
            began.elapsed() < super::SAMPLE_WAIT,
            "a scrape waited {:?} for a store known to be slow",
            began.elapsed()
        );
        assert!(text.contains("ingest_backlog"), "{text}");
        tokio::time::sleep(super::SAMPLE_WAIT * 3).await;
    }
}

#[test]
fn only_methods_of_the_served_services_are_recorded() {
    let mut registry = Registry::default();
    let rpc = RpcMetrics::register(&mut registry, &["ecoscan.v1.RuleService"]);

    assert!(rpc.start("/ecoscan.v1.RuleService/Lookup").is_some());
    assert!(rpc.start("/ecoscan.v1.RuleService/Nope").is_none());
    assert!(rpc.start("/ecoscan.v1.ScanService/Submit").is_none());
    assert!(rpc.start("/grpc.health.v1.Health/Check").is_none());
    assert!(rpc.start("/metrics").is_none());
}

#[test]
fn a_call_without_a_status_counts_as_cancelled_and_leaves_in_flight() {
    let mut registry = Registry::default();
    let rpc = RpcMetrics::register(&mut registry, &["ecoscan.v1.RuleService"]);
    let method = || [("method", "ecoscan.v1.RuleService/Lookup".to_owned())];

    let call = rpc.start("/ecoscan.v1.RuleService/Lookup");
    assert_eq!(rpc.in_flight.get_or_create(&method()).get(), 1);
    drop(call);

    assert_eq!(rpc.in_flight.get_or_create(&method()).get(), 0);
    let [m] = method();
    let cancelled = [m, ("code", "CANCELLED".to_owned())];
    assert_eq!(rpc.requests.get_or_create(&cancelled).get(), 1);
}

#[tokio::test]
async fn durations_carry_their_trace_as_an_exemplar_in_openmetrics_only() {
    let mut metrics = Metrics::new("exemplars");
    let family: SecondsFamily<Labels1> = seconds_family();
    metrics
        .registry()
        .register("stage_duration_seconds", "test durations", family.clone());
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    observe_in_trace(
        &family.get_or_create(&[("stage", "vision".to_owned())]),
        0.3,
        trace,
    );
    // Outside a trace: counted, with no exemplar.
    observe_traced(
        &family.get_or_create(&[("stage", "vision".to_owned())]),
        7.0,
    );

    let open = metrics.render_openmetrics().await;
    let bucket = open
        .lines()
        .find(|l| l.starts_with("stage_duration_seconds_bucket") && l.contains("le=\"0.5\""))
        .unwrap_or_else(|| panic!("no 0.5 s bucket:\n{open}"));
    assert!(
        bucket.ends_with(&format!("# {{trace_id=\"{trace}\"}} 0.3")),
        "the bucket the observation fell in carries its trace: {bucket}"
    );
    let slow = open
        .lines()
        .find(|l| l.starts_with("stage_duration_seconds_bucket") && l.contains("le=\"10.0\""))
        .unwrap();
    assert!(!slow.contains('#'), "no trace, no exemplar: {slow}");
    assert!(open.ends_with("# EOF\n"), "{open}");

    let text = metrics.render().await;
    assert!(text.contains("stage_duration_seconds_count"), "{text}");
    assert!(
        !text.contains("trace_id"),
        "the Prometheus text format has no exemplars:\n{text}"
    );
}

#[test]
fn a_scrape_asking_for_openmetrics_gets_it() {
    // Prometheus 2 and 3 ask for OpenMetrics first.
    let prometheus = http::HeaderValue::from_static(
        "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;\
         q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    );
    assert!(wants_openmetrics(Some(&prometheus)));
    assert!(!wants_openmetrics(Some(&http::HeaderValue::from_static(
        "*/*"
    ))));
    assert!(!wants_openmetrics(None));
}
