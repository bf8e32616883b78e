//! `capacity`: what a scan costs in CPU, and how many the machine can run.
//!
//! Starts `ecoscan up` (the binary built beside this one) as a child process on free loopback
//! ports with the mock model at 0 ms, so that nothing but the suite's own work is left, and
//! drives it with closed-loop users (each a bearer token of its own, as apps send, and each
//! running one multipart upload and its SSE stream to `ready` after another). The users are
//! ramped in steps (8, 16, 32, … by default) until scans/s grows by less than 5 % from one
//! step to the next. For every step it reads, from `/proc`, the CPU each process used while the
//! step was measured: the suite, and with production stores Redis, PostgreSQL and the S3
//! server (moto) too; divided by the scans finished, that is the CPU per scan. At the busiest
//! step it also reports where a scan's time goes: the phases by the events' own times, and the
//! mean time and count per scan of every RPC from each service's `/metrics`.
//!
//! The stores are the environment's (embedded unless `REDIS_URL`, `postgres://` database URLs
//! and `S3_*` are set, as `run-all` sets them). Other work on the same Redis, PostgreSQL or
//! moto while it runs is counted too: run it on a quiet machine.
//!
//! ```sh
//! cargo build --release -p ecoscan -p ecoscan-bench && target/release/capacity
//! ```

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::PathBuf,
    process::Stdio,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use clap::Parser;
use ecoscan_bench::{
    HINTS,
    report::{Figure, Report},
    scan::{Caller, ScanOutcome, scan},
    stats::{Samples, fmt_opt},
    system,
};
use tokio::io::AsyncBufReadExt as _;

#[derive(Parser, Debug)]
#[command(about = "CPU per scan and scans/s of `ecoscan up`, users ramped until it saturates")]
struct Args {
    /// Closed-loop users of each step (the ramp stops early once scans/s stops growing).
    #[arg(long, value_delimiter = ',', default_value = "8,16,32,64,128")]
    steps: Vec<usize>,
    /// How long each step is measured (after its warm-up).
    #[arg(long, default_value = "20s", value_parser = ecoscan_bench::parse_duration)]
    step: Duration,
    /// How long each step runs before it is measured.
    #[arg(long, default_value = "3s", value_parser = ecoscan_bench::parse_duration)]
    warmup: Duration,
    /// Growth in scans/s below which the ramp stops (a fraction).
    #[arg(long, default_value_t = 0.05)]
    min_growth: f64,
    /// The suite binary (default: `ecoscan` beside this one).
    #[arg(long)]
    ecoscan: Option<PathBuf>,
    /// A scan not `ready` within this long counts as a timeout.
    #[arg(long, default_value = "60s", value_parser = ecoscan_bench::parse_duration)]
    scan_timeout: Duration,
}

/// Whether a command line is one of a kind of process.
type Recognise = fn(&str) -> bool;

/// The processes whose CPU is counted, each by how its command line is recognised, and whether
/// the design's figure (and its target) counts it: the suite, Redis and PostgreSQL are; the S3
/// server, moto here (a Python stand-in whose cost per `PUT` says nothing of the object store a
/// deployment uses), is reported beside them and in a second total.
const PROCESSES: &[(&str, Recognise, bool)] = &[
    ("Redis", |c| c.starts_with("redis-server"), true),
    (
        "PostgreSQL",
        |c| c.starts_with("postgres") || c.contains("/bin/postgres"),
        true,
    ),
    (
        "S3 (moto)",
        |c| c.contains("moto_server") || c.contains("moto.server"),
        false,
    ),
];

/// The gRPC services `ecoscan up` runs, as it names them.
const SERVICES: &[&str] = &[
    "ingest",
    "vision",
    "rule",
    "answer",
    "reward",
    "analytics",
    "notification",
];

/// CPU readings of the suite and the store processes at one moment.
struct CpuReading {
    suite: Option<Duration>,
    stores: Vec<BTreeMap<u32, Duration>>,
    client: Option<Duration>,
}

impl CpuReading {
    fn now(suite_pid: u32) -> Self {
        Self {
            suite: system::process_cpu_time(&suite_pid.to_string()),
            stores: PROCESSES
                .iter()
                .map(|(_, matches, _)| system::processes_cpu(matches))
                .collect(),
            client: system::cpu_time(),
        }
    }
}

/// What one step measured.
struct Step {
    users: usize,
    scans: usize,
    errors: BTreeMap<String, usize>,
    window: Duration,
    /// CPU used in the window: the suite, each store process kind, the load generator.
    suite_cpu: Duration,
    stores_cpu: Vec<Duration>,
    client_cpu: Duration,
    outcomes: Vec<ScanOutcome>,
    rpcs: BTreeMap<String, (f64, f64)>,
}

impl Step {
    #[allow(clippy::cast_precision_loss)]
    fn per_second(&self) -> f64 {
        self.scans as f64 / self.window.as_secs_f64().max(1e-9)
    }

    /// CPU per scan in ms.
    #[allow(clippy::cast_precision_loss)]
    fn per_scan(&self, cpu: Duration) -> Option<f64> {
        (self.scans > 0).then(|| cpu.as_secs_f64() * 1000.0 / self.scans as f64)
    }
}

/// `ecoscan up` running as a child, and where it listens.
struct Suite {
    child: tokio::process::Child,
    gateway: SocketAddr,
    gateway_admin: SocketAddr,
    services: Vec<(String, SocketAddr)>,
    data_dir: PathBuf,
    log: PathBuf,
}

impl Suite {
    async fn start(binary: &std::path::Path, dir: &std::path::Path) -> anyhow::Result<Self> {
        let data_dir = dir.join("data");
        let log = dir.join("suite.log");
        let mut cmd = tokio::process::Command::new(binary);
        cmd.arg("up")
            .arg("--data-dir")
            .arg(&data_dir)
            .args(["--host", "127.0.0.1"]);
        for service in ["gateway", "gateway-admin"].iter().chain(SERVICES) {
            cmd.arg(format!("--{service}-port")).arg("0");
        }
        // The model answers at once: what is left is the suite's own work. A user's scans per
        // minute are limited to 60 by default; a closed-loop user at 0 ms makes far more.
        cmd.env("LLM_PROVIDER", "mock")
            .env("LLM_MOCK_LATENCY", "0")
            .env("LLM_MOCK_JITTER", "0")
            .env("GATEWAY_SCANS_PER_MINUTE", "1000000")
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".to_owned()),
            )
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).context("failed to create the suite's log")?)
            .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .with_context(|| format!("failed to start {}", binary.display()))?;
        let stdout = child.stdout.take().context("no stdout from the suite")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let mut found: BTreeMap<String, SocketAddr> = BTreeMap::new();
        let read = async {
            while let Some(line) = lines.next_line().await? {
                // `name   http://127.0.0.1:PORT …` or `name   127.0.0.1:PORT`.
                let mut words = line.split_whitespace();
                let mut name = Vec::new();
                for w in words.by_ref() {
                    let addr = w.strip_prefix("http://").unwrap_or(w);
                    if let Ok(a) = addr.parse::<SocketAddr>() {
                        found.insert(name.join(" "), a);
                        break;
                    }
                    name.push(w);
                }
                if found.contains_key("notification") {
                    return anyhow::Ok(());
                }
            }
            anyhow::bail!("the suite exited before printing its addresses")
        };
        tokio::time::timeout(Duration::from_secs(120), read)
            .await
            .context("the suite printed no addresses within 120 s")?
            .with_context(|| tail(&log))?;
        // Keep reading (and dropping) stdout so that the child never blocks writing to it.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let get = |k: &str| {
            found
                .get(k)
                .copied()
                .with_context(|| format!("no {k} address"))
        };
        let suite = Self {
            gateway: get("gateway")?,
            gateway_admin: get("gateway admin")?,
            services: SERVICES
                .iter()
                .map(|s| Ok(((*s).to_owned(), get(s)?)))
                .collect::<anyhow::Result<_>>()?,
            child,
            data_dir,
            log,
        };
        ecoscan_bench::wait_ready(&format!("http://{}/readyz", suite.gateway_admin))
            .await
            .with_context(|| tail(&suite.log))?;
        Ok(suite)
    }

    fn pid(&self) -> anyhow::Result<u32> {
        self.child.id().context("the suite has exited")
    }

    /// `rpc_server_duration_seconds` sum and count per method, over every service.
    async fn rpc_times(&self, http: &reqwest::Client) -> BTreeMap<String, (f64, f64)> {
        let mut out = BTreeMap::new();
        for (_, addr) in &self.services {
            let Ok(res) = http.get(format!("http://{addr}/metrics")).send().await else {
                continue;
            };
            let Ok(text) = res.text().await else { continue };
            for line in text.lines() {
                for (suffix, slot) in [("_sum{", 0), ("_count{", 1)] {
                    let Some(rest) =
                        line.strip_prefix(&format!("rpc_server_duration_seconds{suffix}"))
                    else {
                        continue;
                    };
                    let Some(method) = rest
                        .split(',')
                        .find_map(|kv| kv.trim_end_matches('}').strip_prefix("method=\""))
                    else {
                        continue;
                    };
                    let method = method.split('"').next().unwrap_or(method).to_owned();
                    let value: f64 = rest
                        .rsplit(' ')
                        .next()
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(0.0);
                    let entry: &mut (f64, f64) = out.entry(method).or_default();
                    if slot == 0 {
                        entry.0 += value;
                    } else {
                        entry.1 += value;
                    }
                }
            }
        }
        out
    }
}

/// The last lines of the suite's log, for an error message.
fn tail(log: &std::path::Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    format!(
        "the suite's log ends:\n{}",
        lines[lines.len().saturating_sub(20)..].join("\n")
    )
}

#[tokio::main]
#[allow(clippy::cast_precision_loss)]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    ecoscan_bench::init_logs();
    anyhow::ensure!(
        !args.steps.is_empty() && args.steps.iter().all(|&n| n > 0),
        "--steps must name at least one step of at least one user"
    );
    let binary = match &args.ecoscan {
        Some(p) => p.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("this binary has no directory")?
            .join("ecoscan"),
    };
    anyhow::ensure!(
        binary.is_file(),
        "no suite binary at {} (build it: cargo build --release -p ecoscan, or pass --ecoscan)",
        binary.display()
    );
    let max_users = args.steps.iter().copied().max().unwrap_or(1);
    system::raise_fd_limit(max_users as u64 * 2 + 1024);
    let dir = tempfile::tempdir().context("failed to create a temporary directory")?;
    let suite = Suite::start(&binary, dir.path()).await?;
    let pid = suite.pid()?;
    let url = format!("http://{}/api/v1/scan/completion", suite.gateway);
    let http = reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(max_users)
        .build()?;
    let callers: Vec<Caller> = (0..max_users)
        .map(|u| {
            ecoscan::local_token(
                &suite.data_dir,
                &format!("capacity-{u}"),
                false,
                Duration::from_secs(3600),
            )
            .map(Caller::Bearer)
        })
        .collect::<anyhow::Result<_>>()?;
    eprintln!(
        "capacity: suite pid {pid} at http://{}; steps {:?} of {:?} after {:?} warm-up",
        suite.gateway, args.steps, args.step, args.warmup
    );

    let mut steps: Vec<Step> = Vec::new();
    for &users in &args.steps {
        let step = run_step(&args, &suite, &http, &url, &callers[..users], pid).await?;
        eprintln!(
            "capacity: {users} users: {:.1} scans/s, suite {} ms CPU per scan, errors {:?}",
            step.per_second(),
            step.per_scan(step.suite_cpu)
                .map_or_else(|| "–".to_owned(), |v| format!("{v:.2}")),
            step.errors
        );
        let grew = steps
            .last()
            .is_none_or(|last| step.per_second() >= last.per_second() * (1.0 + args.min_growth));
        steps.push(step);
        if !grew {
            break;
        }
    }
    drop(suite);

    let mut report = Report::new("capacity");
    report_steps(&mut report, &steps);
    report.print();
    Ok(())
}

/// One step: `callers.len()` closed-loop users for the warm-up and the measured window.
async fn run_step(
    args: &Args,
    suite: &Suite,
    http: &reqwest::Client,
    url: &str,
    callers: &[Caller],
    pid: u32,
) -> anyhow::Result<Step> {
    let started = Instant::now();
    let measure_from = started + args.warmup;
    let stop = measure_from + args.step;
    let outcomes = Arc::new(std::sync::Mutex::new((Vec::new(), BTreeMap::new())));
    let mut users = tokio::task::JoinSet::new();
    for (user, caller) in callers.iter().enumerate() {
        let (http, url, caller, outcomes) = (
            http.clone(),
            url.to_owned(),
            caller.clone(),
            outcomes.clone(),
        );
        let timeout = args.scan_timeout;
        users.spawn(async move {
            let mut n = 0u64;
            while Instant::now() < stop {
                let salt = (user as u64) << 32 | n;
                let hint = HINTS[(user + n as usize) % HINTS.len()];
                let outcome = scan(&http, &url, user, &caller, salt, hint, timeout).await;
                let mut o = outcomes
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                match outcome {
                    // Only scans that finished inside the measured window count.
                    Ok(done) if done.finished_at >= measure_from && done.finished_at <= stop => {
                        o.0.push(done);
                    }
                    Ok(_) => {}
                    Err(kind) => *o.1.entry(kind).or_insert(0usize) += 1,
                }
                n += 1;
            }
        });
    }
    tokio::time::sleep_until(measure_from.into()).await;
    let before = CpuReading::now(pid);
    let rpc_before = suite.rpc_times(http).await;
    tokio::time::sleep_until(stop.into()).await;
    let after = CpuReading::now(pid);
    let rpc_after = suite.rpc_times(http).await;
    let window = stop.saturating_duration_since(measure_from);
    // Scans in flight at the end finish (model at 0 ms) before the next step starts.
    while users.join_next().await.is_some() {}
    let (outcomes, errors) = std::mem::take(
        &mut *outcomes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    let rpcs = rpc_after
        .into_iter()
        .map(|(m, (sum, count))| {
            let (s0, c0) = rpc_before.get(&m).copied().unwrap_or_default();
            (m, (sum - s0, count - c0))
        })
        .filter(|(_, (_, count))| *count > 0.0)
        .collect();
    let diff = |a: Option<Duration>, b: Option<Duration>| {
        a.zip(b)
            .map_or(Duration::ZERO, |(a, b)| a.saturating_sub(b))
    };
    Ok(Step {
        users: callers.len(),
        scans: outcomes.len(),
        errors,
        window,
        suite_cpu: diff(after.suite, before.suite),
        stores_cpu: before
            .stores
            .iter()
            .zip(&after.stores)
            .map(|(b, a)| system::cpu_between(b, a))
            .collect(),
        client_cpu: diff(after.client, before.client),
        outcomes,
        rpcs,
    })
}

#[allow(clippy::cast_precision_loss)]
fn report_steps(report: &mut Report, steps: &[Step]) {
    let production = system::stores().starts_with("production");
    let Some(peak) = steps
        .iter()
        .max_by(|a, b| a.per_second().total_cmp(&b.per_second()))
    else {
        return;
    };
    let counted: Vec<usize> = if production {
        (0..PROCESSES.len()).collect()
    } else {
        Vec::new()
    };
    let total = |s: &Step, with_s3: bool| {
        s.suite_cpu
            + counted
                .iter()
                .filter(|&&i| with_s3 || PROCESSES[i].2)
                .map(|&i| s.stores_cpu[i])
                .sum::<Duration>()
    };
    report
        .header("stores", system::stores())
        .header(
            "settings",
            format!(
                "`ecoscan up` as a child process, mock model at 0 ms, closed-loop users with bearer tokens (multipart upload, SSE to `ready`), steps {}",
                steps
                    .iter()
                    .map(|s| s.users.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        );
    let target = if production { 6.0 } else { 4.0 };
    report
        .measure(Figure::new(
            "scans/s at saturation",
            Some(peak.per_second()),
            "/s",
        ))
        .measure(
            Figure::new(
                if production {
                    "CPU per scan, all processes (suite + Redis + PostgreSQL)"
                } else {
                    "CPU per scan, the suite process (embedded)"
                },
                peak.per_scan(total(peak, false)),
                "ms",
            )
            .at_most(target),
        )
        .measure(Figure::new(
            "CPU per scan, the suite process",
            peak.per_scan(peak.suite_cpu),
            "ms",
        ));
    if production {
        report.measure(Figure::new(
            "CPU per scan, all processes and the S3 server (moto)",
            peak.per_scan(total(peak, true)),
            "ms",
        ));
    }
    for &i in &counted {
        report.measure(Figure::new(
            &format!("CPU per scan, {}", PROCESSES[i].0),
            peak.per_scan(peak.stores_cpu[i]),
            "ms",
        ));
    }
    for s in steps {
        let errors: usize = s.errors.values().sum();
        report.info(
            &format!("{} users", s.users),
            format!(
                "{:.1} scans/s; CPU per scan: suite {}{}; load generator {} ms; {} errors{}",
                s.per_second(),
                s.per_scan(s.suite_cpu)
                    .map_or_else(|| "–".to_owned(), |v| format!("{v:.2} ms")),
                counted
                    .iter()
                    .map(|&i| format!(
                        ", {} {}",
                        PROCESSES[i].0,
                        s.per_scan(s.stores_cpu[i])
                            .map_or_else(|| "–".to_owned(), |v| format!("{v:.2} ms"))
                    ))
                    .collect::<String>(),
                s.per_scan(s.client_cpu)
                    .map_or_else(|| "–".to_owned(), |v| format!("{v:.2}")),
                errors,
                if errors == 0 {
                    String::new()
                } else {
                    format!(" ({:?})", s.errors)
                }
            ),
        );
    }
    let mut phases: [Samples; 4] = Default::default();
    for o in &peak.outcomes {
        for (samples, took) in phases.iter_mut().zip(o.phases.into_iter().flatten()) {
            samples.push(took);
        }
    }
    report.info(
        &format!(
            "where a scan's time goes at {} users, p50 / p95: first byte → queued; queue; vision started → answer completed; answer completed → ready at the client",
            peak.users
        ),
        phases
            .iter_mut()
            .map(|p| format!("{} / {}", fmt_opt(p.percentile(50.0)), fmt_opt(p.percentile(95.0))))
            .collect::<Vec<_>>()
            .join("; "),
    );
    let scans = peak.scans.max(1) as f64;
    let mut rpcs: Vec<(&String, &(f64, f64))> = peak.rpcs.iter().collect();
    rpcs.sort_by(|a, b| (b.1.0).total_cmp(&a.1.0));
    report.info(
        "RPCs per scan at saturation (rpc_server_duration_seconds: calls per scan, mean time each; streams: until their end)",
        rpcs.iter()
            .map(|(m, (sum, count))| {
                format!(
                    "{m} {:.2}× {:.2} ms",
                    count / scans,
                    sum * 1000.0 / count.max(1.0)
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
    );
    report.note(
        "CPU is read from /proc over each step's measured window and divided by the scans finished in it. Store processes are found by their command lines, so other work on the same servers counts too; a process that exited during the window is not counted. The load generator runs in this process (its CPU is shown, not counted).",
    );
}
