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

/// The steady-state throughput of a closed loop, per minute: each user's own rate between its
/// first and last completion inside `window` ((completions − 1) ÷ the time between them),
/// summed over the users with at least two there. `completions` are (user, time since the
/// start). Counting completions in a fixed window instead aliases with the loop's cycle: users
/// that started within a few seconds of each other finish within a few seconds of each other
/// every cycle, so a window of 2.1 cycles holds two or three of those bands depending on where
/// it falls (1000 users on a 16 s cycle: 3,530 or 3,750 a minute for the same run). A user
/// stuck on one scan adds nothing, so a stall lowers the figure rather than hides.
pub fn closed_loop_per_min(
    completions: &[(usize, Duration)],
    window: std::ops::RangeInclusive<Duration>,
) -> Option<f64> {
    let mut per_user: std::collections::BTreeMap<usize, (Duration, Duration, usize)> =
        std::collections::BTreeMap::new();
    for &(user, at) in completions.iter().filter(|(_, at)| window.contains(at)) {
        let e = per_user.entry(user).or_insert((at, at, 0));
        e.0 = e.0.min(at);
        e.1 = e.1.max(at);
        e.2 += 1;
    }
    let rates: Vec<f64> = per_user
        .values()
        .filter(|(first, last, n)| *n >= 2 && last > first)
        .map(|(first, last, n)| (*n - 1) as f64 / (*last - *first).as_secs_f64())
        .collect();
    (!rates.is_empty()).then(|| rates.iter().sum::<f64>() * 60.0)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_closed_loop_rate_does_not_alias_with_its_cycle() {
        // 1000 users started over 10 s, each finishing a scan every 16 s: 3,750 a minute.
        let mut completions = Vec::new();
        for user in 0..1000usize {
            let offset = Duration::from_secs_f64(10.0 * user as f64 / 1000.0);
            for k in 1..=4u32 {
                completions.push((user, offset + Duration::from_secs(16) * k));
            }
        }
        let window = Duration::from_secs(26)..=Duration::from_secs(60);
        let counted = completions
            .iter()
            .filter(|(_, at)| window.contains(at))
            .count();
        // The fixed-window count: two bands of completions in 34 s.
        assert!((counted as f64 * 60.0 / 34.0 - 3530.0).abs() < 10.0);
        let rate = closed_loop_per_min(&completions, window).unwrap();
        assert!((rate - 3750.0).abs() < 1.0, "{rate}");
        // A user stuck after its first scan in the window adds nothing.
        let stalled: Vec<(usize, Duration)> = completions
            .iter()
            .copied()
            .filter(|(user, at)| *user >= 500 || *at < Duration::from_secs(40))
            .collect();
        let rate = closed_loop_per_min(&stalled, Duration::from_secs(26)..=Duration::from_secs(60))
            .unwrap();
        assert!((rate - 1875.0).abs() < 1.0, "{rate}");
        assert_eq!(
            closed_loop_per_min(&[], Duration::ZERO..=Duration::from_secs(1)),
            None
        );
    }

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
