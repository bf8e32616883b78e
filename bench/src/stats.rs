//! Latency samples and their percentiles (nearest rank over every sample: exact, no histogram
//! buckets; the benchmarks keep at most a few million samples).

use std::time::Duration;

/// Latency samples.
#[derive(Clone, Debug, Default)]
pub struct Samples {
    values: Vec<Duration>,
    sorted: bool,
}

impl Samples {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, d: Duration) {
        self.values.push(d);
        self.sorted = false;
    }

    pub fn extend(&mut self, other: impl IntoIterator<Item = Duration>) {
        self.values.extend(other);
        self.sorted = false;
    }

    /// The samples, in no particular order.
    pub fn into_values(self) -> Vec<Duration> {
        self.values
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    fn sort(&mut self) {
        if !self.sorted {
            self.values.sort_unstable();
            self.sorted = true;
        }
    }

    /// The `p`-th percentile (0–100) by nearest rank; `None` without samples.
    pub fn percentile(&mut self, p: f64) -> Option<Duration> {
        if self.values.is_empty() {
            return None;
        }
        self.sort();
        let n = self.values.len();
        // Nearest rank: the smallest value with at least p % of the samples at or below it.
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let rank = ((p / 100.0) * n as f64).ceil() as usize;
        Some(self.values[rank.clamp(1, n) - 1])
    }

    pub fn max(&mut self) -> Option<Duration> {
        self.percentile(100.0)
    }

    pub fn mean(&self) -> Option<Duration> {
        let n = u32::try_from(self.values.len()).ok().filter(|n| *n > 0)?;
        Some(self.values.iter().sum::<Duration>() / n)
    }
}

/// `12.3 ms` / `1.234 s`: milliseconds below ten seconds, seconds above.
pub fn fmt_duration(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1000.0;
    if ms < 1.0 {
        format!("{ms:.3} ms")
    } else if ms < 100.0 {
        format!("{ms:.2} ms")
    } else if ms < 10_000.0 {
        format!("{ms:.0} ms")
    } else {
        format!("{:.2} s", d.as_secs_f64())
    }
}

/// [`fmt_duration`] of an optional value (`–` without samples).
pub fn fmt_opt(d: Option<Duration>) -> String {
    d.map_or_else(|| "–".to_owned(), fmt_duration)
}

/// A per-second rate with thousands separators: `5,123/s`.
pub fn fmt_rate(count: usize, over: Duration) -> String {
    let secs = over.as_secs_f64();
    if secs <= 0.0 {
        return "–".to_owned();
    }
    #[allow(clippy::cast_precision_loss)]
    let rate = count as f64 / secs;
    format!("{}/s", thousands(rate.round()))
}

/// `12345.0` → `12,345`.
pub fn thousands(v: f64) -> String {
    #[allow(clippy::cast_possible_truncation)]
    let n = v.round() as i64;
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 { format!("-{out}") } else { out }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let mut s = Samples::new();
        s.extend((1..=100).map(Duration::from_millis));
        assert_eq!(s.percentile(50.0), Some(Duration::from_millis(50)));
        assert_eq!(s.percentile(99.0), Some(Duration::from_millis(99)));
        assert_eq!(s.percentile(100.0), Some(Duration::from_millis(100)));
        assert_eq!(s.percentile(0.0), Some(Duration::from_millis(1)));
        assert_eq!(Samples::new().percentile(50.0), None);
    }

    #[test]
    fn numbers_are_grouped_by_thousands() {
        assert_eq!(thousands(0.0), "0");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(thousands(1000.0), "1,000");
        assert_eq!(thousands(1_234_567.4), "1,234,567");
        assert_eq!(fmt_rate(5000, Duration::from_secs(2)), "2,500/s");
    }
}
