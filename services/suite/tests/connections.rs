//! Backend connections stay constant whatever the number of watchers: 500 `Watch` streams
//! straight to ingest and 500 SSE clients through the gateway, all open at once on running
//! jobs, and ingest still holds the same few Redis connections (`CLIENT LIST` on a private
//! Redis, so only this test's processes are counted). The gateway shares one `Watch` per job
//! among that job's SSE clients. Every watcher gets its job's end.

mod common;
mod support;

use std::{collections::HashMap, time::Duration};

use ecoscan_common::client::request_as;
use ecoscan_proto::v1::{EventStatus, Stage, WatchRequest, scan_service_client::ScanServiceClient};
use futures::{StreamExt, stream};
use support::{
    processes::{Cluster, Service},
    stores::{PrivateRedis, client_names},
};
use tokio::time::Instant;

const JOBS: usize = 100;
const GRPC_WATCHERS: usize = 500;
const SSE_CLIENTS: usize = 500;
/// The design's ceiling for one process, whatever its load.
const MAX_CONNECTIONS_PER_PROCESS: usize = 4;
const USER: &str = "watcher";
/// The name every connection of ingest carries (`CLIENT SETNAME`).
const INGEST_NAME: &str = "ecoscan-ingest:";

/// The private Redis's clients (but ours), counted by name (unnamed: "").
async fn clients(redis: &mut redis::aio::MultiplexedConnection) -> HashMap<String, usize> {
    let mut by_name = HashMap::new();
    for name in client_names(redis).await {
        *by_name.entry(name).or_default() += 1;
    }
    by_name
}

fn ingest_connections(clients: &HashMap<String, usize>) -> usize {
    clients
        .iter()
        .filter(|(name, _)| name.starts_with(INGEST_NAME))
        .map(|(_, n)| n)
        .sum()
}

/// The value of a gauge (one series) in a Prometheus scrape.
fn gauge(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        // `name value` or `name{labels} value`
        if !(rest.starts_with(' ') || rest.starts_with('{')) {
            return None;
        }
        l.rsplit_once(' ')?.1.parse().ok()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_connections_stay_constant_with_a_thousand_watchers() {
    let started = std::time::Instant::now();
    let redis = PrivateRedis::start().await;
    // Only ingest talks to this Redis: every client but ours is one of its connections.
    let cluster = Cluster::builder()
        .service_env(Service::Ingest, "REDIS_URL", redis.url())
        .service_env(
            Service::Ingest,
            "INGEST_MAX_IN_FLIGHT",
            (JOBS + 28).to_string(),
        )
        // One user owns every job and watches each many times over: lift the per-user limits
        // of the public edge to this test's size.
        .service_env(
            Service::Gateway,
            "GATEWAY_SCANS_PER_MINUTE",
            JOBS.to_string(),
        )
        .service_env(
            Service::Gateway,
            "GATEWAY_MAX_SSE_PER_USER",
            SSE_CLIENTS.to_string(),
        )
        // Jobs run for ~24 s (two model calls each): every watcher is open while they run
        // even on a busy machine (1000 watchers subscribe in ~1-3 s alone, ~8 s under 3x load,
        // and more than 14 s while other builds and a large deletion ran beside the test).
        .env("LLM_MOCK_LATENCY", "12s")
        .env("LLM_MOCK_JITTER", "0")
        .env("LLM_MAX_CONCURRENCY", (2 * JOBS).to_string())
        .start()
        .await;
    let mut observer = redis::Client::open(redis.url())
        .expect("redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("connect to the private redis");

    let idle = clients(&mut observer).await;
    let idle_ingest = ingest_connections(&idle);
    assert!(
        (1..=MAX_CONNECTIONS_PER_PROCESS).contains(&idle_ingest),
        "ingest names its connections and holds a few: {idle:?}"
    );
    assert_eq!(
        idle.values().sum::<usize>(),
        idle_ingest,
        "every connection ingest opens is named: {idle:?}"
    );

    // The jobs, submitted through the gateway.
    let http = reqwest::Client::new();
    let jobs: Vec<String> = stream::iter(0..JOBS)
        .map(|i| {
            let http = http.clone();
            let url = cluster.gateway_url("/api/v1/scan");
            async move {
                let res = http
                    .post(url)
                    .header("x-user-id", USER)
                    .multipart(common::image_form(if i % 2 == 0 {
                        "can"
                    } else {
                        "pet bottle"
                    }))
                    .send()
                    .await
                    .expect("submit");
                assert_eq!(res.status(), 202);
                let body: serde_json::Value = res.json().await.expect("submit JSON");
                body["job_id"].as_str().expect("job_id").to_owned()
            }
        })
        .buffered(16)
        .collect()
        .await;

    // 500 Watch streams straight to ingest, on one HTTP/2 connection.
    let scan = ScanServiceClient::new(
        ecoscan_common::client::channel(&cluster.uri(Service::Ingest)).expect("ingest channel"),
    );
    let mut grpc = tokio::task::JoinSet::new();
    for i in 0..GRPC_WATCHERS {
        let job = jobs[i % JOBS].clone();
        let mut scan = scan.clone();
        grpc.spawn(async move {
            let mut events = scan
                .watch(request_as(
                    WatchRequest {
                        job_id: job.clone(),
                        after_event_id: String::new(),
                    },
                    Duration::from_secs(120),
                    USER,
                ))
                .await
                .unwrap_or_else(|s| panic!("Watch {job}: {s:?}"))
                .into_inner();
            let mut last = None;
            while let Some(ev) = events.next().await {
                let res = ev.unwrap_or_else(|s| panic!("Watch {job} ended with {s:?}"));
                last = Some(
                    res.event
                        .unwrap_or_else(|| panic!("Watch {job} sent a message without an event")),
                );
            }
            (job, last)
        });
    }
    // 500 SSE clients through the gateway (each its own HTTP/1.1 connection).
    let mut sse = tokio::task::JoinSet::new();
    for i in 0..SSE_CLIENTS {
        let job = jobs[i % JOBS].clone();
        let http = http.clone();
        let url = cluster.gateway_url(&format!("/api/v1/scan/{job}/events"));
        sse.spawn(async move {
            let res = http
                .get(url)
                .header("x-user-id", USER)
                .send()
                .await
                .expect("SSE request");
            (job, common::read_sse(res).await)
        });
    }

    // Every watcher subscribed: ingest's hub counts them (the gateway opens one Watch per job
    // and shares it among the job's SSE clients), all while the jobs still run.
    let expected_watchers = GRPC_WATCHERS + JOBS;
    let metrics = format!("{}/metrics", cluster.uri(Service::Ingest));
    let opening = Instant::now();
    let until = Instant::now() + Duration::from_secs(30);
    let scrape = |url: String| {
        let http = http.clone();
        async move {
            http.get(url)
                .send()
                .await
                .expect("scrape")
                .text()
                .await
                .expect("metrics text")
        }
    };
    let (watchers, text, gateway_text) = loop {
        let text = scrape(metrics.clone()).await;
        let gateway_text = scrape(cluster.gateway_admin_url("/metrics")).await;
        let watchers = gauge(&text, "ingest_hub_watchers").unwrap_or_default();
        let sse_open = gauge(&gateway_text, "gateway_sse_connections").unwrap_or_default();
        if (watchers >= expected_watchers as f64 && sse_open >= SSE_CLIENTS as f64)
            || Instant::now() > until
        {
            break (watchers, text, gateway_text);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        watchers, expected_watchers as f64,
        "all {expected_watchers} watchers were subscribed at once; ingest's metrics:\n{text}"
    );
    assert_eq!(
        gauge(&gateway_text, "gateway_sse_connections"),
        Some(SSE_CLIENTS as f64),
        "{gateway_text}"
    );
    assert_eq!(
        gauge(&gateway_text, "gateway_watch_feeds"),
        Some(JOBS as f64),
        "one upstream Watch per job for {SSE_CLIENTS} SSE clients: {gateway_text}"
    );
    let opened_in = opening.elapsed();
    let busy = clients(&mut observer).await;
    assert_eq!(
        ingest_connections(&busy),
        idle_ingest,
        "ingest's Redis connections do not grow with 1000 watchers: idle {idle:?}, busy {busy:?}"
    );
    assert_eq!(
        busy.values().sum::<usize>(),
        idle.values().sum::<usize>(),
        "nothing else connected either: {busy:?}"
    );
    let unfinished: i64 = {
        let res = http
            .get(&metrics)
            .send()
            .await
            .expect("scrape ingest")
            .text()
            .await
            .expect("metrics text");
        gauge(&res, "ingest_dispatch_backlog").unwrap_or_default() as i64
    };
    assert!(
        unfinished > 0,
        "the jobs were still running while the connections were counted"
    );

    // Every watcher gets its job's end.
    while let Some(joined) = grpc.join_next().await {
        let (job, last) = joined.expect("gRPC watcher");
        let last = last.unwrap_or_else(|| panic!("Watch {job} sent nothing"));
        assert_eq!(last.job_id, job);
        assert_eq!(
            (last.stage, last.status),
            (Stage::Done as i32, EventStatus::Completed as i32),
            "Watch {job} ends with done: {last:?}"
        );
    }
    while let Some(joined) = sse.join_next().await {
        let (job, events) = joined.expect("SSE client");
        let last = events
            .last()
            .unwrap_or_else(|| panic!("SSE {job} sent nothing"));
        assert_eq!(
            last.event, "ready",
            "SSE {job} ends with ready: {events:#?}"
        );
        assert_eq!(last.data["job_id"], job.as_str());
    }

    let after = clients(&mut observer).await;
    assert_eq!(
        ingest_connections(&after),
        idle_ingest,
        "and none were left behind: {after:?}"
    );
    eprintln!(
        "connections test: ingest held {idle_ingest} Redis connections idle and with {} \
         watchers (all subscribed within {opened_in:?}); took {:?}",
        GRPC_WATCHERS + SSE_CLIENTS,
        started.elapsed()
    );
    drop(cluster);
    drop(redis);
}
