//! `notification-claim`: claiming due notifications from a schedule of a million.
//!
//! Fills the notification service's `RedisScheduler` (under a private key prefix) with
//! `--scheduled` entries, of which `--claims × --batch` are due (spread over the `--due-spread`
//! before now: an hour by default) and the rest due over the next day, then claims `--batch` due
//! entries `--claims` times, one claim after another, timing each (one Lua script — expired
//! parts back to waiting, then up to `--batch` due members into parts of a claim under one lease
//! deadline, whole seconds of due time renamed — and the claim's members read in the same round
//! trip). `--due-spread 1s` puts every due entry into one second, which the claim must copy
//! member by member. The keys are removed at the end, also when the run fails.
//!
//! Needs Redis: `REDIS_URL` (default `redis://127.0.0.1:6379`, which `infra/services.sh` starts).
//!
//! ```sh
//! cargo run --release -p ecoscan-bench --bin notification-claim
//! ```

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use clap::Parser;
use ecoscan_bench::{
    report::{Figure, Report, Verdict},
    stats::{Samples, fmt_duration, fmt_opt, fmt_rate, thousands},
    system,
};
use ecoscan_notification::scheduler::{RedisScheduler, Scheduler as _};
use rand::Rng as _;

#[derive(Parser, Debug)]
#[command(about = "Claim latency of due notifications in a Redis sorted set of a million")]
struct Args {
    /// Redis to use (a private key prefix keeps the benchmark apart from anything else there).
    #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    /// Entries scheduled in all.
    #[arg(long, default_value_t = 1_000_000)]
    scheduled: usize,
    /// Claims to time.
    #[arg(long, default_value_t = 200)]
    claims: usize,
    /// Entries per claim.
    #[arg(long, default_value_t = 2000)]
    batch: usize,
    /// Lease given to claimed entries.
    #[arg(long, default_value = "30s", value_parser = ecoscan_bench::parse_duration)]
    lease: Duration,
    /// How far before now the due entries are spread (evenly at random).
    #[arg(long, default_value = "1h", value_parser = ecoscan_bench::parse_duration)]
    due_spread: Duration,
    /// Keep every claim live instead of acknowledging each batch (untimed) between claims as
    /// delivery does; the live claims then hold claims × batch entries.
    #[arg(long)]
    no_ack: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    ecoscan_bench::init_logs();
    let due = args.claims * args.batch;
    anyhow::ensure!(
        args.claims > 0 && args.batch > 0 && due <= args.scheduled,
        "need 0 < claims × batch ({due}) ≤ scheduled ({})",
        args.scheduled
    );
    let prefix = format!("bench:{}:", uuid::Uuid::new_v4().simple());
    let scheduler = RedisScheduler::connect(&args.redis_url, &prefix, Duration::from_millis(100))
        .await
        .with_context(|| format!("notification-claim needs Redis at {}", args.redis_url))?;
    let keys: Vec<String> = scheduler.keys().iter().map(|k| (*k).to_owned()).collect();
    let mut stats = redis::Client::open(args.redis_url.as_str())?
        .get_multiplexed_async_connection()
        .await?;

    let outcome = run(&args, &scheduler, &mut stats).await;
    // The keys go whatever happened (UNLINK: a million members freed off the main thread).
    let removed = scheduler
        .remove_all()
        .await
        .context("failed to remove the benchmark's keys");
    let mut report = outcome?;
    removed?;
    report.header(
        "keys",
        format!("{} and each claim (removed at the end)", keys.join(", ")),
    );
    report.print();
    Ok(())
}

fn now_us() -> i64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(since.as_micros()).unwrap_or(i64::MAX)
}

async fn run(
    args: &Args,
    scheduler: &RedisScheduler,
    conn: &mut redis::aio::MultiplexedConnection,
) -> anyhow::Result<Report> {
    let mut report = Report::new("notification-claim");
    let due = args.claims * args.batch;
    let now = now_us();
    let hour_us = 3_600_000_000i64;
    let spread_us = i64::try_from(args.due_spread.as_micros())
        .unwrap_or(i64::MAX)
        .max(2);
    // Due entries spread over the past hour, the rest over the next day: the claim must find
    // the due ones at the low end of the set, as in production.
    let mut rng = rand::rng();
    let entries: Vec<(String, i64)> = (0..args.scheduled)
        .map(|i| {
            let at = if i < due {
                now - rng.random_range(1..spread_us)
            } else {
                now + rng.random_range(hour_us..24 * hour_us)
            };
            (uuid::Uuid::new_v4().to_string(), at)
        })
        .collect();
    eprintln!(
        "notification-claim: scheduling {} entries ({} due)",
        args.scheduled, due
    );
    let loaded = Instant::now();
    scheduler.add_many(&entries).await?;
    let load_time = loaded.elapsed();
    drop(entries);
    let backlog = scheduler.backlog().await?;
    anyhow::ensure!(
        backlog == args.scheduled as u64,
        "expected {} entries in Redis, found {backlog}",
        args.scheduled
    );

    let mut latencies = Samples::new();
    let mut script_usec = 0u64;
    let mut redis_cpu_usec = 0u64;
    let mut short = 0usize;
    for _ in 0..args.claims {
        // Redis's own time for the claim: the commands it ran between two readings, the
        // readings and the acknowledgement outside them.
        let before = redis_spent(conn).await?;
        let start = Instant::now();
        let ids = scheduler
            .claim_due(now_us(), args.batch, args.lease)
            .await?;
        latencies.push(start.elapsed());
        let after = redis_spent(conn).await?;
        redis_cpu_usec += after.cpu_usec.saturating_sub(before.cpu_usec);
        script_usec += after.script_usec.saturating_sub(before.script_usec);
        if ids.len() != args.batch {
            short += 1;
        }
        if !args.no_ack && !ids.is_empty() {
            // What delivery does once the notifications are out, outside the timing.
            scheduler.ack_many(&ids).await?;
        }
    }
    let per_claim = |usec: u64| {
        (args.claims > 0)
            .then(|| Duration::from_micros(usec / args.claims as u64))
            .filter(|d| !d.is_zero())
    };
    let (script_time, redis_cpu) = (per_claim(script_usec), per_claim(redis_cpu_usec));
    let p50 = latencies.percentile(50.0);
    report
        .figure(
            Figure::new(
                &format!("claim of {} p50", args.batch),
                p50.map(|d| d.as_secs_f64() * 1000.0),
                "ms",
            )
            .at_most(2.5),
        )
        .header(
            "settings",
            format!(
                "{} scheduled ({} due over the {:?} before now), {} claims of {} one after another, lease {:?}; {}",
                thousands(args.scheduled as f64),
                thousands(due as f64),
                args.due_spread,
                args.claims,
                args.batch,
                args.lease,
                if args.no_ack {
                    "claimed entries stay in flight (--no-ack)"
                } else {
                    "each batch acknowledged between claims (untimed), as delivery does"
                }
            ),
        )
        .header(
            "redis",
            format!(
                "{} (the claim script through ConnectionManager, as the service runs it)",
                args.redis_url
            ),
        )
        .row(
            &format!(
                "claim of {} due entries incl. the lease, p50 / p99",
                args.batch
            ),
            format!("{} / {}", fmt_opt(p50), fmt_opt(latencies.percentile(99.0))),
            "p50 ≤ 2.5 ms",
            Verdict::of(p50.is_some_and(|p| p <= Duration::from_micros(2500))),
        )
        .info(
            "claim p90 / max",
            format!(
                "{} / {}",
                fmt_opt(latencies.percentile(90.0)),
                fmt_opt(latencies.max())
            ),
        )
        .info(
            "Redis CPU per claim (INFO cpu, main thread; the INFO readings included)",
            redis_cpu.map_or_else(|| "not reported".to_owned(), fmt_duration),
        )
        .info(
            "claim script per claim (INFO commandstats, EVALSHA)",
            script_time.map_or_else(|| "not reported".to_owned(), fmt_duration),
        )
        .info(
            "claims that returned fewer than the batch",
            short.to_string(),
        )
        .info(
            "scheduling the entries (the add script, 1,000 per call)",
            format!(
                "{} ({})",
                fmt_duration(load_time),
                fmt_rate(args.scheduled, load_time)
            ),
        )
        .info("load average", system::loadavg());
    Ok(report)
}

/// What Redis has spent so far, in microseconds: in scripts (`INFO commandstats`, `EVALSHA`; the
/// commands a script calls are inside its time) and of its main thread's CPU (`INFO cpu`: the
/// claim's script, the reads of its parts, the sockets).
struct Spent {
    script_usec: u64,
    cpu_usec: u64,
}

async fn redis_spent(conn: &mut redis::aio::MultiplexedConnection) -> anyhow::Result<Spent> {
    let spent = system::redis_node_spent(conn)
        .await
        .context("Redis did not answer INFO")?;
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    Ok(Spent {
        script_usec: spent.commands.get("evalsha").map_or(0, |(_, usec)| *usec),
        cpu_usec: (spent.cpu_secs * 1e6).round() as u64,
    })
}
