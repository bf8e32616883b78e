//! The `ecoscan.v1` API: messages, tonic clients and servers, proto3-JSON serde impls, the file
//! descriptor set for server reflection, and the vocabulary of a job's events that ingest and
//! the gateway share ([`event`]).

pub mod event;

pub mod v1 {
    #![allow(clippy::all, clippy::pedantic, missing_docs)]
    tonic::include_proto!("ecoscan.v1");
    include!(concat!(env!("OUT_DIR"), "/ecoscan.v1.serde.rs"));
}

/// Encoded `FileDescriptorSet` of every ecoscan proto (imports included), for reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("ecoscan_descriptor");

pub use pbjson_types::Timestamp;

/// Converts a `SystemTime` into a protobuf timestamp.
pub fn timestamp(t: std::time::SystemTime) -> Timestamp {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

/// The current time as a protobuf timestamp.
pub fn now() -> Timestamp {
    timestamp(std::time::SystemTime::now())
}

/// Converts a protobuf timestamp into a `SystemTime` (clamped at the Unix epoch).
pub fn to_system_time(ts: &Timestamp) -> std::time::SystemTime {
    if ts.seconds < 0 {
        return std::time::UNIX_EPOCH;
    }
    std::time::UNIX_EPOCH + std::time::Duration::new(ts.seconds as u64, ts.nanos.max(0) as u32)
}

/// Microseconds since the Unix epoch: how every ecoscan SQL store keeps time.
pub fn now_us() -> i64 {
    system_time_us(std::time::SystemTime::now())
}

/// `t` as microseconds since the Unix epoch (0 before it, saturating far after it).
pub fn system_time_us(t: std::time::SystemTime) -> i64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// Microseconds since the Unix epoch as a `SystemTime` (clamped at the epoch).
pub fn system_time_from_us(us: i64) -> std::time::SystemTime {
    std::time::UNIX_EPOCH + std::time::Duration::from_micros(us.max(0).unsigned_abs())
}

/// A protobuf timestamp as microseconds since the Unix epoch (saturating).
pub fn timestamp_us(t: &Timestamp) -> i64 {
    t.seconds
        .saturating_mul(1_000_000)
        .saturating_add(i64::from(t.nanos) / 1_000)
}

/// Microseconds since the Unix epoch as a protobuf timestamp.
pub fn timestamp_from_us(us: i64) -> Timestamp {
    Timestamp {
        seconds: us.div_euclid(1_000_000),
        // Below one second in nanoseconds, so within i32.
        nanos: (us.rem_euclid(1_000_000) * 1_000) as i32,
    }
}

// `Scan` takes the same input as `Submit` in a message of its own (each RPC's request can
// evolve alone); ingest and its callers convert between the two.
impl From<v1::ScanRequest> for v1::SubmitRequest {
    fn from(r: v1::ScanRequest) -> Self {
        Self {
            image: r.image,
            content_type: r.content_type,
            image_url: r.image_url,
            hint: r.hint,
            idempotency_key: r.idempotency_key,
            locale: r.locale,
            model: r.model,
            upload_id: r.upload_id,
        }
    }
}

impl From<v1::SubmitRequest> for v1::ScanRequest {
    fn from(r: v1::SubmitRequest) -> Self {
        Self {
            image: r.image,
            content_type: r.content_type,
            image_url: r.image_url,
            hint: r.hint,
            idempotency_key: r.idempotency_key,
            locale: r.locale,
            model: r.model,
            upload_id: r.upload_id,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;

    #[test]
    fn system_times_round_trip_through_microseconds() {
        let t = UNIX_EPOCH + Duration::from_micros(1_764_640_800_123_456);
        assert_eq!(system_time_us(t), 1_764_640_800_123_456);
        assert_eq!(system_time_from_us(system_time_us(t)), t);
        assert_eq!(system_time_us(UNIX_EPOCH - Duration::from_secs(1)), 0);
        assert_eq!(system_time_from_us(-5), UNIX_EPOCH);
        assert_eq!(
            timestamp_us(&timestamp_from_us(1_764_640_800_123_456)),
            1_764_640_800_123_456
        );
    }
}
