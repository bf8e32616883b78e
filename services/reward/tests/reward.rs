//! RewardService over a real socket, on a SQLite file in a temporary directory.

use ecoscan_common::{
    USER_ID_HEADER,
    testing::{Spawned, assert_health_and_reflection, spawn},
};
use ecoscan_proto::v1::{
    Classification, DisposalRules, EvaluateRequest, GetCharacterRequest, ListCatalogueRequest,
    ListOwnedRequest, RewardDecision, reward_service_client::RewardServiceClient,
};
use ecoscan_reward::{Config, serve};
use tempfile::TempDir;
use tonic::{Code, Request};

struct Harness {
    server: Spawned,
    client: RewardServiceClient<ecoscan_common::client::TracedChannel>,
    _dir: TempDir,
}

async fn start() -> Harness {
    let dir = TempDir::new().unwrap();
    let config = Config {
        database_url: format!(
            "sqlite://{}/nested/reward.db?mode=rwc",
            dir.path().display()
        ),
    };
    let server = spawn(|l, s| serve(config, l, s)).await;
    let client = RewardServiceClient::new(ecoscan_common::client::channel(&server.uri()).unwrap());
    Harness {
        server,
        client,
        _dir: dir,
    }
}

/// `msg` as a call acting for `user` (the `x-user-id` metadata).
/// A call made for `user` by ingest (the one caller `Evaluate` grants for).
fn as_user<T>(msg: T, user: &str) -> Request<T> {
    let mut req = Request::new(msg);
    req.metadata_mut()
        .insert(USER_ID_HEADER, user.parse().unwrap());
    ecoscan_common::client::by_actor(req, ecoscan_common::identity::INGEST_ACTOR)
}

fn request(
    job: &str,
    user: &str,
    middle: &str,
    recyclable: Option<bool>,
) -> Request<EvaluateRequest> {
    as_user(body(job, middle, recyclable), user)
}

fn body(job: &str, middle: &str, recyclable: Option<bool>) -> EvaluateRequest {
    EvaluateRequest {
        job_id: job.into(),
        classification: Some(Classification {
            major_category: "재활용폐기물".into(),
            middle_category: middle.into(),
            minor_category: "음료PET병".into(),
            ..Default::default()
        }),
        rules: recyclable.map(|recyclable| DisposalRules {
            middle_category: middle.into(),
            recyclable,
            ..Default::default()
        }),
    }
}

async fn evaluate(h: &mut Harness, req: Request<EvaluateRequest>) -> RewardDecision {
    h.client
        .evaluate(req)
        .await
        .unwrap()
        .into_inner()
        .decision
        .unwrap()
}

async fn owned_codes(h: &mut Harness, user: &str) -> Vec<String> {
    h.client
        .list_owned(as_user(ListOwnedRequest {}, user))
        .await
        .unwrap()
        .into_inner()
        .characters
        .into_iter()
        .map(|c| c.character.unwrap().code)
        .collect()
}

#[tokio::test]
async fn a_character_is_granted_once_then_reported_as_already_owned() {
    let mut h = start().await;

    let first = evaluate(&mut h, request("job-1", "alice", "무색페트병", Some(true))).await;
    let second = evaluate(&mut h, request("job-2", "alice", "무색페트병", Some(true))).await;

    assert!(first.eligible && first.newly_granted);
    assert_eq!(first.reason, "granted");
    let character = first.character.unwrap();
    assert_eq!(character.code, "char-petty");
    assert_eq!(character.name_ko, "페티");
    assert!(second.eligible && !second.newly_granted);
    assert_eq!(second.reason, "already_owned");
    assert_eq!(second.character.unwrap().code, "char-petty");
    h.server.stop().await.unwrap();
}

#[tokio::test]
async fn a_replayed_job_returns_the_identical_first_decision() {
    let mut h = start().await;

    let first = evaluate(&mut h, request("job-1", "alice", "유리병", Some(true))).await;
    let replay = evaluate(&mut h, request("job-1", "alice", "유리병", Some(true))).await;
    // Even a replay whose payload changed gets the stored decision and grants nothing new.
    let changed = evaluate(&mut h, request("job-1", "alice", "금속류", Some(true))).await;

    assert!(first.newly_granted);
    assert_eq!(replay, first);
    assert_eq!(changed, first);
    assert_eq!(owned_codes(&mut h, "alice").await, ["char-glassy"]);
}

#[tokio::test]
async fn concurrent_jobs_of_one_category_grant_exactly_once() {
    let h = start().await;

    let calls = (0..10).map(|i| {
        let mut client = h.client.clone();
        async move {
            client
                .evaluate(request(&format!("job-{i}"), "bob", "종이", Some(true)))
                .await
                .unwrap()
                .into_inner()
                .decision
                .unwrap()
        }
    });
    let decisions = futures::future::join_all(calls).await;

    assert_eq!(decisions.iter().filter(|d| d.newly_granted).count(), 1);
    assert!(decisions.iter().all(|d| d.eligible));
    assert_eq!(
        decisions
            .iter()
            .filter(|d| d.reason == "already_owned")
            .count(),
        9
    );
}

#[tokio::test]
async fn ineligible_scans_get_a_reason_and_store_nothing() {
    let mut h = start().await;

    let not_recyclable =
        evaluate(&mut h, request("job-1", "carol", "무색페트병", Some(false))).await;
    let no_rules = evaluate(&mut h, request("job-2", "carol", "무색페트병", None)).await;

    for (d, reason) in [(&not_recyclable, "not_recyclable"), (&no_rules, "no_rules")] {
        assert!(!d.eligible && !d.newly_granted, "{d:?}");
        assert!(d.character.is_none());
        assert_eq!(d.reason, reason);
    }
    assert!(owned_codes(&mut h, "carol").await.is_empty());
}

#[tokio::test]
async fn a_recyclable_item_without_a_character_of_its_own_earns_the_default_one() {
    let mut h = start().await;
    let first = evaluate(&mut h, request("job-1", "kim", "폐식용유", Some(true))).await;
    let again = evaluate(&mut h, request("job-2", "kim", "소형가전", Some(true))).await;

    assert!(first.eligible && first.newly_granted, "{first:?}");
    assert_eq!(first.reason, "granted");
    let character = first.character.unwrap();
    assert_eq!(character.code, "char-eco");
    assert!(character.middle_category.is_empty());
    assert_eq!(again.reason, "already_owned");
    assert_eq!(owned_codes(&mut h, "kim").await, ["char-eco"]);
}

#[tokio::test]
async fn the_catalogue_lists_every_character_with_the_caller_s_ownership() {
    let mut h = start().await;
    evaluate(&mut h, request("job-g", "lee", "유리병", Some(true))).await;

    let list = |h: &mut Harness, user: &str| {
        let mut client = h.client.clone();
        let req = as_user(ListCatalogueRequest {}, user);
        async move {
            client
                .list_catalogue(req)
                .await
                .unwrap()
                .into_inner()
                .characters
        }
    };
    let lee = list(&mut h, "lee").await;
    assert_eq!(lee.len(), 13, "12 characters and the default");
    assert!(lee[0].is_default);
    assert_eq!(lee[0].character.as_ref().unwrap().code, "char-eco");
    assert_eq!(lee.iter().filter(|e| e.is_default).count(), 1);
    let owned: Vec<_> = lee
        .iter()
        .filter(|e| e.owned)
        .map(|e| {
            (
                e.character.as_ref().unwrap().code.as_str(),
                e.job_id.as_str(),
            )
        })
        .collect();
    assert_eq!(owned, [("char-glassy", "job-g")]);
    assert!(lee.iter().all(|e| e.owned == e.acquired_at.is_some()));
    // Another user owns nothing of it.
    assert!(list(&mut h, "park").await.iter().all(|e| !e.owned));

    // One character, by any of its names.
    for name in ["char-glassy", "글래시", "glassy"] {
        let entry = h
            .client
            .get_character(as_user(GetCharacterRequest { name: name.into() }, "lee"))
            .await
            .unwrap()
            .into_inner()
            .entry
            .unwrap();
        assert_eq!(entry.character.unwrap().code, "char-glassy", "{name}");
        assert!(entry.owned && entry.job_id == "job-g", "{name}");
    }
    let err = h
        .client
        .get_character(as_user(
            GetCharacterRequest {
                name: "Pikachu".into(),
            },
            "lee",
        ))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    assert!(
        err.message().contains("\"Pikachu\"") && err.message().contains("ListCatalogue"),
        "{err:?}"
    );
    let err = h
        .client
        .get_character(as_user(GetCharacterRequest { name: " ".into() }, "lee"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    // Ownership is the caller's: no identity, no answer.
    let err = h
        .client
        .list_catalogue(Request::new(ListCatalogueRequest {}))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
}

#[tokio::test]
async fn list_owned_returns_characters_in_acquisition_order_with_their_jobs() {
    let mut h = start().await;
    evaluate(&mut h, request("job-a", "dave", "전지", Some(true))).await;
    evaluate(&mut h, request("job-b", "dave", "비닐류", Some(true))).await;
    evaluate(&mut h, request("job-c", "erin", "종이팩", Some(true))).await;

    let owned = h
        .client
        .list_owned(as_user(ListOwnedRequest {}, "dave"))
        .await
        .unwrap()
        .into_inner()
        .characters;

    let summary: Vec<_> = owned
        .iter()
        .map(|o| {
            (
                o.character.as_ref().unwrap().code.as_str(),
                o.job_id.as_str(),
            )
        })
        .collect();
    assert_eq!(summary, [("char-battery", "job-a"), ("char-bini", "job-b")]);
    assert!(owned.iter().all(|o| o.acquired_at.is_some()));
    assert!(owned_codes(&mut h, "nobody").await.is_empty());
}

#[tokio::test]
async fn bad_input_is_rejected_with_invalid_argument_and_stores_nothing() {
    let mut h = start().await;
    let cases = [
        (
            request("", "frank", "종이", Some(true)),
            Code::InvalidArgument,
            "job_id",
        ),
        // The acting user comes from the identity assertion: a call whose identity is unusable
        // or missing is UNAUTHENTICATED.
        (
            request("job-1", " ", "종이", Some(true)),
            Code::Unauthenticated,
            "identity",
        ),
        (
            Request::new(body("job-1", "종이", Some(true))),
            Code::Unauthenticated,
            "needs an identity",
        ),
        (
            as_user(
                EvaluateRequest {
                    classification: None,
                    ..body("job-1", "종이", Some(true))
                },
                "frank",
            ),
            Code::InvalidArgument,
            "classification",
        ),
    ];
    for (req, code, field) in cases {
        let err = h.client.evaluate(req).await.unwrap_err();
        assert_eq!(err.code(), code, "{}", err.message());
        assert!(err.message().contains(field), "{}", err.message());
    }
    let err = h
        .client
        .list_owned(Request::new(ListOwnedRequest {}))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    assert!(owned_codes(&mut h, "frank").await.is_empty());
    // The rejected job id was not consumed: a valid call for it still grants.
    let d = evaluate(&mut h, request("job-1", "frank", "종이", Some(true))).await;
    assert!(d.newly_granted);
}

#[tokio::test]
async fn only_ingest_may_grant_a_character() {
    let mut h = start().await;
    // A user's own assertion (what `ecoscan token --grpc` mints), or another service's, names
    // a job id of its choosing: refused, nothing granted.
    let own = || {
        let mut req = Request::new(body("job-manual-1", "종이", Some(true)));
        req.metadata_mut()
            .insert(USER_ID_HEADER, "ivy".parse().unwrap());
        req
    };
    for req in [own(), ecoscan_common::client::by_actor(own(), "vision")] {
        let err = h.client.evaluate(req).await.unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
        assert!(err.message().contains("only ingest"), "{err:?}");
    }
    assert!(owned_codes(&mut h, "ivy").await.is_empty());
    // An actor sent as plain metadata is dropped like `x-user-id`: only a verified assertion
    // names one. (The test client signs what it sends, so this is what the server saw.)
    let d = evaluate(&mut h, request("job-manual-1", "ivy", "종이", Some(true))).await;
    assert!(
        d.newly_granted,
        "ingest's call for the same job still grants"
    );
}

#[tokio::test]
async fn a_job_evaluated_for_one_user_is_refused_for_another() {
    let mut h = start().await;
    evaluate(&mut h, request("job-1", "gina", "종이", Some(true))).await;

    let err = h
        .client
        .evaluate(request("job-1", "hank", "종이", Some(true)))
        .await
        .unwrap_err();

    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(owned_codes(&mut h, "hank").await.is_empty());
}

#[tokio::test]
async fn serves_health_and_reflection() {
    let h = start().await;
    assert_health_and_reflection(&h.server.uri(), "ecoscan.v1.RewardService").await;
}

#[tokio::test]
async fn concurrent_replays_of_one_job_all_return_the_one_grant() {
    let h = start().await;

    let calls = (0..10).map(|_| {
        let mut client = h.client.clone();
        async move {
            client
                .evaluate(request("job-same", "ivy", "금속류", Some(true)))
                .await
                .unwrap()
                .into_inner()
                .decision
                .unwrap()
        }
    });
    let decisions = futures::future::join_all(calls).await;

    assert!(
        decisions.iter().all(|d| d == &decisions[0]),
        "{decisions:?}"
    );
    assert!(decisions[0].newly_granted);
}
