//! What an operator types and sets, through the real `ecoscan` binary: `--help` on every
//! subcommand, durations in hours, and `ECOSCAN_STORES=production` refusing embedded stores.

use std::process::Output;

fn ecoscan(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_ecoscan"));
    cmd.args(args);
    // Nothing from the caller's environment may choose the stores of these runs.
    for var in [
        "DATABASE_URL",
        "INGEST_DATABASE_URL",
        "REDIS_URL",
        "S3_ENDPOINT",
        "S3_BUCKET",
        "ECOSCAN_STORES",
    ] {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied());
    cmd.env("RUST_LOG", "warn");
    cmd.output().expect("ecoscan runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn every_subcommand_has_help() {
    for args in [
        vec!["--help"],
        vec!["up", "--help"],
        vec!["serve", "--help"],
        vec!["token", "--help"],
        vec!["migrate", "--help"],
        vec!["jobs", "--help"],
        vec!["jobs", "dead-letter", "--help"],
        vec!["jobs", "dead-letter", "list", "--help"],
        vec!["jobs", "dead-letter", "requeue", "--help"],
    ] {
        let out = ecoscan(&args, &[]);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        assert!(
            text(&out.stdout).contains("Usage:"),
            "{args:?}: {}",
            text(&out.stdout)
        );
    }
    let out = ecoscan(&["frobnicate"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("unrecognized subcommand"));
}

#[test]
fn token_help_names_the_usage_route_and_a_long_lived_assertion_is_refused() {
    let help = text(&ecoscan(&["token", "--help"], &[]).stdout);
    assert!(help.contains("/api/v1/analytics/usage"), "{help}");
    assert!(!help.contains("/api/v1/usage"), "{help}");
    let data = tempfile::tempdir().unwrap();
    let dir = data.path().to_str().unwrap();
    let out = ecoscan(
        &[
            "token",
            "--user",
            "alice",
            "--grpc",
            "ecoscan.v1.ScanService",
            "--ttl",
            "5000d",
            "--data-dir",
            dir,
        ],
        &[],
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("an identity assertion lives at most 5 min (asked for 5000 days)"),
        "{err}"
    );
    // The default and the cap itself are fine.
    for ttl in [None, Some("5m")] {
        let mut args = vec![
            "token",
            "--user",
            "alice",
            "--grpc",
            "ecoscan.v1.ScanService",
            "--data-dir",
            dir,
        ];
        args.extend(ttl.iter().flat_map(|t| ["--ttl", *t]));
        let out = ecoscan(&args, &[]);
        assert!(out.status.success(), "{ttl:?}: {}", text(&out.stderr));
        assert!(text(&out.stdout).starts_with("x-ecoscan-identity: "));
    }
}

#[test]
fn production_stores_refuse_to_start_ingest_on_embedded_ones() {
    let out = ecoscan(
        &["serve", "ingest"],
        &[
            ("ECOSCAN_STORES", "production"),
            ("INGEST_ADDR", "127.0.0.1:0"),
            // An hour, written as one: durations take h.
            ("INGEST_EVENT_TTL", "1h"),
        ],
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    for needle in [
        "ECOSCAN_STORES=production",
        "job rows in SQLite",
        "REDIS_URL",
        "S3_ENDPOINT",
    ] {
        assert!(err.contains(needle), "{needle:?} in {err}");
    }
}

#[test]
fn a_misspelt_duration_unit_is_refused_with_the_variable_named() {
    let out = ecoscan(
        &["serve", "ingest"],
        &[
            ("INGEST_ADDR", "127.0.0.1:0"),
            ("INGEST_EVENT_TTL", "1 week"),
        ],
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("INGEST_EVENT_TTL"), "{err}");
    assert!(err.contains("use ms, s, m, h or d"), "{err}");
}

#[test]
fn a_misspelt_setting_stops_the_start_with_the_name_it_meant() {
    let out = ecoscan(
        &["serve", "ingest"],
        &[("INGEST_ADDR", "127.0.0.1:0"), ("INGEST_LEASES", "5m")],
    );
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("INGEST_LEASES (did you mean INGEST_LEASE?)"),
        "{err}"
    );
}

#[test]
fn ecoscan_up_takes_the_gateways_settings_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let mut args = vec!["up", "--data-dir", dir.path().to_str().unwrap()];
    for port in [
        "--gateway-port",
        "--gateway-admin-port",
        "--ingest-port",
        "--vision-port",
        "--rule-port",
        "--answer-port",
        "--reward-port",
        "--analytics-port",
        "--notification-port",
    ] {
        args.extend([port, "0"]);
    }
    // A value the gateway cannot run with: refused, so it was read (it used to be ignored).
    let out = ecoscan(&args, &[("GATEWAY_SSE_MAX_LIFETIME", "0s")]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(
        err.contains("GATEWAY_SSE_MAX_LIFETIME must be positive"),
        "{err}"
    );
}
