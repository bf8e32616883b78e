//! `gateway-overhead`: what the gateway's REST → gRPC hop adds.
//!
//! Runs the suite in this process, finishes one scan, then fetches its result alternately
//! through the gateway (`GET /api/v1/scan/{id}`, HTTP/1.1 keep-alive) and straight from ingest
//! (`ScanService.GetResult` over HTTP/2), one request at a time, and compares the latency
//! percentiles. Alternating keeps both paths under the same background noise.
//!
//! ```sh
//! cargo run --release -p ecoscan-bench --bin gateway-overhead
//! ```

use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use ecoscan_bench::{
    report::{Figure, Report, Verdict},
    stats::{Samples, fmt_duration, fmt_opt},
    system,
};
use ecoscan_proto::v1::{GetResultRequest, scan_service_client::ScanServiceClient};

const USER: &str = "bench-overhead";

#[derive(Parser, Debug)]
#[command(about = "Latency the gateway adds to a gRPC call (GET /api/v1/scan/{id} vs GetResult)")]
struct Args {
    /// Requests per path (after the warm-up).
    #[arg(long, default_value_t = 10_000)]
    requests: usize,
    /// Requests per path before measuring.
    #[arg(long, default_value_t = 1000)]
    warmup: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    ecoscan_bench::init_logs();
    let mut report = Report::new("gateway-overhead");
    let dir = tempfile::tempdir().context("failed to create a temporary data directory")?;
    let (running, shutdown) = ecoscan_bench::start_suite(dir.path(), |c| {
        c.llm.mock_latency = Duration::from_millis(20);
    })
    .await?;
    let gateway = running.addrs.gateway;
    let http = reqwest::Client::builder().tcp_nodelay(true).build()?;

    // One finished scan whose result both paths fetch.
    let job_id = ecoscan_bench::finished_scan(&http, gateway, USER).await?;

    let rest_url = format!("http://{gateway}/api/v1/scan/{job_id}");
    let mut grpc = ScanServiceClient::new(ecoscan_common::client::channel(&format!(
        "http://{}",
        running.addrs.ingest
    ))?);
    let rest_once = || async {
        let res = http.get(&rest_url).header("x-user-id", USER).send().await?;
        anyhow::ensure!(
            res.status() == 200,
            "GET {rest_url} answered {}",
            res.status()
        );
        res.bytes().await?;
        anyhow::Ok(())
    };
    let request = || {
        ecoscan_common::client::request_as(
            GetResultRequest {
                job_id: job_id.clone(),
            },
            Duration::from_secs(5),
            USER,
        )
    };

    for _ in 0..args.warmup {
        rest_once().await?;
        grpc.get_result(request()).await?;
    }
    let mut rest = Samples::new();
    let mut direct = Samples::new();
    let cpu_before = system::cpu_time();
    let started = Instant::now();
    for _ in 0..args.requests {
        let t = Instant::now();
        rest_once().await?;
        rest.push(t.elapsed());
        let t = Instant::now();
        grpc.get_result(request()).await?;
        direct.push(t.elapsed());
    }
    let elapsed = started.elapsed();
    let cpu = system::cpu_time()
        .zip(cpu_before)
        .map(|(a, b)| a.saturating_sub(b));
    shutdown.cancel();
    drop(running);

    // Signed: under noise the direct path's tail can be the longer one.
    let diff = |p: f64, rest: &mut Samples, direct: &mut Samples| {
        rest.percentile(p)
            .zip(direct.percentile(p))
            .map(|(r, d)| (r.as_secs_f64() - d.as_secs_f64()) * 1000.0)
    };
    let signed = |ms: Option<f64>| ms.map_or_else(|| "–".to_owned(), |ms| format!("{ms:+.3} ms"));
    let added_p50 = diff(50.0, &mut rest, &mut direct);
    let added_p99 = diff(99.0, &mut rest, &mut direct);
    report
        .figure(Figure::new("added by the gateway p50", added_p50, "ms"))
        .figure(Figure::new("added by the gateway p99", added_p99, "ms").at_most(1.0))
        .header(
            "settings",
            format!(
                "{} requests per path after {} warm-up, one at a time, alternating; the result of one finished scan (embedded stores unless the production variables are set)",
                args.requests, args.warmup
            ),
        )
        .header("stores", system::stores())
        .header(
            "process",
            format!(
                "suite and client in one process; CPU {} over {:.1} s",
                cpu.map_or_else(|| "?".to_owned(), fmt_duration),
                elapsed.as_secs_f64()
            ),
        )
        .info(
            "GET /api/v1/scan/{id} via the gateway, p50 / p99",
            format!(
                "{} / {}",
                fmt_opt(rest.percentile(50.0)),
                fmt_opt(rest.percentile(99.0))
            ),
        )
        .info(
            "ScanService.GetResult straight to ingest, p50 / p99",
            format!(
                "{} / {}",
                fmt_opt(direct.percentile(50.0)),
                fmt_opt(direct.percentile(99.0))
            ),
        )
        .row(
            "added by the gateway, p50 / p99 (difference of the percentiles)",
            format!("{} / {}", signed(added_p50), signed(added_p99)),
            "p99 ≤ 1 ms added",
            Verdict::of(added_p99.is_some_and(|ms| ms <= 1.0)),
        );
    report.print();
    Ok(())
}
