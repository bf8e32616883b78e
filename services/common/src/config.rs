//! Configuration from environment variables with documented defaults.

use std::{fmt::Display, net::SocketAddr, str::FromStr, time::Duration};

use anyhow::{Context, anyhow};

/// Reads `name` and parses it, or returns `default` when it is unset or empty.
pub fn env_or<T>(name: &str, default: T) -> anyhow::Result<T>
where
    T: FromStr,
    T::Err: Display,
{
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse()
            .map_err(|e| anyhow!("invalid value {v:?} for {name}: {e}")),
        _ => Ok(default),
    }
}

/// Reads an optional variable; unset or empty is `None`.
pub fn env_opt(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Reads a duration written in milliseconds (`250`) or with a unit (`250ms`, `2s`, `1m`).
pub fn env_duration(name: &str, default: Duration) -> anyhow::Result<Duration> {
    match env_opt(name) {
        None => Ok(default),
        Some(v) => parse_duration(&v).with_context(|| format!("invalid duration {v:?} for {name}")),
    }
}

/// Parses `250`, `250ms`, `2s` or `1m`.
pub fn parse_duration(v: &str) -> anyhow::Result<Duration> {
    let v = v.trim();
    let (num, unit) = v
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .map_or((v, "ms"), |i| v.split_at(i));
    let n: f64 = num.parse().context("not a number")?;
    let ms = match unit {
        "ms" => n,
        "s" => n * 1_000.0,
        "m" => n * 60_000.0,
        other => return Err(anyhow!("unknown unit {other:?} (use ms, s or m)")),
    };
    if !ms.is_finite() || ms < 0.0 {
        return Err(anyhow!("duration must be a non-negative number"));
    }
    Ok(Duration::from_secs_f64(ms / 1_000.0))
}

/// Reads a listen address such as `127.0.0.1:50051`.
pub fn env_addr(name: &str, default: &str) -> anyhow::Result<SocketAddr> {
    let v = env_opt(name).unwrap_or_else(|| default.to_owned());
    v.parse()
        .with_context(|| format!("invalid socket address {v:?} for {name}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_duration_accepts_units_and_bare_milliseconds() {
        assert_eq!(parse_duration("250").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("1m").unwrap(), Duration::from_secs(60));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
    }

    #[test]
    fn parse_duration_rejects_unknown_units_and_garbage() {
        assert!(parse_duration("5h").is_err());
        assert!(parse_duration("abc").is_err());
        assert!(parse_duration("").is_err());
    }
}
