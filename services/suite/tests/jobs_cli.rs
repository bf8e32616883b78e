//! `ecoscan jobs dead-letter …` against a running suite, through the real binary: what it
//! prints, and that every refusal ends with a non-zero status and a message saying why. (Dead
//! letters themselves, listed and requeued, are tested in ingest's `tests/faults.rs`.)

mod common;

use std::process::Output;

use common::TestSuite;

fn jobs(ingest: &str, data_dir: &std::path::Path, args: &[&str]) -> Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_ecoscan"))
        .args(["jobs", "--ingest", ingest, "--data-dir"])
        .arg(data_dir)
        .arg("dead-letter")
        .args(args)
        .output()
        .expect("ecoscan jobs runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test]
async fn the_dead_letter_commands_talk_to_ingest_and_explain_refusals() {
    let suite = TestSuite::start().await;
    let ingest = format!("http://{}", suite.running.addrs.ingest);

    let listed = tokio::task::spawn_blocking({
        let (ingest, dir) = (ingest.clone(), suite.data_dir.path().to_owned());
        move || jobs(&ingest, &dir, &["list", "--limit", "10"])
    })
    .await
    .unwrap();
    assert!(listed.status.success(), "{}", text(&listed.stderr));
    assert_eq!(text(&listed.stdout), "no dead-lettered jobs\n");

    let cases = [
        (vec!["requeue", "not-a-job"], "INVALID_ARGUMENT"),
        (
            vec!["requeue", "0193a3c4-0000-7000-8000-000000000000"],
            "NOT_FOUND",
        ),
        (
            vec!["list", "--before", "yesterday"],
            "not an RFC 3339 time",
        ),
    ];
    for (args, expected) in cases {
        let (ingest, dir) = (ingest.clone(), suite.data_dir.path().to_owned());
        let out = tokio::task::spawn_blocking(move || jobs(&ingest, &dir, &args))
            .await
            .unwrap();
        assert!(!out.status.success());
        assert!(
            text(&out.stderr).contains(expected),
            "expected {expected:?} in {}",
            text(&out.stderr)
        );
    }
}

#[tokio::test]
async fn an_unreachable_ingest_is_named_in_the_error() {
    // A port nobody listens on: bind one, then let it go.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let ingest = format!("http://127.0.0.1:{port}");
    let tmp = tempfile::tempdir().unwrap();
    let out = tokio::task::spawn_blocking({
        let (ingest, dir) = (ingest.clone(), tmp.path().to_owned());
        move || jobs(&ingest, &dir, &["list"])
    })
    .await
    .unwrap();
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains(&ingest), "{}", text(&out.stderr));
}
