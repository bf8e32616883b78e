//! The hub's side of the event log on Redis: the subscription to every feed shard, and the
//! format of what is published on it.

use async_trait::async_trait;
use ecoscan_proto::v1::ScanEvent;
use ecoscan_redis::{Delivery, Subscriber, redis::streams::StreamId};
use prost::Message;

use crate::{
    error::StoreError,
    store::events::{Feed, FeedItem, Wanted},
};

/// The hub's subscription to every feed shard.
pub(super) struct RedisFeed {
    subscriber: Subscriber,
    /// Items of a batch not handed out yet.
    pending: std::collections::VecDeque<FeedItem>,
}

/// What a fence marker carries in place of an event id: `<job>\nfence\n<epoch>\n`.
pub(super) const FENCE_MARKER: &str = "fence";

/// A feed message: an event, `<job>\n<id>\n<seq>\n<event body>`, published by a writer of
/// claim `epoch` when that is given (see [`FeedItem::Event`]); or a fence marker,
/// `<job>\nfence\n<epoch>\n`.
pub(super) fn parse_feed_message(
    payload: &[u8],
    epoch: Option<u64>,
    wanted: &Wanted<'_>,
) -> Result<Option<FeedItem>, StoreError> {
    let mut parts = payload.splitn(4, |b| *b == b'\n');
    let (Some(job), Some(id), Some(seq), Some(body)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(StoreError::Corrupt(
            "feed message without its header".into(),
        ));
    };
    let job = std::str::from_utf8(job)
        .map_err(|_| StoreError::Corrupt("feed message with a non-UTF-8 job id".into()))?;
    if !wanted(job) {
        return Ok(None);
    }
    let number = || {
        std::str::from_utf8(seq)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .ok_or_else(|| StoreError::Corrupt(format!("feed message of job {job}: bad number")))
    };
    if id == FENCE_MARKER.as_bytes() {
        return Ok(Some(FeedItem::Fence {
            job_id: job.to_owned(),
            epoch: number()?,
        }));
    }
    let mut event = ScanEvent::decode(body)
        .map_err(|e| StoreError::Corrupt(format!("feed message of job {job}: {e}")))?;
    event.job_id = job.to_owned();
    event.event_id = String::from_utf8_lossy(id).into_owned();
    event.seq = number()?;
    Ok(Some(FeedItem::Event(Box::new(event), epoch)))
}

/// The messages of one published batch: `<length>:<message>` items, published by a script
/// after the streams took them, or `<length>@<epoch>:<message>` items, published beside their
/// `XADD`s by a writer of claim `epoch` ([`send_piped`]).
/// One item of a published batch: its writer's epoch when it was published unchecked, and the
/// message.
type BatchItem<'a> = (Option<u64>, &'a [u8]);

fn split_batch(payload: &[u8]) -> Result<Vec<BatchItem<'_>>, StoreError> {
    let mut out = Vec::new();
    let mut rest = payload;
    while !rest.is_empty() {
        let colon = rest
            .iter()
            .position(|b| *b == b':')
            .ok_or_else(|| StoreError::Corrupt("feed batch item without a length".into()))?;
        let header = std::str::from_utf8(&rest[..colon])
            .map_err(|_| StoreError::Corrupt("feed batch item with a bad length".into()))?;
        let (len, epoch) = match header.split_once('@') {
            Some((len, epoch)) => (len, Some(epoch)),
            None => (header, None),
        };
        let len: usize = len
            .parse()
            .map_err(|_| StoreError::Corrupt("feed batch item with a bad length".into()))?;
        let epoch = epoch
            .map(str::parse::<u64>)
            .transpose()
            .map_err(|_| StoreError::Corrupt("feed batch item with a bad epoch".into()))?;
        let item = rest
            .get(colon + 1..colon + 1 + len)
            .ok_or_else(|| StoreError::Corrupt("feed batch item cut short".into()))?;
        out.push((epoch, item));
        rest = &rest[colon + 1 + len..];
    }
    Ok(out)
}

impl RedisFeed {
    pub(super) fn new(subscriber: Subscriber) -> Self {
        Self {
            subscriber,
            pending: std::collections::VecDeque::new(),
        }
    }
}

#[async_trait]
impl Feed for RedisFeed {
    async fn recv(&mut self, wanted: &Wanted<'_>) -> Option<FeedItem> {
        loop {
            if let Some(item) = self.pending.pop_front() {
                return Some(item);
            }
            match self.subscriber.recv().await? {
                Delivery::Resync => return Some(FeedItem::Resync),
                Delivery::Message { payload, .. } => {
                    let items = match split_batch(&payload) {
                        Ok(items) => items,
                        Err(e) => {
                            tracing::warn!(error = %e, "skipping an undecodable feed message");
                            continue;
                        }
                    };
                    for (epoch, item) in items {
                        match parse_feed_message(item, epoch, wanted) {
                            Ok(Some(item)) => self.pending.push_back(item),
                            Ok(None) => {}
                            Err(e) => {
                                tracing::warn!(error = %e, "skipping an undecodable feed message");
                            }
                        }
                    }
                }
            }
        }
    }
}

/// What the log stores and the feed carries for an event: `<job>\n<id>\n<seq>\n<body>`, the
/// header readable without decoding the body.
pub(super) fn encode_message(event: &ScanEvent) -> Vec<u8> {
    let body = ScanEvent {
        job_id: String::new(),
        event_id: String::new(),
        seq: 0,
        ..event.clone()
    }
    .encode_to_vec();
    let mut out = format!("{}\n{}\n{}\n", event.job_id, event.event_id, event.seq).into_bytes();
    out.extend(body);
    out
}

pub(super) fn decode_event(entry: &StreamId) -> Result<ScanEvent, StoreError> {
    let bytes: Vec<u8> = entry
        .get("ev")
        .ok_or_else(|| StoreError::Corrupt(format!("event {} has no body", entry.id)))?;
    match parse_feed_message(&bytes, None, &|_| true)? {
        Some(FeedItem::Event(event, _)) => Ok(*event),
        _ => Err(StoreError::Corrupt(format!(
            "event {} is unreadable",
            entry.id
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn feed_messages_decode_only_for_wanted_jobs() {
        let ev = ScanEvent {
            message: "hi".into(),
            ..ScanEvent::default()
        };
        let mut payload = b"job-1\n1700000000000-0\n7\n".to_vec();
        payload.extend(ev.encode_to_vec());
        let Some(FeedItem::Event(got, None)) =
            parse_feed_message(&payload, None, &|j| j == "job-1").unwrap()
        else {
            panic!("an event")
        };
        assert_eq!(
            (
                got.job_id.as_str(),
                got.event_id.as_str(),
                got.seq,
                got.message.as_str()
            ),
            ("job-1", "1700000000000-0", 7, "hi")
        );
        assert!(
            parse_feed_message(&payload, None, &|_| false)
                .unwrap()
                .is_none()
        );
        assert!(parse_feed_message(b"job-1\nno-header", None, &|_| true).is_err());
        assert_eq!(
            parse_feed_message(b"job-1\nfence\n4\n", None, &|_| true).unwrap(),
            Some(FeedItem::Fence {
                job_id: "job-1".into(),
                epoch: 4
            }),
            "a fence marker"
        );
        assert!(parse_feed_message(b"job-1\nfence\nx\n", None, &|_| true).is_err());
    }

    #[test]
    fn a_published_batch_splits_into_its_messages() {
        let items = split_batch(b"3:abc0:5:a:b:c").unwrap();
        assert_eq!(
            items.iter().map(|(_, m)| *m).collect::<Vec<_>>(),
            [&b"abc"[..], b"", b"a:b:c"]
        );
        assert!(items.iter().all(|(epoch, _)| epoch.is_none()));
        let items = split_batch(b"3@7:abc2:xy").unwrap();
        assert_eq!(items, [(Some(7), &b"abc"[..]), (None, &b"xy"[..])]);
        assert!(split_batch(b"3@x:abc").is_err());
        assert!(split_batch(b"").unwrap().is_empty());
        assert!(split_batch(b"9:short").is_err());
        assert!(split_batch(b"x:abc").is_err());
    }
}
