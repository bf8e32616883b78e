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

/// What the client process prints on its last line (`result <json>`).
#[derive(Debug, Default)]
struct ClientResult {
    connected: usize,
    connect_errors: BTreeMap<String, usize>,
    connect_secs: f64,
    ready: usize,
    stream_errors: BTreeMap<String, usize>,
    events: usize,
    live: Latency,
    live_span_secs: f64,
    client_rss_kib: u64,
    /// CPU the client process used from all connected to the end.
    cpu: Option<Duration>,
}

/// Delivery latency of live events, summarised by the client process (shipping millions of
/// samples over a pipe would buy nothing).
#[derive(Debug, Default)]
struct Latency {
    count: usize,
    p50: Option<Duration>,
    p90: Option<Duration>,
    p99: Option<Duration>,
    p999: Option<Duration>,
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

/// Descriptors the suite process needs besides the gateway's client sockets (connections
/// between the services, databases, files).
const SERVER_FD_RESERVE: u64 = 512;

async fn server(mut args: Args) -> anyhow::Result<()> {
    let mut report = Report::new("sse-fanout");
    let fd_limit = system::raise_fd_limit(args.clients as u64 + 8192);
    let requested = args.clients;
    // Other ingest processes may share this Redis: ours is the one whose connection name
    // appears when the suite starts.
    let redis = match std::env::var("REDIS_URL").ok().filter(|u| !u.is_empty()) {
        Some(url) => {
            let conn = redis_conn(&url).await?;
            let before = ingest_connection_names(conn.clone()).await?;
            Some((conn, before))
        }
        None => None,
    };
    // Each client is a socket in the gateway: past the limit, accept fails and the run measures
    // nothing but errors. Run what fits and say so.
    let fits = usize::try_from(fd_limit.saturating_sub(SERVER_FD_RESERVE)).unwrap_or(usize::MAX);
    if args.clients > fits {
        eprintln!(
            "sse-fanout: the open-file limit is {fd_limit} and cannot be raised here; running {fits} clients instead of {requested}"
        );
        args.clients = fits;
    }
    let dir = tempfile::tempdir().context("failed to create a temporary data directory")?;
    let (running, shutdown) = ecoscan_bench::start_suite(dir.path(), |c| {
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
    .await?;
    let gateway = running.addrs.gateway;
    let http = reqwest::Client::builder().tcp_nodelay(true).build()?;

    // Submit the jobs; they wait on their vision call for about the model latency.
    let mut ids = Vec::with_capacity(args.jobs);
    let submitted_at = Instant::now();
    let mut submits = futures::stream::iter(0..args.jobs)
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
                let v: serde_json::Value = res.json().await?;
                v.get("job_id")
                    .and_then(serde_json::Value::as_str)
                    .map(str::to_owned)
                    .context("202 without a job_id")
            }
        })
        .buffer_unordered(32);
    while let Some(id) = submits.next().await {
        ids.push(id.context("failed to submit a job")?);
    }
    drop(submits);
    let ids_file = dir.path().join("job-ids");
    std::fs::write(&ids_file, ids.join("\n"))?;

    let redis = match redis {
        Some((conn, before)) => {
            let mut ours = ingest_connection_names(conn.clone()).await?;
            for (name, _) in before {
                ours.remove(&name);
            }
            anyhow::ensure!(
                !ours.is_empty(),
                "no new ecoscan-ingest connection in CLIENT LIST after the suite started"
            );
            Some((conn, ours.into_keys().collect::<Vec<_>>()))
        }
        None => None,
    };
    let rss_base = system::rss_kib().context("no VmRSS in /proc/self/status")?;
    let redis_base = match &redis {
        Some((c, ours)) => Some(ingest_redis_connections(c.clone(), ours).await?),
        None => None,
    };

    let exe = std::env::current_exe().context("cannot find this benchmark's executable")?;
    let mut child = tokio::process::Command::new(exe)
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
        .context("failed to start the client process")?;
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
                    let redis_now = match &redis {
                        Some((c, ours)) => Some(ingest_redis_connections(c.clone(), ours).await?),
                        None => None,
                    };
                    let sse_open = scrape(&http, &format!("http://{}/metrics", running.addrs.gateway_admin), "gateway_sse_connections").await;
                    let watchers = scrape(&http, &format!("http://{}/metrics", running.addrs.ingest), "ingest_hub_watchers").await;
                    eprintln!("sse-fanout: clients connected ({rest}); server RSS {} MiB", rss / 1024);
                    cpu_at_connected = system::cpu_time();
                    at_connected = Some((rest.to_owned(), rss, redis_now, sse_open, watchers));
                } else if let Some(json) = line.strip_prefix("result ") {
                    result = Some(parse_result(json)?);
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
    let elapsed = submitted_at.elapsed();
    let server_cpu = system::cpu_time()
        .zip(cpu_at_connected)
        .map(|(a, b)| a.saturating_sub(b));
    let redis_after = match &redis {
        Some((c, ours)) => Some(ingest_redis_connections(c.clone(), ours).await?),
        None => None,
    };
    shutdown.cancel();
    drop(running);

    let r = result.with_context(|| format!("the client process gave no result ({status})"))?;
    let (connect_line, rss_connected, redis_connected, sse_open, watchers) =
        at_connected.context("the client process never reported its connections")?;
    let per_client = |rss: u64| {
        #[allow(clippy::cast_precision_loss)]
        let kib = rss.saturating_sub(rss_base) as f64 / r.connected.max(1) as f64;
        kib
    };
    let kib_connected = per_client(rss_connected);
    let kib_peak = per_client(rss_max);
    let p99 = r.live.p99;

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
                sse_open.map_or_else(|| "?".to_owned(), thousands),
                watchers.map_or_else(|| "?".to_owned(), thousands),
                r.connect_secs
            ),
            "19,488 (the design's figure: what 20,000 open files leave)",
            Verdict::of(r.connected >= 19_488 && r.connected == args.clients),
        );
    #[allow(clippy::cast_precision_loss)]
    report
        .figure(
            Figure::new(
                "SSE clients connected at once",
                Some(r.connected as f64),
                "",
            )
            .at_least(19_488.0),
        )
        .figure(
            Figure::new("server RSS growth per client", Some(kib_connected), "KiB").at_most(16.0),
        )
        .figure(
            Figure::new(
                "event delivery p99",
                p99.map(|d| d.as_secs_f64() * 1000.0),
                "ms",
            )
            .at_most(50.0),
        );
    match (redis_base, redis_connected, redis_after) {
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
    report
        .row(
            "server RSS growth per client (gateway + ingest + everything in the suite process)",
            format!(
                "{kib_connected:.1} KiB with all connected ({} → {} MiB); {kib_peak:.1} KiB at the peak while events flowed",
                rss_base / 1024,
                rss_connected / 1024
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
        .info("client connect report", connect_line)
        .info("run time", fmt_duration(elapsed))
        .note(
            "RSS per client = (the suite process's VmRSS with every client connected − VmRSS before the first client) / clients: user-space memory of the gateway's SSE stream and Watch call, ingest's hub subscription and gRPC stream, and allocator slack; kernel socket buffers are not in RSS. The peak figure is taken while events were flowing (buffers in use).",
        );
    report.print();
    Ok(())
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
    println!("result {}", result_json(&result));
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

fn result_json(r: &ClientResult) -> String {
    let us = |d: Option<Duration>| d.map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    serde_json::json!({
        "connected": r.connected,
        "connect_errors": r.connect_errors,
        "connect_secs": r.connect_secs,
        "ready": r.ready,
        "stream_errors": r.stream_errors,
        "events": r.events,
        "live_count": r.live.count,
        "live_span_secs": r.live_span_secs,
        "p50_us": us(r.live.p50),
        "p90_us": us(r.live.p90),
        "p99_us": us(r.live.p99),
        "p999_us": us(r.live.p999),
        "max_us": us(r.live.max),
        "client_rss_kib": r.client_rss_kib,
        "cpu_ms": r.cpu.map(|c| u64::try_from(c.as_millis()).unwrap_or(u64::MAX)),
    })
    .to_string()
}

/// Reads the client's `result` line back.
fn parse_result(json: &str) -> anyhow::Result<ClientResult> {
    let v: serde_json::Value = serde_json::from_str(json).context("bad result line")?;
    let n = |k: &str| {
        v.get(k)
            .and_then(serde_json::Value::as_u64)
            .map_or(0, |x| usize::try_from(x).unwrap_or(usize::MAX))
    };
    let f = |k: &str| v.get(k).and_then(serde_json::Value::as_f64).unwrap_or(0.0);
    let us = |k: &str| {
        v.get(k)
            .and_then(serde_json::Value::as_u64)
            .map(Duration::from_micros)
    };
    let map = |k: &str| -> BTreeMap<String, usize> {
        v.get(k)
            .and_then(serde_json::Value::as_object)
            .map(|m| {
                m.iter()
                    .map(|(k, n)| {
                        let n = n
                            .as_u64()
                            .map_or(0, |x| usize::try_from(x).unwrap_or(usize::MAX));
                        (k.clone(), n)
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    Ok(ClientResult {
        connected: n("connected"),
        connect_errors: map("connect_errors"),
        connect_secs: f("connect_secs"),
        ready: n("ready"),
        stream_errors: map("stream_errors"),
        events: n("events"),
        live: Latency {
            count: n("live_count"),
            p50: us("p50_us"),
            p90: us("p90_us"),
            p99: us("p99_us"),
            p999: us("p999_us"),
            max: us("max_us"),
        },
        live_span_secs: f("live_span_secs"),
        client_rss_kib: v
            .get("client_rss_kib")
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0),
        cpu: v
            .get("cpu_ms")
            .and_then(serde_json::Value::as_u64)
            .map(Duration::from_millis),
    })
}
