//! Drain: two ingest replicas behind one gateway (its `INGEST_URL` names both, so its calls are
//! balanced over them), scans submitted at a steady rate and each watched over SSE; mid-run one
//! ingest replica gets SIGTERM. It turns NOT_SERVING at once, serves on for its drain grace,
//! finishes or hands back its jobs and exits cleanly; no scan fails, and no SSE client sees a
//! gap (the gateway follows its upstream `Watch` to the other replica by itself).

mod common;
mod support;

use std::time::Duration;

use ecoscan_proto::v1::JobStatus;
use support::{
    processes::{Cluster, Service},
    stores::TestStores,
};

const JOBS: usize = 40;
const EVERY: Duration = Duration::from_millis(100);
const USER: &str = "drain-user";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_ingest_replica_drains_on_sigterm_without_failing_a_scan() {
    let stores = TestStores::create(None).await;
    let mut cluster = stores
        .configure(Cluster::builder())
        .env("LLM_MOCK_LATENCY", "300ms")
        .env("SHUTDOWN_DRAIN_GRACE", "2s")
        .env("INGEST_LEASE", "3s")
        .env("GATEWAY_MAX_SSE_PER_USER", JOBS.to_string())
        .env("GATEWAY_SCANS_PER_MINUTE", "100000")
        .start()
        .await;
    let ingest_a = cluster.addr(Service::Ingest);
    let ingest_b = cluster
        .start_replica(Service::Ingest, "ingest-b", &[])
        .await;
    let gateway = cluster
        .start_replica(
            Service::Gateway,
            "gateway-b",
            &[("INGEST_URL", format!("http://{ingest_a},http://{ingest_b}"))],
        )
        .await;
    let pg = stores.pg().await;
    let http = reqwest::Client::new();

    // A steady stream of scans, each watched from the start over one SSE connection.
    let load = {
        let http = http.clone();
        tokio::spawn(async move {
            let mut clients = tokio::task::JoinSet::new();
            let mut tick = tokio::time::interval(EVERY);
            for i in 0..JOBS {
                tick.tick().await;
                let res = http
                    .post(format!("http://{gateway}/api/v1/scan"))
                    .header("x-user-id", USER)
                    .multipart(common::image_form(if i % 2 == 0 {
                        "can"
                    } else {
                        "pet bottle"
                    }))
                    .send()
                    .await
                    .expect("submit");
                assert_eq!(res.status(), 202, "scan {i} was accepted");
                let job = res.json::<serde_json::Value>().await.unwrap()["job_id"]
                    .as_str()
                    .unwrap()
                    .to_owned();
                let http = http.clone();
                clients.spawn(async move {
                    let res = http
                        .get(format!("http://{gateway}/api/v1/scan/{job}/events"))
                        .header("x-user-id", USER)
                        .send()
                        .await
                        .expect("SSE request");
                    (job, common::read_sse(res).await)
                });
            }
            clients.join_all().await
        })
    };

    // A third of the way in, ingest A is asked to stop.
    tokio::time::sleep(EVERY * (JOBS as u32) / 3).await;
    let clean = cluster
        .terminate(Service::Ingest, Duration::from_secs(30))
        .await;
    assert!(clean, "ingest A drained and exited on its own, in time");

    let watched = tokio::time::timeout(Duration::from_secs(120), load)
        .await
        .expect("every SSE client ended within 2 minutes")
        .expect("the load ran");
    assert_eq!(watched.len(), JOBS);
    for (job, events) in &watched {
        common::assert_whole_stream(job, events);
    }
    let statuses = support::stores::job_statuses(&pg).await;
    assert_eq!(statuses.len(), JOBS);
    assert!(
        statuses.iter().all(|s| *s == JobStatus::Succeeded as i32),
        "no scan failed: {statuses:?}"
    );
    drop(cluster);
    pg.close().await;
}
