//! `analytics-ingest`: 10 KB LLM-call events into AnalyticsService, acknowledged after commit.
//!
//! Runs the analytics service in this process on PostgreSQL + S3 when `DATABASE_URL`
//! (`postgres://…`) and `S3_ENDPOINT` + `S3_BUCKET` are set, else on SQLite + a local directory,
//! and calls it over one shared HTTP/2 channel, as vision and answer do. Two phases:
//!
//! 1. a fixed offered rate (default 2,000/s) of unary `Record` calls, open loop: each call's
//!    latency is measured from when it was due to be sent, so a server that falls behind is
//!    charged for the wait;
//! 2. the maximum sustained rate, closed loop: `RecordStream` (streams of many calls, acked
//!    once after commit, as the services report) and unary `Record` with many calls in flight.
//!
//! On S3 the bodies go under a key prefix of the benchmark's own, deleted before each phase
//! and at the end (not timed), so every run meets the same bucket (the rows stay).
//!
//! ```sh
//! cargo run --release -p ecoscan-bench --bin analytics-ingest
//! ```

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::Context as _;
use clap::Parser;
use ecoscan_bench::{
    report::{Figure, Report, Verdict},
    scrape,
    stats::{Samples, fmt_opt, fmt_rate, thousands},
    system,
};
use ecoscan_common::client::TracedChannel;
use ecoscan_proto::v1::{
    CallStatus, LlmCall, RecordRequest, RecordStreamRequest,
    analytics_service_client::AnalyticsServiceClient,
};
use rand::Rng as _;
use tokio::{sync::Mutex, task::JoinSet};

#[derive(Parser, Debug)]
#[command(about = "10 KB LLM-call events into AnalyticsService: latency at a fixed rate, max rate")]
struct Args {
    /// Offered rate of the fixed-rate phase (calls per second).
    #[arg(long, default_value_t = 2000)]
    rate: u32,
    /// Length of each fixed-rate run.
    #[arg(long, default_value = "60s", value_parser = ecoscan_bench::parse_duration)]
    rate_duration: Duration,
    /// Fixed-rate runs, one after another: the tail is reported as their median and spread.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Length of each maximum-rate run.
    #[arg(long, default_value = "10s", value_parser = ecoscan_bench::parse_duration)]
    max_duration: Duration,
    /// Concurrent `RecordStream` streams in the maximum-rate run.
    #[arg(long, default_value_t = 8)]
    streams: usize,
    /// Batches the writer may have on their way to the stores at once (the service's
    /// `ANALYTICS_BATCH_IN_FLIGHT`; default: the service's default).
    #[arg(long)]
    batch_in_flight: Option<usize>,
    /// Calls per `RecordStream` stream.
    #[arg(long, default_value_t = 250)]
    stream_calls: usize,
    /// Unary `Record` calls in flight in the maximum-rate run.
    #[arg(long, default_value_t = 512)]
    in_flight: usize,
    /// Request plus response body bytes of each call.
    #[arg(long, default_value_t = 10 * 1024)]
    body_bytes: usize,
}

/// Pre-made bodies, so that generating 50 MB/s of text does not compete with the server.
struct Bodies(Vec<String>);

impl Bodies {
    fn new(bytes: usize) -> Self {
        let mut rng = rand::rng();
        Self(
            (0..64)
                .map(|_| {
                    (0..bytes)
                        .map(|_| char::from(rng.random_range(b'a'..=b'z')))
                        .collect()
                })
                .collect(),
        )
    }

    fn call(&self, i: usize) -> LlmCall {
        let body = &self.0[i % self.0.len()];
        let half = body.len() / 2;
        LlmCall {
            call_id: uuid::Uuid::new_v4().to_string(),
            service: "bench".to_owned(),
            provider: "mock".to_owned(),
            model: "mock".to_owned(),
            operation: "answer".to_owned(),
            input_tokens: 1200,
            output_tokens: 300,
            latency_ms: 8000.0,
            ttft_ms: 2000.0,
            status: CallStatus::Ok as i32,
            error: String::new(),
            request_body: body[..half].to_owned(),
            response_body: body[half..].to_owned(),
            job_id: uuid::Uuid::new_v4().to_string(),
            trace_id: String::new(),
            started_at: Some(ecoscan_proto::now()),
            ..LlmCall::default()
        }
    }
}

type Client = AnalyticsServiceClient<TracedChannel>;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    ecoscan_bench::init_logs();
    anyhow::ensure!(
        args.rate > 0
            && args.runs > 0
            && args.streams > 0
            && args.stream_calls > 0
            && args.in_flight > 0,
        "rates and concurrencies must be positive"
    );
    let mut report = Report::new("analytics-ingest");
    system::raise_fd_limit(8192);

    let dir = tempfile::tempdir().context("failed to create a temporary data directory")?;
    let mut config = ecoscan_analytics::Config {
        database_url: format!(
            "sqlite://{}?mode=rwc",
            dir.path().join("analytics.db").display()
        ),
        bodies: ecoscan_analytics::ObjectStoreConfig::Local(dir.path().join("bodies")),
        ..ecoscan_analytics::Config::default()
    }
    .with_stores_from_env()?;
    if let Some(n) = args.batch_in_flight {
        config.batch_in_flight = n;
    }
    // This run's bodies under a key prefix of its own, deleted before each measured phase and
    // at the end: an S3 stand-in that holds every body in memory (moto) slows down as gigabytes
    // pile up over the runs (60 s at 2,000/s is 1.2 GB of 10 KB bodies), which would make the
    // later runs measure the stand-in rather than analytics. What S3 holds at the start of
    // each run is the same, as with a real bucket whose size does not matter.
    let bodies_written = match &mut config.bodies {
        ecoscan_analytics::ObjectStoreConfig::S3(s3) => {
            s3.key_prefix = format!("{}bench-{}/", s3.key_prefix, uuid::Uuid::new_v4().simple());
            Some(s3.clone())
        }
        ecoscan_analytics::ObjectStoreConfig::Local(_) => None,
    };
    let clear_bodies = || async {
        if let Some(s3) = &bodies_written {
            let started = Instant::now();
            match ecoscan_objects::S3ObjectStore::connect(s3.clone()).await {
                Ok(store) => match store.delete_all().await {
                    Ok(n) => eprintln!(
                        "analytics-ingest: deleted the {n} body objects of the last phase in {:.1} s",
                        started.elapsed().as_secs_f64()
                    ),
                    Err(e) => eprintln!("analytics-ingest: failed to delete the bodies: {e}"),
                },
                Err(e) => {
                    eprintln!("analytics-ingest: failed to reach S3 to delete the bodies: {e}")
                }
            }
        }
    };
    let on_s3 = bodies_written.is_some();
    let on_postgres = config.database_url.starts_with("postgres");
    let stores = format!(
        "{} rows, bodies in {}",
        if on_postgres { "PostgreSQL" } else { "SQLite" },
        if on_s3 { "S3" } else { "a local directory" }
    );
    let batch = format!(
        "group commit ≤ {} rows, linger {:?}, queue {}, {} batch(es) on their way at once",
        config.batch_max_rows, config.batch_linger, config.queue_capacity, config.batch_in_flight
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let shutdown = ecoscan_common::CancellationToken::new();
    let server = tokio::spawn(ecoscan_analytics::serve(config, listener, shutdown.clone()));
    let client = Client::new(ecoscan_common::client::channel(&format!("http://{addr}"))?)
        .max_encoding_message_size(ecoscan_common::server::MAX_MESSAGE_BYTES);
    let bodies = Arc::new(Bodies::new(args.body_bytes));
    wait_serving(&client, &bodies).await?;
    eprintln!("analytics-ingest: {stores}; warming up");
    // A short warm-up: connections, prepared statements, the first batch objects.
    closed_loop_unary(&client, &bodies, 64, Duration::from_secs(2)).await;

    // Each run's tail on its own: one stall decides one run's p99, the median of the runs says
    // what is usual and the spread how much it varies.
    let mut fixed = Run::default();
    let (mut p95s, mut p99s) = (Vec::new(), Vec::new());
    for n in 1..=args.runs {
        clear_bodies().await;
        eprintln!(
            "analytics-ingest: fixed rate {}/s for {:?}, run {n} of {}",
            args.rate, args.rate_duration, args.runs
        );
        let mut run = fixed_rate(&client, &bodies, args.rate, args.rate_duration).await;
        let ms = |d: Option<Duration>| d.map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0);
        p95s.push(ms(run.latencies.percentile(95.0)));
        p99s.push(ms(run.latencies.percentile(99.0)));
        fixed.acked += run.acked;
        fixed.elapsed += run.elapsed;
        for (k, n) in run.errors {
            *fixed.errors.entry(k).or_default() += n;
        }
        fixed.latencies.extend(run.latencies.into_values());
    }
    clear_bodies().await;
    eprintln!(
        "analytics-ingest: RecordStream, {} streams × {} calls, {:?}",
        args.streams, args.stream_calls, args.max_duration
    );
    let streamed = closed_loop_streams(
        &client,
        &bodies,
        args.streams,
        args.stream_calls,
        args.max_duration,
    )
    .await;
    clear_bodies().await;
    eprintln!(
        "analytics-ingest: Record, {} in flight, {:?}",
        args.in_flight, args.max_duration
    );
    let unary = closed_loop_unary(&client, &bodies, args.in_flight, args.max_duration).await;

    let http = reqwest::Client::new();
    let metrics = format!("http://{addr}/metrics");
    let rows_sum = scrape(&http, &metrics, "analytics_batch_rows_sum").await;
    let rows_count = scrape(&http, &metrics, "analytics_batch_rows_count").await;
    let commit_sum = scrape(&http, &metrics, "analytics_commit_duration_seconds_sum").await;
    shutdown.cancel();
    let _ = server.await;
    clear_bodies().await;

    let mut fixed_lat = fixed.latencies;
    let p95 = fixed_lat.percentile(95.0);
    let fixed_rate = fixed.acked as f64 / fixed.elapsed.as_secs_f64().max(1e-9);
    let max_rate = streamed.rate().max(unary.rate());
    let rate_label = format!("at {}/s, {:?} per run", args.rate, args.rate_duration);
    // The design's target: p99 ≤ 20 ms at 2,000/s in each run, so the worst run is the
    // figure; the p95 is context (its median over the runs). At a lower offered rate, both are.
    let p99_runs =
        Figure::worst_of_runs(&format!("latency p99 {rate_label}, worst run"), &p99s, "ms");
    let p95_runs = Figure::of_runs(&format!("latency p95 {rate_label}"), &p95s, "ms");
    let p99_runs = if args.rate >= 2000 {
        p99_runs.at_most(20.0)
    } else {
        p99_runs
    };
    report
        .measure(p99_runs)
        .measure(p95_runs)
        .figure({
            let f = Figure::new("max sustained, RecordStream", Some(streamed.rate()), "/s");
            if on_s3 { f.at_least(20_000.0) } else { f }
        })
        .figure(Figure::new("max sustained, Record", Some(unary.rate()), "/s"))
        .header(
            "settings",
            format!(
                "{} B bodies per call (request + response), {batch}; one HTTP/2 channel; fixed rate {}/s, {} runs of {:?}; max-rate runs of {:?} each",
                args.body_bytes, args.rate, args.runs, args.rate_duration, args.max_duration
            ),
        )
        .header("stores", stores.clone())
        .row(
            &format!(
                "latency at {}/s offered (Record, open loop), all {} runs together, p50 / p95 / p99",
                args.rate, args.runs
            ),
            format!(
                "{} / {} / {}",
                fmt_opt(fixed_lat.percentile(50.0)),
                fmt_opt(p95),
                fmt_opt(fixed_lat.percentile(99.0))
            ),
            "p99 ≤ 20 ms at 2,000/s in each run",
            Verdict::of(
                args.rate >= 2000 && !p99s.is_empty() && p99s.iter().all(|p| *p <= 20.0),
            ),
        )
        .info(
            "achieved in the fixed-rate phase",
            format!(
                "{}/s ({} acked, errors: {})",
                thousands(fixed_rate),
                thousands(fixed.acked as f64),
                kinds(&fixed.errors)
            ),
        )
        .row(
            "max sustained, RecordStream",
            format!(
                "{} ({} acked in {:.1} s, {} streams × {} calls; errors: {})",
                fmt_rate(streamed.acked, streamed.elapsed),
                thousands(streamed.acked as f64),
                streamed.elapsed.as_secs_f64(),
                args.streams,
                args.stream_calls,
                kinds(&streamed.errors)
            ),
            "≥ 20,000/s with bodies in S3",
            if on_s3 {
                Verdict::of(streamed.rate() >= 20_000.0)
            } else {
                Verdict::Info
            },
        )
        .row(
            "max sustained, Record (unary)",
            format!(
                "{} ({} acked in {:.1} s, {} in flight; errors: {})",
                fmt_rate(unary.acked, unary.elapsed),
                thousands(unary.acked as f64),
                unary.elapsed.as_secs_f64(),
                args.in_flight,
                kinds(&unary.errors)
            ),
            "(the design's ≥ 20,000/s is for RecordStream, which callers use)",
            Verdict::Info,
        )
        .info(
            "group commit over the whole run",
            match (rows_sum, rows_count, commit_sum) {
                (Some(rows), Some(n), Some(secs)) if n > 0.0 => format!(
                    "{} batches, {:.0} rows per batch on average, {:.1} ms per commit (bodies object + rows)",
                    thousands(n),
                    rows / n,
                    secs * 1000.0 / n
                ),
                _ => "not reported".to_owned(),
            },
        );
    if !on_s3 {
        report.note(format!(
            "Bodies went to a local directory, not S3 (set S3_ENDPOINT and S3_BUCKET, and a postgres:// DATABASE_URL, for the target's configuration); best rate here {}/s.",
            thousands(max_rate)
        ));
    }
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

/// Waits until the service records a call (its store is open), for at most 30 s.
async fn wait_serving(client: &Client, bodies: &Bodies) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match client
            .clone()
            .record(reported(RecordRequest {
                call: Some(bodies.call(0)),
            }))
            .await
        {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => {
                anyhow::bail!("analytics did not start within 30 s: {e}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

#[derive(Default)]
struct Run {
    acked: usize,
    errors: BTreeMap<String, usize>,
    latencies: Samples,
    elapsed: Duration,
}

impl Run {
    fn rate(&self) -> f64 {
        self.acked as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Counts one round's outcome: the calls it got acknowledged and its latency, or, when it
    /// failed, its `calls` as errors under the status code.
    fn count(&mut self, outcome: Result<usize, tonic::Status>, calls: usize, latency: Duration) {
        match outcome {
            Ok(acked) => {
                self.acked += acked;
                self.latencies.push(latency);
            }
            Err(s) => *self.errors.entry(code(&s)).or_default() += calls,
        }
    }
}

fn code(s: &tonic::Status) -> String {
    ecoscan_common::codes::code_name(s.code()).to_owned()
}

/// The tally of a run once every one of its `tasks` is done, timed from `start`.
async fn finish(mut tasks: JoinSet<()>, run: &Mutex<Run>, start: Instant) -> Run {
    while tasks.join_next().await.is_some() {}
    let mut r = std::mem::take(&mut *run.lock().await);
    r.elapsed = start.elapsed();
    r
}

/// Open loop: a call is due every 1/rate s; each is sent on its own task at its due time and
/// its latency counts from that due time.
async fn fixed_rate(client: &Client, bodies: &Arc<Bodies>, rate: u32, duration: Duration) -> Run {
    let run = Arc::new(Mutex::new(Run::default()));
    let total = (f64::from(rate) * duration.as_secs_f64()).round() as usize;
    let interval = Duration::from_secs_f64(1.0 / f64::from(rate));
    let start = tokio::time::Instant::now();
    let mut tasks = JoinSet::new();
    for i in 0..total {
        let due = start + interval.mul_f64(i as f64);
        // Timers have millisecond resolution: calls due within the same millisecond go out
        // together, and one already due is sent at once.
        tokio::time::sleep_until(due).await;
        let (mut client, run, call) = (client.clone(), run.clone(), bodies.call(i));
        tasks.spawn(async move {
            let outcome = client
                .record(reported(RecordRequest { call: Some(call) }))
                .await;
            let latency = due.elapsed();
            run.lock().await.count(outcome.map(|_| 1), 1, latency);
        });
    }
    finish(tasks, &run, start.into_std()).await
}

/// Closed loop: `workers` tasks each make one round after another until `duration` ends.
/// `round(w, n)` builds worker `w`'s `n`th round and returns it as a future of its outcome (the
/// calls acknowledged) and the calls it carries; its latency runs from before it is built.
async fn closed_loop<F, Fut>(workers: usize, duration: Duration, round: F) -> Run
where
    F: Fn(usize, usize) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = (Result<usize, tonic::Status>, usize)> + Send,
{
    let run = Arc::new(Mutex::new(Run::default()));
    let start = Instant::now();
    let end = start + duration;
    let mut tasks = JoinSet::new();
    for w in 0..workers {
        let (round, run) = (round.clone(), run.clone());
        tasks.spawn(async move {
            let mut n = 0;
            while Instant::now() < end {
                let sent = Instant::now();
                let (outcome, calls) = round(w, n).await;
                let mut r = run.lock().await;
                r.count(outcome, calls, sent.elapsed());
                n += 1;
            }
        });
    }
    finish(tasks, &run, start).await
}

/// Closed loop: `in_flight` workers each send one `Record` after another until `duration` ends.
async fn closed_loop_unary(
    client: &Client,
    bodies: &Arc<Bodies>,
    in_flight: usize,
    duration: Duration,
) -> Run {
    let (client, bodies) = (client.clone(), bodies.clone());
    closed_loop(in_flight, duration, move |w, n| {
        let mut client = client.clone();
        let call = bodies.call(w + n * in_flight);
        async move {
            let outcome = client
                .record(reported(RecordRequest { call: Some(call) }))
                .await;
            (outcome.map(|_| 1), 1)
        }
    })
    .await
}

/// Closed loop: `streams` workers each open one `RecordStream` after another, `calls` calls
/// each, until `duration` ends; a stream's calls count when its single ack arrives.
async fn closed_loop_streams(
    client: &Client,
    bodies: &Arc<Bodies>,
    streams: usize,
    calls: usize,
    duration: Duration,
) -> Run {
    let (client, bodies) = (client.clone(), bodies.clone());
    closed_loop(streams, duration, move |w, n| {
        let mut client = client.clone();
        let first = (w + n * streams) * calls;
        let batch: Vec<RecordStreamRequest> = (first..first + calls)
            .map(|i| RecordStreamRequest {
                call: Some(bodies.call(i)),
            })
            .collect();
        async move {
            let outcome = client.record_stream(futures::stream::iter(batch)).await;
            let acked = outcome.map(|resp| {
                let resp = resp.into_inner();
                usize::try_from(resp.recorded + resp.duplicates).unwrap_or(0)
            });
            (acked, calls)
        }
    })
    .await
}

/// `message` as vision reports its model calls: signed as itself (recording needs an identity).
fn reported<T>(message: T) -> tonic::Request<T> {
    ecoscan_common::client::by_actor(tonic::Request::new(message), "vision")
}
