//! Where ingest's things live in Redis: which feed shard a job belongs to (its keys' hash
//! tag), the stream ids its events get, and this process's name in the dispatch group.

use crate::store::events::EventId;

/// Which feed shard a job belongs to: FNV-1a of its id, so every process agrees.
pub fn shard_of(job_id: &str, shards: u32) -> u32 {
    let hash = job_id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    (hash % u64::from(shards.max(1))) as u32
}

/// The millisecond part of the stream ids a writer of claim `epoch` gives `job_id`'s events:
/// the job's own time `T` plus the epoch, so that a newer claim's ids sort after every older
/// claim's (see [`scripts::RAISE_FENCE`]). The public id of an event stays `<T>-<seq>`.
pub(super) fn stream_ms(job_id: &str, epoch: u64) -> u64 {
    EventId::of(job_id, 0).ms.saturating_add(epoch)
}

/// This process's consumer name in the dispatch group: host plus a random suffix, so a
/// restarted process never inherits a dead one's claims except through reclaiming.
pub fn consumer_name() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "ingest".into());
    let host: String = host
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!(
        "{host}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn jobs_spread_over_every_shard_and_stay_on_theirs() {
        let mut seen = HashSet::new();
        for i in 0..2_000 {
            let job = format!("0193a0b0-0000-7000-8000-{i:012}");
            let shard = shard_of(&job, 64);
            assert_eq!(shard, shard_of(&job, 64), "stable");
            assert!(shard < 64);
            seen.insert(shard);
        }
        assert_eq!(seen.len(), 64, "every shard gets jobs");
    }
}
