//! Several replicas: two ingest and two gateway processes on one Redis (and once on a Redis
//! Cluster), with PostgreSQL and S3. Scans go in through one gateway and are watched through
//! the other, over the other ingest replica; mid-run the first ingest replica is SIGKILLed.
//! Every job ends exactly once, every SSE client on the surviving gateway gets every event of
//! its job in order with no gap and no repeat, and the dead replica's consumer leaves the
//! dispatch group.

mod common;
mod support;

use std::{collections::BTreeMap, time::Duration};

use ecoscan_ingest::store::redis::{DEFAULT_FEED_SHARDS, shard_of};
use ecoscan_proto::v1::{JobStatus, Stage};
use futures::{StreamExt, stream};
use sqlx::Row;
use support::{
    processes::{Cluster, Service},
    stores::{PrivateCluster, TestStores},
};
use tokio::time::Instant;

const JOBS: usize = 40;
/// SSE clients per job, all on the second gateway.
const CLIENTS_PER_JOB: usize = 2;
const USER: &str = "replica-user";
const LEASE: Duration = Duration::from_secs(2);

async fn submit(http: &reqwest::Client, url: &str, i: usize) -> String {
    let res = http
        .post(url)
        .header("x-user-id", USER)
        .multipart(common::image_form(if i.is_multiple_of(2) {
            "can"
        } else {
            "pet bottle"
        }))
        .send()
        .await
        .expect("submit");
    assert_eq!(res.status(), 202);
    let body: serde_json::Value = res.json().await.expect("submit JSON");
    body["job_id"].as_str().expect("job id").to_owned()
}

/// The consumers of the dispatch group, by name.
async fn consumers(redis: &mut ecoscan_redis::Conn, stores: &TestStores) -> Vec<String> {
    let infos: Vec<redis::Value> = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg(format!("{}scan:dispatch", stores.prefix))
        .arg("ingest")
        .query_async(redis)
        .await
        .expect("XINFO CONSUMERS");
    infos
        .into_iter()
        .filter_map(|c| {
            let fields: BTreeMap<String, redis::Value> = redis::from_redis_value(c).ok()?;
            redis::from_redis_value_ref::<String>(fields.get("name")?).ok()
        })
        .collect()
}

async fn run(stores: TestStores) {
    let started = std::time::Instant::now();
    let mut cluster = stores
        .configure(Cluster::builder())
        .env("LLM_MOCK_LATENCY", "500ms")
        .env("INGEST_LEASE", format!("{}ms", LEASE.as_millis()))
        .env("INGEST_SWEEP_INTERVAL", "1s")
        .env("INGEST_SWEEP_GRACE", "2s")
        // One user owns every job and watches each from several clients.
        .env(
            "GATEWAY_MAX_SSE_PER_USER",
            (JOBS * CLIENTS_PER_JOB).to_string(),
        )
        .start()
        .await;
    // The second ingest replica, and a second gateway in front of it.
    let ingest_b = cluster
        .start_replica(Service::Ingest, "ingest-b", &[])
        .await;
    let gateway_b = cluster
        .start_replica(
            Service::Gateway,
            "gateway-b",
            &[("INGEST_URL", format!("http://{ingest_b}"))],
        )
        .await;
    let mut redis = stores.redis().await;
    let pg = stores.pg().await;

    // Submitted through gateway A (and so ingest A); the replicas share the work.
    let http = reqwest::Client::new();
    let submit_url = cluster.gateway_url("/api/v1/scan");
    let jobs: Vec<String> = stream::iter(0..JOBS)
        .map(|i| {
            let (http, url) = (http.clone(), submit_url.clone());
            async move { submit(&http, &url, i).await }
        })
        .buffered(8)
        .collect()
        .await;
    // Watched through gateway B, from the start.
    let mut clients = tokio::task::JoinSet::new();
    for job in &jobs {
        for _ in 0..CLIENTS_PER_JOB {
            let (http, job) = (http.clone(), job.clone());
            let url = format!("http://{gateway_b}/api/v1/scan/{job}/events");
            clients.spawn(async move {
                let res = http
                    .get(url)
                    .header("x-user-id", USER)
                    .send()
                    .await
                    .expect("SSE request");
                (job, common::read_sse(res).await)
            });
        }
    }

    // Mid-run: some jobs running, not all done. Then ingest A dies.
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let running: i64 = sqlx::query("SELECT count(*) AS n FROM scan_jobs WHERE status = $1")
            .bind(JobStatus::Running as i32)
            .fetch_one(&pg)
            .await
            .expect("count running")
            .get("n");
        if running > 0 || Instant::now() > until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let consumers_before = consumers(&mut redis, &stores).await;
    assert_eq!(consumers_before.len(), 2, "{consumers_before:?}");
    cluster.kill(Service::Ingest);

    // Every client on gateway B gets every event of its job, in order, once, to `ready`.
    let deadline = Duration::from_secs(120);
    let mut seen = 0;
    let all = tokio::time::timeout(deadline, async {
        while let Some(joined) = clients.join_next().await {
            let (job, events) = joined.expect("SSE client");
            common::assert_whole_stream(&job, &events);
            seen += 1;
        }
    })
    .await;
    assert!(all.is_ok(), "SSE clients still open after {deadline:?}");
    assert_eq!(seen, JOBS * CLIENTS_PER_JOB);

    // Every job ended once: succeeded in its row, one done event in its log.
    let statuses = support::stores::job_statuses(&pg).await;
    assert_eq!(statuses.len(), JOBS);
    assert!(
        statuses.iter().all(|s| *s == JobStatus::Succeeded as i32),
        "{statuses:?}"
    );
    for job in &jobs {
        let shard = shard_of(job, DEFAULT_FEED_SHARDS);
        let reply: redis::streams::StreamRangeReply = redis::cmd("XRANGE")
            .arg(format!("{}scan:{{s{shard}}}:{job}:events", stores.prefix))
            .arg("-")
            .arg("+")
            .query_async(&mut redis)
            .await
            .expect("XRANGE");
        let done = reply
            .ids
            .iter()
            .map(|e| {
                let body: Vec<u8> = e.get("ev").expect("event body");
                support::stores::logged_event(&body)
            })
            .filter(|e| e.stage == Stage::Done as i32)
            .count();
        assert_eq!(done, 1, "job {job} ended once");
    }

    // The dead replica's consumer is removed once it holds nothing and has been idle for ten
    // leases: the group does not grow with every replica that came and went.
    let until = Instant::now() + LEASE * 30;
    let remaining = loop {
        let now = consumers(&mut redis, &stores).await;
        if now.len() == 1 || Instant::now() > until {
            break now;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(
        remaining.len(),
        1,
        "only the living replica's consumer is left (before: {consumers_before:?})"
    );
    assert!(consumers_before.contains(&remaining[0]));
    eprintln!(
        "replica test: {JOBS} jobs, {} SSE clients on the second gateway, took {:?}",
        JOBS * CLIENTS_PER_JOB,
        started.elapsed()
    );
    drop(cluster);
    pg.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_ingest_and_two_gateway_replicas_survive_losing_one_ingest() {
    run(TestStores::create(None).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_on_a_redis_cluster_survive_losing_one_ingest() {
    let redis = PrivateCluster::start().await;
    run(TestStores::create_on(redis.settings()).await).await;
    drop(redis);
}
