//! The spool directory's files: how they are named, the lock that keeps the directory to one
//! process, and the durable write of one batch's file (temporary file, fsync, rename, fsync of
//! the directory).

use std::{
    collections::BTreeMap,
    fs::{self, File},
    io,
    path::Path,
};

use anyhow::{Context, bail};

use super::format::write_frame;

/// Suffix of a spooled batch's file.
pub const BATCH_SUFFIX: &str = ".batch";
/// Where unreadable (truncated, corrupt) spool files are moved.
pub const CORRUPT_DIR: &str = "corrupt";
/// Where batches the stores kept refusing while accepting others are moved.
pub const REJECTED_DIR: &str = "rejected";
const TMP_SUFFIX: &str = ".tmp";
const LOCK_FILE: &str = ".lock";

/// The file name of batch `seq`: zero-padded, so names sort oldest first.
pub(super) fn file_name(seq: u64) -> String {
    format!("{seq:020}{BATCH_SUFFIX}")
}

/// Creates and locks the directory, removes leftover temporary files, and lists the batches.
pub(super) fn open_dir(dir: &Path) -> anyhow::Result<(File, BTreeMap<u64, u64>)> {
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

pub(super) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Writes the batch as `<seq>.batch.tmp`, fsyncs it, renames it to `<seq>.batch` and fsyncs the
/// directory; on failure nothing is left behind.
pub(super) fn write_file(dir: &Path, seq: u64, meta: &[u8], object: &[u8]) -> io::Result<()> {
    let name = file_name(seq);
    let tmp = dir.join(format!("{name}{TMP_SUFFIX}"));
    let path = dir.join(&name);
    let written = (|| {
        let mut file = File::options().write(true).create_new(true).open(&tmp)?;
        write_frame(&mut file, meta, object)?;
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
