//! The [`Spool`] itself: the index of the batches waiting in the directory, bounded in bytes,
//! with what the writer does with it (push, report how the stores fare) and what the replayer
//! does (pick the oldest, load, remove, set aside).

use std::{
    collections::BTreeMap,
    fs::{self, File},
    io,
    path::{Path, PathBuf},
    sync::{
        Mutex, MutexGuard,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use bytes::Bytes;
use tokio::sync::Notify;

use super::{
    files::{file_name, open_dir, sync_dir, write_file},
    format::{decode, encode_meta, file_len},
};
use crate::{batch::Batch, metrics::SpoolMetrics};

/// Most spool files one replay writes together (their rows in one transaction).
const MAX_FILES_PER_REPLAY: usize = 64;
/// Most bytes of spool files one replay loads.
const MAX_BYTES_PER_REPLAY: u64 = 64 << 20;

/// Why a batch could not be spooled.
#[derive(Debug)]
pub enum PushError {
    /// The spool holds `used` bytes of `max` and the batch does not fit (or the disk is full).
    Full { used: u64, max: u64 },
    /// The file could not be written.
    Io(io::Error),
}

/// The bounded, crash-safe directory of batches waiting for the stores; see the
/// [module docs](crate::spool).
pub struct Spool {
    pub(super) dir: PathBuf,
    pub(super) max_bytes: u64,
    pub(super) state: Mutex<State>,
    /// Woken when a batch is spooled.
    pub(super) wake: Notify,
    /// The last write to the stores (the writer's or a replay) failed.
    pub(super) stores_down: AtomicBool,
    /// Successful writes to the stores so far: evidence that a batch failing on its own is at
    /// fault, not the stores.
    pub(super) store_writes: AtomicU64,
    pub(super) metrics: SpoolMetrics,
    /// Holds the directory's lock for as long as the spool lives.
    pub(super) _lock: File,
}

/// What the index holds, under the spool's lock.
pub(super) struct State {
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

    pub(super) fn store_writes(&self) -> u64 {
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
    pub(super) fn oldest(&self, ready: impl Fn(u64) -> bool) -> Vec<u64> {
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

    pub(super) fn contains(&self, seq: u64) -> bool {
        self.state().files.contains_key(&seq)
    }

    fn path(&self, seq: u64) -> PathBuf {
        self.dir.join(file_name(seq))
    }

    pub(super) async fn load(&self, seq: u64) -> Result<Batch, LoadError> {
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
    pub(super) fn forget(&self, seq: u64) {
        let mut state = self.state();
        if let Some(size) = state.files.remove(&seq) {
            state.bytes -= size;
        }
        self.publish(&state);
    }

    /// Deletes the file of a batch the stores have taken.
    pub(super) async fn remove(&self, seq: u64) {
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
    pub(super) async fn set_aside(&self, seq: u64, subdir: &'static str) -> PathBuf {
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

/// Why a waiting batch could not be loaded.
pub(super) enum LoadError {
    /// The file is gone (removed by hand).
    Missing,
    /// Truncated, failing its checksum, or unreadable.
    Corrupt(anyhow::Error),
}
