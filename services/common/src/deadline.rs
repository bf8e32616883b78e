//! The deadline a gRPC caller sets on its call (`grpc-timeout`), read the same way by every
//! server and by the in-process calls of [`crate::local`].

use std::time::Duration;

/// The `grpc-timeout` of a request's headers, as a duration from now.
pub(crate) fn grpc_timeout(headers: &http::HeaderMap) -> Option<Duration> {
    timeout_value(headers.get("grpc-timeout")?.to_str().ok()?)
}

fn timeout_value(value: &str) -> Option<Duration> {
    // At most 8 digits and one unit letter, by the gRPC spec.
    if value.len() < 2 || value.len() > 9 {
        return None;
    }
    let (digits, unit) = value.split_at(value.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}
