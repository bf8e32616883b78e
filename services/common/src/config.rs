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

/// Parses `250`, `250ms`, `2s`, `1m`, `1h` or `7d`.
pub fn parse_duration(v: &str) -> anyhow::Result<Duration> {
    let v = v.trim();
    let (num, unit) = v
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .map_or((v, "ms"), |i| v.split_at(i));
    let n: f64 = num.parse().context("not a number")?;
    let ms = match unit.trim() {
        "ms" => n,
        "s" => n * 1_000.0,
        "m" => n * 60_000.0,
        "h" => n * 3_600_000.0,
        "d" => n * 86_400_000.0,
        other => return Err(anyhow!("unknown unit {other:?} (use ms, s, m, h or d)")),
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

/// Every variable any ecoscan binary reads, one per line; `infra/k8s-check.sh` (in the test
/// command) fails when it differs from what the code reads, and
/// `python3 infra/k8s_check.py --write-env-registry` rewrites it.
const KNOWN_VARIABLES: &str = include_str!("known_env.txt");

/// Variables of ecoscan's prefixes that its scripts (`infra/`) read, not its binaries: a user
/// who exports them for the scripts must still be able to start the binaries.
const SCRIPT_VARIABLES: &[&str] = &[
    "ECOSCAN_SERVICES_DIR",
    "ECOSCAN_TOOLS_DIR",
    // The LiteLLM proxy the tests run (infra/test.sh installs it and says where).
    "ECOSCAN_LITELLM",
];

/// Prefixes that belong to ecoscan: a variable starting with one of them that no code reads is
/// a mistake (a typo, a setting that was renamed or removed). Shared ones (`REDIS_`, `S3_`,
/// `DATABASE_URL`, `OTEL_`, `GRPC_`) may belong to other software and are left alone.
const OWNED_PREFIXES: &[&str] = &[
    "ECOSCAN_",
    "GATEWAY_",
    "INGEST_",
    "VISION_",
    "RULE_",
    "ANSWER_",
    "REWARD_",
    "ANALYTICS_",
    "NOTIFICATION_",
    "LLM_",
];

/// Refuses to start when the environment holds a variable of ecoscan's own prefixes that no
/// ecoscan code reads, naming it and the closest known one: a misspelt `INGEST_LEASES=5m` would
/// otherwise be ignored in silence.
pub fn check_unknown_variables() -> anyhow::Result<()> {
    let names: Vec<String> = std::env::vars_os()
        .filter_map(|(k, _)| k.into_string().ok())
        .collect();
    let unknown = unknown_variables(names.iter().map(String::as_str));
    if unknown.is_empty() {
        return Ok(());
    }
    let list: Vec<String> = unknown
        .iter()
        .map(|(name, near)| match near {
            Some(near) => format!("{name} (did you mean {near}?)"),
            None => name.clone(),
        })
        .collect();
    Err(anyhow!(
        "unknown setting{} {}: no ecoscan service reads {}; correct or remove {} (docs/configuration.md \
         lists every setting)",
        if list.len() == 1 { "" } else { "s" },
        list.join(", "),
        if list.len() == 1 { "it" } else { "them" },
        if list.len() == 1 { "it" } else { "them" },
    ))
}

/// The names among `names` with an ecoscan prefix that are not known, each with the closest
/// known name of the same prefix when one is close (a typo).
fn unknown_variables<'a>(names: impl Iterator<Item = &'a str>) -> Vec<(String, Option<String>)> {
    let known: Vec<&str> = KNOWN_VARIABLES.lines().collect();
    let mut unknown: Vec<(String, Option<String>)> = names
        .filter(|n| OWNED_PREFIXES.iter().any(|p| n.starts_with(p)))
        .filter(|n| !known.contains(n) && !SCRIPT_VARIABLES.contains(n))
        .map(|n| {
            let near = known
                .iter()
                .map(|k| (edit_distance(n, k), *k))
                .filter(|(d, _)| *d <= 3)
                .min()
                .map(|(_, k)| k.to_owned());
            (n.to_owned(), near)
        })
        .collect();
    unknown.sort();
    unknown
}

/// Levenshtein distance, for "did you mean".
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// `ECOSCAN_STORES`: which stores a deployment promises.
pub const STORES_VAR: &str = "ECOSCAN_STORES";

/// With `ECOSCAN_STORES=production`, refuses to go on when `service` would keep anything in an
/// embedded store: a replicated deployment whose store variable is missing or misspelt would
/// otherwise start on a private SQLite file or in memory, and each replica would see its own
/// data. `embedded` lists, for each such store, what it is and the variable that moves it.
/// Unset (or `auto`), embedded stores are allowed.
pub fn require_production_stores(service: &str, embedded: &[(&str, &str)]) -> anyhow::Result<()> {
    check_stores(env_opt(STORES_VAR).as_deref(), service, embedded)
}

fn check_stores(
    setting: Option<&str>,
    service: &str,
    embedded: &[(&str, &str)],
) -> anyhow::Result<()> {
    match setting.map(str::trim) {
        None | Some("auto") => Ok(()),
        Some("production") if embedded.is_empty() => Ok(()),
        Some("production") => {
            let list: Vec<String> = embedded
                .iter()
                .map(|(what, fix)| format!("{what} (set {fix})"))
                .collect();
            Err(anyhow!(
                "{STORES_VAR}=production, but {service} would keep {} in an embedded store: {}",
                if embedded.len() == 1 {
                    "one thing"
                } else {
                    "some things"
                },
                list.join("; ")
            ))
        }
        Some(other) => Err(anyhow!(
            "invalid value {other:?} for {STORES_VAR} (use `production`, or `auto` for whatever the \
             store variables select)"
        )),
    }
}

/// Words found in secrets copied from examples and templates.
const PLACEHOLDER_MARKERS: &[&str] = &[
    "changeme",
    "change-me",
    "change_me",
    "replaceme",
    "replace-me",
    "replace_me",
    "placeholder",
    "yoursecret",
    "your-secret",
    "your_secret",
    "example",
    "dev-only",
    "insecure",
    "do-not-use",
    "donotuse",
    "notasecret",
    "not-a-secret",
    "supersecret",
    "secretkey",
    "secret-key",
    "0123456789abcdef",
];

/// Why `secret` looks like a placeholder rather than a generated secret, if it does.
pub fn placeholder(secret: &str) -> Option<String> {
    let lower = secret.to_ascii_lowercase();
    if let Some(word) = PLACEHOLDER_MARKERS.iter().find(|w| lower.contains(*w)) {
        return Some(format!("it contains {word:?}"));
    }
    let mut distinct: Vec<u8> = secret.bytes().collect();
    distinct.sort_unstable();
    distinct.dedup();
    (distinct.len() < 10).then(|| format!("it has only {} distinct characters", distinct.len()))
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
    fn parse_duration_accepts_hours_and_days() {
        assert_eq!(parse_duration("1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(
            parse_duration("7d").unwrap(),
            Duration::from_secs(7 * 86_400)
        );
        assert_eq!(parse_duration("0.5h").unwrap(), Duration::from_secs(1800));
    }

    #[test]
    fn parse_duration_rejects_unknown_units_and_garbage() {
        let err = parse_duration("5w").unwrap_err().to_string();
        assert!(err.contains("use ms, s, m, h or d"), "{err}");
        assert!(parse_duration("abc").is_err());
        assert!(parse_duration("").is_err());
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn unknown_variables_of_ecoscan_prefixes_are_found_with_the_closest_known_name() {
        let env = [
            "INGEST_LEASE",
            "INGEST_LEASES",
            "GATEWAY_JWT_SECRT",
            "ECOSCAN_FROBNICATE",
            "REDIS_URL",
            "REDIS_WHATEVER",
            "PATH",
            "TEST_REDIS_URL",
            "ECOSCAN_TOOLS_DIR",
        ];
        assert_eq!(
            unknown_variables(env.into_iter()),
            vec![
                ("ECOSCAN_FROBNICATE".to_owned(), None),
                (
                    "GATEWAY_JWT_SECRT".to_owned(),
                    Some("GATEWAY_JWT_SECRET".to_owned())
                ),
                ("INGEST_LEASES".to_owned(), Some("INGEST_LEASE".to_owned())),
            ]
        );
        assert!(unknown_variables(KNOWN_VARIABLES.lines()).is_empty());
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
    }

    #[test]
    fn production_stores_refuse_every_embedded_store_and_say_what_to_set() {
        let embedded = [
            (
                "job rows in SQLite",
                "INGEST_DATABASE_URL or DATABASE_URL to a postgres:// URL",
            ),
            ("the queue in memory", "REDIS_URL"),
        ];
        for unset in [None, Some("auto"), Some(" auto ")] {
            check_stores(unset, "ingest", &embedded).unwrap();
        }
        check_stores(Some("production"), "ingest", &[]).unwrap();
        let err = check_stores(Some("production"), "ingest", &embedded)
            .unwrap_err()
            .to_string();
        assert!(err.contains("ECOSCAN_STORES=production"), "{err}");
        assert!(err.contains("ingest"), "{err}");
        assert!(
            err.contains("job rows in SQLite (set INGEST_DATABASE_URL"),
            "{err}"
        );
        assert!(err.contains("the queue in memory (set REDIS_URL)"), "{err}");
        let err = check_stores(Some("prod"), "ingest", &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("invalid value \"prod\" for ECOSCAN_STORES"),
            "{err}"
        );
    }
}
