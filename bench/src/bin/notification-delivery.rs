//! `notification-delivery`: due → delivered to a live stream, with a million scheduled.
//!
//! Starts `--replicas` notification services in this process (each on its own loopback port,
//! all on one PostgreSQL database and one Redis key prefix of the run's own), writes a backlog
//! of `--scheduled` notifications due over the next day (rows with one `INSERT … SELECT
//! generate_series` through `psql`, due-set entries with `RedisScheduler::add_many`), opens a
//! live `Subscribe` stream for each of `--users` users (spread over the replicas), then writes,
//! the same way, `--rate` × `--duration` notifications due `1/rate` apart from a moment after
//! the writing is over (with `--via-schedule`: sends them through the replicas' `Schedule` RPC
//! during the run instead, each `--lead` before its due time). Each notification's due time →
//! the moment its user's stream hands it to the benchmark is the latency; an id received twice
//! is a duplicate, one not received within `--grace` of the last due time (or of the end of
//! scheduling) is counted lost (it is late: its row stays scheduled).
//! The database and the keys are removed at the end, also when the run fails.
//!
//! Needs Redis (`REDIS_URL`, default `redis://127.0.0.1:6379`) and PostgreSQL (`--postgres`,
//! an administrative URL; a scratch database is made on that server) and `psql`, as
//! `infra/services.sh` starts them.
//!
//! ```sh
//! cargo run --release -p ecoscan-bench --bin notification-delivery
//! cargo run -p ecoscan-bench --bin notification-delivery -- --scheduled 20000 --rate 500 --duration 3s
//! ```

use std::{
    collections::HashMap,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::Context as _;
use clap::Parser;
use ecoscan_bench::{
    report::{Figure, Report},
    stats::{Samples, fmt_duration, fmt_opt, fmt_rate, thousands},
    system,
};
use ecoscan_common::{CancellationToken, client::TracedChannel};
use ecoscan_notification::scheduler::RedisScheduler;
use ecoscan_proto::{
    Timestamp,
    v1::{
        ListRequest, ScheduleRequest, SubscribeRequest,
        notification_service_client::NotificationServiceClient,
    },
};
use tokio::sync::{Semaphore, mpsc};

type Client = NotificationServiceClient<TracedChannel>;

#[derive(Parser, Debug)]
#[command(about = "Due → delivered latency of scheduled notifications across replicas")]
struct Args {
    /// Redis the replicas share (a key prefix of the run's own keeps them apart from the rest).
    #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    /// PostgreSQL server, as an administrative URL: a scratch database is made there and
    /// dropped at the end.
    #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/postgres")]
    postgres: String,
    /// Notifications scheduled beforehand, due over the next day (the backlog).
    #[arg(long, default_value_t = 1_000_000)]
    scheduled: usize,
    /// Notifications falling due per second during the run.
    #[arg(long, default_value_t = 10_000)]
    rate: usize,
    /// How long notifications keep falling due.
    #[arg(long, default_value = "60s", value_parser = ecoscan_bench::parse_duration)]
    duration: Duration,
    /// Notification service replicas.
    #[arg(long, default_value_t = 2)]
    replicas: usize,
    /// Users (one live stream each) the notifications belong to, spread over the replicas.
    #[arg(long, default_value_t = 1000)]
    users: usize,
    /// How long before its due time each notification is scheduled.
    #[arg(long, default_value = "2s", value_parser = ecoscan_bench::parse_duration)]
    lead: Duration,
    /// How long after the last due time a notification may still arrive before it is lost.
    #[arg(long, default_value = "10s", value_parser = ecoscan_bench::parse_duration)]
    grace: Duration,
    /// `Schedule` calls in flight at most (with `--via-schedule`).
    #[arg(long, default_value_t = 128)]
    in_flight: usize,
    /// Schedule the notifications falling due through the replicas' `Schedule` RPC during the
    /// run, `--lead` ahead, instead of writing them beforehand as the backlog is written (rows,
    /// then due-set entries). On 2 shared cores `Schedule` does not reach 10,000/s, so the
    /// figure then measures scheduling as much as delivery.
    #[arg(long)]
    via_schedule: bool,
}

/// Live streams per client connection (below the servers' concurrent-stream limit).
const STREAMS_PER_CONNECTION: usize = 100;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // The service reads its Redis from `REDIS_URL` (its settings type is not reachable from
    // here, and setting a variable in a running process is unsafe): when the flag says
    // otherwise, run again with the variable set.
    if std::env::var("REDIS_URL").ok().as_deref() != Some(args.redis_url.as_str()) {
        let status = tokio::process::Command::new(std::env::current_exe()?)
            .args(std::env::args_os().skip(1))
            .env("REDIS_URL", &args.redis_url)
            .status()
            .await?;
        std::process::exit(status.code().unwrap_or(1));
    }
    ecoscan_bench::init_logs();
    anyhow::ensure!(
        args.rate > 0 && args.replicas > 0 && args.users > 0 && args.in_flight > 0,
        "--rate, --replicas, --users and --in-flight must be positive"
    );
    let run_id = uuid::Uuid::new_v4().simple().to_string();
    let prefix = format!("bench:{run_id}:");
    let db = format!("bench_notif_{run_id}");
    let (server, _) = args
        .postgres
        .rsplit_once('/')
        .context("--postgres must be a postgres:// URL with a database")?;
    let database_url = format!("{server}/{db}");
    psql(&args.postgres, &format!("create database {db}"))
        .await
        .with_context(|| format!("notification-delivery needs PostgreSQL at {server}"))?;

    let outcome = run(&args, &prefix, &database_url).await;
    let dropped = psql(
        &args.postgres,
        &format!("drop database if exists {db} with (force)"),
    )
    .await;
    let removed = remove_keys(&args.redis_url, &prefix).await;
    let mut report = outcome?;
    dropped?;
    let keys = removed.context("failed to remove the benchmark's keys")?;
    report.header(
        "stores",
        format!(
            "PostgreSQL {server}/{db} (dropped at the end); Redis {} under {prefix}* (removed at the end: {keys} keys)",
            args.redis_url
        ),
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

fn user(i: usize, users: usize) -> String {
    format!("bench-user-{}", i % users)
}

/// What a subscriber saw: the notification's id and when it arrived (µs).
struct Received {
    id: String,
    at_us: i64,
}

async fn run(args: &Args, prefix: &str, database_url: &str) -> anyhow::Result<Report> {
    let mut report = Report::new("notification-delivery");
    let config = ecoscan_notification::Config::default().with_stores_from_env()?;
    let config = ecoscan_notification::Config {
        database_url: database_url.to_owned(),
        redis_prefix: prefix.to_owned(),
        ..config
    };
    ecoscan_notification::migrate(&config).await?;

    let shutdown = CancellationToken::new();
    let mut servers = Vec::new();
    let mut addrs = Vec::new();
    for _ in 0..args.replicas {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        addrs.push(format!("http://{}", listener.local_addr()?));
        servers.push(tokio::spawn(ecoscan_notification::serve(
            config.clone(),
            listener,
            shutdown.clone(),
        )));
    }
    let outcome = measure(args, prefix, database_url, &addrs, &mut report).await;
    shutdown.cancel();
    for server in servers {
        match tokio::time::timeout(Duration::from_secs(30), server).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => eprintln!("notification-delivery: a replica failed: {e:#}"),
            Ok(Err(e)) => eprintln!("notification-delivery: a replica panicked: {e}"),
            Err(_) => eprintln!("notification-delivery: a replica did not stop within 30 s"),
        }
    }
    outcome?;
    Ok(report)
}

async fn measure(
    args: &Args,
    prefix: &str,
    database_url: &str,
    addrs: &[String],
    report: &mut Report,
) -> anyhow::Result<()> {
    // One connection per replica for `Schedule`, others for the live streams.
    let schedulers: Vec<Client> = addrs
        .iter()
        .map(|a| Ok(Client::new(ecoscan_common::client::channel(a)?)))
        .collect::<anyhow::Result<_>>()?;
    for client in &schedulers {
        wait_serving(client.clone()).await?;
    }

    let backlog = write_backlog(args, prefix, database_url).await?;

    // Live streams, user u on replica u % replicas.
    let (tx, mut rx) = mpsc::unbounded_channel::<Received>();
    let stop = CancellationToken::new();
    let ended_early = Arc::new(AtomicUsize::new(0));
    let mut stream_clients: Vec<Vec<Client>> = vec![Vec::new(); addrs.len()];
    let opened = Instant::now();
    for u in 0..args.users {
        let replica = u % addrs.len();
        let k = u / addrs.len();
        if k.is_multiple_of(STREAMS_PER_CONNECTION) {
            stream_clients[replica].push(Client::new(ecoscan_common::client::channel(
                &addrs[replica],
            )?));
        }
        let mut client = stream_clients[replica][k / STREAMS_PER_CONNECTION].clone();
        let req = ecoscan_common::client::request_as(
            SubscribeRequest::default(),
            Duration::from_secs(24 * 3600),
            &user(u, args.users),
        );
        let mut stream = client
            .subscribe(req)
            .await
            .context("failed to open a Subscribe stream")?
            .into_inner();
        let (tx, ended_early, stop) = (tx.clone(), ended_early.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let message = tokio::select! {
                    () = stop.cancelled() => break,
                    m = stream.message() => m,
                };
                match message {
                    Ok(Some(m)) => {
                        let at_us = now_us();
                        if let Some(n) = m.notification {
                            let _ = tx.send(Received { id: n.id, at_us });
                        }
                    }
                    Ok(None) => break,
                    Err(s) => {
                        if s.code() != tonic::Code::Unavailable {
                            ended_early.fetch_add(1, Ordering::Relaxed);
                            eprintln!("notification-delivery: a stream ended: {s}");
                        }
                        break;
                    }
                }
            }
        });
    }
    drop(tx);
    let open_time = opened.elapsed();
    let distinct = Arc::new(AtomicUsize::new(0));
    let collector = {
        let distinct = distinct.clone();
        tokio::spawn(async move {
            let mut seen: HashMap<String, (i64, u32)> = HashMap::new();
            while let Some(r) = rx.recv().await {
                let e = seen.entry(r.id).or_insert_with(|| {
                    distinct.fetch_add(1, Ordering::Relaxed);
                    (r.at_us, 0)
                });
                e.1 += 1;
            }
            seen
        })
    };

    // The stream of notifications falling due: scheduled `lead` before their due times.
    let total = (args.rate as f64 * args.duration.as_secs_f64()).round() as usize;
    anyhow::ensure!(total > 0, "--rate × --duration is below one notification");
    let step_us = 1e6 / args.rate as f64;
    let lead_us = i64::try_from(args.lead.as_micros())?;
    eprintln!(
        "notification-delivery: {} falling due at {}/s over {:?}",
        thousands(total as f64),
        thousands(args.rate as f64),
        args.duration
    );
    if !args.via_schedule {
        // Written beforehand, due from when the writing is sure to be over (at the backlog's
        // pace, with room to spare): the rows first, so that a claimed entry finds its row.
        let secs = total as f64 / (args.scheduled.max(1) as f64 / backlog.as_secs_f64().max(1e-3));
        let t0_us = now_us()
            + lead_us
            + i64::try_from(Duration::from_secs_f64(secs * 2.0 + 1.0).as_micros())?;
        let rate = i64::try_from(args.rate)?;
        let written = Instant::now();
        write_scheduled(
            args,
            prefix,
            database_url,
            total,
            "9000",
            t0_us,
            1_000_000,
            rate,
        )
        .await?;
        let feed_time = written.elapsed();
        let expected: HashMap<String, i64> = (0..total)
            .map(|i| {
                (
                    id("9000", i),
                    t0_us + i64::try_from(i).unwrap_or(0) * 1_000_000 / rate,
                )
            })
            .collect();
        let last_due_us = t0_us + i64::try_from(total - 1)? * 1_000_000 / rate;
        anyhow::ensure!(
            now_us() < t0_us,
            "writing the due notifications overran their due time"
        );
        let grace_us = i64::try_from(args.grace.as_micros())?;
        while distinct.load(Ordering::Relaxed) < expected.len() && now_us() < last_due_us + grace_us
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        stop.cancel();
        let seen = collector.await?;
        Outcome {
            total,
            backlog,
            open_time,
            feed_time,
            schedule_errors: 0,
            scheduled_late: 0,
            schedule_latency: Samples::new(),
            expected,
            ended_early: ended_early.load(Ordering::Relaxed),
        }
        .report(args, &seen, report);
        return Ok(());
    }
    let permits = Arc::new(Semaphore::new(args.in_flight));
    // Per call: the id, its due time, how long the call took, whether it returned after the due
    // time (then the replica delivered it within the call).
    let (done_tx, mut done_rx) =
        mpsc::unbounded_channel::<anyhow::Result<(String, i64, i64, bool)>>();
    let started = Instant::now();
    let t0_us = now_us() + lead_us;
    let mut tick = tokio::time::interval(Duration::from_millis(5));
    let mut i = 0usize;
    while i < total {
        tick.tick().await;
        let until = total.min((started.elapsed().as_secs_f64() * args.rate as f64) as usize + 1);
        while i < until {
            let permit = permits.clone().acquire_owned().await?;
            let due_us = t0_us + (i as f64 * step_us) as i64;
            let mut client = schedulers[i % schedulers.len()].clone();
            let req = ecoscan_common::client::request_as(
                ScheduleRequest {
                    kind: "bench".to_owned(),
                    title: format!("due {i}"),
                    due_at: Some(Timestamp {
                        seconds: due_us.div_euclid(1_000_000),
                        nanos: i32::try_from(due_us.rem_euclid(1_000_000) * 1000)?,
                    }),
                    ..Default::default()
                },
                Duration::from_secs(30),
                &user(i, args.users),
            );
            let done_tx = done_tx.clone();
            tokio::spawn(async move {
                let sent = Instant::now();
                let r = client.schedule(req).await;
                let took = i64::try_from(sent.elapsed().as_micros()).unwrap_or(i64::MAX);
                let late = now_us() > due_us;
                drop(permit);
                let _ = done_tx.send(
                    r.map_err(anyhow::Error::from)
                        .and_then(|r| {
                            r.into_inner()
                                .notification
                                .context("Schedule answered without the notification")
                        })
                        .map(|n| (n.id, due_us, took, late)),
                );
            });
            i += 1;
        }
    }
    let feed_time = started.elapsed();
    drop(done_tx);
    let mut expected: HashMap<String, i64> = HashMap::with_capacity(total);
    let mut schedule_errors = 0usize;
    let mut scheduled_late = 0usize;
    let mut schedule_latency = Samples::new();
    let mut first_error = None;
    while let Some(r) = done_rx.recv().await {
        match r {
            Ok((id, due_us, took, late)) => {
                scheduled_late += usize::from(late);
                schedule_latency.push(Duration::from_micros(u64::try_from(took).unwrap_or(0)));
                expected.insert(id, due_us);
            }
            Err(e) => {
                schedule_errors += 1;
                first_error.get_or_insert(e);
            }
        }
    }
    if let Some(e) = &first_error {
        eprintln!("notification-delivery: {schedule_errors} Schedule calls failed, first: {e:#}");
    }

    // Wait for everything scheduled to arrive, at most `grace` after the last due time.
    let last_due_us = t0_us + (total.saturating_sub(1) as f64 * step_us) as i64;
    let grace_us = i64::try_from(args.grace.as_micros())?;
    let until_us = last_due_us.max(now_us()) + grace_us;
    while distinct.load(Ordering::Relaxed) < expected.len() && now_us() < until_us {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A moment more for duplicates on their way.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.cancel();
    let seen = collector.await?;
    let outcome = Outcome {
        total,
        backlog,
        open_time,
        feed_time,
        schedule_errors,
        scheduled_late,
        schedule_latency,
        expected,
        ended_early: ended_early.load(Ordering::Relaxed),
    };
    outcome.report(args, &seen, report);
    Ok(())
}

/// What the run measured besides what the subscribers saw.
struct Outcome {
    total: usize,
    backlog: Duration,
    open_time: Duration,
    feed_time: Duration,
    schedule_errors: usize,
    /// `Schedule` calls that returned after the notification's due time.
    scheduled_late: usize,
    schedule_latency: Samples,
    /// Scheduled notifications: id → due time (µs).
    expected: HashMap<String, i64>,
    ended_early: usize,
}

impl Outcome {
    /// `seen`: id → (first arrival, arrivals) as the subscribers saw them.
    fn report(mut self, args: &Args, seen: &HashMap<String, (i64, u32)>, report: &mut Report) {
        let mut latency = Samples::new();
        let (mut lost, mut duplicated, mut early) = (0usize, 0usize, 0usize);
        let (mut first_at, mut last_at) = (i64::MAX, i64::MIN);
        for (id, due_us) in &self.expected {
            let Some(&(at_us, count)) = seen.get(id) else {
                lost += 1;
                continue;
            };
            if count > 1 {
                duplicated += 1;
            }
            if at_us < *due_us {
                early += 1;
            }
            first_at = first_at.min(at_us);
            last_at = last_at.max(at_us);
            latency.push(Duration::from_micros(
                u64::try_from(at_us - due_us).unwrap_or(0),
            ));
        }
        let unexpected = seen
            .keys()
            .filter(|id| !self.expected.contains_key(*id))
            .count();
        let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1000.0);
        let (p50, p99) = (latency.percentile(50.0), latency.percentile(99.0));
        let received = self.expected.len() - lost;
        let span = Duration::from_micros(u64::try_from(last_at - first_at).unwrap_or(0));
        report
            .header(
                "settings",
                format!(
                    "{} scheduled beforehand (due over the next day); {} falling due at {}/s for {:?}, \
                     {}; {} replicas, \
                     {} users with one live `Subscribe` stream each (user u on replica u mod {}); \
                     grace {:?}",
                    thousands(args.scheduled as f64),
                    thousands(self.total as f64),
                    thousands(args.rate as f64),
                    args.duration,
                    if args.via_schedule {
                        format!(
                            "each scheduled {:?} ahead through `Schedule` (≤ {} in flight)",
                            args.lead, args.in_flight
                        )
                    } else {
                        format!(
                            "written beforehand as the backlog is (in {})",
                            fmt_duration(self.feed_time)
                        )
                    },
                    args.replicas,
                    thousands(args.users as f64),
                    args.replicas,
                    args.grace,
                ),
            )
            .measure(Figure::new("due → delivered p50", ms(p50), "ms"))
            .measure(Figure::new("due → delivered p99", ms(p99), "ms").at_most(200.0))
            .measure(Figure::new("lost", Some(lost as f64), "notifications").at_most(0.0))
            .measure(
                Figure::new("delivered twice", Some(duplicated as f64), "notifications")
                    .at_most(0.0),
            )
            .info(
                "due → delivered p90 / max",
                format!(
                    "{} / {}",
                    fmt_opt(latency.percentile(90.0)),
                    fmt_opt(latency.max())
                ),
            )
            .info(
                "received / scheduled",
                format!(
                    "{} / {} (delivery rate {})",
                    thousands(received as f64),
                    thousands(self.expected.len() as f64),
                    if span.is_zero() {
                        "–".to_owned()
                    } else {
                        fmt_rate(received, span)
                    }
                ),
            )
            .info(
                "`Schedule` calls: failed; returned after the due time; p50 / p99",
                format!(
                    "{}; {}; {} / {} (sent over {})",
                    self.schedule_errors,
                    self.scheduled_late,
                    fmt_opt(self.schedule_latency.percentile(50.0)),
                    fmt_opt(self.schedule_latency.percentile(99.0)),
                    fmt_duration(self.feed_time)
                ),
            )
            .info(
                "received before the due time / not scheduled by the run / streams ended early",
                format!("{early} / {unexpected} / {}", self.ended_early),
            )
            .info(
                "backlog written (rows via psql, then Redis) / streams opened",
                format!(
                    "{} ({}) / {}",
                    fmt_duration(self.backlog),
                    fmt_rate(args.scheduled, self.backlog),
                    fmt_duration(self.open_time)
                ),
            )
            .info("load average", system::loadavg());
    }
}

/// Waits until the replica answers a `List` (its database and Redis are up), at most 30 s.
async fn wait_serving(mut client: Client) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let req = ecoscan_common::client::request_as(
            ListRequest { limit: 1 },
            Duration::from_secs(5),
            "bench-user-0",
        );
        match client.list(req).await {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                anyhow::bail!("a notification replica did not answer within 30 s: {e}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Id `i` of a batch: UUID-shaped, `tag` telling the backlog from the notifications falling due.
fn id(tag: &str, i: usize) -> String {
    format!("00000000-0000-7000-{tag}-{i:012}")
}

/// The backlog: `--scheduled` notifications due over the next day (after the run).
async fn write_backlog(args: &Args, prefix: &str, database_url: &str) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let hour_us = 3_600_000_000i64;
    let n = i64::try_from(args.scheduled.max(1))?;
    eprintln!(
        "notification-delivery: writing a backlog of {}",
        thousands(args.scheduled as f64)
    );
    write_scheduled(
        args,
        prefix,
        database_url,
        args.scheduled,
        "8000",
        now_us() + hour_us,
        23 * hour_us,
        n,
    )
    .await?;
    Ok(started.elapsed())
}

/// Writes `count` scheduled notifications, `i` due at `base + i × num / den` µs: the rows
/// server-side in batches (one `INSERT … SELECT generate_series` each), then the same ids into
/// the Redis due set the replicas claim from.
#[allow(clippy::too_many_arguments)] // One call site per use; a struct would only rename them.
async fn write_scheduled(
    args: &Args,
    prefix: &str,
    database_url: &str,
    count: usize,
    tag: &str,
    base: i64,
    num: i64,
    den: i64,
) -> anyhow::Result<()> {
    const BATCH: usize = 100_000;
    let now = now_us();
    let mut from = 0;
    while from < count {
        let to = (from + BATCH).min(count);
        psql(
            database_url,
            &format!(
                "INSERT INTO notifications (id, user_id, kind, title, body, job_id, dedupe_key, \
                 status, due_at_us, created_at_us, delivered_at_us) \
                 SELECT '00000000-0000-7000-{tag}-' || lpad(g::text, 12, '0'), \
                 'bench-user-' || (g % {users}), 'bench', 'due ' || g, '', '', NULL, 'scheduled', \
                 {base} + g::bigint * {num} / {den}, {now}, NULL \
                 FROM generate_series({from}, {last}) g",
                users = args.users,
                last = to - 1,
            ),
        )
        .await?;
        from = to;
    }
    // Statistics, as autovacuum would gather them a minute or so after a load like this one:
    // without any, PostgreSQL ANDs the whole partial index of scheduled rows into every marking
    // statement (measured on 1.6M rows: 70 ms for 250 ids instead of 5 ms), and the run measures
    // a planner that has not looked at the table yet rather than delivery.
    psql(database_url, "ANALYZE notifications").await?;
    let scheduler = RedisScheduler::connect(&args.redis_url, prefix, Duration::from_millis(100))
        .await
        .with_context(|| format!("notification-delivery needs Redis at {}", args.redis_url))?;
    let mut from = 0;
    while from < count {
        let to = (from + BATCH).min(count);
        let entries: Vec<(String, i64)> = (from..to)
            .map(|g| (id(tag, g), base + i64::try_from(g).unwrap_or(0) * num / den))
            .collect();
        scheduler.add_many(&entries).await?;
        from = to;
    }
    Ok(())
}

/// Runs one SQL statement with `psql` against `url`.
async fn psql(url: &str, sql: &str) -> anyhow::Result<()> {
    let out = tokio::process::Command::new("psql")
        .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", url, "-c", sql])
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .context("failed to run psql")?;
    anyhow::ensure!(
        out.status.success(),
        "psql failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// Unlinks every key under `prefix`; returns how many there were.
async fn remove_keys(url: &str, prefix: &str) -> anyhow::Result<usize> {
    let mut conn = redis::Client::open(url)?
        .get_multiplexed_async_connection()
        .await?;
    Ok(ecoscan_redis::unlink_prefixed(&mut conn, prefix).await?)
}
