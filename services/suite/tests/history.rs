//! The history checker: does the event contract hold for every client under every fault?
//!
//! Every service runs as its own process (the real gateway, ingest and stage processes) on
//! PostgreSQL (a schema of the test's own), S3 (a bucket of its own) and a Redis of the test's
//! own: one private `redis-server`, or a private three-master Redis Cluster. The vision and
//! answer stages call a scripted OpenAI-compatible model on loopback
//! ([`history/model.rs`](history/model.rs)) that cuts some answer streams mid-answer.
//!
//! A bounded number of scans go in through the gateway, each watched by several SSE clients
//! over HTTP that read the raw bytes, drop at planned points (mid-event too) and resume with
//! their last id in `Last-Event-ID`; others resume at the final id once the gateway's feed
//! for the job is gone, past the end, from inside a log that expired (deleted by the test),
//! from another job's id, or with a malformed id.
//! Meanwhile, one at a time, in an order and at moments drawn from the seed: Redis restarted
//! empty (one server), Redis at `maxmemory`, a job's log key turned into a string, `CLIENT
//! PAUSE` past the lease, SIGKILL of ingest and of the gateway, a Cluster slot moved while its
//! jobs stream (Cluster).
//!
//! Each client's history is then checked against the contract
//! ([`history/contract.rs`](history/contract.rs), where its rules live) and the stores; one
//! summary line is printed, and the test fails listing the violations.
//!
//! `HISTORY_SEED=<n>` replays another seed (the default is fixed); the plan (scans, clients,
//! drop points, faults and their order) follows from it.

mod common;
mod support;

#[path = "history/client.rs"]
mod client;
#[path = "history/contract.rs"]
mod contract;
#[path = "history/faults.rs"]
mod faults;
#[path = "history/model.rs"]
mod model;
#[path = "history/observer.rs"]
mod observer;
#[path = "history/record.rs"]
mod record;

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
    time::Duration,
};

use contract::{EventId, History, Kind, Stored, Violation};
use ecoscan_proto::v1::JobStatus;
use faults::{Fault, Nodes, Targets};
use support::{
    processes::{Cluster, Service},
    stores::{PrivateCluster, PrivateRedis, TestStores},
};
use tokio::time::Instant;

const DEFAULT_SEED: u64 = 22;
const SCANS: usize = 8;
/// SSE clients following each scan from its start.
const FOLLOWERS: usize = 3;
/// Scans are submitted at an even pace over this long, so that every fault hits scans in flight.
const SUBMIT_OVER: Duration = Duration::from_secs(16);
const LEASE: Duration = Duration::from_secs(2);
/// How long a scan's clients wait for its end, from its submit.
const SCAN_DEADLINE: Duration = Duration::from_secs(50);
/// How long a client that resumes after the end waits for it.
const PROBE_DEADLINE: Duration = Duration::from_secs(20);
const USER: &str = "history-user";
const HINTS: [&str; 3] = ["pet bottle", "can", "milk carton"];
/// `Last-Event-ID`s the gateway must refuse with 400.
const MALFORMED: [&str; 6] = [
    "abc",
    "12-",
    "1-2-3",
    "-5",
    "0x10-0",
    "99999999999999999999-0",
];

/// splitmix64: small and reproducible (the plan must not depend on `rand`'s streams).
pub struct Rng(pub u64);

impl Rng {
    pub fn draw(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.draw() % n.max(1)
    }

    pub fn between(&mut self, lo: Duration, hi: Duration) -> Duration {
        lo + Duration::from_millis(self.below((hi - lo).as_millis() as u64))
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            items.swap(i, self.below(i as u64 + 1) as usize);
        }
    }
}

fn seed() -> u64 {
    std::env::var("HISTORY_SEED")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(DEFAULT_SEED)
}

/// The Redis layout a run uses.
enum Layout {
    Single(PrivateRedis),
    Cluster(PrivateCluster),
}

impl Layout {
    fn name(&self) -> &'static str {
        match self {
            Self::Single(_) => "one Redis",
            Self::Cluster(_) => "Redis Cluster",
        }
    }

    fn faults(&self) -> Vec<Fault> {
        let mut faults = vec![
            Fault::RedisMaxmemory,
            Fault::WrongType,
            Fault::ClientPause,
            Fault::KillIngest,
            Fault::KillGateway,
        ];
        if let Self::Cluster(_) = self {
            faults.push(Fault::MoveSlot);
        }
        faults.push(Fault::RedisRestartEmpty);
        faults
    }
}

/// Submits a scan (again after a refusal while a process restarts, with the same idempotency
/// key) until it is accepted.
async fn submit(http: &reqwest::Client, gateway: &str, i: usize, key: &str) -> Option<String> {
    let until = Instant::now() + Duration::from_secs(30);
    while Instant::now() < until {
        let sent = http
            .post(format!("{gateway}/api/v1/scan"))
            .header("x-user-id", USER)
            .header("idempotency-key", key)
            .multipart(common::image_form(HINTS[i % HINTS.len()]))
            .timeout(Duration::from_secs(10))
            .send()
            .await;
        if let Ok(res) = sent
            && res.status() == 202
            && let Ok(body) = res.json::<serde_json::Value>().await
            && let Some(id) = body["job_id"].as_str()
        {
            return Some(id.to_owned());
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    None
}

/// A follower's plan: 0 to 3 drops at random byte counts, short pauses.
fn follower_plan(
    rng: &mut Rng,
    job: &str,
    kind: Kind,
    after: Option<String>,
    until: Instant,
) -> client::Plan {
    let drops = (0..rng.below(4))
        .map(|_| 150 + rng.below(2500) as usize)
        .collect();
    let pauses = (0..4)
        .map(|_| rng.between(Duration::from_millis(20), Duration::from_millis(800)))
        .collect();
    client::Plan {
        job: job.to_owned(),
        kind,
        first_after: after,
        drops,
        pauses,
        deadline: until,
    }
}

fn probe(job: &str, kind: Kind, after: String) -> client::Plan {
    client::Plan {
        job: job.to_owned(),
        kind,
        first_after: Some(after),
        drops: Vec::new(),
        pauses: Vec::new(),
        deadline: Instant::now() + PROBE_DEADLINE,
    }
}

/// One scan: submit, followers from the start, a client from another job's id; once they
/// are done and the feed is gone, resumes at and past the end; a malformed id now and then.
#[allow(clippy::too_many_arguments)]
async fn scan(
    i: usize,
    seed: u64,
    http: reqwest::Client,
    gateway: String,
    observer: observer::Observer,
    jobs: Arc<Mutex<Vec<String>>>,
    key: String,
) -> (Option<String>, Vec<History>) {
    let mut rng = Rng(seed ^ (i as u64).wrapping_mul(0x517c_c1b7_2722_0a95));
    let Some(job) = submit(&http, &gateway, i, &key).await else {
        return (None, Vec::new());
    };
    observer.watch(&job);
    let other = jobs.lock().expect("jobs lock").last().cloned();
    jobs.lock().expect("jobs lock").push(job.clone());
    let until = Instant::now() + SCAN_DEADLINE;
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..FOLLOWERS {
        let plan = follower_plan(&mut rng, &job, Kind::Follower, None, until);
        let start = rng.between(Duration::ZERO, Duration::from_millis(600));
        let (http, gateway) = (http.clone(), gateway.clone());
        clients.spawn(async move {
            tokio::time::sleep(start).await;
            client::run(&http, &gateway, USER, plan).await
        });
    }
    // From another job's latest id, a moment in.
    if let Some(other) = other {
        let plan = follower_plan(&mut rng, &job, Kind::ForeignId, None, until);
        let start = rng.between(Duration::from_millis(300), Duration::from_secs(3));
        let (http, gateway, observer) = (http.clone(), gateway.clone(), observer.clone());
        clients.spawn(async move {
            tokio::time::sleep(start).await;
            let after = observer.seen(&other).last_id().map(|id| id.to_string());
            let plan = client::Plan {
                first_after: Some(after.unwrap_or_else(|| "1-1".to_owned())),
                ..plan
            };
            client::run(&http, &gateway, USER, plan).await
        });
    }
    if rng.below(2) == 0 {
        let bad = MALFORMED[rng.below(MALFORMED.len() as u64) as usize];
        let plan = probe(&job, Kind::Malformed, bad.to_owned());
        let (http, gateway) = (http.clone(), gateway.clone());
        clients.spawn(async move { client::run(&http, &gateway, USER, plan).await });
    }
    let mut histories = clients.join_all().await;

    // The feed is gone once the last client left; then resume at the final id, and past it.
    tokio::time::sleep(rng.between(Duration::from_millis(1500), Duration::from_secs(3))).await;
    let final_id = observer.seen(&job).final_id().or_else(|| {
        histories
            .iter()
            .flat_map(|h| h.events())
            .filter(|(_, e)| e.is_end())
            .filter_map(|(_, e)| e.id.as_deref().and_then(EventId::parse))
            .max()
    });
    if let Some(EventId(ms, n)) = final_id {
        let past = EventId(ms, n + 1 + rng.below(5));
        let at_end = probe(&job, Kind::AtEnd, EventId(ms, n).to_string());
        let past_end = probe(&job, Kind::PastEnd, past.to_string());
        let (a, b) = tokio::join!(
            client::run(&http, &gateway, USER, at_end),
            client::run(&http, &gateway, USER, past_end)
        );
        histories.extend([a, b]);
        // Its log expired (deleted here): a resume from inside it.
        if rng.below(2) == 0 {
            let mut conn = observer.redis_conn();
            let mut del = redis::cmd("DEL");
            del.arg(observer.log_key(&job));
            let deleted =
                tokio::time::timeout(Duration::from_secs(5), del.query_async::<()>(&mut conn))
                    .await;
            // A position the client could have: an event the log held, not the last.
            let mut held: Vec<EventId> = observer
                .seen(&job)
                .log
                .keys()
                .filter_map(|id| EventId::parse(id))
                .filter(|id| *id < EventId(ms, n))
                .collect();
            held.sort();
            if matches!(deleted, Ok(Ok(()))) && !held.is_empty() {
                let inside = held[rng.below(held.len() as u64) as usize];
                let plan = probe(&job, Kind::Expired, inside.to_string());
                histories.push(client::run(&http, &gateway, USER, plan).await);
            }
        }
    }
    (Some(job), histories)
}

/// Copies every service's log to `<target tmp dir>/history/<layout>-seed<seed>/`.
fn keep_logs(cluster: &Cluster, layout: &Layout, seed: u64) -> std::path::PathBuf {
    let name = match layout {
        Layout::Single(_) => "one-redis",
        Layout::Cluster(_) => "redis-cluster",
    };
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("history")
        .join(format!("{name}-seed{seed}"));
    let _ = std::fs::create_dir_all(&dir);
    for service in Service::ALL {
        let _ = std::fs::write(
            dir.join(format!("{}.log", service.name())),
            cluster.logs(service),
        );
    }
    dir
}

async fn run(layout: Layout) {
    let started = std::time::Instant::now();
    let seed = seed();
    let mut rng = Rng(seed);
    eprintln!(
        "history checker ({}): seed {seed} (HISTORY_SEED replays another)",
        layout.name()
    );
    let (mut layout, stores) = match layout {
        Layout::Single(redis) => {
            let stores = TestStores::create(Some(redis.url())).await;
            (Layout::Single(redis), stores)
        }
        Layout::Cluster(cluster) => {
            let stores = TestStores::create_on(cluster.settings()).await;
            (Layout::Cluster(cluster), stores)
        }
    };
    let nodes = match &layout {
        Layout::Single(r) => Nodes {
            urls: vec![r.url()],
        },
        Layout::Cluster(c) => Nodes { urls: c.urls() },
    };
    let model = model::ScriptedModel::start(seed, 3).await;
    let mut cluster = stores
        .configure(Cluster::builder())
        .env("LLM_PROVIDER", "openai")
        .env("LLM_BASE_URL", model.base_url())
        .env("LLM_TIMEOUT", "5s")
        .env("LLM_MAX_RETRIES", "2")
        .env("LLM_RETRY_BASE_DELAY", "100ms")
        .env("INGEST_LEASE", format!("{}ms", LEASE.as_millis()))
        .env("REDIS_RESPONSE_TIMEOUT", "1s")
        .env("GATEWAY_SCANS_PER_MINUTE", "100000")
        .env("GATEWAY_MAX_SSE_PER_USER", "1000")
        .start()
        .await;
    let gateway = cluster.uri(Service::Gateway);
    let pg = stores.pg().await;
    let observer = observer::Observer::new(stores.redis().await, stores.prefix.clone(), pg.clone());
    let observing = observer.clone().spawn();

    // The scans, at an even pace.
    let http = reqwest::Client::new();
    let jobs: Arc<Mutex<Vec<String>>> = Arc::default();
    // One more scan whenever a fault that acts on a running job finds none free (the planned
    // scans may all have ended by then), so that every fault is injected.
    let (more, mut more_wanted) = tokio::sync::mpsc::unbounded_channel::<()>();
    let scans = {
        let (http, gateway, observer, jobs) = (
            http.clone(),
            gateway.clone(),
            observer.clone(),
            jobs.clone(),
        );
        let prefix = stores.prefix.clone();
        tokio::spawn(async move {
            let mut each = tokio::task::JoinSet::new();
            let mut tick = tokio::time::interval(SUBMIT_OVER / SCANS as u32);
            let mut i = 0;
            let start = |each: &mut tokio::task::JoinSet<_>, i: usize| {
                each.spawn(scan(
                    i,
                    seed,
                    http.clone(),
                    gateway.clone(),
                    observer.clone(),
                    jobs.clone(),
                    format!("{prefix}{i}"),
                ));
            };
            while i < SCANS {
                tick.tick().await;
                start(&mut each, i);
                i += 1;
            }
            // Closed when the faults are done.
            while more_wanted.recv().await.is_some() {
                start(&mut each, i);
                i += 1;
            }
            each.join_all().await
        })
    };

    // The faults, one at a time, in a drawn order with drawn pauses.
    let mut faults = layout.faults();
    rng.shuffle(&mut faults);
    let mut timeline = Vec::new();
    let mut outages = Vec::new();
    let mut taken = Vec::new();
    let mut not_injected: Vec<String> = Vec::new();
    tokio::time::sleep(rng.between(Duration::from_secs(3), Duration::from_secs(5))).await;
    for fault in &faults {
        let at = started.elapsed();
        let (redis, redis_cluster) = match &mut layout {
            Layout::Single(r) => (Some(r), None),
            Layout::Cluster(c) => (None, Some(c)),
        };
        let mut targets = Targets {
            cluster: &mut cluster,
            redis,
            redis_cluster,
            nodes: &nodes,
            observer: &observer,
            lease: LEASE,
            taken: &mut taken,
        };
        if let Some(early) = fault.needs_job()
            && !faults::a_job_is_free(&observer, targets.taken, early)
        {
            let _ = more.send(());
        }
        match faults::inject(*fault, &mut targets).await {
            Ok((what, outage)) => {
                timeline.push(format!("{at:.1?} {fault:?}: {what}"));
                outages.extend(outage);
            }
            Err(e) => {
                not_injected.push(format!("{fault:?}"));
                timeline.push(format!("{at:.1?} {fault:?} NOT INJECTED: {e}"));
            }
        }
        tokio::time::sleep(rng.between(Duration::from_millis(500), Duration::from_secs(2))).await;
    }
    drop(more);
    let scans = scans.await.expect("the scans");
    observer.await_finals(Duration::from_secs(15)).await;
    observing.abort();

    // The stores' side: rows, stored answers, every event the logs were seen holding.
    let seen = observer.all();
    let mut stored: HashMap<String, Stored> = HashMap::new();
    for (job, s) in &seen {
        let answer = record::stored_answer(&http, &gateway, USER, job, s.status).await;
        stored.insert(
            job.clone(),
            Stored {
                log: s.log.clone(),
                last_seq: s.last_seq,
                status: s.status,
                ended_at: s.ended_at(),
                answer,
                outages: outages.clone(),
                store_outages: Vec::new(),
                run_began: started,
            },
        );
    }

    // Check every client.
    let mut violations: Vec<Violation> = Vec::new();
    let (mut clients, mut events, mut resumes, mut drops) = (0, 0, 0, 0);
    let mut submitted = 0;
    for (i, (job, histories)) in scans.iter().enumerate() {
        let Some(job) = job else {
            violations.push(Violation {
                job: format!("#{i}"),
                client: "submit".into(),
                rule: "scan-accepted",
                detail: "the scan was never accepted within 30 s".into(),
            });
            continue;
        };
        submitted += 1;
        let store = &stored[job];
        if store.status.is_none() {
            use sqlx::Row;
            let row = sqlx::query("SELECT status, attempts FROM scan_jobs WHERE id = $1")
                .bind(job)
                .fetch_optional(&pg)
                .await
                .ok()
                .flatten()
                .map(|r| {
                    let status = JobStatus::try_from(r.get::<i32, _>("status"))
                        .map_or("?", |s| s.as_str_name());
                    format!("row {status}, {} attempts", r.get::<i32, _>("attempts"))
                });
            let last = store
                .log
                .values()
                .max_by_key(|e| EventId::parse(&e.event_id))
                .map(|e| format!("seq {} {:?} {:?}", e.seq, e.stage(), e.status()));
            violations.push(Violation {
                job: job.clone(),
                client: "row".into(),
                rule: "job-ends",
                detail: format!(
                    "the job did not end within {SCAN_DEADLINE:?} of its submit ({}; last \
                     logged event: {last:?})",
                    row.unwrap_or_else(|| "no row".into())
                ),
            });
        }
        for (c, h) in histories.iter().enumerate() {
            clients += 1;
            events += h.events().count();
            resumes += h.resumes();
            drops += h.drops();
            let name = format!("#{c} {:?}", h.kind);
            violations.extend(contract::check(&name, h, store));
        }
    }
    // A run that did not do what it set out to proves less than it says: every fault of the
    // plan is injected, and the model cuts at least one answer stream (its first).
    for fault in &not_injected {
        violations.push(Violation {
            job: "-".into(),
            client: "faults".into(),
            rule: "fault-injected",
            detail: format!("{fault} could not be injected (see the timeline)"),
        });
    }
    if model.calls.cut.load(std::sync::atomic::Ordering::Relaxed) == 0 {
        violations.push(Violation {
            job: "-".into(),
            client: "model".into(),
            rule: "model-cut",
            detail: "no answer stream was cut mid-answer".into(),
        });
    }
    let mut by_rule: BTreeMap<&str, usize> = BTreeMap::new();
    for v in &violations {
        *by_rule.entry(v.rule).or_default() += 1;
    }
    let calls = &model.calls;
    use std::sync::atomic::Ordering::Relaxed;
    println!(
        "history checker ({}, seed {seed}): {submitted} scans, {clients} clients, {events} events, \
         {resumes} resumes ({drops} drops), {} faults injected{} + {} model streams cut of {} answer calls, {} violations {by_rule:?} in {:.1?}",
        layout.name(),
        timeline.len() - not_injected.len(),
        if not_injected.is_empty() {
            String::new()
        } else {
            format!(" (not injected: {})", not_injected.join(", "))
        },
        calls.cut.load(Relaxed),
        calls.answer.load(Relaxed),
        violations.len(),
        started.elapsed(),
    );
    eprintln!("faults:\n  {}", timeline.join("\n  "));
    // The processes' logs say why; they go with the cluster's temporary directory.
    if !violations.is_empty() {
        let kept = keep_logs(&cluster, &layout, seed);
        eprintln!("the services' logs of this run are in {}", kept.display());
    }

    drop(cluster);
    pg.close().await;
    drop(stores);
    drop(layout);
    if !violations.is_empty() {
        for v in &violations {
            eprintln!("violation {v}");
        }
        let shown: Vec<String> = violations
            .iter()
            .take(60)
            .map(ToString::to_string)
            .collect();
        panic!(
            "{} violations of the event contract (seed {seed}; first {}):\n  {}",
            violations.len(),
            shown.len(),
            shown.join("\n  ")
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_client_history_keeps_the_event_contract_on_one_redis() {
    run(Layout::Single(PrivateRedis::start().await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_client_history_keeps_the_event_contract_on_a_redis_cluster() {
    run(Layout::Cluster(PrivateCluster::start().await)).await;
}
