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
//!
//! The pieces: `queue` is the [`Spool`] itself (the index of waiting batches and its bound),
//! `files` the directory's files (names, lock, durable writes), `format` the bytes of one file,
//! and `replay` the task writing the batches to the stores.

mod files;
mod format;
mod queue;
mod replay;

#[cfg(test)]
mod tests;

pub use files::{BATCH_SUFFIX, CORRUPT_DIR, REJECTED_DIR};
pub use queue::{PushError, Spool};
pub use replay::{ReplayOptions, STRIKES_BEFORE_REJECT, spawn_replayer};

pub use crate::metrics::SpoolMetrics;
