//! How the dead-letter schedule retries each kind of dead letter (`INGEST_DEAD_LETTER_RETRY`):
//! the setting parsed and checked, and when a dead letter's next try is due. A leaf, so that
//! the configuration can hold one without knowing the stores.

use std::{
    collections::BTreeMap,
    fmt,
    str::FromStr,
    time::{Duration, SystemTime},
};

/// How the schedule retries each kind of dead letter (`Job::dead_reason`): at most `times`
/// requeues, the first `backoff` after the job was set aside, each next one twice as long
/// after it was set aside again.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RetryPolicy {
    rules: BTreeMap<String, Rule>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Rule {
    times: u32,
    backoff: Duration,
}

/// The kinds of dead letter there are (the `reason` of `ingest_jobs_dead_lettered_total`).
pub const KINDS: [&str; 2] = ["attempts", "store"];

/// The longest wait the doubling reaches: past it, every next try waits this long.
const MAX_BACKOFF: Duration = Duration::from_secs(24 * 60 * 60);

impl RetryPolicy {
    /// The default: jobs started too often without finishing, 3 times from 5 minutes on;
    /// a record that cannot be read (a poison input) never.
    pub fn default_schedule() -> Self {
        "attempts:3x5m"
            .parse()
            .expect("the default schedule parses")
    }

    /// Whether the schedule retries nothing.
    pub fn is_off(&self) -> bool {
        self.rules.values().all(|r| r.times == 0)
    }

    /// When the schedule requeues a dead letter of kind `reason` (`Job::dead_reason`), set
    /// aside at `dead_at` after the schedule requeued it `auto_requeues` times, if ever: its
    /// kind's rule, while it has tries left.
    pub fn next_try(
        &self,
        reason: Option<&str>,
        auto_requeues: u32,
        dead_at: Option<SystemTime>,
    ) -> Option<SystemTime> {
        let rule = self.rules.get(reason?)?;
        if auto_requeues >= rule.times {
            return None;
        }
        let wait = rule
            .backoff
            .checked_mul(1 << auto_requeues.min(20))
            .unwrap_or(MAX_BACKOFF)
            .min(MAX_BACKOFF);
        Some(dead_at? + wait)
    }

    /// How many times `kind` is retried.
    pub fn times(&self, kind: &str) -> u32 {
        self.rules.get(kind).map_or(0, |r| r.times)
    }
}

/// `off`, or comma-separated `<kind>:<times>x<backoff>` (`attempts:3x5m,store:1x1h`); a kind
/// not named is never retried.
impl FromStr for RetryPolicy {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() || s == "off" {
            return Ok(Self::default());
        }
        let mut rules = BTreeMap::new();
        for part in s.split(',') {
            let part = part.trim();
            let bad = || {
                format!(
                    "{part:?} is not <kind>:<times>x<backoff> (e.g. attempts:3x5m); kinds: {}",
                    KINDS.join(", ")
                )
            };
            let (kind, rule) = part.split_once(':').ok_or_else(bad)?;
            let kind = kind.trim();
            if !KINDS.contains(&kind) {
                return Err(format!(
                    "unknown kind of dead letter {kind:?}; kinds: {}",
                    KINDS.join(", ")
                ));
            }
            let (times, backoff) = match rule.trim().split_once('x') {
                Some((times, backoff)) => (times, backoff),
                // `store:0`: never.
                None => (rule.trim(), "1m"),
            };
            let times: u32 = times.trim().parse().map_err(|_| bad())?;
            if times > 100 {
                return Err(format!("{part:?}: at most 100 tries"));
            }
            let backoff =
                ecoscan_common::config::parse_duration(backoff.trim()).map_err(|_| bad())?;
            if backoff.is_zero() && times > 0 {
                return Err(format!("{part:?}: the backoff must be more than zero"));
            }
            if rules
                .insert(kind.to_owned(), Rule { times, backoff })
                .is_some()
            {
                return Err(format!("{kind:?} is named twice"));
            }
        }
        Ok(Self { rules })
    }
}

impl fmt::Display for RetryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_off() {
            return f.write_str("off");
        }
        let parts: Vec<String> = self
            .rules
            .iter()
            .filter(|(_, r)| r.times > 0)
            .map(|(k, r)| format!("{k}:{}x{}", r.times, spoken(r.backoff)))
            .collect();
        f.write_str(&parts.join(","))
    }
}

/// A duration as the setting takes it: `90s`, `5m`, `1h`, `2d`.
fn spoken(d: Duration) -> String {
    match d.as_secs() {
        s if s > 0 && s % 86_400 == 0 => format!("{}d", s / 86_400),
        s if s > 0 && s % 3_600 == 0 => format!("{}h", s / 3_600),
        s if s > 0 && s % 60 == 0 => format!("{}m", s / 60),
        s if d.subsec_millis() == 0 => format!("{s}s"),
        _ => format!("{}ms", d.as_millis()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// When `p` next retries a dead letter of `reason` set aside at `t`, requeued `n` times.
    fn next(p: &RetryPolicy, reason: &str, n: u32, t: SystemTime) -> Option<SystemTime> {
        p.next_try(Some(reason), n, Some(t))
    }

    #[test]
    fn the_default_retries_jobs_that_kept_dying_never_poison_inputs() {
        let p = RetryPolicy::default_schedule();
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let min = |m: u64| Duration::from_secs(60 * m);
        assert_eq!(next(&p, "attempts", 0, t), Some(t + min(5)));
        assert_eq!(next(&p, "attempts", 1, t), Some(t + min(10)));
        assert_eq!(next(&p, "attempts", 2, t), Some(t + min(20)));
        assert_eq!(
            next(&p, "attempts", 3, t),
            None,
            "three tries, then an operator"
        );
        assert_eq!(
            next(&p, "store", 0, t),
            None,
            "a poison input is never retried"
        );
        assert_eq!(
            p.next_try(None, 0, Some(t)),
            None,
            "a row from before reasons were kept"
        );
        assert_eq!(p.to_string(), "attempts:3x5m");
    }

    #[test]
    fn schedules_parse_or_say_what_is_wrong() {
        let p: RetryPolicy = "attempts:2x30s, store:1x1h".parse().unwrap();
        assert_eq!(p.times("attempts"), 2);
        assert_eq!(p.times("store"), 1);
        assert!("off".parse::<RetryPolicy>().unwrap().is_off());
        assert!("store:0".parse::<RetryPolicy>().unwrap().is_off());
        for (bad, says) in [
            ("crashes:3x5m", "unknown kind"),
            ("attempts", "is not <kind>"),
            ("attempts:three", "is not <kind>"),
            ("attempts:3xsoon", "is not <kind>"),
            ("attempts:3x0s", "more than zero"),
            ("attempts:1000x1m", "at most 100"),
            ("attempts:1x1m,attempts:2x1m", "named twice"),
        ] {
            let err = bad.parse::<RetryPolicy>().unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
        // The doubling stops at a day.
        let p: RetryPolicy = "attempts:30x1h".parse().unwrap();
        let t = SystemTime::UNIX_EPOCH;
        assert_eq!(next(&p, "attempts", 20, t), Some(t + MAX_BACKOFF));
    }
}
