//! A small incremental Server-Sent Events parser (what the gateway writes: `id:`, `event:`,
//! `data:` lines, a blank line between events, `:` comments for keep-alives).

use std::time::{Duration, SystemTime};

/// One SSE event.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Event {
    pub id: Option<String>,
    pub event: String,
    pub data: String,
}

impl Event {
    /// The event's `ts` (RFC 3339, set by ingest when it appended the event), read straight from
    /// the JSON text so that tens of thousands of clients need not parse whole events.
    pub fn ts(&self) -> Option<SystemTime> {
        json_str(&self.data, "ts").and_then(|s| humantime::parse_rfc3339(s).ok())
    }

    /// A string field of the `data:` JSON (first occurrence of `"name":"…"`, no escapes).
    pub fn field(&self, name: &str) -> Option<&str> {
        json_str(&self.data, name)
    }
}

fn json_str<'a>(json: &'a str, name: &str) -> Option<&'a str> {
    let key = format!("\"{name}\":\"");
    let start = json.find(&key)? + key.len();
    let len = json[start..].find('"')?;
    Some(&json[start..start + len])
}

/// Feeds on chunks as they arrive and yields the complete events.
#[derive(Debug, Default)]
pub struct Parser {
    buf: Vec<u8>,
}

impl Parser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `chunk` and returns every event it completed.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<Event> {
        self.buf.extend_from_slice(chunk);
        let mut events = Vec::new();
        while let Some(end) = find(&self.buf, b"\n\n") {
            let block: Vec<u8> = self.buf.drain(..end + 2).collect();
            if let Some(ev) = parse_block(&String::from_utf8_lossy(&block)) {
                events.push(ev);
            }
        }
        events
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

fn parse_block(block: &str) -> Option<Event> {
    let mut ev = Event {
        event: "message".to_owned(),
        ..Event::default()
    };
    let mut any = false;
    for line in block.lines() {
        if let Some(v) = line.strip_prefix("id:") {
            ev.id = Some(v.trim().to_owned());
        } else if let Some(v) = line.strip_prefix("event:") {
            ev.event = v.trim().to_owned();
            any = true;
        } else if let Some(v) = line.strip_prefix("data:") {
            if !ev.data.is_empty() {
                ev.data.push('\n');
            }
            ev.data.push_str(v.strip_prefix(' ').unwrap_or(v));
            any = true;
        }
    }
    // A block of comments only (`: keepalive`) is no event.
    any.then_some(ev)
}

/// `later − earlier`, or zero when the clocks say otherwise (one machine, one clock: only
/// sub-microsecond rounding can make it negative).
pub fn since(earlier: SystemTime, later: SystemTime) -> Duration {
    later.duration_since(earlier).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_split_across_chunks_are_assembled_and_comments_skipped() {
        let mut p = Parser::new();
        assert!(p.push(b": keepalive\n\nid: 1-0\nevent: st").is_empty());
        let evs = p.push(
            b"age\ndata: {\"ts\":\"2026-11-30T08:00:00.250Z\",\"stage\":\"vision\"}\n\nevent: ready\ndata: {}\n\n",
        );
        assert_eq!(evs.len(), 2);
        assert_eq!(evs[0].id.as_deref(), Some("1-0"));
        assert_eq!(evs[0].event, "stage");
        assert_eq!(evs[0].field("stage"), Some("vision"));
        let ts = evs[0].ts().expect("ts parses");
        assert_eq!(
            ts,
            humantime::parse_rfc3339("2026-11-30T08:00:00Z").expect("valid")
                + Duration::from_millis(250)
        );
        assert_eq!(evs[1].event, "ready");
    }
}
