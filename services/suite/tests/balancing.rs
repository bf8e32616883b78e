//! Balanced gRPC calls at the process level: two `ecoscan serve vision` processes listen on the
//! same port of 127.0.0.2 and 127.0.0.3, behind one name that resolves to both (the test's
//! resolver stands in for a headless Service's DNS). Each replica gets a fair share of the
//! calls, and calls keep succeeding while one replica is SIGKILLed and started again.
//!
//! A call already on its way to the replica when it dies fails (`UNAVAILABLE`, or `UNKNOWN`
//! with a transport error when the connection broke mid-call); the caller retries it, as every
//! caller of a gRPC service must, and the balanced channel sends the retry to the replica that
//! is up (it stops using the dead one as soon as its health watch breaks).

mod common;
mod support;

use std::{
    io,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use ecoscan_common::{
    balance::{Balancing, Resolve},
    client::{TracedChannel, channel_with, request},
};
use ecoscan_proto::v1::{ClassifyRequest, vision_service_client::VisionServiceClient};
use futures::{StreamExt, future::BoxFuture, stream};
use support::processes::{Cluster, Service};

const CALLS: usize = 200;
/// Attempts per call while a replica is being killed and restarted.
const ATTEMPTS: usize = 5;

/// Resolves every name to the two replicas' addresses.
struct TwoReplicas;

impl Resolve for TwoReplicas {
    fn resolve(&self, _host: &str, port: u16) -> BoxFuture<'static, io::Result<Vec<SocketAddr>>> {
        let ips: [IpAddr; 2] = [[127, 0, 0, 2].into(), [127, 0, 0, 3].into()];
        Box::pin(async move { Ok(ips.map(|ip| SocketAddr::new(ip, port)).to_vec()) })
    }
}

/// One `Classify` call, read to the end of its stream.
async fn classify(channel: &TracedChannel, i: usize) -> Result<(), tonic::Status> {
    let req = ClassifyRequest {
        job_id: format!("balance-{i}"),
        image: common::PNG.to_vec(),
        content_type: "image/png".into(),
        hint: "can".into(),
        ..ClassifyRequest::default()
    };
    let mut stream = VisionServiceClient::new(channel.clone())
        .classify(request(req, Duration::from_secs(20)))
        .await?
        .into_inner();
    while stream.message().await?.is_some() {}
    Ok(())
}

/// Whether the call failed because the replica it went to died: `UNAVAILABLE` (it could not be
/// reached) or, for a call already under way, tonic's `UNKNOWN` for a broken connection (a
/// status made by the client from a transport error: it has a source, which a status sent by
/// the server has not).
fn replica_died(status: &tonic::Status) -> bool {
    use std::error::Error as _;
    status.code() == tonic::Code::Unavailable
        || (status.code() == tonic::Code::Unknown && status.source().is_some())
}

/// [`classify`], retried when the replica it went to died.
async fn classify_retrying(channel: &TracedChannel, i: usize, retries: &AtomicUsize) {
    for attempt in 1..=ATTEMPTS {
        match classify(channel, i).await {
            Ok(()) => return,
            Err(status) if replica_died(&status) && attempt < ATTEMPTS => {
                retries.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(status) => panic!("call {i} failed after {attempt} attempts: {status:?}"),
        }
    }
}

/// `Classify` calls the replica at `addr` has answered with OK, from its `/metrics`.
async fn answered(http: &reqwest::Client, addr: SocketAddr) -> u64 {
    let text = http
        .get(format!("http://{addr}/metrics"))
        .send()
        .await
        .expect("scrape")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .filter(|l| {
            l.starts_with("rpc_server_requests_total{")
                && l.contains("VisionService/Classify")
                && l.contains("code=\"OK\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_vision_replicas_share_calls_and_calls_survive_a_restart() {
    let mut cluster = Cluster::builder()
        .only(&[Service::Rule, Service::Analytics])
        .start()
        .await;
    let a = cluster
        .start_replica_on(Service::Vision, "vision-a", "127.0.0.2:0", &[])
        .await;
    let b_listen = format!("127.0.0.3:{}", a.port());
    let b = cluster
        .start_replica_on(Service::Vision, "vision-b", &b_listen, &[])
        .await;
    let balancing = Balancing::with_resolver(TwoReplicas);
    let channel = channel_with(
        &format!("http://vision.test:{}", a.port()),
        None,
        &balancing,
    )
    .expect("balanced channel");
    let http = reqwest::Client::new();

    // A fair share each.
    stream::iter(0..CALLS)
        .for_each_concurrent(8, |i| {
            let channel = channel.clone();
            async move { classify(&channel, i).await.expect("call succeeds") }
        })
        .await;
    let (on_a, on_b) = (answered(&http, a).await, answered(&http, b).await);
    assert_eq!(on_a + on_b, CALLS as u64, "{on_a} + {on_b}");
    for n in [on_a, on_b] {
        let share = n as f64 / CALLS as f64;
        assert!(
            (0.35..=0.65).contains(&share),
            "uneven split: {on_a} on 127.0.0.2, {on_b} on 127.0.0.3"
        );
    }

    // Steady calls while B is SIGKILLed and started again on its address.
    let retries = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let load = tokio::spawn({
        let (channel, retries, stop) = (channel.clone(), retries.clone(), stop.clone());
        async move {
            let mut done = 0;
            while !stop.load(Ordering::Relaxed) {
                stream::iter(0..8)
                    .for_each_concurrent(8, |i| {
                        let (channel, retries) = (channel.clone(), retries.clone());
                        async move { classify_retrying(&channel, done + i, &retries).await }
                    })
                    .await;
                done += 8;
            }
            done
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    cluster.kill_replica("vision-b");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let b = cluster
        .start_replica_on(Service::Vision, "vision-b", &b_listen, &[])
        .await;
    // The restarted replica gets calls again.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while answered(&http, b).await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the restarted replica got no calls"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let done = load.await.expect("load task");
    eprintln!(
        "balancing test: {CALLS} calls split {on_a}/{on_b}; then {done} calls across the restart \
         with {} retries",
        retries.load(Ordering::Relaxed)
    );
}
