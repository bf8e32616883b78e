//! `start-to-ready`: from process start to `GET /readyz` answering 200, for each service
//! binary and for `ecoscan up`, on the embedded stores and on the production ones.
//!
//! The binaries are the ones built beside this benchmark (`cargo build [--release] --workspace
//! --bins`). Each service runs alone with the others' addresses pointing at a suite running in
//! this process (a service is ready when its own dependencies answer), on a free port, in a
//! temporary working directory. Production stores are used when `REDIS_URL`, a `postgres://`
//! `DATABASE_URL` and `S3_*` are set; their schemas are migrated (`ecoscan migrate`) first, so
//! the figure is a restart's, not a first install's.
//!
//! ```sh
//! cargo run --release -p ecoscan-bench --bin start-to-ready
//! ```

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use clap::Parser;
use ecoscan_bench::report::{Figure, Report};

#[derive(Parser, Debug)]
#[command(about = "Process start → /readyz 200 of each service binary and of `ecoscan up`")]
struct Args {
    /// Starts of each binary on each kind of store (the median is reported, with the spread).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// A start not ready within this long counts as failed.
    #[arg(long, default_value = "30s", value_parser = ecoscan_bench::parse_duration)]
    timeout: Duration,
}

/// The service binaries: name, listen variable, the suite address each dependency variable
/// takes.
const SERVICES: &[(&str, &str)] = &[
    ("gateway", "GATEWAY_ADDR"),
    ("ingest", "INGEST_ADDR"),
    ("vision", "VISION_ADDR"),
    ("rule", "RULE_ADDR"),
    ("answer", "ANSWER_ADDR"),
    ("reward", "REWARD_ADDR"),
    ("analytics", "ANALYTICS_ADDR"),
    ("notification", "NOTIFICATION_ADDR"),
];

/// Variables that select the production stores (removed for the embedded runs).
const STORE_VARS: &[&str] = &[
    "REDIS_URL",
    "DATABASE_URL",
    "INGEST_DATABASE_URL",
    "REWARD_DATABASE_URL",
    "ANALYTICS_DATABASE_URL",
    "NOTIFICATION_DATABASE_URL",
    "S3_ENDPOINT",
    "S3_BUCKET",
];

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    ecoscan_bench::init_logs();
    anyhow::ensure!(args.runs > 0, "--runs must be positive");
    let mut report = Report::new("start-to-ready");
    let bin_dir = std::env::current_exe()?
        .parent()
        .context("the benchmark binary has no directory")?
        .to_path_buf();
    let production = ecoscan_bench::system::stores().starts_with("production");

    // The dependencies every service finds running (embedded stores: the figure is the
    // service's own start, not its neighbours').
    let dir = tempfile::tempdir()?;
    let (running, shutdown) = ecoscan_bench::start_suite(dir.path(), |_| {}).await?;
    let a = running.addrs;
    let deps: Vec<(&str, String)> = vec![
        ("INGEST_URL", format!("http://{}", a.ingest)),
        ("VISION_URL", format!("http://{}", a.vision)),
        ("RULE_URL", format!("http://{}", a.rule)),
        ("ANSWER_URL", format!("http://{}", a.answer)),
        ("REWARD_URL", format!("http://{}", a.reward)),
        ("ANALYTICS_URL", format!("http://{}", a.analytics)),
        ("NOTIFICATION_URL", format!("http://{}", a.notification)),
    ];

    let mut kinds = vec![("embedded", false)];
    if production {
        let status = tokio::process::Command::new(bin_dir.join("ecoscan"))
            .arg("migrate")
            .stdout(Stdio::null())
            .status()
            .await
            .context("failed to run ecoscan migrate")?;
        anyhow::ensure!(status.success(), "ecoscan migrate failed: {status}");
        kinds.push(("production", true));
    } else {
        report.note("Production stores not configured (REDIS_URL, postgres:// DATABASE_URL, S3_*): embedded only.");
    }

    for (kind, keep_stores) in kinds {
        for (service, addr_var) in SERVICES {
            let binary = bin_dir.join(format!("ecoscan-{service}"));
            let mut times = Vec::new();
            for _ in 0..args.runs {
                let port = free_port()?;
                let work = tempfile::tempdir()?;
                let mut cmd = command(&binary, work.path(), keep_stores);
                cmd.env(addr_var, format!("127.0.0.1:{port}"))
                    .envs(deps.iter().cloned());
                // The gateway's /readyz is on its admin listener, and it refuses to start
                // without a way to authenticate callers: a fresh secret per run (a placeholder
                // would be refused too).
                let probe = if *service == "gateway" {
                    let admin = free_port()?;
                    cmd.env("GATEWAY_ADMIN_ADDR", format!("127.0.0.1:{admin}"))
                        .env(
                            "GATEWAY_JWT_SECRET",
                            format!(
                                "{}{}",
                                uuid::Uuid::new_v4().simple(),
                                uuid::Uuid::new_v4().simple()
                            ),
                        );
                    admin
                } else {
                    port
                };
                times.push(time_to_ready(cmd, probe, args.timeout).await);
            }
            report.measure(figure(&format!("ecoscan-{service}, {kind} stores"), &times));
        }
        let mut times = Vec::new();
        for _ in 0..args.runs {
            let work = tempfile::tempdir()?;
            let mut cmd = command(&bin_dir.join("ecoscan"), work.path(), keep_stores);
            cmd.arg("up")
                .env("ECOSCAN_DATA_DIR", work.path().join("data"));
            let mut gateway = 0;
            for var in [
                "ECOSCAN_GATEWAY_ADMIN_PORT",
                "ECOSCAN_GATEWAY_PORT",
                "ECOSCAN_INGEST_PORT",
                "ECOSCAN_VISION_PORT",
                "ECOSCAN_RULE_PORT",
                "ECOSCAN_ANSWER_PORT",
                "ECOSCAN_REWARD_PORT",
                "ECOSCAN_ANALYTICS_PORT",
                "ECOSCAN_NOTIFICATION_PORT",
            ] {
                let port = free_port()?;
                if gateway == 0 {
                    gateway = port;
                }
                cmd.env(var, port.to_string());
            }
            // The first port is the gateway's admin listener, where /readyz is.
            times.push(time_to_ready(cmd, gateway, args.timeout).await);
        }
        report.measure(figure(
            &format!("ecoscan up (gateway /readyz), {kind} stores"),
            &times,
        ));
    }
    shutdown.cancel();
    let _ = running.wait().await;
    report
        .header(
            "settings",
            format!(
                "{} starts of each binary per kind of store, /readyz polled every 5 ms",
                args.runs
            ),
        )
        // The build profile, not the directory: results files are committed, and a path of
        // this machine says nothing to anyone else.
        .header(
            "binaries",
            format!(
                "the `{}` build beside this benchmark",
                bin_dir
                    .file_name()
                    .map_or_else(|| "?".into(), |n| n.to_string_lossy())
            ),
        )
        .header("stores", ecoscan_bench::system::stores());
    report.print();
    Ok(())
}

/// The median start of `times` in ms, failed starts counting as unmeasured.
fn figure(name: &str, times: &[Option<Duration>]) -> Figure {
    let ms: Vec<f64> = times
        .iter()
        .map(|t| t.map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0))
        .collect();
    let mut f = Figure::of_runs(name, &ms, "ms").at_most(1000.0);
    if times.iter().any(Option::is_none) {
        // One start that never became ready is a missed target whatever the others did.
        f.value = None;
    }
    f
}

fn command(binary: &Path, dir: &Path, keep_stores: bool) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(binary);
    cmd.current_dir(dir)
        .env_remove(ecoscan_bench::report::JSON_OUT_VAR)
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .kill_on_drop(true);
    if !keep_stores {
        for v in STORE_VARS {
            cmd.env_remove(v);
        }
    }
    cmd
}

/// A port free now (the child binds it a moment later).
fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Starts `cmd` and polls its `/readyz` until 200; `None` when it exits or the time runs out.
async fn time_to_ready(
    mut cmd: tokio::process::Command,
    port: u16,
    timeout: Duration,
) -> Option<Duration> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .build()
        .ok()?;
    let url = format!("http://127.0.0.1:{port}/readyz");
    let started = Instant::now();
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("start-to-ready: failed to start {cmd:?}: {e}");
            return None;
        }
    };
    let ready = loop {
        if let Ok(r) = http.get(&url).send().await
            && r.status().is_success()
        {
            break Some(started.elapsed());
        }
        if started.elapsed() > timeout || matches!(child.try_wait(), Ok(Some(_))) {
            eprintln!(
                "start-to-ready: {} on port {port} was not ready",
                PathBuf::from(cmd.as_std().get_program()).display()
            );
            break None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    // Killed: the figure is the start, the drain is not measured here.
    let _ = child.kill().await;
    ready
}
