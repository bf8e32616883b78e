//! RuleService over a real socket.

use ecoscan_common::testing::{Spawned, assert_health_and_reflection, spawn};
use ecoscan_proto::v1::{
    Classification, DisposalRules, ListCategoriesRequest, LookupRequest, LookupResponse, Progress,
    lookup_response::Event, rule_service_client::RuleServiceClient,
};
use ecoscan_rule::{Config, serve};
use tokio_stream::StreamExt;
use tonic::Code;

async fn start(
    config: Config,
) -> (
    Spawned,
    RuleServiceClient<ecoscan_common::client::TracedChannel>,
) {
    let server = spawn(|l, s| serve(config, l, s)).await;
    let client = RuleServiceClient::new(ecoscan_common::client::channel(&server.uri()).unwrap());
    (server, client)
}

fn classification(major: &str, middle: &str, minor: &str, tags: &[&str]) -> Classification {
    Classification {
        major_category: major.into(),
        middle_category: middle.into(),
        minor_category: minor.into(),
        item_name: "test item".into(),
        confidence: 0.9,
        situation_tags: tags.iter().map(|t| (*t).to_owned()).collect(),
        provider: "mock".into(),
        model: "mock".into(),
    }
}

fn request(c: Classification, locale: &str) -> LookupRequest {
    LookupRequest {
        classification: Some(c),
        locale: locale.into(),
    }
}

/// Every event of a lookup, or the status the call failed with.
async fn lookup(
    client: &mut RuleServiceClient<ecoscan_common::client::TracedChannel>,
    req: LookupRequest,
) -> Result<Vec<LookupResponse>, tonic::Status> {
    let mut stream = client.lookup(req).await?.into_inner();
    let mut events = Vec::new();
    while let Some(event) = stream.next().await {
        events.push(event?);
    }
    Ok(events)
}

/// Splits a successful lookup into its progress messages and its one rules message, asserting
/// the stream's shape: progress first, exactly one rules message, last.
fn split(events: Vec<LookupResponse>) -> (Vec<Progress>, DisposalRules) {
    let mut progress = Vec::new();
    let mut rules = Vec::new();
    for (i, e) in events.iter().enumerate() {
        match e.event.clone().expect("event is set") {
            Event::Progress(p) => {
                assert!(rules.is_empty(), "progress after the rules at {i}");
                progress.push(p);
            }
            Event::Rules(r) => rules.push(r),
        }
    }
    assert_eq!(rules.len(), 1, "expected exactly one rules message");
    (progress, rules.remove(0))
}

#[tokio::test]
async fn lookup_of_a_labelled_pet_bottle_returns_steps_and_label_advice_in_korean_and_english() {
    let (server, mut client) = start(Config::default()).await;
    let c = classification(
        "재활용폐기물",
        "무색페트병",
        "음료PET병",
        &["비닐_라벨_부착", "내용물_있음"],
    );

    let (progress, ko) = split(lookup(&mut client, request(c.clone(), "")).await.unwrap());
    let (_, en) = split(lookup(&mut client, request(c, "en")).await.unwrap());

    let steps: Vec<&str> = progress.iter().map(|p| p.step.as_str()).collect();
    assert_eq!(
        steps,
        ["resolve_category", "resolve_item", "apply_situation_tags"]
    );
    assert!(progress.windows(2).all(|w| w[0].fraction < w[1].fraction));

    assert_eq!(ko.locale, "ko");
    assert_eq!(
        (ko.major_category.as_str(), ko.middle_category.as_str()),
        ("재활용폐기물", "무색페트병")
    );
    assert_eq!(ko.minor_category, "음료PET병");
    assert!(ko.recyclable);
    assert!(ko.stream_name.contains("페트병"));
    assert!(!ko.targets.is_empty());
    assert!(ko.common_steps.iter().any(|s| s.contains("라벨")));
    assert!(!ko.item_steps.is_empty());
    assert!(
        ko.exclusions
            .iter()
            .any(|e| e.item.contains("색깔") && e.instead == "플라스틱류")
    );
    assert_eq!(ko.situation_advice.len(), 2);
    assert!(
        ko.situation_advice[0].contains("라벨"),
        "{:?}",
        ko.situation_advice
    );
    assert!(
        ko.situation_advice[1].contains("비우"),
        "{:?}",
        ko.situation_advice
    );
    assert!(ko.source.contains("환경부"));

    assert_eq!(en.locale, "en");
    assert_eq!(en.minor_category, "음료PET병");
    assert!(en.stream_name.contains("PET"));
    assert!(en.common_steps.iter().any(|s| s.contains("label")));
    assert_eq!(en.item_steps.len(), ko.item_steps.len());
    assert_eq!(en.exclusions.len(), ko.exclusions.len());
    assert!(
        en.situation_advice[0].contains("label"),
        "{:?}",
        en.situation_advice
    );
    assert!(
        en.situation_advice[1].to_lowercase().contains("pour out"),
        "{:?}",
        en.situation_advice
    );
    assert!(en.source.contains("Ministry of Environment"));
    server.stop().await.unwrap();
}

#[tokio::test]
async fn lookup_of_a_non_recyclable_category_says_not_recyclable() {
    let (server, mut client) = start(Config::default()).await;
    let c = classification("음식물류폐기물", "", "뼈(배출불가)", &[]);
    let (_, rules) = split(lookup(&mut client, request(c, "en")).await.unwrap());
    assert!(!rules.recyclable);
    assert_eq!(rules.middle_category, "");
    assert!(
        rules.item_steps[0].contains("general-waste bag"),
        "{:?}",
        rules.item_steps
    );
    assert!(rules.exclusions.len() > 5);
    assert!(rules.situation_advice.is_empty());
    server.stop().await.unwrap();
}

#[tokio::test]
async fn lookup_of_a_butane_canister_with_gas_left_says_to_empty_it_outdoors() {
    let (server, mut client) = start(Config::default()).await;
    let c = classification("재활용폐기물", "금속류", "부탄가스", &["가스_잔존_의심"]);
    let (_, rules) = split(lookup(&mut client, request(c, "en")).await.unwrap());
    let advice = rules.situation_advice[0].to_lowercase();
    assert!(
        advice.contains("outdoors") && advice.contains("puncture"),
        "{advice}"
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn lookup_of_an_unknown_item_returns_the_category_rules_without_item_steps() {
    let (server, mut client) = start(Config::default()).await;
    let c = classification("재활용폐기물", "플라스틱류", "우주선", &["음식물_오염"]);
    let (progress, rules) = split(lookup(&mut client, request(c, "ko")).await.unwrap());
    assert_eq!(rules.minor_category, "");
    assert!(rules.item_steps.is_empty());
    assert!(!rules.common_steps.is_empty());
    assert!(
        rules.situation_advice[0].contains("일반 종량제봉투"),
        "{:?}",
        rules.situation_advice
    );
    let item = progress.iter().find(|p| p.step == "resolve_item").unwrap();
    assert!(
        item.message.contains("우주선") && item.message.contains("without item steps"),
        "{}",
        item.message
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn lookup_reports_situation_tags_outside_the_vocabulary_without_failing() {
    let (server, mut client) = start(Config::default()).await;
    let c = classification("대형폐기물", "", "가구", &["없는_태그", "대형_폐기물_의심"]);
    let (progress, rules) = split(lookup(&mut client, request(c, "ko")).await.unwrap());
    assert_eq!(rules.situation_advice.len(), 1);
    let tags = progress
        .iter()
        .find(|p| p.step == "apply_situation_tags")
        .unwrap();
    assert!(tags.message.contains("없는_태그"), "{}", tags.message);
    server.stop().await.unwrap();
}

#[tokio::test]
async fn lookup_returns_not_found_for_an_unknown_major_listing_the_valid_ones() {
    let (server, mut client) = start(Config::default()).await;
    let c = classification("우주폐기물", "", "", &[]);
    let status = lookup(&mut client, request(c, "")).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    assert!(
        status.message().contains("우주폐기물"),
        "{}",
        status.message()
    );
    assert!(
        status.message().contains("재활용폐기물"),
        "{}",
        status.message()
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn lookup_returns_not_found_for_an_unknown_middle_listing_the_valid_ones() {
    let (server, mut client) = start(Config::default()).await;
    let c = classification("재활용폐기물", "우주선", "", &[]);
    let status = lookup(&mut client, request(c, "")).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    assert!(
        status.message().contains("무색페트병"),
        "{}",
        status.message()
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn lookup_returns_invalid_argument_for_an_empty_major() {
    let (server, mut client) = start(Config::default()).await;
    let c = classification("  ", "무색페트병", "음료PET병", &[]);
    let status = lookup(&mut client, request(c, "")).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("major_category is empty"),
        "{}",
        status.message()
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn lookup_returns_invalid_argument_for_a_missing_middle_it_cannot_infer() {
    let (server, mut client) = start(Config::default()).await;
    let c = classification("재활용폐기물", "", "", &[]);
    let status = lookup(&mut client, request(c, "")).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("middle_category is required"),
        "{}",
        status.message()
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn lookup_returns_invalid_argument_for_an_unsupported_locale() {
    let (server, mut client) = start(Config::default()).await;
    for locale in ["fr", "KO", "en-US"] {
        let c = classification("재활용폐기물", "무색페트병", "음료PET병", &[]);
        let status = lookup(&mut client, request(c, locale)).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{locale}");
        assert!(status.message().contains(locale), "{}", status.message());
    }
    server.stop().await.unwrap();
}

#[tokio::test]
async fn lookup_returns_invalid_argument_without_a_classification() {
    let (server, mut client) = start(Config::default()).await;
    let req = LookupRequest {
        classification: None,
        locale: "ko".into(),
    };
    let status = lookup(&mut client, req).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().contains("classification"),
        "{}",
        status.message()
    );
    server.stop().await.unwrap();
}

#[tokio::test]
async fn list_categories_includes_all_twelve_recyclable_middles_and_the_tag_vocabulary() {
    let (server, mut client) = start(Config::default()).await;
    let res = client
        .list_categories(ListCategoriesRequest {})
        .await
        .unwrap()
        .into_inner();
    let recyclable: Vec<&str> = res
        .categories
        .iter()
        .filter(|c| c.recyclable)
        .map(|c| c.middle_category.as_str())
        .collect();
    assert_eq!(
        recyclable,
        [
            "종이",
            "종이팩",
            "무색페트병",
            "플라스틱류",
            "비닐류",
            "발포합성수지",
            "유리병",
            "금속류",
            "의류및원단",
            "전지",
            "조명제품",
            "전기전자제품"
        ]
    );
    assert!(
        res.categories
            .iter()
            .all(|c| c.recyclable == (c.major_category == "재활용폐기물"))
    );
    assert!(
        res.categories
            .iter()
            .all(|c| !c.name_en.is_empty() && !c.items.is_empty())
    );
    // Every name in English too: the major's, and each item's beside it.
    for c in &res.categories {
        assert!(!c.major_name_en.is_empty(), "{c:?}");
        assert_eq!(c.items_en.len(), c.items.len(), "{c:?}");
        assert!(c.items_en.iter().all(|n| !n.is_empty()), "{c:?}");
    }
    let paper = &res.categories[0];
    assert_eq!(paper.major_name_en, "Recyclables");
    assert_eq!(
        (paper.items[0].as_str(), paper.items_en[0].as_str()),
        ("골판지류", "Corrugated cardboard")
    );
    assert!(
        res.categories
            .iter()
            .any(|c| c.major_category == "생활계유해폐기물")
    );
    let non_recyclable = res.categories.iter().filter(|c| !c.recyclable).count();
    assert_eq!(non_recyclable, 6);
    assert_eq!(res.situation_tags.len(), 79);
    assert!(res.situation_tags.iter().any(|t| t == "비닐_라벨_부착"));
    server.stop().await.unwrap();
}

#[tokio::test]
async fn every_listed_item_resolves_over_lookup() {
    let (server, mut client) = start(Config::default()).await;
    let res = client
        .list_categories(ListCategoriesRequest {})
        .await
        .unwrap()
        .into_inner();
    for c in res.categories {
        for item in &c.items {
            let cl = classification(&c.major_category, &c.middle_category, item, &[]);
            let events = lookup(&mut client, request(cl, "en"))
                .await
                .unwrap_or_else(|s| {
                    panic!("{} / {} / {item}: {s}", c.major_category, c.middle_category)
                });
            let (_, rules) = split(events);
            assert_eq!(&rules.minor_category, item);
            assert_eq!(rules.recyclable, c.recyclable);
        }
    }
    server.stop().await.unwrap();
}

#[tokio::test]
async fn serves_health_and_reflection() {
    let (server, _client) = start(Config::default()).await;
    assert_health_and_reflection(&server.uri(), "ecoscan.v1.RuleService").await;
    server.stop().await.unwrap();
}

#[tokio::test]
async fn serve_uses_a_valid_dataset_file_from_the_config() {
    let dir = tempfile::TempDir::new().unwrap();
    let path = dir.path().join("rules.json");
    let mut json: serde_json::Value =
        serde_json::from_str(include_str!("../data/rules.json")).unwrap();
    json["source"]["en"] = "an alternative dataset for tests".into();
    std::fs::write(&path, json.to_string()).unwrap();

    let (server, mut client) = start(Config {
        dataset_path: Some(path),
    })
    .await;
    let c = classification("대형폐기물", "", "가구", &[]);
    let (_, rules) = split(lookup(&mut client, request(c, "en")).await.unwrap());
    assert_eq!(rules.source, "an alternative dataset for tests");
    server.stop().await.unwrap();
}

#[tokio::test]
async fn serve_refuses_to_start_with_an_invalid_dataset_file() {
    let dir = tempfile::TempDir::new().unwrap();
    let path = dir.path().join("rules.json");
    let mut json: serde_json::Value =
        serde_json::from_str(include_str!("../data/rules.json")).unwrap();
    json["general_advice"]["내용물_있음"]["en"] = "".into();
    std::fs::write(&path, json.to_string()).unwrap();

    let server = spawn(|l, s| {
        serve(
            Config {
                dataset_path: Some(path),
            },
            l,
            s,
        )
    })
    .await;
    let err = server.handle.await.unwrap().expect_err("startup must fail");
    let chain = format!("{err:#}");
    assert!(chain.contains("failed to load the rule dataset"), "{chain}");
    assert!(
        chain.contains("내용물_있음") && chain.contains("both ko and en"),
        "{chain}"
    );
}

#[tokio::test]
async fn serve_refuses_to_start_with_a_missing_dataset_file() {
    let dir = tempfile::TempDir::new().unwrap();
    let path = dir.path().join("absent.json");
    let server = spawn(|l, s| {
        serve(
            Config {
                dataset_path: Some(path),
            },
            l,
            s,
        )
    })
    .await;
    let err = server.handle.await.unwrap().expect_err("startup must fail");
    assert!(format!("{err:#}").contains("absent.json"), "{err:#}");
}
