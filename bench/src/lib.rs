//! Shared pieces of the ecoscan benchmarks (`src/bin/*`): percentiles, the report table that
//! prints each figure beside its target from DESIGN.md, facts about the machine and the process
//! (CPU model, load, RSS, file-descriptor limit), an SSE parser and the suite in a temporary
//! directory.
//!
//! Every benchmark is one command, sends traffic only to 127.0.0.1, bounds its request loops in
//! count and time, prints its figures and exits.

pub mod report;
pub mod results;
pub mod scan;
pub mod sse;
pub mod stats;
pub mod system;

use std::{path::Path, time::Duration};

use ecoscan::{Running, SuiteConfig};
use ecoscan_common::CancellationToken;

/// Logs of the services and the benchmark on stderr: `RUST_LOG` when set, else warnings only
/// (per-request info lines would cost CPU the benchmark is measuring). Spans are not exported.
pub fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // A second init (never happens in a benchmark binary) would only keep the first subscriber.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Parses a duration as the services do: `250ms`, `8s`, `2m`, or a bare number of milliseconds.
pub fn parse_duration(v: &str) -> anyhow::Result<Duration> {
    ecoscan_common::config::parse_duration(v)
}

/// The whole suite in this process on free loopback ports, data under `dir`; production stores
/// when the usual variables are set (`REDIS_URL`, `postgres://` database URLs, `S3_*`).
pub async fn start_suite(
    dir: &Path,
    tweak: impl FnOnce(&mut SuiteConfig),
) -> anyhow::Result<(Running, CancellationToken)> {
    let mut config = SuiteConfig::ephemeral(dir);
    // The benchmarks measure the pipeline, not authentication: their clients name users in
    // X-User-Id (header mode, explicitly), and all of them come from 127.0.0.1, so the
    // per-address connection cap is the global one.
    config.gateway.auth.trust_header = ecoscan::TrustHeader::Loopback;
    config.gateway.limits.max_connections_per_ip = usize::MAX;
    tweak(&mut config);
    let shutdown = CancellationToken::new();
    let running = ecoscan::start(config, shutdown.clone()).await?;
    wait_ready(&format!("http://{}/readyz", running.addrs.gateway_admin)).await?;
    Ok((running, shutdown))
}

/// Polls `url` until it answers 200 (every backend reachable), for at most 30 s.
pub async fn wait_ready(url: &str) -> anyhow::Result<()> {
    let client = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match client.get(url).send().await {
            Ok(r) if r.status().is_success() => return Ok(()),
            _ if tokio::time::Instant::now() >= deadline => {
                anyhow::bail!("{url} did not answer 200 within 30 s")
            }
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

/// A sample's value from a Prometheus text page: the first line `name{…} value` or
/// `name value` (`None` when the page or the series is missing).
pub async fn scrape(http: &reqwest::Client, url: &str, name: &str) -> Option<f64> {
    let text = http.get(url).send().await.ok()?.text().await.ok()?;
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with(' ') || r.starts_with('{'))
        })
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// A 1×1 PNG: the gateway sniffs the type, and the mock model classifies by the hint.
pub const PNG: &[u8] = &[
    0x89, 0x50, 0x4E, 0x47, 0x0D, 0x0A, 0x1A, 0x0A, 0x00, 0x00, 0x00, 0x0D, 0x49, 0x48, 0x44, 0x52,
    0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x01, 0x08, 0x06, 0x00, 0x00, 0x00, 0x1F, 0x15, 0xC4,
    0x89, 0x00, 0x00, 0x00, 0x0D, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9C, 0x63, 0xF8, 0xCF, 0xC0, 0xF0,
    0x1F, 0x00, 0x05, 0x00, 0x01, 0xFF, 0x89, 0x99, 0x3D, 0x1D, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45,
    0x4E, 0x44, 0xAE, 0x42, 0x60, 0x82,
];

/// A scan request body for `POST /api/v1/scan[/completion]`: the PNG with `salt` appended (so
/// every image is distinct, as photos are) and a hint.
pub fn scan_body(salt: u64, hint: &str) -> String {
    use base64::Engine as _;
    serde_json::json!({
        "image_base64": base64::engine::general_purpose::STANDARD.encode(scan_image(salt)),
        "hint": hint,
    })
    .to_string()
}

/// The test PNG made distinct by `salt` (content-addressed storage keeps each scan's own).
pub fn scan_image(salt: u64) -> Vec<u8> {
    let mut image = PNG.to_vec();
    image.extend_from_slice(&salt.to_be_bytes());
    image
}

/// Runs one scan through the gateway at `gateway` (`POST /api/v1/scan/completion` as `user`),
/// reads its stream to the end and returns the job's id: a finished job whose result the
/// request benchmarks fetch.
pub async fn finished_scan(
    http: &reqwest::Client,
    gateway: std::net::SocketAddr,
    user: &str,
) -> anyhow::Result<String> {
    use anyhow::Context as _;
    use futures::StreamExt as _;
    let res = http
        .post(format!("http://{gateway}/api/v1/scan/completion"))
        .header("content-type", "application/json")
        .header("x-user-id", user)
        .body(scan_body(1, "plastic bottle"))
        .send()
        .await?
        .error_for_status()?;
    let mut parser = sse::Parser::new();
    let mut body = res.bytes_stream();
    let mut job_id = None;
    while let Some(chunk) = body.next().await {
        for ev in parser.push(&chunk?) {
            job_id = job_id.or_else(|| ev.field("job_id").map(str::to_owned));
        }
    }
    job_id.context("the scan stream carried no job id")
}

/// Hints the scans rotate through (items the mock recognises).
pub const HINTS: &[&str] = &[
    "plastic bottle",
    "glass bottle",
    "aluminium can",
    "paper box",
];
