//! `all`: every benchmark in one run on the production stores, one results file.
//!
//! Starts Redis, PostgreSQL and moto as `infra/services.sh` does (it runs that script), gives
//! the run a database, a bucket and Redis key prefixes of its own (removed at the end), runs
//! each benchmark binary (built beside this one) with `BENCH_JSON_OUT` set, and writes
//! `bench/results/<date>.json`: every figure with its target, verdict, runs and spread, the
//! machine, the load before and after, the git commit. It then prints each figure beside its
//! target and beside the previous results file of the same mode (a change of more than 10 % is
//! flagged) and regenerates the table between `<!-- bench:begin -->` and `<!-- bench:end -->`
//! in `bench/README.md`.
//!
//! `--quick` runs each benchmark for a few seconds (the test command runs it so that the
//! benchmarks cannot rot); its figures say nothing about the targets.
//!
//! ```sh
//! bench/run-all                  # = cargo build --release --workspace --bins && target/release/all
//! cargo run -p ecoscan-bench --bin all -- --quick --out-dir /tmp/bench
//! ```

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use clap::Parser;
use ecoscan_bench::{
    report::JSON_OUT_VAR,
    results::{self, Comparison},
    system,
};

#[derive(Parser, Debug)]
#[command(
    about = "Every benchmark on the production stores, one results file, compared with the last"
)]
struct Args {
    /// A few seconds per benchmark: checks that they run, measures nothing worth keeping.
    #[arg(long)]
    quick: bool,
    /// Where the results file is written (and the previous one looked for).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/results"))]
    out_dir: PathBuf,
    /// The Markdown file whose generated table is regenerated (full runs only; `none` to leave
    /// it): `bench/README.md`.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))]
    readme: PathBuf,
    /// Only these benchmarks (comma-separated names).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Use the servers already configured in the environment (`REDIS_URL`, `DATABASE_URL`,
    /// `S3_*`) instead of starting them with `infra/services.sh` and making scratch ones.
    #[arg(long)]
    no_services: bool,
}

/// A benchmark binary with its arguments for a full and a quick run.
struct Bench {
    name: &'static str,
    full: &'static [&'static str],
    quick: &'static [&'static str],
    /// Longest a full run may take before it is stopped.
    limit: Duration,
}

const BENCHES: &[Bench] = &[
    Bench {
        name: "start-to-ready",
        full: &[],
        quick: &["--runs", "1"],
        limit: Duration::from_secs(600),
    },
    Bench {
        name: "gateway-overhead",
        full: &[],
        quick: &["--requests", "300", "--warmup", "50"],
        limit: Duration::from_secs(300),
    },
    Bench {
        name: "gateway-throughput",
        full: &[],
        quick: &["--duration", "2s", "--warmup", "1s"],
        limit: Duration::from_secs(300),
    },
    Bench {
        name: "notification-claim",
        full: &[],
        quick: &["--scheduled", "20000", "--claims", "20", "--batch", "500"],
        limit: Duration::from_secs(600),
    },
    Bench {
        name: "notification-delivery",
        full: &[],
        quick: &[
            "--scheduled",
            "20000",
            "--rate",
            "500",
            "--duration",
            "3s",
            "--users",
            "100",
        ],
        limit: Duration::from_secs(900),
    },
    Bench {
        name: "analytics-ingest",
        full: &[],
        quick: &[
            "--rate",
            "500",
            "--rate-duration",
            "1s",
            "--runs",
            "2",
            "--max-duration",
            "1s",
            "--streams",
            "2",
            "--in-flight",
            "64",
        ],
        limit: Duration::from_secs(1200),
    },
    Bench {
        name: "scan-load",
        full: &[],
        quick: &[
            "--users",
            "20",
            "--duration",
            "4s",
            "--ramp",
            "1s",
            "--model-latency",
            "300ms",
            "--scan-timeout",
            "30s",
        ],
        limit: Duration::from_secs(600),
    },
    Bench {
        name: "capacity",
        full: &[],
        quick: &["--steps", "2,4", "--step", "2s", "--warmup", "1s"],
        limit: Duration::from_secs(600),
    },
    Bench {
        name: "sse-fanout",
        full: &[],
        quick: &[
            "--clients",
            "200",
            "--jobs",
            "10",
            "--model-latency",
            "3s",
            "--deadline",
            "30s",
        ],
        limit: Duration::from_secs(900),
    },
];

const QUICK_LIMIT: Duration = Duration::from_secs(60);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let started = Instant::now();
    let date = humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string();
    let load_before = system::loadavg();
    let exe_dir = std::env::current_exe()?
        .parent()
        .context("the benchmark binary has no directory")?
        .to_path_buf();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");

    let stores = if args.no_services {
        None
    } else {
        Some(results::ScratchStores::create(&root).await?)
    };
    let stores_text = if stores.is_some() {
        "production: Redis + PostgreSQL + S3 (moto), as infra/services.sh starts them; a scratch database, bucket and Redis prefixes, removed at the end".to_owned()
    } else {
        system::stores()
    };

    let work = tempfile::tempdir()?;
    let mut benchmarks = Vec::new();
    for bench in BENCHES {
        if !args.only.is_empty() && !args.only.iter().any(|o| o == bench.name) {
            continue;
        }
        let out = work.path().join(format!("{}.json", bench.name));
        let mut cmd = tokio::process::Command::new(exe_dir.join(bench.name));
        cmd.args(if args.quick { bench.quick } else { bench.full })
            .env(JSON_OUT_VAR, &out)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        if let Some(s) = &stores {
            cmd.envs(s.env());
        }
        let limit = if args.quick { QUICK_LIMIT } else { bench.limit };
        eprintln!(
            "==> {} ({})",
            bench.name,
            if args.quick { "quick" } else { "full" }
        );
        let t = Instant::now();
        let outcome = match cmd.spawn() {
            Err(e) => Err(format!(
                "failed to start {}: {e} (build the benchmarks first)",
                bench.name
            )),
            Ok(mut child) => match tokio::time::timeout(limit, child.wait()).await {
                Err(_) => {
                    let _ = child.kill().await;
                    Err(format!("stopped after {limit:?}"))
                }
                Ok(Err(e)) => Err(e.to_string()),
                Ok(Ok(status)) if !status.success() => Err(format!("exited with {status}")),
                Ok(Ok(_)) => std::fs::read_to_string(&out)
                    .map_err(|e| format!("wrote no results: {e}"))
                    .and_then(|t| {
                        serde_json::from_str::<serde_json::Value>(&t).map_err(|e| e.to_string())
                    }),
            },
        };
        let secs = t.elapsed().as_secs_f64();
        benchmarks.push(match outcome {
            Ok(mut v) => {
                v["seconds"] = serde_json::json!(secs);
                v
            }
            Err(error) => {
                eprintln!("{}: {error}", bench.name);
                serde_json::json!({ "name": bench.name, "error": error, "seconds": secs, "figures": [] })
            }
        });
    }

    let cleanup = match &stores {
        Some(s) => s.remove().await,
        None => Ok(()),
    };

    let results = serde_json::json!({
        "date": date,
        "quick": args.quick,
        "git_commit": results::git_commit(&root),
        "machine": system::machine(),
        "load_before": load_before,
        "load_after": system::loadavg(),
        "stores": stores_text,
        "seconds": started.elapsed().as_secs_f64(),
        "benchmarks": benchmarks,
    });
    std::fs::create_dir_all(&args.out_dir)
        .with_context(|| format!("failed to create {}", args.out_dir.display()))?;
    let previous = results::latest(&args.out_dir, args.quick);
    let file = args.out_dir.join(results::file_name(&date, args.quick));
    std::fs::write(&file, serde_json::to_string_pretty(&results)? + "\n")
        .with_context(|| format!("failed to write {}", file.display()))?;

    let comparison = Comparison::new(&results, previous.as_ref().map(|(_, v)| v));
    println!(
        "\n# all benchmarks{}\n",
        if args.quick {
            " (quick: figures not comparable to the targets)"
        } else {
            ""
        }
    );
    println!("- results: {}", file.display());
    println!(
        "- previous: {}",
        previous.as_ref().map_or_else(
            || "none of this mode".to_owned(),
            |(p, _)| p.display().to_string()
        )
    );
    println!(
        "- machine: {}; load before {load_before}, after {}",
        system::machine(),
        system::loadavg()
    );
    println!("{}", comparison.render());
    if !args.quick && args.readme.as_os_str() != "none" {
        let file_name = file
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        results::update_readme(&args.readme, &comparison.readme_table(&results, &file_name))?;
        println!("README table regenerated: {}", args.readme.display());
    }
    cleanup.context("failed to remove the scratch stores")?;
    let failed: Vec<&str> = benchmarks_failed(&results);
    anyhow::ensure!(
        failed.is_empty(),
        "benchmarks that did not finish: {}",
        failed.join(", ")
    );
    // Missed targets are reported, not failures: the benchmarks measure, they do not assert.
    Ok(())
}

fn benchmarks_failed(results: &serde_json::Value) -> Vec<&str> {
    results["benchmarks"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b.get("error").is_some())
        .filter_map(|b| b["name"].as_str())
        .collect()
}
