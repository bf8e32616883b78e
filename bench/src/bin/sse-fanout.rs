//! `sse-fanout`: many SSE clients watching running jobs through one gateway.
//!
//! This process runs the suite (gateway, ingest and the rest; production stores when the usual
//! variables are set) and submits `--jobs` scans with a slow mock model, so they stay running.
//! It then starts a second process of this same binary (`--role clients`) that opens
//! `--clients` SSE streams (`GET /api/v1/scan/{id}/events`) spread over those jobs and reads
//! them to `ready`. Clients live in their own process so that this process's resident memory
//! is the server side only (gateway, ingest's hub and every other service), and so that each
//! side has its own file-descriptor table.
//!
//! Figures: the server's RSS growth per connected client, Redis connections of ingest (`CLIENT
//! LIST`, with `REDIS_URL`), and event delivery latency: the event's `ts` (set by ingest when
//! it appended the event) to its receipt by a client, for events appended after that client
//! connected.
//!
//! ```sh
//! cargo run --release -p ecoscan-bench --bin sse-fanout -- --clients 20000
//! ```

use std::{
    collections::BTreeMap,
    path::PathBuf,
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant, SystemTime},
};

use anyhow::{Context as _, bail};
use clap::Parser;
use ecoscan_bench::{
    HINTS,
    report::{Figure, Report, Verdict},
    scan_body, scrape, sse,
    stats::{Samples, fmt_duration, fmt_opt, thousands},
    system,
};
use futures::StreamExt as _;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt as _, BufReader};

/// The user every job and every watcher acts as (a person may watch only their own jobs).
const USER: &str = "bench-fanout";

#[derive(Parser, Debug)]
#[command(
    about = "SSE clients through one gateway: memory per client, Redis connections, event latency"
)]
struct Args {
    /// SSE clients, spread evenly over the jobs.
    #[arg(long, default_value_t = 20_000)]
    clients: usize,
    /// Running jobs the clients watch.
    #[arg(long, default_value_t = 200)]
    jobs: usize,
    /// Mean latency of each mock model call: long enough for every client to connect while the
    /// jobs wait on their vision call.
    #[arg(long, default_value = "30s", value_parser = ecoscan_bench::parse_duration)]
    model_latency: Duration,
    /// Spread of the mock latency (± fraction), so the jobs' events do not all come at once.
    #[arg(long, default_value_t = 0.25)]
    model_jitter: f64,
    /// Connections being opened at once while clients connect.
    #[arg(long, default_value_t = 256)]
    connect_concurrency: usize,
    /// Clients still open this long after they started are closed (bounds the run).
    #[arg(long, default_value = "180s", value_parser = ecoscan_bench::parse_duration)]
    deadline: Duration,
    /// Internal: `clients` runs the client side (started by the benchmark itself).
    #[arg(long, hide = true)]
    role: Option<String>,
    /// Internal: the gateway's address, for the client side.
    #[arg(long, hide = true)]
    gateway: Option<String>,
    /// Internal: a file of job ids, one a line, for the client side.
    #[arg(long, hide = true)]
    job_ids: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    ecoscan_bench::init_logs();
    anyhow::ensure!(
        args.clients > 0 && args.jobs > 0,
        "--clients and --jobs must be positive"
    );
    match args.role.as_deref() {
        None => server(args).await,
        Some("clients") => clients(args).await,
        Some(other) => bail!("unknown role {other:?}"),
    }
}

/// What the client process prints on its last line (`result <json>`), and the server side reads
/// back: one type, so the two ends cannot disagree on the line's fields. A field the line lacks
/// is left at its default.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct ClientResult {
    connected: usize,
    connect_errors: BTreeMap<String, usize>,
    connect_secs: f64,
    ready: usize,
    stream_errors: BTreeMap<String, usize>,
    events: usize,
    /// Its fields on the line itself (`live_count`, `p50_us`, …).
    #[serde(flatten)]
    live: Latency,
    live_span_secs: f64,
    client_rss_kib: u64,
    /// CPU the client process used from all connected to the end.
    #[serde(rename = "cpu_ms", with = "opt_millis")]
    cpu: Option<Duration>,
}

/// Delivery latency of live events, summarised by the client process (shipping millions of
/// samples over a pipe would buy nothing).
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(default)]
struct Latency {
    #[serde(rename = "live_count")]
    count: usize,
    #[serde(rename = "p50_us", with = "opt_micros")]
    p50: Option<Duration>,
    #[serde(rename = "p90_us", with = "opt_micros")]
    p90: Option<Duration>,
    #[serde(rename = "p99_us", with = "opt_micros")]
    p99: Option<Duration>,
    #[serde(rename = "p999_us", with = "opt_micros")]
    p999: Option<Duration>,
    #[serde(rename = "max_us", with = "opt_micros")]
    max: Option<Duration>,
}

impl Latency {
    fn of(s: &mut Samples) -> Self {
        Self {
            count: s.len(),
            p50: s.percentile(50.0),
            p90: s.percentile(90.0),
            p99: s.percentile(99.0),
            p999: s.percentile(99.9),
            max: s.max(),
        }
    }
}

/// An optional duration on the result line as whole microseconds (latencies need no finer).
mod opt_micros {
    use std::time::Duration;

    use serde::{Deserialize as _, Deserializer, Serialize as _, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        d.map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
            .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_micros))
    }
}

/// An optional duration on the result line as whole milliseconds (CPU time needs no finer).
mod opt_millis {
    use std::time::Duration;

    use serde::{Deserialize as _, Deserializer, Serialize as _, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        d.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_millis))
    }
}

/// Descriptors the suite process needs besides the gateway's client sockets (connections
/// between the services, databases, files).
const SERVER_FD_RESERVE: u64 = 512;

/// The server side, in the order it runs: start the suite, submit the jobs, start the client
/// process and follow it, then report. Each step is a function of its own below.
async fn server(mut args: Args) -> anyhow::Result<()> {
    // First: the report's clock and the machine's load are taken when it is made.
    let mut report = Report::new("sse-fanout");
    let fd_limit = system::raise_fd_limit(args.clients as u64 + 8192);
    let requested = args.clients;
    let redis = redis_before_the_suite().await?;
    fit_clients_to_fd_limit(&mut args, fd_limit);
    let dir = tempfile::tempdir().context("failed to create a temporary data directory")?;
    let (running, shutdown) = start_suite(dir.path(), &args).await?;
    let gateway = running.addrs.gateway;
    let http = reqwest::Client::builder().tcp_nodelay(true).build()?;

    // Submit the jobs; they wait on their vision call for about the model latency.
    let submitted_at = Instant::now();
    let ids = submit_jobs(&http, gateway, args.jobs).await?;
    let ids_file = dir.path().join("job-ids");
    std::fs::write(&ids_file, ids.join("\n"))?;

    let redis = match redis {
        Some(before) => Some(before.ours().await?),
        None => None,
    };
    let rss_base = system::rss_kib().context("no VmRSS in /proc/self/status")?;
    let redis_base = ingest_connections(redis.as_ref()).await?;

    let child = spawn_clients(&args, gateway, &ids_file)?;
    let run = follow_clients(
        child,
        &args,
        &http,
        &running.addrs,
        redis.as_ref(),
        rss_base,
    )
    .await?;
    let elapsed = submitted_at.elapsed();
    let server_cpu = system::cpu_time()
        .zip(run.cpu_at_connected)
        .map(|(a, b)| a.saturating_sub(b));
    let redis_after = ingest_connections(redis.as_ref()).await?;
    shutdown.cancel();
    drop(running);

    let r = run
        .result
        .with_context(|| format!("the client process gave no result ({})", run.status))?;
    let connected = run
        .at_connected
        .context("the client process never reported its connections")?;
    fill_report(
        &mut report,
        &args,
        Measured {
            fd_limit,
            requested,
            r,
            connected,
            rss_base,
            rss_max: run.rss_max,
            redis_base,
            redis_after,
            server_cpu,
            elapsed,
        },
    );
    report.print();
    Ok(())
}

/// Each client is a socket in the gateway: past the limit, accept fails and the run measures
/// nothing but errors. Run what fits and say so.
fn fit_clients_to_fd_limit(args: &mut Args, fd_limit: u64) {
    let fits = usize::try_from(fd_limit.saturating_sub(SERVER_FD_RESERVE)).unwrap_or(usize::MAX);
    if args.clients > fits {
        eprintln!(
            "sse-fanout: the open-file limit is {fd_limit} and cannot be raised here; running {fits} clients instead of {}",
            args.clients
        );
        args.clients = fits;
    }
}

/// The suite with the slow mock model, and limits sized to the run.
async fn start_suite(
    dir: &std::path::Path,
    args: &Args,
) -> anyhow::Result<(ecoscan::Running, ecoscan_common::CancellationToken)> {
    ecoscan_bench::start_suite(dir, |c| {
        c.llm.mock_latency = args.model_latency;
        c.llm.mock_jitter = args.model_jitter;
        // Every stream belongs to one user here (only a job's owner may watch it), so the
        // per-user limits meant for the public edge are lifted to the whole run's size.
        c.gateway.limits.scans_per_minute = u32::try_from(args.jobs).unwrap_or(u32::MAX).max(60);
        c.gateway.limits.max_sse_per_user = args.clients.max(64);
        c.gateway.limits.max_sse = c.gateway.limits.max_sse.max(args.clients);
        c.gateway.limits.max_connections =
            c.gateway.limits.max_connections.max(args.clients + 1024);
    })
    .await
}

/// The answer to a scan's submission.
#[derive(Deserialize)]
struct Submitted {
    job_id: Option<String>,
}

/// Submits `jobs` scans, 32 at a time; their ids.
async fn submit_jobs(
    http: &reqwest::Client,
    gateway: std::net::SocketAddr,
    jobs: usize,
) -> anyhow::Result<Vec<String>> {
    let mut ids = Vec::with_capacity(jobs);
    let mut submits = futures::stream::iter(0..jobs)
        .map(|i| {
            let http = http.clone();
            async move {
                let res = http
                    .post(format!("http://{gateway}/api/v1/scan"))
                    .header("content-type", "application/json")
                    .header("x-user-id", USER)
                    .body(scan_body(i as u64, HINTS[i % HINTS.len()]))
                    .send()
                    .await?
                    .error_for_status()?;
                let submitted: Submitted = res.json().await?;
                submitted.job_id.context("202 without a job_id")
            }
        })
        .buffer_unordered(32);
    while let Some(id) = submits.next().await {
        ids.push(id.context("failed to submit a job")?);
    }
    Ok(ids)
}

/// Starts the client process: this binary with `--role clients`.
fn spawn_clients(
    args: &Args,
    gateway: std::net::SocketAddr,
    ids_file: &std::path::Path,
) -> anyhow::Result<tokio::process::Child> {
    let exe = std::env::current_exe().context("cannot find this benchmark's executable")?;
    tokio::process::Command::new(exe)
        .args([
            "--role",
            "clients",
            "--gateway",
            &gateway.to_string(),
            "--job-ids",
            &ids_file.display().to_string(),
            "--clients",
            &args.clients.to_string(),
            "--jobs",
            &args.jobs.to_string(),
            "--connect-concurrency",
            &args.connect_concurrency.to_string(),
            "--deadline",
            &format!("{}ms", args.deadline.as_millis()),
        ])
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("failed to start the client process")
}

/// The server side at the moment the client process reported every client connected.
struct AtConnected {
    /// The client process's `connected` line.
    line: String,
    rss: u64,
    redis: Option<usize>,
    sse_open: Option<f64>,
    watchers: Option<f64>,
}

/// What the server side saw while the client process ran.
struct ClientRun {
    status: std::process::ExitStatus,
    at_connected: Option<AtConnected>,
    cpu_at_connected: Option<Duration>,
    rss_max: u64,
    result: Option<ClientResult>,
}

/// Reads the client process's lines until it ends (a backstop past its deadline stops it),
/// sampling the server's RSS meanwhile, and the server's state when every client connected.
async fn follow_clients(
    mut child: tokio::process::Child,
    args: &Args,
    http: &reqwest::Client,
    addrs: &ecoscan::Addrs,
    redis: Option<&IngestRedis>,
    rss_base: u64,
) -> anyhow::Result<ClientRun> {
    let stdout = child.stdout.take().context("client stdout")?;
    let mut lines = BufReader::new(stdout).lines();

    let mut at_connected = None;
    let mut cpu_at_connected = None;
    let mut rss_max = rss_base;
    let mut result = None;
    let mut sample = tokio::time::interval(Duration::from_millis(500));
    // The client process ends by itself (its deadline); this is a backstop.
    let backstop = tokio::time::sleep(args.deadline + Duration::from_secs(60));
    tokio::pin!(backstop);
    loop {
        tokio::select! {
            line = lines.next_line() => {
                let Some(line) = line? else { break };
                if let Some(rest) = line.strip_prefix("connected ") {
                    let rss = system::rss_kib().unwrap_or(0);
                    let redis_now = ingest_connections(redis).await?;
                    let sse_open = scrape(http, &format!("http://{}/metrics", addrs.gateway_admin), "gateway_sse_connections").await;
                    let watchers = scrape(http, &format!("http://{}/metrics", addrs.ingest), "ingest_hub_watchers").await;
                    eprintln!("sse-fanout: clients connected ({rest}); server RSS {} MiB", rss / 1024);
                    cpu_at_connected = system::cpu_time();
                    at_connected = Some(AtConnected {
                        line: rest.to_owned(),
                        rss,
                        redis: redis_now,
                        sse_open,
                        watchers,
                    });
                } else if let Some(json) = line.strip_prefix("result ") {
                    result = Some(serde_json::from_str(json).context("bad result line")?);
                } else {
                    eprintln!("client: {line}");
                }
            }
            _ = sample.tick() => {
                rss_max = rss_max.max(system::rss_kib().unwrap_or(0));
            }
            () = &mut backstop => {
                eprintln!("sse-fanout: the client process overran its deadline; stopping it");
                child.start_kill()?;
                break;
            }
        }
    }
    let status = child.wait().await?;
    Ok(ClientRun {
        status,
        at_connected,
        cpu_at_connected,
        rss_max,
        result,
    })
}

/// Everything the report says, measured.
struct Measured {
    fd_limit: u64,
    /// The clients asked for (`--clients`), before the open-file limit capped them.
    requested: usize,
    r: ClientResult,
    connected: AtConnected,
    rss_base: u64,
    rss_max: u64,
    redis_base: Option<usize>,
    redis_after: Option<usize>,
    server_cpu: Option<Duration>,
    elapsed: Duration,
}

impl Measured {
    /// The server's RSS growth over `rss` per connected client.
    fn kib_per_client(&self, rss: u64) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let kib = rss.saturating_sub(self.rss_base) as f64 / self.r.connected.max(1) as f64;
        kib
    }
}

/// The report: settings, connections, the figures against their targets, Redis, memory,
/// latency and the rest.
fn fill_report(report: &mut Report, args: &Args, m: Measured) {
    report_connections(report, args, &m);
    report_figures(report, &m);
    report_redis(report, &m);
    report_the_rest(report, m);
}

fn report_connections(report: &mut Report, args: &Args, m: &Measured) {
    let (r, fd_limit, requested) = (&m.r, m.fd_limit, m.requested);
    report
        .header(
            "settings",
            format!(
                "{} clients over {} jobs ({} per job), mock model latency {:?} ± {:.0} %, {} connects at a time, fd limit {fd_limit}",
                args.clients,
                args.jobs,
                args.clients.div_ceil(args.jobs),
                args.model_latency,
                args.model_jitter * 100.0,
                args.connect_concurrency
            ),
        )
        .header("stores", system::stores())
        .header(
            "processes",
            "the suite in one process, the SSE clients in a second one (this binary with --role clients)",
        )
        .row(
            "SSE clients connected at once",
            format!(
                "{} of {}{} (gateway_sse_connections {}, ingest_hub_watchers {}); connected in {:.1} s",
                r.connected,
                args.clients,
                if requested > args.clients {
                    format!(" (asked for {requested}; capped by the open-file limit {fd_limit})")
                } else {
                    String::new()
                },
                m.connected.sse_open.map_or_else(|| "?".to_owned(), thousands),
                m.connected.watchers.map_or_else(|| "?".to_owned(), thousands),
                r.connect_secs
            ),
            "19,488 (the design's figure: what 20,000 open files leave)",
            Verdict::of(r.connected >= 19_488 && r.connected == args.clients),
        );
}

/// The figures of the results file.
fn report_figures(report: &mut Report, m: &Measured) {
    #[allow(clippy::cast_precision_loss)]
    report
        .figure(
            Figure::new(
                "SSE clients connected at once",
                Some(m.r.connected as f64),
                "",
            )
            .at_least(19_488.0),
        )
        .figure(
            Figure::new(
                "server RSS growth per client",
                Some(m.kib_per_client(m.connected.rss)),
                "KiB",
            )
            .at_most(16.0),
        )
        .figure(
            Figure::new(
                "event delivery p99",
                m.r.live.p99.map(|d| d.as_secs_f64() * 1000.0),
                "ms",
            )
            .at_most(50.0),
        );
}

/// Ingest's Redis connections, when `REDIS_URL` let them be counted.
fn report_redis(report: &mut Report, m: &Measured) {
    match (m.redis_base, m.connected.redis, m.redis_after) {
        (Some(base), Some(connected), Some(after)) => {
            #[allow(clippy::cast_precision_loss)]
            report.figure(
                Figure::new(
                    "Redis connections of ingest, most at once",
                    Some(base.max(connected).max(after) as f64),
                    "",
                )
                .at_most(4.0),
            );
            report.row(
                "Redis connections of ingest (CLIENT LIST, named ecoscan-ingest:*)",
                format!(
                    "{base} before the clients, {connected} with all connected, {after} at the end"
                ),
                "≤ 4 per process",
                Verdict::of(base.max(connected).max(after) <= 4),
            );
        }
        _ => {
            report.info(
                "Redis connections",
                "not measured: REDIS_URL is unset, the event log is in memory (0 connections)",
            );
        }
    }
}

/// Memory, latency, CPU and the streams' outcomes.
fn report_the_rest(report: &mut Report, m: Measured) {
    let kib_connected = m.kib_per_client(m.connected.rss);
    let kib_peak = m.kib_per_client(m.rss_max);
    let (r, rss_base, server_cpu) = (&m.r, m.rss_base, m.server_cpu);
    let p99 = r.live.p99;
    report
        .row(
            "server RSS growth per client (gateway + ingest + everything in the suite process)",
            format!(
                "{kib_connected:.1} KiB with all connected ({} → {} MiB); {kib_peak:.1} KiB at the peak while events flowed",
                rss_base / 1024,
                m.connected.rss / 1024
            ),
            "≤ 16 KiB",
            Verdict::of(kib_connected <= 16.0 && kib_peak <= 16.0),
        )
        .info(
            "client process RSS per client (reqwest/hyper HTTP/1.1 client, for reference)",
            format!("{:.1} KiB", r.client_rss_kib as f64 / r.connected.max(1) as f64),
        )
        .row(
            "event delivery latency (event ts → client receipt) p50 / p99",
            format!(
                "{} / {}",
                fmt_opt(r.live.p50),
                fmt_opt(p99)
            ),
            "p99 ≤ 50 ms",
            Verdict::of(p99.is_some_and(|p| p <= Duration::from_millis(50))),
        )
        .info(
            "event delivery latency p90 / p99.9 / max",
            format!(
                "{} / {} / {}",
                fmt_opt(r.live.p90),
                fmt_opt(r.live.p999),
                fmt_opt(r.live.max)
            ),
        )
        .info(
            "live events delivered",
            format!(
                "{} ({} per s over the {:.1} s they flowed; {} events read in all, replays included)",
                thousands(r.live.count as f64),
                thousands(r.live.count as f64 / r.live_span_secs.max(1e-9)),
                r.live_span_secs,
                thousands(r.events as f64)
            ),
        )
        .info(
            "CPU from all connected to the end: suite process / client process",
            format!(
                "{} / {} ({} of suite CPU per delivered event)",
                fmt_opt(server_cpu),
                fmt_opt(r.cpu),
                fmt_opt(server_cpu.map(|c| c / u32::try_from(r.live.count.max(1)).unwrap_or(u32::MAX)))
            ),
        )
        .info(
            "streams that reached ready",
            format!(
                "{} of {}; errors: {}",
                r.ready,
                r.connected,
                kinds(&r.stream_errors)
            ),
        )
        .info("connect errors", kinds(&r.connect_errors))
        .info("client connect report", m.connected.line)
        .info("run time", fmt_duration(m.elapsed))
        .note(
            "RSS per client = (the suite process's VmRSS with every client connected − VmRSS before the first client) / clients: user-space memory of the gateway's SSE stream and Watch call, ingest's hub subscription and gRPC stream, and allocator slack; kernel socket buffers are not in RSS. The peak figure is taken while events were flowing (buffers in use).",
        );
}

fn kinds(m: &BTreeMap<String, usize>) -> String {
    if m.is_empty() {
        return "none".to_owned();
    }
    m.iter()
        .map(|(k, n)| format!("{k}: {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `CLIENT LIST`'s ingest names before the suite started (with `REDIS_URL`): other ingest
/// processes may share this Redis, and ours is the one whose connection name appears when the
/// suite starts.
struct RedisBefore {
    conn: redis::aio::MultiplexedConnection,
    names: BTreeMap<String, usize>,
}

async fn redis_before_the_suite() -> anyhow::Result<Option<RedisBefore>> {
    match std::env::var("REDIS_URL").ok().filter(|u| !u.is_empty()) {
        Some(url) => {
            let conn = redis_conn(&url).await?;
            let names = ingest_connection_names(conn.clone()).await?;
            Ok(Some(RedisBefore { conn, names }))
        }
        None => Ok(None),
    }
}

impl RedisBefore {
    /// Our ingest's connection names: those new since the suite started.
    async fn ours(self) -> anyhow::Result<IngestRedis> {
        let mut ours = ingest_connection_names(self.conn.clone()).await?;
        for name in self.names.keys() {
            ours.remove(name);
        }
        anyhow::ensure!(
            !ours.is_empty(),
            "no new ecoscan-ingest connection in CLIENT LIST after the suite started"
        );
        Ok(IngestRedis {
            conn: self.conn,
            names: ours.into_keys().collect(),
        })
    }
}

/// This process's ingest in Redis: its connection names.
struct IngestRedis {
    conn: redis::aio::MultiplexedConnection,
    names: Vec<String>,
}

/// Connections of this process's ingest now; `None` without `REDIS_URL`.
async fn ingest_connections(redis: Option<&IngestRedis>) -> anyhow::Result<Option<usize>> {
    match redis {
        Some(r) => Ok(Some(
            ingest_redis_connections(r.conn.clone(), &r.names).await?,
        )),
        None => Ok(None),
    }
}

async fn redis_conn(url: &str) -> anyhow::Result<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(url).with_context(|| format!("invalid REDIS_URL {url:?}"))?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .with_context(|| format!("failed to connect to redis at {url}"))?;
    let _: () = redis::cmd("CLIENT")
        .arg("SETNAME")
        .arg("ecoscan-bench")
        .query_async(&mut conn)
        .await?;
    Ok(conn)
}

/// `CLIENT LIST` names starting with `ecoscan-ingest` (one name per ingest process) and how
/// many connections carry each.
async fn ingest_connection_names(
    mut conn: redis::aio::MultiplexedConnection,
) -> anyhow::Result<BTreeMap<String, usize>> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut conn)
        .await
        .context("CLIENT LIST failed")?;
    let mut names = BTreeMap::new();
    for line in list.lines() {
        if let Some(name) = line
            .split(' ')
            .find_map(|f| f.strip_prefix("name="))
            .filter(|n| n.starts_with("ecoscan-ingest"))
        {
            *names.entry(name.to_owned()).or_default() += 1;
        }
    }
    Ok(names)
}

/// Connections of this process's ingest (`names`: its connection names).
async fn ingest_redis_connections(
    conn: redis::aio::MultiplexedConnection,
    names: &[String],
) -> anyhow::Result<usize> {
    let all = ingest_connection_names(conn).await?;
    Ok(names.iter().filter_map(|n| all.get(n)).sum())
}

// ---------------------------------------------------------------------------------------------
// The client process.

async fn clients(args: Args) -> anyhow::Result<()> {
    let fd_limit = system::raise_fd_limit(args.clients as u64 + 1024);
    let gateway = args
        .gateway
        .context("--gateway is required with --role clients")?;
    let ids_file = args
        .job_ids
        .context("--job-ids is required with --role clients")?;
    let ids: Vec<String> = std::fs::read_to_string(&ids_file)?
        .lines()
        .map(str::to_owned)
        .collect();
    anyhow::ensure!(!ids.is_empty(), "no job ids in {}", ids_file.display());
    if (fd_limit as usize) < args.clients + 64 {
        eprintln!(
            "fd limit {fd_limit} is below the client count; expect connect errors (ulimit -n)"
        );
    }
    let http = reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(0)
        .build()?;
    let permits = Arc::new(tokio::sync::Semaphore::new(args.connect_concurrency.max(1)));
    let (connected_tx, mut connected_rx) = tokio::sync::mpsc::unbounded_channel();
    let open = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let deadline = started + args.deadline;

    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..args.clients {
        let url = format!("http://{gateway}/api/v1/scan/{}/events", ids[i % ids.len()]);
        let (http, permits, connected_tx, open) = (
            http.clone(),
            permits.clone(),
            connected_tx.clone(),
            open.clone(),
        );
        tasks.spawn(
            async move { watch(&http, &url, &permits, &connected_tx, &open, deadline).await },
        );
    }
    drop(connected_tx);

    let mut result = ClientResult::default();
    let mut live = Samples::new();
    let mut reported = 0usize;
    while reported < args.clients {
        let Some(outcome) = connected_rx.recv().await else {
            break;
        };
        reported += 1;
        match outcome {
            Ok(()) => result.connected += 1,
            Err(kind) => *result.connect_errors.entry(kind).or_default() += 1,
        }
    }
    result.connect_secs = started.elapsed().as_secs_f64();
    result.client_rss_kib = system::rss_kib().unwrap_or(0);
    let cpu_at_connected = system::cpu_time();
    println!(
        "connected {} ok, {} failed, {:.1} s, {} open now",
        result.connected,
        args.clients - result.connected,
        result.connect_secs,
        open.load(Ordering::Relaxed)
    );

    let mut first_live: Option<SystemTime> = None;
    let mut last_live: Option<SystemTime> = None;
    while let Some(joined) = tasks.join_next().await {
        let Ok(w) = joined else { continue };
        result.events += w.events;
        if w.ready {
            result.ready += 1;
        }
        if let Some(e) = w.error {
            *result.stream_errors.entry(e).or_default() += 1;
        }
        live.extend(w.live.iter().map(|(_, d)| *d));
        for (at, _) in &w.live {
            first_live = Some(first_live.map_or(*at, |f| f.min(*at)));
            last_live = Some(last_live.map_or(*at, |l| l.max(*at)));
        }
    }
    result.live_span_secs = first_live
        .zip(last_live)
        .map_or(0.0, |(a, b)| sse::since(a, b).as_secs_f64());
    result.live = Latency::of(&mut live);
    result.cpu = system::cpu_time()
        .zip(cpu_at_connected)
        .map(|(a, b)| a.saturating_sub(b));
    println!("result {}", serde_json::to_string(&result)?);
    Ok(())
}

/// What one watcher saw.
struct Watched {
    events: usize,
    /// (receipt time, delivery latency) of each event appended after the stream opened.
    live: Vec<(SystemTime, Duration)>,
    ready: bool,
    error: Option<String>,
}

async fn watch(
    http: &reqwest::Client,
    url: &str,
    permits: &tokio::sync::Semaphore,
    connected: &tokio::sync::mpsc::UnboundedSender<Result<(), String>>,
    open: &AtomicUsize,
    deadline: Instant,
) -> Watched {
    let mut w = Watched {
        events: 0,
        live: Vec::new(),
        ready: false,
        error: None,
    };
    let permit = permits.acquire().await;
    let res = match http.get(url).header("x-user-id", USER).send().await {
        Ok(r) if r.status().is_success() => r,
        Ok(r) => {
            let _ = connected.send(Err(format!("http {}", r.status().as_u16())));
            return w;
        }
        Err(e) => {
            let _ = connected.send(Err(format!("connect: {}", root_cause(&e))));
            return w;
        }
    };
    // The gateway answers after the Watch call is subscribed: events appended from now on are
    // live for this client.
    let opened_at = SystemTime::now();
    drop(permit);
    open.fetch_add(1, Ordering::Relaxed);
    let _ = connected.send(Ok(()));

    let mut parser = sse::Parser::new();
    let mut body = res.bytes_stream();
    let read = async {
        while let Some(chunk) = body.next().await {
            let chunk = match chunk {
                Ok(c) => c,
                Err(e) => return Some(format!("body: {}", root_cause(&e))),
            };
            let now = SystemTime::now();
            for ev in parser.push(&chunk) {
                w.events += 1;
                if let Some(ts) = ev.ts().filter(|ts| *ts >= opened_at) {
                    w.live.push((now, sse::since(ts, now)));
                }
                match ev.event.as_str() {
                    "ready" => {
                        w.ready = true;
                        return None;
                    }
                    "error" => {
                        let code = ev.field("code").unwrap_or("unknown");
                        return Some(format!("sse error event {code}"));
                    }
                    _ => {}
                }
            }
        }
        Some("stream ended before ready".to_owned())
    };
    w.error = match tokio::time::timeout_at(deadline.into(), read).await {
        Ok(e) => e,
        Err(_) => Some("deadline".to_owned()),
    };
    open.fetch_sub(1, Ordering::Relaxed);
    w
}

fn root_cause(e: &reqwest::Error) -> String {
    let mut source: &dyn std::error::Error = e;
    while let Some(s) = source.source() {
        source = s;
    }
    source.to_string()
}
