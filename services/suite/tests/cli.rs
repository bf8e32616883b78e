//! `ecoscan scan|watch|characters|notifications` against a running suite, through the real
//! binary and only the public REST/SSE API.

mod common;

use std::process::Output;

use common::{PNG, TestSuite};
use serde_json::Value;

async fn ecoscan(suite: &TestSuite, args: &[&str]) -> Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_ecoscan"));
    cmd.args(args)
        .args([
            "--gateway",
            &suite.url(""),
            "--user",
            "cli-user",
            "--data-dir",
        ])
        .arg(suite.data_dir.path())
        .env_remove("ECOSCAN_TOKEN")
        .env("RUST_LOG", "warn");
    tokio::task::spawn_blocking(move || cmd.output().expect("ecoscan runs"))
        .await
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn json_lines(out: &Output) -> Vec<Value> {
    text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect()
}

#[tokio::test]
async fn a_scan_from_the_terminal_streams_to_its_end_and_the_rest_follows() {
    let suite = TestSuite::start().await;
    let dir = tempfile::tempdir().unwrap();
    let photo = dir.path().join("bottle.png");
    std::fs::write(&photo, PNG).unwrap();
    let photo = photo.to_str().unwrap().to_owned();

    // For scripts: one JSON object per event, ending with `ready`.
    let out = ecoscan(
        &suite,
        &["scan", &photo, "--hint", "plastic bottle", "--json"],
    )
    .await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let events = json_lines(&out);
    let names: Vec<&str> = events.iter().filter_map(|e| e["event"].as_str()).collect();
    assert_eq!(names.last(), Some(&"ready"), "{names:?}");
    assert!(names.contains(&"delta"), "the answer streamed: {names:?}");
    for stage in ["vision", "rule", "answer", "reward"] {
        assert!(
            events
                .iter()
                .any(|e| e["data"]["stage"] == stage && e["data"]["status"] == "completed"),
            "{stage} completed: {events:?}"
        );
    }
    let job_id = events[0]["data"]["job_id"].as_str().unwrap().to_owned();

    // For people: the answer (the mock provider says it is mock) and the character.
    let out = ecoscan(&suite, &["scan", &photo, "--hint", "plastic bottle"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let human = text(&out.stdout);
    assert!(human.contains("mock"), "{human}");
    assert!(human.contains("character:"), "{human}");
    assert!(
        human.contains("already yours"),
        "the second scan grants nothing new: {human}"
    );

    // Watching a finished job replays it to its end.
    let out = ecoscan(&suite, &["watch", &job_id, "--json"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        json_lines(&out).last().unwrap()["event"],
        "ready",
        "{}",
        text(&out.stdout)
    );

    let out = ecoscan(&suite, &["characters", "--json"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let owned = &json_lines(&out)[0]["characters"];
    assert_eq!(owned.as_array().unwrap().len(), 1, "{owned}");

    let out = ecoscan(&suite, &["notifications", "--json"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(!json_lines(&out).is_empty(), "the owner was told");
}

#[tokio::test]
async fn failures_end_with_a_non_zero_status_and_say_why() {
    let suite = TestSuite::start().await;
    let dir = tempfile::tempdir().unwrap();
    let not_an_image = dir.path().join("notes.txt");
    std::fs::write(&not_an_image, b"just text").unwrap();

    let out = ecoscan(&suite, &["scan", not_an_image.to_str().unwrap()]).await;
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("415"), "{err}");

    let out = ecoscan(&suite, &["scan", "/no/such/photo.jpg"]).await;
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("cannot read /no/such/photo.jpg"));

    // Another person's (or no) job: 404, not retried.
    let out = ecoscan(&suite, &["watch", "0193a3c4-0000-7000-8000-000000000000"]).await;
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("404"), "{}", text(&out.stderr));
}

/// `ecoscan <args>` with neither `--user` nor `--token`: what a person types after `ecoscan up`.
async fn ecoscan_as_is(suite: &TestSuite, args: &[&str]) -> Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_ecoscan"));
    cmd.args(args)
        .args(["--gateway", &suite.url(""), "--data-dir"])
        .arg(suite.data_dir.path())
        .env_remove("ECOSCAN_TOKEN")
        .env("RUST_LOG", "warn");
    tokio::task::spawn_blocking(move || cmd.output().expect("ecoscan runs"))
        .await
        .unwrap()
}

#[tokio::test]
async fn with_no_user_or_token_the_cli_takes_the_token_ecoscan_up_left_and_nothing_else() {
    // Tokens only, as `ecoscan up` runs by default: no header names anyone.
    let suite =
        TestSuite::start_with(|c| c.gateway.auth.trust_header = ecoscan_gateway::TrustHeader::Off)
            .await;

    let out = ecoscan_as_is(&suite, &["characters", "--json"]).await;
    assert!(!out.status.success(), "no token anywhere, yet it answered");
    let err = text(&out.stderr);
    assert!(err.contains("no token given and none in"), "{err}");

    ecoscan::write_local_token(suite.data_dir.path()).expect("write the local token");
    let out = ecoscan_as_is(&suite, &["characters", "--json"]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
}
