//! The wait a provider asks for before the next request, from every header servers use for it:
//!
//! - `retry-after-ms` (milliseconds; OpenAI, Azure OpenAI) and `Retry-After` (seconds, or an
//!   HTTP-date, RFC 9110);
//! - `x-ratelimit-reset-requests` / `x-ratelimit-reset-tokens` (OpenAI's duration format,
//!   `1s`, `6m0s`, `20ms`, `7.66s`): when the exhausted limit refills;
//! - the same names prefixed `llm_provider-`, which is how LiteLLM's proxy forwards the
//!   upstream provider's headers.
//!
//! An explicit wait (`retry-after-ms`, `Retry-After`) wins over a limit's reset time; when the
//! proxy and the upstream both name one, the longer is kept, since both asked to be left alone
//! that long.

use std::time::{Duration, SystemTime};

use http::HeaderMap;

/// Days of waiting are as good as forever: the retry budget refuses either.
const MAX_HINT: Duration = Duration::from_secs(86_400);

/// Header-name prefixes a hint may come under: ours, and LiteLLM's for its upstream's.
const PREFIXES: [&str; 2] = ["", "llm_provider-"];

/// The wait `headers` ask for, relative to `now` (for an HTTP-date); `None` when they name
/// none, and the backoff decides.
pub(crate) fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let explicit = PREFIXES
        .iter()
        .filter_map(|p| explicit_wait(headers, p, now))
        .max();
    explicit
        .or_else(|| PREFIXES.iter().filter_map(|p| reset_wait(headers, p)).max())
        .map(|d| d.min(MAX_HINT))
}

fn header<'a>(headers: &'a HeaderMap, prefix: &str, name: &str) -> Option<&'a str> {
    headers
        .get(format!("{prefix}{name}").as_str())?
        .to_str()
        .ok()
        .map(str::trim)
}

/// `retry-after-ms`, else `retry-after` (seconds, fractions accepted, or an HTTP-date).
fn explicit_wait(headers: &HeaderMap, prefix: &str, now: SystemTime) -> Option<Duration> {
    if let Some(ms) = header(headers, prefix, "retry-after-ms").and_then(non_negative) {
        return Some(from_secs(ms / 1e3));
    }
    let value = header(headers, prefix, "retry-after")?;
    if let Some(secs) = non_negative(value) {
        return Some(from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    // A date already past asks for no wait at all.
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The reset time of the limit that ran out (`x-ratelimit-remaining-*: 0`), or, when the
/// headers do not say which, the later of the two.
fn reset_wait(headers: &HeaderMap, prefix: &str) -> Option<Duration> {
    let limits = ["requests", "tokens"].map(|limit| {
        let reset = header(headers, prefix, &format!("x-ratelimit-reset-{limit}"))
            .and_then(parse_openai_duration);
        let exhausted =
            header(headers, prefix, &format!("x-ratelimit-remaining-{limit}")) == Some("0");
        (reset, exhausted)
    });
    let exhausted = limits
        .iter()
        .filter(|(_, exhausted)| *exhausted)
        .filter_map(|(reset, _)| *reset)
        .max();
    exhausted.or_else(|| limits.iter().filter_map(|(reset, _)| *reset).max())
}

fn non_negative(v: &str) -> Option<f64> {
    v.parse::<f64>().ok().filter(|v| v.is_finite() && *v >= 0.0)
}

fn from_secs(secs: f64) -> Duration {
    Duration::from_secs_f64(secs.min(MAX_HINT.as_secs_f64()))
}

/// OpenAI's rate-limit durations, which are Go's `time.Duration` strings: a sequence of
/// decimal numbers each with a unit (`h`, `m`, `s`, `ms`, `us`/`µs`, `ns`), such as `6m0s`,
/// `1.5s`, `20ms`. `None` for anything else.
pub(crate) fn parse_openai_duration(s: &str) -> Option<Duration> {
    let mut rest = s.trim();
    if rest.is_empty() {
        return None;
    }
    if rest == "0" {
        return Some(Duration::ZERO);
    }
    let mut total = 0.0_f64;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if number_len == 0 {
            return None;
        }
        let value: f64 = rest[..number_len].parse().ok()?;
        rest = &rest[number_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let seconds_per = match &rest[..unit_len] {
            "h" => 3_600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" | "μs" => 1e-6,
            "ns" => 1e-9,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += value * seconds_per;
    }
    total.is_finite().then(|| from_secs(total))
}

#[cfg(test)]
mod tests;
