//! A store that stops answering: once its circuit is open, submits are refused
//! at once (`UNAVAILABLE` naming the store, with `retry-after`) instead of each waiting out the
//! 10 s response timeout, `/metrics` says the store is down, and once the path heals submits
//! are accepted again and the metrics say so. Redis is a private `redis-server` behind a
//! loopback forwarder the test switches to a blackhole (it accepts and reads, never answers).

mod support;

use std::time::Duration;

use ecoscan_proto::v1::Stage;
use ecoscan_redis::{
    Settings,
    testing::{Blackhole, PrivateRedis},
};
use support::*;
use tokio::time::Instant;
use tonic::Code;
use tonic_types::StatusExt as _;

/// Generous on a busy machine, and still far under the 10 s response timeout a refusal would
/// otherwise take.
const FAST: Duration = Duration::from_secs(3);

async fn submit(env: &Env) -> Result<String, tonic::Status> {
    support::try_submit_png(env, Duration::from_secs(30)).await
}

async fn metrics(env: &Env) -> String {
    reqwest::get(format!("{}/metrics", env._servers[1].uri()))
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("the metrics' text")
}

/// The value of the series of `name` whose labels contain every one of `labels`.
fn value(metrics: &str, name: &str, labels: &[&str]) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| l.starts_with(name) && labels.iter().all(|want| l.contains(want)))
        .find_map(|l| l.rsplit(' ').next()?.parse().ok())
}

fn assert_refused_naming_redis(status: &tonic::Status) {
    assert_refused_naming(status, "redis");
}

fn assert_refused_naming(status: &tonic::Status, store: &str) {
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains(store), "{status:?}");
    let retry_after: u64 = status
        .metadata()
        .get("retry-after")
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .expect("a retry-after");
    assert_eq!(retry_after, 1, "at most the probe interval");
    let details = status.get_error_details();
    let info = details.error_info().expect("an ErrorInfo");
    assert_eq!(info.reason, "STORE_UNAVAILABLE");
    assert_eq!(info.metadata["store"], store);
}

/// Submits until one is refused at once (the circuit is open), for at most a minute.
async fn until_refused_fast(env: &Env, store: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let started = Instant::now();
        let refused = submit(env)
            .await
            .expect_err("no submit succeeds while the store is away");
        let took = started.elapsed();
        if refused.metadata().get("retry-after").is_some() && took < FAST {
            assert_refused_naming(&refused, store);
            return;
        }
        assert!(
            Instant::now() < deadline,
            "refusals still slow or not naming {store} after 60 s: {refused:?} took {took:?}"
        );
    }
}

#[tokio::test]
async fn submits_are_refused_fast_while_redis_does_not_answer_and_accepted_again() {
    let server = PrivateRedis::start().await;
    let path = Blackhole::start(([127, 0, 0, 1], server.port()).into()).await;
    let url = path.redis_url();
    let env = start(None, |c| {
        // The default response timeout (10 s): what a submit waited before.
        c.redis = Some(Settings::single(url));
    })
    .await;
    submit(&env).await.expect("a submit with redis up");
    let up = metrics(&env).await;
    assert_eq!(
        value(&up, "store_up{", &[r#"store="redis""#]),
        Some(1.0),
        "{up}"
    );

    path.blackhole();
    // The first submits wait for Redis until the circuit opens (a timeout after seconds of
    // silence); then the refusals come at once.
    until_refused_fast(&env, "redis").await;
    for _ in 0..3 {
        let started = Instant::now();
        let refused = submit(&env).await.expect_err("refused while redis is away");
        let took = started.elapsed();
        // One call a second goes through as the probe and waits; the others are refused at
        // once.
        if refused.metadata().get("retry-after").is_some() {
            assert!(took < FAST, "a refusal took {took:?}");
            assert_refused_naming_redis(&refused);
        }
    }
    let down = metrics(&env).await;
    assert_eq!(
        value(&down, "store_up{", &[r#"store="redis""#]),
        Some(0.0),
        "{down}"
    );
    assert!(
        value(
            &down,
            "store_faults_total{",
            &[r#"store="redis""#, r#"kind="timed_out""#]
        )
        .is_some_and(|n| n >= 1.0),
        "{down}"
    );

    path.heal();
    let deadline = Instant::now() + Duration::from_secs(60);
    let after = loop {
        match submit(&env).await {
            Ok(job) => break job,
            Err(e) => assert!(
                Instant::now() < deadline,
                "no submit accepted 60 s after the path healed: {e:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let events = watch_all(&env, &after).await;
    assert_eq!(
        events.last().map(|e| e.stage),
        Some(Stage::Done as i32),
        "a scan submitted after the outage runs to its end"
    );
    let up = metrics(&env).await;
    assert_eq!(
        value(&up, "store_up{", &[r#"store="redis""#]),
        Some(1.0),
        "{up}"
    );
}

#[tokio::test]
async fn on_postgres_submits_are_refused_fast_while_it_does_not_answer_and_its_pool_is_a_metric() {
    let schema = ecoscan_sql::testing::PgSchema::create().await;
    let base = std::env::var("TEST_DATABASE_URL")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .unwrap_or_else(|| ecoscan_sql::testing::DEFAULT_TEST_DATABASE_URL.to_owned());
    let server: std::net::SocketAddr = tokio::net::lookup_host(
        base.split('@')
            .next_back()
            .and_then(|rest| rest.split('/').next())
            .expect("host:port in TEST_DATABASE_URL"),
    )
    .await
    .expect("resolve the database's address")
    .next()
    .expect("an address");
    let path = Blackhole::start(server).await;
    // The schema's URL, through the forwarder.
    let url = schema
        .url
        .replacen(&server.to_string(), &path.addr().to_string(), 1);
    assert_ne!(
        url, schema.url,
        "the test URL names its server as host:port: {base}"
    );
    let via = url.clone();
    let env = start(None, |c| c.database_url = via).await;
    submit(&env).await.expect("a submit with postgres up");
    let up = metrics(&env).await;
    assert_eq!(
        value(&up, "store_up{", &[r#"store="postgres""#]),
        Some(1.0),
        "{up}"
    );
    assert!(
        value(
            &up,
            "store_pool_connections{",
            &[r#"store="postgres""#, r#"state="open""#]
        )
        .is_some_and(|n| n >= 1.0),
        "{up}"
    );
    assert!(
        !up.contains("search_path"),
        "the address is shown without its query: {up}"
    );

    path.blackhole();
    // Idle past the ping threshold: the next statement's connection is checked first, and
    // that check (bounded by DATABASE_ACQUIRE_TIMEOUT) is what meets the blackhole.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    until_refused_fast(&env, "postgres").await;
    let down = metrics(&env).await;
    assert_eq!(
        value(&down, "store_up{", &[r#"store="postgres""#]),
        Some(0.0),
        "{down}"
    );

    path.heal();
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Err(e) = submit(&env).await {
        assert!(
            Instant::now() < deadline,
            "no submit accepted 60 s after the path healed: {e:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let up = metrics(&env).await;
    assert_eq!(
        value(&up, "store_up{", &[r#"store="postgres""#]),
        Some(1.0),
        "{up}"
    );
}
