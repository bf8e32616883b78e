//! The spool under injected faults: AnalyticsService over a real socket on a SQLite file and a
//! body directory, both wrapped so a test can make them fail (for a while, for a number of
//! calls, or for one kind of batch) — and no acknowledged call may be lost or stored twice.

mod support;

use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use async_trait::async_trait;
use bytes::Bytes;
use ecoscan_analytics::{
    Config, serve_with_stores,
    spool::{CORRUPT_DIR, REJECTED_DIR},
    store::{CallRow, CallStore, SqliteCallStore, StoreError, UsageSample},
};
use ecoscan_common::testing::{Spawned, sample, scrape, spawn};
use ecoscan_objects::{LocalObjectStore, ObjectError, ObjectStore};
use ecoscan_proto::v1::{
    GetCallRequest, LlmCall, RecordRequest, RecordStreamRequest,
    analytics_service_client::AnalyticsServiceClient,
};
use tempfile::TempDir;
use tonic::Code;

// ---------------------------------------------------------------------------------------------
// Stores that fail on demand.

/// When the wrapped object store fails.
#[derive(Debug, Clone, Copy)]
enum Outage {
    None,
    /// Every call fails.
    Always,
    /// The next n calls fail, then it recovers.
    Calls(u32),
    /// Every call fails until then.
    Until(Instant),
}

/// An object store that fails (every method) while its outage lasts, like an S3 that is down.
struct FlakyObjects {
    inner: LocalObjectStore,
    outage: Mutex<Outage>,
    puts: AtomicUsize,
    failures: AtomicUsize,
    /// When set, each put waits for a permit of it (the test holds uploads).
    gate: Option<tokio::sync::Semaphore>,
    /// Puts in progress now, and the most at once so far.
    active: AtomicUsize,
    most_active: AtomicUsize,
}

impl FlakyObjects {
    async fn new(dir: &Path, outage: Outage) -> Arc<Self> {
        Arc::new(Self::open(dir, outage, None).await)
    }

    /// Puts wait until the test adds permits to the gate.
    async fn gated(dir: &Path) -> Arc<Self> {
        let gate = tokio::sync::Semaphore::new(0);
        Arc::new(Self::open(dir, Outage::None, Some(gate)).await)
    }

    async fn open(dir: &Path, outage: Outage, gate: Option<tokio::sync::Semaphore>) -> Self {
        Self {
            inner: LocalObjectStore::open(dir).await.unwrap(),
            outage: Mutex::new(outage),
            puts: AtomicUsize::new(0),
            failures: AtomicUsize::new(0),
            gate,
            active: AtomicUsize::new(0),
            most_active: AtomicUsize::new(0),
        }
    }

    fn set(&self, outage: Outage) {
        *self.outage.lock().unwrap() = outage;
    }

    fn check(&self) -> Result<(), ObjectError> {
        let mut outage = self.outage.lock().unwrap();
        let fail = match *outage {
            Outage::None => false,
            Outage::Always => true,
            Outage::Calls(0) => {
                *outage = Outage::None;
                false
            }
            Outage::Calls(n) => {
                *outage = Outage::Calls(n - 1);
                true
            }
            Outage::Until(t) => Instant::now() < t,
        };
        if fail {
            self.failures.fetch_add(1, Ordering::Relaxed);
            return Err(ObjectError::S3(
                "injected outage: connection refused".into(),
            ));
        }
        Ok(())
    }
}

#[async_trait]
impl ObjectStore for FlakyObjects {
    async fn put(&self, key: &str, body: Bytes) -> Result<(), ObjectError> {
        self.check()?;
        self.puts.fetch_add(1, Ordering::Relaxed);
        let now = self.active.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_active.fetch_max(now, Ordering::SeqCst);
        if let Some(gate) = &self.gate {
            gate.acquire().await.unwrap().forget();
        }
        let put = self.inner.put(key, body).await;
        self.active.fetch_sub(1, Ordering::SeqCst);
        put
    }

    async fn get(&self, key: &str) -> Result<Option<Bytes>, ObjectError> {
        self.check()?;
        self.inner.get(key).await
    }

    async fn delete(&self, key: &str) -> Result<(), ObjectError> {
        self.check()?;
        self.inner.delete(key).await
    }
}

/// Rows in a real SQLite file, with inserts that fail on demand.
struct FlakyRows {
    inner: SqliteCallStore,
    /// The next n inserts fail before writing anything.
    fail: AtomicU32,
    /// The next n inserts commit, then report a failure (a connection lost after COMMIT).
    commit_then_fail: AtomicU32,
    /// Batches holding a call of this job always fail (a batch the database refuses for good).
    poison_job: Mutex<Option<String>>,
}

fn take_one(n: &AtomicU32) -> bool {
    n.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1))
        .is_ok()
}

impl FlakyRows {
    async fn open(url: &str) -> Arc<Self> {
        Arc::new(Self {
            inner: SqliteCallStore::connect(url).await.unwrap(),
            fail: AtomicU32::new(0),
            commit_then_fail: AtomicU32::new(0),
            poison_job: Mutex::new(None),
        })
    }
}

/// An injected failure, as the store reports a database that is down.
fn injected(what: &str) -> StoreError {
    StoreError::Unavailable(sqlx::Error::Protocol(format!("injected: {what}")))
}

#[async_trait::async_trait]
impl CallStore for FlakyRows {
    async fn insert_batch(&self, rows: &[CallRow]) -> Result<HashSet<String>, StoreError> {
        let poison = self.poison_job.lock().unwrap().clone();
        if let Some(job) = poison
            && rows.iter().any(|r| r.job_id == job)
        {
            return Err(injected("the database refuses this batch"));
        }
        if take_one(&self.fail) {
            return Err(injected("the database is down"));
        }
        let inserted = self.inner.insert_batch(rows).await?;
        if take_one(&self.commit_then_fail) {
            return Err(injected("connection lost after commit"));
        }
        Ok(inserted)
    }

    async fn get(&self, call_id: &str) -> Result<Option<CallRow>, StoreError> {
        self.inner.get(call_id).await
    }

    async fn usage_samples(
        &self,
        since_us: i64,
        until_us: i64,
    ) -> Result<Vec<UsageSample>, StoreError> {
        self.inner.usage_samples(since_us, until_us).await
    }

    async fn close(&self) {
        self.inner.close().await;
    }
}

// ---------------------------------------------------------------------------------------------
// The service.

type Client = AnalyticsServiceClient<ecoscan_common::client::TracedChannel>;

/// Everything a test's services share: the database file, the body directory, the spool.
struct Dirs {
    dir: TempDir,
}

impl Dirs {
    fn new() -> Self {
        Self {
            dir: TempDir::new().unwrap(),
        }
    }

    fn db_url(&self) -> String {
        format!(
            "sqlite://{}/analytics.db?mode=rwc",
            self.dir.path().display()
        )
    }

    fn bodies(&self) -> PathBuf {
        self.dir.path().join("bodies")
    }

    fn spool(&self) -> PathBuf {
        self.dir.path().join("spool")
    }

    /// Spooled batches waiting (files at the top of the spool directory).
    fn spooled_files(&self) -> Vec<PathBuf> {
        files_in(&self.spool(), ".batch")
    }

    fn config(&self) -> Config {
        Config {
            spool_dir: Some(self.spool()),
            batch_linger: Duration::from_millis(2),
            store_timeout: Duration::from_secs(2),
            spool_retry_max: Duration::from_millis(200),
            ..Config::default()
        }
    }
}

fn files_in(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut files: Vec<PathBuf> = entries
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file() && p.to_string_lossy().ends_with(suffix))
        .collect();
    files.sort();
    files
}

struct Service {
    server: Spawned,
    client: Client,
}

async fn start(config: Config, rows: Arc<FlakyRows>, objects: Arc<FlakyObjects>) -> Service {
    let server = spawn(move |l, s| serve_with_stores(config, rows, objects, l, s)).await;
    let client =
        AnalyticsServiceClient::new(ecoscan_common::client::channel(&server.uri()).unwrap());
    Service { server, client }
}

impl Service {
    async fn metric(&self, name: &str) -> f64 {
        sample(&scrape(self.server.addr).await, name, &[]).unwrap_or_else(|| panic!("{name}"))
    }

    /// Waits until the spool is empty (the replayer wrote everything); at most `limit`.
    async fn wait_until_drained(&self, limit: Duration) {
        let deadline = Instant::now() + limit;
        loop {
            if self.metric("analytics_spool_batches").await == 0.0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the spool still holds {} batches after {limit:?}",
                self.metric("analytics_spool_batches").await
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn get(&self, call_id: &str) -> Result<LlmCall, tonic::Status> {
        self.client
            .clone()
            .get_call(ecoscan_common::client::as_admin(GetCallRequest {
                call_id: call_id.into(),
            }))
            .await
            .map(|r| r.into_inner().call.unwrap())
    }

    /// Asserts every call in `calls` reads back exactly as sent, bodies included.
    async fn assert_stored(&self, calls: &[LlmCall]) {
        let back = futures::future::join_all(calls.iter().map(|c| self.get(&c.call_id))).await;
        for (sent, back) in calls.iter().zip(back) {
            let back = back.unwrap_or_else(|e| panic!("call {} is missing: {e}", sent.job_id));
            assert_eq!(
                back,
                support::as_recorded(sent),
                "call {} read back differently",
                sent.job_id
            );
        }
    }
}

fn call(i: usize) -> LlmCall {
    let response = if i.is_multiple_of(5) {
        String::new()
    } else {
        format!("응답 {i}")
    };
    support::llm_call(i, format!("request {i} ").repeat(i % 7 + 1), response)
}

async fn record(client: &Client, c: LlmCall) -> Result<bool, tonic::Status> {
    client
        .clone()
        .record(reported(RecordRequest { call: Some(c) }))
        .await
        .map(|r| r.into_inner().duplicate)
}

/// Records `calls` with up to 32 unary calls in flight and one RecordStream per 50 calls of the
/// last fifth; panics unless every call is acknowledged.
async fn record_under_load(client: &Client, calls: &[LlmCall]) {
    let split = calls.len() * 4 / 5;
    let (unary, streamed) = calls.split_at(split);
    let streams = futures::future::join_all(streamed.chunks(50).map(|chunk| {
        let mut client = client.clone();
        let chunk = chunk.to_vec();
        async move {
            let n = chunk.len() as u64;
            let res = client
                .record_stream(reported(tokio_stream::iter(
                    chunk
                        .into_iter()
                        .map(|c| RecordStreamRequest { call: Some(c) }),
                )))
                .await
                .unwrap()
                .into_inner();
            assert_eq!((res.recorded, res.duplicates), (n, 0));
        }
    }));
    let unary = async {
        use futures::StreamExt;
        futures::stream::iter(unary.iter().cloned())
            .for_each_concurrent(32, |c| async move {
                assert!(!record(client, c).await.unwrap(), "not a duplicate");
            })
            .await;
    };
    tokio::join!(streams, unary);
}

async fn count_rows(db_url: &str) -> (i64, i64) {
    let pool = sqlx::SqlitePool::connect(db_url).await.unwrap();
    let counts: (i64, i64) =
        sqlx::query_as("SELECT COUNT(*), COUNT(DISTINCT call_id) FROM llm_calls")
            .fetch_one(&pool)
            .await
            .unwrap();
    pool.close().await;
    counts
}

// ---------------------------------------------------------------------------------------------
// The tests.

/// A service whose uploads wait at the objects' gate, writing up to two batches of `max_rows`
/// at once (the held uploads must not count as a store outage: a long store timeout).
async fn start_gated(dirs: &Dirs, max_rows: usize) -> (Service, Arc<FlakyObjects>) {
    start_gated_lingering(dirs, max_rows, Duration::ZERO).await
}

/// [`start_gated`] with batches that wait `linger` for company.
async fn start_gated_lingering(
    dirs: &Dirs,
    max_rows: usize,
    linger: Duration,
) -> (Service, Arc<FlakyObjects>) {
    let objects = FlakyObjects::gated(&dirs.bodies()).await;
    let rows = FlakyRows::open(&dirs.db_url()).await;
    let config = Config {
        batch_max_rows: max_rows,
        batch_linger: linger,
        store_timeout: Duration::from_secs(300),
        batch_in_flight: 2,
        ..dirs.config()
    };
    (start(config, rows, objects.clone()).await, objects)
}

/// Records `calls` at once, in a task of their own; its output is each call's answer.
fn record_all(
    svc: &Service,
    calls: &[LlmCall],
) -> tokio::task::JoinHandle<Vec<Result<bool, tonic::Status>>> {
    let client = svc.client.clone();
    let calls = calls.to_vec();
    tokio::spawn(async move {
        futures::future::join_all(calls.into_iter().map(|c| record(&client, c))).await
    })
}

/// Waits for each of `recordings` ([`record_all`]) and asserts every call was new.
async fn assert_all_new(
    recordings: Vec<tokio::task::JoinHandle<Vec<Result<bool, tonic::Status>>>>,
) {
    for recording in recordings {
        for duplicate in recording.await.unwrap() {
            assert!(!duplicate.unwrap(), "each call is new");
        }
    }
}

/// Waits until `n` uploads are held at the gate; at most a minute.
async fn wait_for_uploads(objects: &FlakyObjects, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while objects.active.load(Ordering::SeqCst) < n {
        assert!(
            Instant::now() < deadline,
            "{n} uploads did not start: {} active",
            objects.active.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// With `ANALYTICS_BATCH_IN_FLIGHT=2`, two full batches are written at once, never more, and
/// every caller is answered once its own batch is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_are_written_two_at_a_time_and_never_more() {
    let dirs = Dirs::new();
    // One call per batch, so that six calls are six (full) batches.
    let (svc, objects) = start_gated(&dirs, 1).await;
    let calls: Vec<LlmCall> = (0..6).map(call).collect();
    let recording = record_all(&svc, &calls);

    // Two uploads start and are held; the other batches wait for room meanwhile.
    wait_for_uploads(&objects, 2).await;
    // A moment for a third batch to start, which it must not.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(objects.active.load(Ordering::SeqCst), 2);
    objects.gate.as_ref().unwrap().add_permits(calls.len());

    assert_all_new(vec![recording]).await;
    assert_eq!(objects.most_active.load(Ordering::SeqCst), 2);
    assert_eq!(objects.puts.load(Ordering::SeqCst), calls.len());
    assert_eq!(count_rows(&dirs.db_url()).await.0, calls.len() as i64);
    svc.assert_stored(&calls).await;
    assert!(dirs.spooled_files().is_empty(), "nothing was spooled");
}

/// A batch that is not full does not go out beside another: it waits for the one on its way,
/// taking the calls that arrive meanwhile (two half batches would cost the stores twice the
/// requests).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_that_is_not_full_waits_for_the_one_on_its_way() {
    let dirs = Dirs::new();
    let (svc, objects) = start_gated(&dirs, 10).await;
    let calls: Vec<LlmCall> = (0..4).map(call).collect();
    let first = record_all(&svc, &calls[..1]);
    wait_for_uploads(&objects, 1).await;
    // Three more calls while the first batch is held: fewer than a full batch.
    let rest = record_all(&svc, &calls[1..]);
    // A moment for a second upload to start, which it must not.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(objects.active.load(Ordering::SeqCst), 1);
    objects.gate.as_ref().unwrap().add_permits(calls.len());

    assert_all_new(vec![first, rest]).await;
    assert_eq!(objects.most_active.load(Ordering::SeqCst), 1);
    assert_eq!(
        objects.puts.load(Ordering::SeqCst),
        2,
        "the three later calls went out as one batch"
    );
    svc.assert_stored(&calls).await;
}

/// A batch that waited for the one on its way then lingers for company as it would have after
/// it with one batch at a time, so that a steady rate forms the same batches (and the stores
/// take the same requests) with two at once as with one.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_that_waited_for_the_one_on_its_way_lingers_after_it() {
    let dirs = Dirs::new();
    let linger = Duration::from_secs(2);
    let (svc, objects) = start_gated_lingering(&dirs, 10, linger).await;
    let calls: Vec<LlmCall> = (0..3).map(call).collect();
    let first = record_all(&svc, &calls[..1]);
    wait_for_uploads(&objects, 1).await;
    // A second call, and time for its batch to linger out and wait for the first.
    let second = record_all(&svc, &calls[1..2]);
    tokio::time::sleep(linger + Duration::from_millis(500)).await;
    assert_eq!(objects.active.load(Ordering::SeqCst), 1);
    objects.gate.as_ref().unwrap().add_permits(calls.len());
    assert_all_new(vec![first]).await;
    // The first batch is stored: a call now joins the waiting batch within its linger.
    let third = record_all(&svc, &calls[2..]);
    assert_all_new(vec![second, third]).await;
    assert_eq!(
        objects.puts.load(Ordering::SeqCst),
        2,
        "the second and third calls went out as one batch"
    );
    svc.assert_stored(&calls).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_recorded_while_the_object_store_is_down_are_all_stored_once_after_it() {
    let dirs = Dirs::new();
    let objects = FlakyObjects::new(&dirs.bodies(), Outage::Always).await;
    let rows = FlakyRows::open(&dirs.db_url()).await;
    let svc = start(dirs.config(), rows.clone(), objects.clone()).await;
    let calls: Vec<LlmCall> = (0..300).map(call).collect();

    record_under_load(&svc.client, &calls).await;
    let waiting = svc.metric("analytics_spool_batches").await;
    let spooled_bytes = svc.metric("analytics_spool_bytes").await;
    assert!(objects.failures.load(Ordering::Relaxed) > 0);
    objects.set(Outage::None);
    svc.wait_until_drained(Duration::from_secs(20)).await;

    // Every acknowledged call was spooled and is stored now, once, with its bodies.
    assert!(
        waiting > 0.0 && spooled_bytes > 0.0,
        "{waiting} {spooled_bytes}"
    );
    assert_eq!(count_rows(&dirs.db_url()).await, (300, 300));
    svc.assert_stored(&calls).await;
    assert!(dirs.spooled_files().is_empty());
    assert_eq!(svc.metric("analytics_calls_recorded_total").await, 300.0);
    let spooled = svc.metric("analytics_spooled_total").await;
    assert!(spooled >= waiting);
    assert_eq!(svc.metric("analytics_spool_replayed_total").await, spooled);
    assert_eq!(svc.metric("analytics_spool_bytes").await, 0.0);
    assert_eq!(svc.metric("analytics_spool_full_total").await, 0.0);
    // Once recovered, calls are committed directly again and are duplicates when repeated.
    assert!(record(&svc.client, calls[3].clone()).await.unwrap());
    let after = call(1000);
    assert!(!record(&svc.client, after.clone()).await.unwrap());
    svc.assert_stored(&[after]).await;
    assert_eq!(svc.metric("analytics_spooled_total").await, spooled);
    svc.server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_outage_of_some_seconds_or_some_calls_loses_nothing() {
    let dirs = Dirs::new();
    let objects = FlakyObjects::new(
        &dirs.bodies(),
        Outage::Until(Instant::now() + Duration::from_secs(2)),
    )
    .await;
    let rows = FlakyRows::open(&dirs.db_url()).await;
    let svc = start(dirs.config(), rows.clone(), objects.clone()).await;
    let mut calls: Vec<LlmCall> = (0..200).map(call).collect();

    // Recorded in waves across the two seconds of the outage and after it.
    for wave in calls.chunks(40) {
        record_under_load(&svc.client, wave).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // Then three failing calls (the next batch's PUT, the replayer's next tries).
    objects.set(Outage::Calls(3));
    let more: Vec<LlmCall> = (200..260).map(call).collect();
    record_under_load(&svc.client, &more).await;
    calls.extend(more);
    svc.wait_until_drained(Duration::from_secs(20)).await;

    assert_eq!(count_rows(&dirs.db_url()).await, (260, 260));
    svc.assert_stored(&calls).await;
    assert!(svc.metric("analytics_spooled_total").await >= 2.0);
    assert_eq!(svc.metric("analytics_calls_recorded_total").await, 260.0);
    svc.server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_failure_after_the_bodies_were_uploaded_is_replayed_consistently() {
    let dirs = Dirs::new();
    let objects = FlakyObjects::new(&dirs.bodies(), Outage::None).await;
    let rows = FlakyRows::open(&dirs.db_url()).await;
    // Bodies uploaded, then: rows refused twice, and rows committed but reported failed twice.
    rows.fail.store(2, Ordering::Relaxed);
    rows.commit_then_fail.store(2, Ordering::Relaxed);
    let svc = start(dirs.config(), rows.clone(), objects.clone()).await;
    let calls: Vec<LlmCall> = (0..120).map(call).collect();

    for wave in calls.chunks(30) {
        record_under_load(&svc.client, wave).await;
    }
    svc.wait_until_drained(Duration::from_secs(20)).await;

    assert_eq!(count_rows(&dirs.db_url()).await, (120, 120));
    svc.assert_stored(&calls).await;
    // Every body object referenced is the one its batch uploaded, re-uploaded with the same
    // bytes under the same key by the replay; no row points at a missing object.
    let pool = sqlx::SqlitePool::connect(&dirs.db_url()).await.unwrap();
    let keys: Vec<(String,)> =
        sqlx::query_as("SELECT DISTINCT body_key FROM llm_calls WHERE body_key <> ''")
            .fetch_all(&pool)
            .await
            .unwrap();
    pool.close().await;
    for (key,) in &keys {
        assert!(dirs.bodies().join(key).is_file(), "{key} is missing");
    }
    assert!(svc.metric("analytics_spool_replayed_total").await >= 2.0);
    // Rows committed by an attempt that reported failure are found by the replay and count
    // once, as the calls they are.
    assert_eq!(svc.metric("analytics_calls_recorded_total").await, 120.0);
    svc.server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn past_its_bound_the_spool_refuses_with_resource_exhausted_and_stores_nothing() {
    let dirs = Dirs::new();
    let objects = FlakyObjects::new(&dirs.bodies(), Outage::Always).await;
    let rows = FlakyRows::open(&dirs.db_url()).await;
    let max = 4096_u64;
    let config = Config {
        spool_max_bytes: max,
        spool_retry_max: Duration::from_secs(3),
        ..dirs.config()
    };
    let svc = start(config, rows.clone(), objects.clone()).await;
    let big = |i| LlmCall {
        request_body: "x".repeat(900),
        ..call(i)
    };

    // One call at a time (a batch each) until the spool is full.
    let mut accepted = Vec::new();
    let refusal = loop {
        let c = big(accepted.len());
        match record(&svc.client, c.clone()).await {
            Ok(_) => accepted.push(c),
            Err(status) => break (c, status),
        }
        assert!(accepted.len() < 10, "the spool never filled");
    };
    let (refused, status) = refusal;
    let streamed = big(100);
    let stream_status = svc
        .client
        .clone()
        .record_stream(reported(tokio_stream::iter([RecordStreamRequest {
            call: Some(streamed.clone()),
        }])))
        .await
        .unwrap_err();
    let on_disk: u64 = dirs
        .spooled_files()
        .iter()
        .map(|f| f.metadata().unwrap().len())
        .sum();
    let full_total = svc.metric("analytics_spool_full_total").await;

    assert!(accepted.len() >= 2, "{} accepted", accepted.len());
    for s in [&status, &stream_status] {
        assert_eq!(s.code(), Code::ResourceExhausted, "{s:?}");
        assert!(s.message().contains("spool is full"), "{}", s.message());
        assert!(s.message().contains("retry them in 3 s"), "{}", s.message());
        assert_eq!(s.metadata().get("retry-after").unwrap(), "3");
    }
    assert!(on_disk <= max, "{on_disk} bytes spooled past {max}");
    assert_eq!(dirs.spooled_files().len(), accepted.len());
    assert_eq!(full_total, 2.0);

    // Recovered: what was accepted is stored, what was refused is not.
    objects.set(Outage::None);
    svc.wait_until_drained(Duration::from_secs(20)).await;
    svc.assert_stored(&accepted).await;
    for c in [&refused, &streamed] {
        assert_eq!(
            svc.get(&c.call_id).await.unwrap_err().code(),
            Code::NotFound
        );
    }
    assert_eq!(
        count_rows(&dirs.db_url()).await.0,
        i64::try_from(accepted.len()).unwrap()
    );
    svc.server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_service_replays_what_its_spool_holds() {
    let dirs = Dirs::new();
    let objects = FlakyObjects::new(&dirs.bodies(), Outage::Always).await;
    let rows = FlakyRows::open(&dirs.db_url()).await;
    let first = start(dirs.config(), rows.clone(), objects.clone()).await;
    let calls: Vec<LlmCall> = (0..150).map(call).collect();
    record_under_load(&first.client, &calls).await;

    // A second process cannot take the spool while the first holds it.
    let other = spawn({
        let (config, rows, objects) = (dirs.config(), rows.clone(), objects.clone());
        move |l, s| serve_with_stores(config, rows, objects, l, s)
    })
    .await;
    let err = other.handle.await.unwrap().unwrap_err();
    assert!(
        format!("{err:#}").contains("in use by another process"),
        "{err:#}"
    );

    first.server.stop().await.unwrap();
    let left = dirs.spooled_files().len();
    assert!(left > 0);
    assert_eq!(count_rows(&dirs.db_url()).await, (0, 0));
    rows.inner.close().await;

    // A new process on the same spool, with the stores back, replays it at start.
    let objects = FlakyObjects::new(&dirs.bodies(), Outage::None).await;
    let rows = FlakyRows::open(&dirs.db_url()).await;
    let second = start(dirs.config(), rows.clone(), objects.clone()).await;
    second.wait_until_drained(Duration::from_secs(20)).await;

    assert_eq!(count_rows(&dirs.db_url()).await, (150, 150));
    second.assert_stored(&calls).await;
    assert!(dirs.spooled_files().is_empty());
    assert_eq!(
        second.metric("analytics_spool_replayed_total").await,
        left as f64
    );
    assert_eq!(second.metric("analytics_spooled_total").await, 0.0);
    second.server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unreadable_spool_file_is_moved_aside_and_the_rest_is_replayed() {
    let dirs = Dirs::new();
    let objects = FlakyObjects::new(&dirs.bodies(), Outage::Always).await;
    let rows = FlakyRows::open(&dirs.db_url()).await;
    let first = start(dirs.config(), rows.clone(), objects.clone()).await;
    // One call at a time: a spool file each.
    let calls: Vec<LlmCall> = (0..3).map(call).collect();
    for c in &calls {
        record(&first.client, c.clone()).await.unwrap();
    }
    first.server.stop().await.unwrap();
    let files = dirs.spooled_files();
    assert_eq!(files.len(), 3);
    // A crash (or a bad disk) cut the second file short, and garbage sits beside them.
    let bytes = std::fs::read(&files[1]).unwrap();
    std::fs::write(&files[1], &bytes[..bytes.len() / 2]).unwrap();
    std::fs::write(
        dirs.spool().join("00000000000000000099.batch"),
        b"not a spool file at all",
    )
    .unwrap();

    objects.set(Outage::None);
    let second = start(dirs.config(), rows.clone(), objects.clone()).await;
    second.wait_until_drained(Duration::from_secs(20)).await;

    second
        .assert_stored(&[calls[0].clone(), calls[2].clone()])
        .await;
    assert_eq!(
        second.get(&calls[1].call_id).await.unwrap_err().code(),
        Code::NotFound
    );
    let aside = files_in(&dirs.spool().join(CORRUPT_DIR), ".batch");
    assert_eq!(aside.len(), 2, "{aside:?}");
    assert!(dirs.spooled_files().is_empty());
    assert_eq!(second.metric("analytics_spool_corrupt_total").await, 2.0);
    assert_eq!(second.metric("analytics_spool_replayed_total").await, 2.0);
    // The service goes on as usual.
    let after = call(7);
    record(&second.client, after.clone()).await.unwrap();
    second.assert_stored(&[after]).await;
    second.server.stop().await.unwrap();

    // And the next start does not see them again.
    let third = start(dirs.config(), rows.clone(), objects.clone()).await;
    assert_eq!(third.metric("analytics_spool_batches").await, 0.0);
    third.server.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_the_database_keeps_refusing_is_set_aside_without_wedging_the_spool() {
    let dirs = Dirs::new();
    let objects = FlakyObjects::new(&dirs.bodies(), Outage::None).await;
    let rows = FlakyRows::open(&dirs.db_url()).await;
    *rows.poison_job.lock().unwrap() = Some("job-poison".into());
    let svc = start(dirs.config(), rows.clone(), objects.clone()).await;
    let poison = LlmCall {
        job_id: "job-poison".into(),
        ..call(0)
    };
    let calls: Vec<LlmCall> = (1..60).map(call).collect();

    record(&svc.client, poison.clone()).await.unwrap();
    record_under_load(&svc.client, &calls).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while svc.metric("analytics_spool_rejected_total").await < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the bad batch was never set aside"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    svc.wait_until_drained(Duration::from_secs(20)).await;

    svc.assert_stored(&calls).await;
    assert_eq!(
        svc.get(&poison.call_id).await.unwrap_err().code(),
        Code::NotFound
    );
    assert_eq!(
        files_in(&dirs.spool().join(REJECTED_DIR), ".batch").len(),
        1
    );
    assert_eq!(count_rows(&dirs.db_url()).await, (59, 59));
    // The stores are trusted again: new calls are committed without the spool.
    let spooled = svc.metric("analytics_spooled_total").await;
    record_under_load(&svc.client, &(100..120).map(call).collect::<Vec<_>>()).await;
    assert_eq!(svc.metric("analytics_spooled_total").await, spooled);
    svc.server.stop().await.unwrap();
}

/// `message` as vision reports its model calls: signed as itself (recording needs an identity).
fn reported<T>(message: T) -> tonic::Request<T> {
    ecoscan_common::client::by_actor(tonic::Request::new(message), "vision")
}
