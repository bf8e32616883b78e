//! The spool: batches the stores could not take, kept on local disk until they do.
//!
//! When writing a batch to the stores fails (the body object to S3, or the rows to SQL), the
//! writer puts the batch here instead — its rows, with their body locations already assigned,
//! and its body object — and acknowledges the callers once the file is on disk. A background
//! task ([`spawn_replayer`]) writes the spooled batches to the stores, oldest first, with
//! backoff, and deletes each file once the stores have taken it. So a call acknowledged by
//! analytics is never lost to a store outage, only delayed.
//!
//! - **Files.** One file per batch, `<seq>.batch` (`seq` a zero-padded counter, so names sort
//!   oldest first), written as `<seq>.batch.tmp`, fsynced, renamed, and the directory fsynced:
//!   a crash leaves either the whole file or a `.tmp` that was never acknowledged (removed at
//!   start). The format is `ECOSPOOL`, a version, the rows, the body object, and a CRC-32 of it
//!   all; a file that is truncated or fails its checksum is moved to `corrupt/` and logged,
//!   never replayed again and never fatal.
//! - **Idempotent replay.** A call's id is unique in the rows (`ON CONFLICT (call_id) DO
//!   NOTHING`), and a batch's body object keeps the key and bytes it was given when the batch
//!   was formed, so replaying a batch that was partly written (the object uploaded, or even the
//!   rows committed, before the failure or a crash) uploads the same bytes under the same key and
//!   stores each call once, its row pointing into that object.
//! - **Bound.** The files may take `max_bytes` at most; past it [`Spool::push`] refuses and the
//!   callers get `RESOURCE_EXHAUSTED` with nothing written.
//! - **One process per directory.** The directory is locked (`.lock`) while a process uses it.
//! - **A batch the stores refuse for good** (while other writes succeed) would hold its place
//!   forever; after [`STRIKES_BEFORE_REJECT`] failed attempts with other writes succeeding
//!   between them, it is moved to `rejected/` and logged. Moving such a file back into the
//!   directory replays it at the next start.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fs::{self, File},
    io::{self, Write},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, bail, ensure};
use bytes::Bytes;
use ecoscan_common::CancellationToken;
use ecoscan_objects::ObjectStore;
use futures::{StreamExt, TryStreamExt};
use prometheus_client::metrics::{counter::Counter, gauge::Gauge};
use tokio::{sync::Notify, task::JoinHandle, time::Instant};

use crate::{
    store::{CallRow, CallStore},
    writer::{Batch, WriterMetrics},
};

/// Suffix of a spooled batch's file.
pub const BATCH_SUFFIX: &str = ".batch";
/// Where unreadable (truncated, corrupt) spool files are moved.
pub const CORRUPT_DIR: &str = "corrupt";
/// Where batches the stores kept refusing while accepting others are moved.
pub const REJECTED_DIR: &str = "rejected";
const TMP_SUFFIX: &str = ".tmp";
const LOCK_FILE: &str = ".lock";

/// Failed attempts, with other writes succeeding between them, after which a batch is moved to
/// `rejected/` (about 25 s of retries with the default backoff).
pub const STRIKES_BEFORE_REJECT: u32 = 8;
/// Most spool files one replay writes together (their rows in one transaction).
const MAX_FILES_PER_REPLAY: usize = 64;
/// Most bytes of spool files one replay loads.
const MAX_BYTES_PER_REPLAY: u64 = 64 << 20;
/// Body objects uploaded at once by one replay.
const PUT_CONCURRENCY: usize = 16;
/// First delay between replay attempts after a failure (it doubles up to the configured most).
const RETRY_MIN: Duration = Duration::from_millis(100);

/// Why a batch could not be spooled.
#[derive(Debug)]
pub enum PushError {
    /// The spool holds `used` bytes of `max` and the batch does not fit (or the disk is full).
    Full { used: u64, max: u64 },
    /// The file could not be written.
    Io(io::Error),
}

/// The bounded, crash-safe directory of batches waiting for the stores; see the module docs.
pub struct Spool {
    dir: PathBuf,
    max_bytes: u64,
    state: Mutex<State>,
    /// Woken when a batch is spooled.
    wake: Notify,
    /// The last write to the stores (the writer's or a replay) failed.
    stores_down: AtomicBool,
    /// Successful writes to the stores so far: evidence that a batch failing on its own is at
    /// fault, not the stores.
    store_writes: AtomicU64,
    metrics: SpoolMetrics,
    /// Holds the directory's lock for as long as the spool lives.
    _lock: File,
}

struct State {
    /// Spooled batches by sequence number, with their file sizes.
    files: BTreeMap<u64, u64>,
    /// Bytes of the files, plus those reserved by writes under way.
    bytes: u64,
    next_seq: u64,
}

impl std::fmt::Debug for Spool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spool")
            .field("dir", &self.dir)
            .field("max_bytes", &self.max_bytes)
            .field("batches", &self.batches())
            .field("bytes", &self.bytes())
            .finish_non_exhaustive()
    }
}

impl Spool {
    /// Opens (creating it when needed) and locks the spool directory, removes what a crash left
    /// half-written, and indexes the batches waiting there (the replayer writes them first).
    /// Fails when another process holds the directory.
    pub async fn open(dir: &Path, max_bytes: u64, metrics: SpoolMetrics) -> anyhow::Result<Self> {
        let dir = dir.to_owned();
        let (lock, files) = tokio::task::spawn_blocking({
            let dir = dir.clone();
            move || open_dir(&dir)
        })
        .await??;
        let next_seq = files.keys().next_back().map_or(1, |last| last + 1);
        let bytes = files.values().sum();
        if !files.is_empty() {
            tracing::warn!(
                dir = %dir.display(),
                batches = files.len(),
                bytes,
                "the analytics spool holds batches from before; replaying them"
            );
        }
        let spool = Self {
            dir,
            max_bytes,
            state: Mutex::new(State {
                files,
                bytes,
                next_seq,
            }),
            wake: Notify::new(),
            stores_down: AtomicBool::new(false),
            store_writes: AtomicU64::new(0),
            metrics,
            _lock: lock,
        };
        spool.publish(&spool.state());
        Ok(spool)
    }

    /// The spool's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Batches waiting.
    pub fn batches(&self) -> usize {
        self.state().files.len()
    }

    /// Bytes the waiting batches take (and writes under way have reserved).
    pub fn bytes(&self) -> u64 {
        self.state().bytes
    }

    /// True when the last write to the stores failed: the writer then spools new batches at
    /// once instead of waiting on the stores, until a write (a replay) succeeds again.
    pub fn stores_down(&self) -> bool {
        self.stores_down.load(Ordering::Relaxed)
    }

    /// Records a successful write to the stores.
    pub(crate) fn store_write_succeeded(&self) {
        self.store_writes.fetch_add(1, Ordering::Relaxed);
        if self.stores_down.swap(false, Ordering::Relaxed) {
            tracing::info!(
                waiting = self.batches(),
                "the analytics stores accept writes again; replaying the spool"
            );
        }
    }

    /// Records a failed write to the stores.
    pub(crate) fn store_write_failed(&self, error: &anyhow::Error) {
        if !self.stores_down.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                error = format!("{error:#}"),
                spool = %self.dir.display(),
                "writing to the analytics stores failed; accepted calls go to the spool until \
                 the stores take them"
            );
        }
    }

    fn store_writes(&self) -> u64 {
        self.store_writes.load(Ordering::Relaxed)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .expect("spool state lock is never poisoned")
    }

    fn publish(&self, state: &State) {
        self.metrics
            .bytes
            .set(i64::try_from(state.bytes).unwrap_or(i64::MAX));
        self.metrics
            .batches
            .set(i64::try_from(state.files.len()).unwrap_or(i64::MAX));
    }

    /// Writes `batch` to the spool durably (fsynced file and directory) and returns once it is:
    /// the calls in it may be acknowledged then. Refuses when it would take the spool past its
    /// bound.
    pub async fn push(&self, batch: &Batch) -> Result<(), PushError> {
        let meta = encode_meta(&batch.key, &batch.rows);
        let size = file_len(meta.len(), batch.object.len());
        let seq = {
            let mut state = self.state();
            if state.bytes.saturating_add(size) > self.max_bytes {
                return Err(PushError::Full {
                    used: state.bytes,
                    max: self.max_bytes,
                });
            }
            state.bytes += size;
            let seq = state.next_seq;
            state.next_seq += 1;
            seq
        };
        let dir = self.dir.clone();
        let object = batch.object.clone();
        let written = tokio::task::spawn_blocking(move || write_file(&dir, seq, &meta, &object))
            .await
            .unwrap_or_else(|e| Err(io::Error::other(e)));
        let mut state = self.state();
        match written {
            Ok(()) => {
                state.files.insert(seq, size);
                self.publish(&state);
                drop(state);
                self.metrics.spooled.inc();
                self.wake.notify_one();
                Ok(())
            }
            Err(e) => {
                state.bytes -= size;
                let used = state.bytes;
                drop(state);
                if e.kind() == io::ErrorKind::StorageFull {
                    Err(PushError::Full {
                        used,
                        max: self.max_bytes,
                    })
                } else {
                    Err(PushError::Io(e))
                }
            }
        }
    }

    /// The oldest waiting batches `ready` accepts, at most [`MAX_FILES_PER_REPLAY`] and about
    /// [`MAX_BYTES_PER_REPLAY`] (always one when any is ready).
    fn oldest(&self, ready: impl Fn(u64) -> bool) -> Vec<u64> {
        let state = self.state();
        let mut picked = Vec::new();
        let mut bytes = 0;
        for (&seq, &size) in &state.files {
            if !ready(seq) {
                continue;
            }
            if !picked.is_empty() && bytes + size > MAX_BYTES_PER_REPLAY {
                break;
            }
            picked.push(seq);
            bytes += size;
            if picked.len() == MAX_FILES_PER_REPLAY {
                break;
            }
        }
        picked
    }

    fn contains(&self, seq: u64) -> bool {
        self.state().files.contains_key(&seq)
    }

    fn path(&self, seq: u64) -> PathBuf {
        self.dir.join(file_name(seq))
    }

    async fn load(&self, seq: u64) -> Result<Batch, LoadError> {
        let path = self.path(seq);
        let read = tokio::task::spawn_blocking(move || fs::read(path))
            .await
            .unwrap_or_else(|e| Err(io::Error::other(e)));
        match read {
            Ok(bytes) => decode(Bytes::from(bytes)).map_err(LoadError::Corrupt),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Err(LoadError::Missing),
            Err(e) => Err(LoadError::Corrupt(
                anyhow::Error::new(e).context("the file cannot be read"),
            )),
        }
    }

    /// Drops `seq` from the index (and the byte count).
    fn forget(&self, seq: u64) {
        let mut state = self.state();
        if let Some(size) = state.files.remove(&seq) {
            state.bytes -= size;
        }
        self.publish(&state);
    }

    /// Deletes the file of a batch the stores have taken.
    async fn remove(&self, seq: u64) {
        let path = self.path(seq);
        let removed = tokio::task::spawn_blocking({
            let path = path.clone();
            move || fs::remove_file(path)
        })
        .await
        .unwrap_or_else(|e| Err(io::Error::other(e)));
        match removed {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            // Replaying it again after a restart is harmless: its calls are stored once.
            Err(e) => tracing::error!(
                path = %path.display(),
                error = %e,
                "failed to delete a replayed spool file; it will be replayed again at the next start"
            ),
        }
        self.forget(seq);
    }

    /// Moves a batch's file into `subdir` (`corrupt` or `rejected`), out of the replay.
    async fn set_aside(&self, seq: u64, subdir: &'static str) -> PathBuf {
        let from = self.path(seq);
        let to_dir = self.dir.join(subdir);
        let to = to_dir.join(file_name(seq));
        let moved = tokio::task::spawn_blocking({
            let (from, to) = (from.clone(), to.clone());
            move || {
                fs::create_dir_all(&to_dir)?;
                fs::rename(&from, &to)?;
                sync_dir(&to_dir)?;
                sync_dir(from.parent().unwrap_or(Path::new(".")))
            }
        })
        .await
        .unwrap_or_else(|e| Err(io::Error::other(e)));
        if let Err(e) = moved {
            tracing::error!(
                path = %from.display(),
                error = %e,
                "failed to move a spool file aside; it is left in place and skipped until the next start"
            );
        }
        self.forget(seq);
        to
    }
}

enum LoadError {
    /// The file is gone (removed by hand).
    Missing,
    /// Truncated, failing its checksum, or unreadable.
    Corrupt(anyhow::Error),
}

fn file_name(seq: u64) -> String {
    format!("{seq:020}{BATCH_SUFFIX}")
}

/// Creates and locks the directory, removes leftover temporary files, and lists the batches.
fn open_dir(dir: &Path) -> anyhow::Result<(File, BTreeMap<u64, u64>)> {
    fs::create_dir_all(dir)
        .with_context(|| format!("failed to create the spool directory {}", dir.display()))?;
    let lock = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(LOCK_FILE))
        .with_context(|| format!("failed to open the lock of the spool {}", dir.display()))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(fs::TryLockError::WouldBlock) => bail!(
            "the analytics spool {} is in use by another process; give each analytics process \
             its own ANALYTICS_SPOOL_DIR",
            dir.display()
        ),
        Err(fs::TryLockError::Error(e)) => {
            return Err(anyhow::Error::new(e)
                .context(format!("failed to lock the spool {}", dir.display())));
        }
    }
    let mut files = BTreeMap::new();
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !entry.file_type()?.is_file() || name == LOCK_FILE {
            continue;
        }
        if name.ends_with(TMP_SUFFIX) {
            // A write a crash interrupted: its calls were never acknowledged.
            tracing::warn!(
                file = name,
                "removing a half-written spool file left by a crash"
            );
            fs::remove_file(entry.path())?;
            continue;
        }
        match name
            .strip_suffix(BATCH_SUFFIX)
            .and_then(|seq| seq.parse::<u64>().ok())
        {
            Some(seq) => {
                files.insert(seq, entry.metadata()?.len());
            }
            None => tracing::warn!(file = name, "ignoring a file that is not a spooled batch"),
        }
    }
    sync_dir(dir)?;
    Ok((lock, files))
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Writes the batch as `<seq>.batch.tmp`, fsyncs it, renames it to `<seq>.batch` and fsyncs the
/// directory; on failure nothing is left behind.
fn write_file(dir: &Path, seq: u64, meta: &[u8], object: &[u8]) -> io::Result<()> {
    let name = file_name(seq);
    let tmp = dir.join(format!("{name}{TMP_SUFFIX}"));
    let path = dir.join(&name);
    let written = (|| {
        let mut file = File::options().write(true).create_new(true).open(&tmp)?;
        let mut crc = Crc::new();
        file.write_all(MAGIC)?;
        for piece in [
            &VERSION.to_le_bytes()[..],
            &len_u64(meta.len()).to_le_bytes(),
            meta,
            &len_u64(object.len()).to_le_bytes(),
            object,
        ] {
            crc.update(piece);
            file.write_all(piece)?;
        }
        file.write_all(&crc.finish().to_le_bytes())?;
        file.sync_all()?;
        drop(file);
        fs::rename(&tmp, &path)
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    if let Err(e) = sync_dir(dir) {
        // Not known to be durable, so not acknowledged: take it back.
        let _ = fs::remove_file(&path);
        return Err(e);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The file format.

const MAGIC: &[u8; 8] = b"ECOSPOOL";
const VERSION: u32 = 1;

fn len_u64(n: usize) -> u64 {
    u64::try_from(n).expect("lengths fit in u64")
}

/// Size of the file holding `meta` and an object of `object` bytes.
fn file_len(meta: usize, object: usize) -> u64 {
    // magic, version, meta length, meta, object length, object, crc
    len_u64(8 + 4 + 8 + meta + 8 + object + 4)
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_i64(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_u32(
        out,
        u32::try_from(s.len()).expect("a field is far below 4 GiB"),
    );
    out.extend_from_slice(s.as_bytes());
}

/// The body key and the rows, each field in column order.
fn encode_meta(key: &str, rows: &[CallRow]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + rows.len() * 256);
    put_str(&mut out, key);
    put_u32(
        &mut out,
        u32::try_from(rows.len()).expect("a batch is far below 4G rows"),
    );
    for r in rows {
        put_str(&mut out, &r.call_id);
        put_str(&mut out, &r.service);
        put_str(&mut out, &r.provider);
        put_str(&mut out, &r.model);
        put_str(&mut out, &r.operation);
        put_i64(&mut out, r.input_tokens);
        put_i64(&mut out, r.output_tokens);
        out.extend_from_slice(&r.latency_ms.to_le_bytes());
        out.extend_from_slice(&r.ttft_ms.to_le_bytes());
        out.extend_from_slice(&r.status.to_le_bytes());
        put_str(&mut out, &r.error);
        put_str(&mut out, &r.body_key);
        put_i64(&mut out, r.body_offset);
        put_i64(&mut out, r.request_len);
        put_i64(&mut out, r.response_len);
        put_str(&mut out, &r.job_id);
        put_str(&mut out, &r.trace_id);
        put_i64(&mut out, r.started_at_us);
        put_i64(&mut out, r.recorded_at_us);
    }
    out
}

/// Reads a spool file back (the body object is a slice of `file`, not a copy); any truncation,
/// checksum mismatch or malformed field is an error.
fn decode(file: Bytes) -> anyhow::Result<Batch> {
    ensure!(file.len() >= 8 + 4 + 4, "truncated: {} bytes", file.len());
    ensure!(&file[..8] == MAGIC, "not a spool file (bad magic)");
    let (body, crc) = file[8..].split_at(file.len() - 8 - 4);
    let mut check = Crc::new();
    check.update(body);
    let stored = u32::from_le_bytes(crc.try_into().expect("4 bytes"));
    let mut r = Reader { buf: body, pos: 0 };
    let version = r.u32()?;
    ensure!(version == VERSION, "unknown spool format version {version}");
    let meta_len = r.len()?;
    let meta = r.take(meta_len)?;
    let object_len = r.len()?;
    let object_at = 8 + r.pos;
    r.take(object_len)?;
    ensure!(
        r.pos == body.len(),
        "{} unexpected trailing bytes",
        body.len() - r.pos
    );
    ensure!(check.finish() == stored, "checksum mismatch");
    let mut m = Reader { buf: meta, pos: 0 };
    let key = m.str()?;
    let n = m.u32()?;
    let mut rows = Vec::with_capacity(usize::try_from(n)?.min(100_000));
    for _ in 0..n {
        rows.push(CallRow {
            call_id: m.str()?,
            service: m.str()?,
            provider: m.str()?,
            model: m.str()?,
            operation: m.str()?,
            input_tokens: m.i64()?,
            output_tokens: m.i64()?,
            latency_ms: m.f64()?,
            ttft_ms: m.f64()?,
            status: m.i32()?,
            error: m.str()?,
            body_key: m.str()?,
            body_offset: m.i64()?,
            request_len: m.i64()?,
            response_len: m.i64()?,
            job_id: m.str()?,
            trace_id: m.str()?,
            started_at_us: m.i64()?,
            recorded_at_us: m.i64()?,
        });
    }
    ensure!(m.pos == meta.len(), "unexpected bytes after the rows");
    Ok(Batch {
        key,
        object: file.slice(object_at..object_at + object_len),
        rows,
    })
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> anyhow::Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.buf.len())
            .with_context(|| format!("truncated at byte {}", self.pos))?;
        let bytes = &self.buf[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> anyhow::Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("took N bytes"))
    }

    fn u32(&mut self) -> anyhow::Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn len(&mut self) -> anyhow::Result<usize> {
        Ok(usize::try_from(u64::from_le_bytes(self.array()?))?)
    }

    fn i32(&mut self) -> anyhow::Result<i32> {
        Ok(i32::from_le_bytes(self.array()?))
    }

    fn i64(&mut self) -> anyhow::Result<i64> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    fn f64(&mut self) -> anyhow::Result<f64> {
        Ok(f64::from_le_bytes(self.array()?))
    }

    fn str(&mut self) -> anyhow::Result<String> {
        let n = usize::try_from(self.u32()?)?;
        Ok(std::str::from_utf8(self.take(n)?)
            .context("a text field is not utf-8")?
            .to_owned())
    }
}

/// CRC-32 (IEEE 802.3, as zlib and gzip compute it).
struct Crc(u32);

const CRC_TABLE: [u32; 256] = {
    let mut table = [0_u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 == 1 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

impl Crc {
    fn new() -> Self {
        Self(!0)
    }

    fn update(&mut self, data: &[u8]) {
        for &b in data {
            self.0 = CRC_TABLE[((self.0 ^ u32::from(b)) & 0xff) as usize] ^ (self.0 >> 8);
        }
    }

    fn finish(&self) -> u32 {
        !self.0
    }
}

// ---------------------------------------------------------------------------------------------
// Replay.

/// How the replayer retries.
#[derive(Debug, Clone, Copy)]
pub struct ReplayOptions {
    /// Longest one attempt to write to the stores may take.
    pub store_timeout: Duration,
    /// Longest pause between attempts while the stores keep failing.
    pub retry_max: Duration,
    /// Most rows one replay writes in one transaction (a single spooled batch may hold more).
    pub max_rows: usize,
}

/// The pause after the `n`th failure in a row: 100 ms doubling up to `max`.
fn backoff(n: u32, max: Duration) -> Duration {
    RETRY_MIN
        .saturating_mul(1_u32 << n.saturating_sub(1).min(20))
        .min(max)
        .max(RETRY_MIN.min(max))
}

/// Starts the task writing spooled batches to the stores, oldest first, with backoff, until
/// `stop` is cancelled (what is left stays on disk for the next start).
pub fn spawn_replayer(
    spool: Arc<Spool>,
    store: Arc<dyn CallStore>,
    bodies: Arc<dyn ObjectStore>,
    options: ReplayOptions,
    metrics: WriterMetrics,
    stop: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(replay(spool, store, bodies, options, metrics, stop))
}

/// A batch that failed on its own and waits before its next attempt.
struct Parked {
    failures: u32,
    retry_at: Instant,
    /// `Spool::store_writes` at its first failure: when writes succeed after it while this batch
    /// keeps failing, the batch is at fault.
    writes_at_first_failure: u64,
}

async fn replay(
    spool: Arc<Spool>,
    store: Arc<dyn CallStore>,
    bodies: Arc<dyn ObjectStore>,
    options: ReplayOptions,
    metrics: WriterMetrics,
    stop: CancellationToken,
) {
    let mut parked: HashMap<u64, Parked> = HashMap::new();
    // After a group failed, batches go one at a time until one succeeds, so a bad one is found.
    let mut one_at_a_time = false;
    let mut failures_in_a_row = 0_u32;
    // The batch whose attempt just failed on its own: the next attempt tries another one when
    // there is one, so a batch at fault cannot keep the others from the stores.
    let mut last_failed: Option<u64> = None;
    let mut replayed_since_empty = 0_u64;
    loop {
        parked.retain(|&seq, _| spool.contains(seq));
        let now = Instant::now();
        let mut ready = spool.oldest(|seq| parked.get(&seq).is_none_or(|p| p.retry_at <= now));
        if ready.is_empty() {
            if replayed_since_empty > 0 && spool.batches() == 0 {
                tracing::info!(
                    batches = replayed_since_empty,
                    "the analytics spool is empty: every spooled batch is stored"
                );
                replayed_since_empty = 0;
            }
            let next_due = parked.values().map(|p| p.retry_at).min();
            tokio::select! {
                () = spool.wake.notified() => {}
                () = async {
                    match next_due {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                } => {}
                () = stop.cancelled() => return,
            }
            continue;
        }
        if let Some(failed) = last_failed
            && ready.len() > 1
        {
            ready.retain(|&seq| seq != failed);
        }
        if one_at_a_time {
            ready.truncate(1);
        }

        let mut group: Vec<(u64, Batch)> = Vec::with_capacity(ready.len());
        let mut rows = 0;
        for seq in ready {
            match spool.load(seq).await {
                Ok(batch) => {
                    if !group.is_empty() && rows + batch.rows.len() > options.max_rows {
                        break;
                    }
                    rows += batch.rows.len();
                    group.push((seq, batch));
                }
                Err(LoadError::Missing) => {
                    tracing::warn!(seq, "a spooled batch's file is gone; skipping it");
                    spool.forget(seq);
                }
                Err(LoadError::Corrupt(e)) => {
                    let to = spool.set_aside(seq, CORRUPT_DIR).await;
                    spool.metrics.corrupt.inc();
                    tracing::error!(
                        error = format!("{e:#}"),
                        moved_to = %to.display(),
                        "a spool file is unreadable (truncated or corrupt); moved aside, its calls are not replayed"
                    );
                }
            }
        }
        if group.is_empty() {
            continue;
        }

        let attempt = tokio::select! {
            r = tokio::time::timeout(options.store_timeout, store_group(&*store, &*bodies, &group)) => {
                r.unwrap_or_else(|_| Err(anyhow::anyhow!(
                    "the stores took longer than {:?}", options.store_timeout
                )))
            }
            // Abandoning the attempt is safe: the replay at the next start writes the same.
            () = stop.cancelled() => return,
        };
        match attempt {
            Ok(inserted) => {
                // Counted before the files go, so the series agree whenever the spool looks
                // empty.
                let recorded =
                    stored_by_these_batches(&*store, &group, &inserted, options.store_timeout)
                        .await;
                metrics.replayed(recorded);
                spool.metrics.replayed.inc_by(len_u64(group.len()));
                for (seq, _) in &group {
                    spool.remove(*seq).await;
                }
                spool.store_write_succeeded();
                replayed_since_empty += len_u64(group.len());
                tracing::debug!(
                    batches = group.len(),
                    rows,
                    inserted = inserted.len(),
                    "replayed spooled batches"
                );
                failures_in_a_row = 0;
                one_at_a_time = false;
                last_failed = None;
            }
            Err(e) => {
                failures_in_a_row += 1;
                spool.store_write_failed(&e);
                if failures_in_a_row == 1 || failures_in_a_row.is_multiple_of(10) {
                    tracing::warn!(
                        error = format!("{e:#}"),
                        batches = group.len(),
                        waiting = spool.batches(),
                        failures_in_a_row,
                        "replaying the analytics spool failed; retrying with backoff"
                    );
                }
                if group.len() > 1 {
                    one_at_a_time = true;
                    last_failed = None;
                } else {
                    let seq = group[0].0;
                    last_failed = Some(seq);
                    let writes = spool.store_writes();
                    let p = parked.entry(seq).or_insert(Parked {
                        failures: 0,
                        retry_at: Instant::now(),
                        writes_at_first_failure: writes,
                    });
                    p.failures += 1;
                    p.retry_at = Instant::now() + backoff(p.failures, options.retry_max);
                    if p.failures >= STRIKES_BEFORE_REJECT && writes > p.writes_at_first_failure {
                        let to = spool.set_aside(seq, REJECTED_DIR).await;
                        spool.metrics.rejected.inc();
                        tracing::error!(
                            error = format!("{e:#}"),
                            attempts = p.failures,
                            rows = group[0].1.rows.len(),
                            moved_to = %to.display(),
                            "the stores keep refusing a spooled batch while taking others; moved \
                             it aside (move it back into the spool directory to replay it at the \
                             next start)"
                        );
                        parked.remove(&seq);
                        // That failure was the batch's, not the stores': trust them again.
                        spool.stores_down.store(false, Ordering::Relaxed);
                    }
                }
                let pause = backoff(failures_in_a_row, options.retry_max);
                tokio::select! {
                    () = tokio::time::sleep(pause) => {}
                    () = stop.cancelled() => return,
                }
            }
        }
    }
}

/// How many calls of `group` are stored by these very batches: those the replay inserted, plus
/// those an earlier attempt committed although it reported failure (a timeout or a lost
/// connection after COMMIT, or a crash before the spool file was deleted). Those are told from a
/// repeat of the call id by their row: the same `recorded_at_us` and body key. Counted for
/// `analytics_calls_recorded_total` only; when the reads fail, only the inserted are counted.
async fn stored_by_these_batches(
    store: &dyn CallStore,
    group: &[(u64, Batch)],
    inserted: &HashSet<String>,
    timeout: Duration,
) -> usize {
    let mut seen: HashSet<&str> = HashSet::new();
    let earlier: Vec<&CallRow> = group
        .iter()
        .flat_map(|(_, b)| &b.rows)
        .filter(|r| !inserted.contains(&r.call_id) && seen.insert(&r.call_id))
        .collect();
    if earlier.is_empty() {
        return inserted.len();
    }
    let check = async {
        let mut n = 0;
        for row in earlier {
            if let Some(stored) = store.get(&row.call_id).await?
                && stored.recorded_at_us == row.recorded_at_us
                && stored.body_key == row.body_key
            {
                n += 1;
            }
        }
        anyhow::Ok(n)
    };
    match tokio::time::timeout(timeout, check).await {
        Ok(Ok(n)) => inserted.len() + n,
        Ok(Err(e)) => {
            tracing::debug!(
                error = format!("{e:#}"),
                "could not check which replayed calls were stored before"
            );
            inserted.len()
        }
        Err(_) => {
            tracing::debug!("checking which replayed calls were stored before took too long");
            inserted.len()
        }
    }
}

/// Uploads each batch's body object again (same key, same bytes) and inserts all their rows in
/// one transaction.
async fn store_group(
    store: &dyn CallStore,
    bodies: &dyn ObjectStore,
    group: &[(u64, Batch)],
) -> anyhow::Result<HashSet<String>> {
    futures::stream::iter(group.iter().filter(|(_, b)| !b.object.is_empty()))
        .map(Ok)
        .try_for_each_concurrent(PUT_CONCURRENCY, |(_, b)| {
            bodies.put(&b.key, b.object.clone())
        })
        .await
        .context("failed to upload a spooled batch's bodies")?;
    if let [(_, only)] = group {
        return Ok(store.insert_batch(&only.rows).await?);
    }
    let rows: Vec<CallRow> = group
        .iter()
        .flat_map(|(_, b)| b.rows.iter().cloned())
        .collect();
    Ok(store.insert_batch(&rows).await?)
}

// ---------------------------------------------------------------------------------------------
// Metrics.

/// The spool's Prometheus series. Cheap to clone; clones share the series.
#[derive(Clone, Debug, Default)]
pub struct SpoolMetrics {
    bytes: Gauge,
    batches: Gauge,
    spooled: Counter,
    replayed: Counter,
    full: Counter,
    corrupt: Counter,
    rejected: Counter,
}

impl SpoolMetrics {
    /// Registers `analytics_spool_bytes`, `analytics_spool_batches`, `analytics_spooled_total`,
    /// `analytics_spool_replayed_total`, `analytics_spool_full_total`,
    /// `analytics_spool_corrupt_total` and `analytics_spool_rejected_total` in `metrics`.
    pub fn register(metrics: &mut ecoscan_common::metrics::Metrics) -> Self {
        let this = Self::default();
        let r = metrics.registry();
        r.register(
            "analytics_spool_bytes",
            "Bytes of batches waiting in the spool for the stores",
            this.bytes.clone(),
        );
        r.register(
            "analytics_spool_batches",
            "Batches waiting in the spool for the stores",
            this.batches.clone(),
        );
        r.register(
            "analytics_spooled",
            "Batches written to the spool because the stores failed",
            this.spooled.clone(),
        );
        r.register(
            "analytics_spool_replayed",
            "Spooled batches written to the stores and removed from the spool",
            this.replayed.clone(),
        );
        r.register(
            "analytics_spool_full",
            "Calls refused with RESOURCE_EXHAUSTED because the stores failed and the spool was full",
            this.full.clone(),
        );
        r.register(
            "analytics_spool_corrupt",
            "Unreadable spool files moved to corrupt/",
            this.corrupt.clone(),
        );
        r.register(
            "analytics_spool_rejected",
            "Spooled batches the stores kept refusing while taking others, moved to rejected/",
            this.rejected.clone(),
        );
        this
    }

    /// Counts `calls` refused because the spool was full.
    pub(crate) fn refused(&self, calls: usize) {
        self.full.inc_by(len_u64(calls));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str) -> CallRow {
        CallRow {
            call_id: id.into(),
            service: "vision".into(),
            provider: "mock".into(),
            model: "모델".into(),
            operation: "classify".into(),
            input_tokens: 1,
            output_tokens: -2,
            latency_ms: 3.5,
            ttft_ms: f64::MIN_POSITIVE,
            status: 2,
            error: "e".into(),
            body_key: "k.bin".into(),
            body_offset: 7,
            request_len: 8,
            response_len: 9,
            job_id: "j".into(),
            trace_id: String::new(),
            started_at_us: i64::MIN,
            recorded_at_us: i64::MAX,
        }
    }

    fn file(batch: &Batch) -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        write_file(
            dir.path(),
            1,
            &encode_meta(&batch.key, &batch.rows),
            &batch.object,
        )
        .unwrap();
        let bytes = fs::read(dir.path().join(file_name(1))).unwrap();
        assert_eq!(
            len_u64(bytes.len()),
            file_len(
                encode_meta(&batch.key, &batch.rows).len(),
                batch.object.len()
            )
        );
        bytes
    }

    #[test]
    fn crc_is_the_ieee_one() {
        let mut c = Crc::new();
        c.update(b"123456789");
        assert_eq!(c.finish(), 0xCBF4_3926);
    }

    #[test]
    fn a_batch_round_trips_and_any_damage_is_detected() {
        let batch = Batch {
            key: "0193.bin".into(),
            object: Bytes::from_static("요청 응답".as_bytes()),
            rows: vec![row("a"), row("b")],
        };
        let bytes = file(&batch);
        let bytes = Bytes::from(bytes);
        let back = decode(bytes.clone()).unwrap();
        assert_eq!(back.key, batch.key);
        assert_eq!(back.object, batch.object);
        assert_eq!(back.rows, batch.rows);

        for cut in [0, 7, 8, 20, bytes.len() / 2, bytes.len() - 1] {
            assert!(decode(bytes.slice(..cut)).is_err(), "truncated at {cut}");
        }
        for flip in [8, 30, bytes.len() - 10, bytes.len() - 1] {
            let mut bad = bytes.to_vec();
            bad[flip] ^= 0x40;
            assert!(decode(bad.into()).is_err(), "bit flipped at {flip}");
        }
        let mut longer = bytes.to_vec();
        longer.push(0);
        assert!(decode(longer.into()).is_err());
    }

    #[test]
    fn backoff_doubles_from_100ms_up_to_the_most() {
        let max = Duration::from_secs(1);
        let got: Vec<_> = (1..=6).map(|n| backoff(n, max).as_millis()).collect();
        assert_eq!(got, [100, 200, 400, 800, 1000, 1000]);
        assert_eq!(backoff(1000, max), max);
        assert_eq!(
            backoff(1, Duration::from_millis(20)),
            Duration::from_millis(20)
        );
    }

    #[tokio::test]
    async fn a_second_process_cannot_take_a_spool_in_use_and_leftovers_are_cleaned() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("00000000000000000007.batch.tmp"), b"half").unwrap();
        fs::write(dir.path().join("notes.txt"), b"left alone").unwrap();
        let spool = Spool::open(dir.path(), 1 << 20, SpoolMetrics::default())
            .await
            .unwrap();
        let err = Spool::open(dir.path(), 1 << 20, SpoolMetrics::default())
            .await
            .unwrap_err();
        assert!(err.to_string().contains("in use"), "{err:#}");
        assert!(!dir.path().join("00000000000000000007.batch.tmp").exists());
        assert!(dir.path().join("notes.txt").exists());

        let batch = Batch {
            key: "x.bin".into(),
            object: Bytes::from_static(b"body"),
            rows: vec![row("a")],
        };
        spool.push(&batch).await.unwrap();
        spool.push(&batch).await.unwrap();
        assert_eq!(spool.batches(), 2);
        drop(spool);

        // Reopened, it finds both and numbers new batches after them.
        let spool = Spool::open(dir.path(), 1 << 20, SpoolMetrics::default())
            .await
            .unwrap();
        assert_eq!(spool.oldest(|_| true), [1, 2]);
        spool.push(&batch).await.unwrap();
        assert_eq!(spool.oldest(|_| true), [1, 2, 3]);
        let full = spool.bytes();

        // Past the bound nothing is written.
        let small = Spool {
            max_bytes: full + 10,
            ..spool
        };
        assert!(matches!(
            small.push(&batch).await,
            Err(PushError::Full { used, .. }) if used == full
        ));
        assert_eq!(small.batches(), 3);
        assert_eq!(
            fs::read_dir(dir.path())
                .unwrap()
                .filter(|e| e
                    .as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .ends_with(BATCH_SUFFIX))
                .count(),
            3
        );
    }
}
