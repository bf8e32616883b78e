use super::{
    model::{Dataset, Locale},
    names::list,
};
use crate::error::Error;

fn tags(t: &[&str]) -> Vec<String> {
    t.iter().map(|s| (*s).to_owned()).collect()
}

/// A small valid dataset to break one way at a time.
fn minimal() -> serde_json::Value {
    serde_json::json!({
        "dataset": "t", "version": "1", "jurisdiction": "KR",
        "source": {"ko": "출처", "en": "source"},
        "situation_tags": ["내용물_있음", "깨짐"],
        "general_advice": {"내용물_있음": {"ko": "비우세요", "en": "empty it"}},
        "majors": [{"name": "재활용폐기물", "name_en": "Recyclables"}, {"name": "대형폐기물", "name_en": "Bulky"}],
        "categories": [
            {"major": "재활용폐기물", "middle": "종이", "name_en": "Paper", "recyclable": true,
             "stream": {"ko": "종이", "en": "paper"},
             "targets": [{"ko": "종이", "en": "paper"}],
             "common_steps": [{"ko": "묶기", "en": "tie"}],
             "items": [{"name": "신문지", "name_en": "Newspaper"}],
             "exclusions": [{"item": {"ko": "영수증", "en": "receipt"}, "instead": {"ko": "일반", "en": "general"}, "goes_to": {"major": "대형폐기물"}}]},
            {"major": "대형폐기물", "name_en": "Bulky", "recyclable": false,
             "stream": {"ko": "대형", "en": "bulky"},
             "targets": [{"ko": "가구", "en": "furniture"}],
             "common_steps": [{"ko": "스티커", "en": "sticker"}],
             "items": [{"name": "가구", "name_en": "Furniture"}]}
        ]
    })
}

fn problems_of(v: serde_json::Value) -> Vec<String> {
    match Dataset::from_json(&v.to_string()) {
        Err(Error::InvalidDataset { problems }) => problems,
        other => panic!("expected a validation failure, got {other:?}"),
    }
}

#[test]
fn the_embedded_dataset_is_valid() {
    let d = Dataset::embedded().expect("embedded dataset validates");
    assert_eq!(d.categories().len(), 18);
}

#[test]
fn a_minimal_dataset_is_valid() {
    Dataset::from_json(&minimal().to_string()).expect("minimal dataset validates");
}

#[test]
fn validation_rejects_a_duplicate_category_path() {
    let mut v = minimal();
    let dup = v["categories"][0].clone();
    v["categories"].as_array_mut().unwrap().push(dup);
    let problems = problems_of(v);
    assert!(
        problems
            .iter()
            .any(|p| p.contains("duplicate category path")),
        "{problems:?}"
    );
}

#[test]
fn validation_rejects_a_duplicate_item_name() {
    let mut v = minimal();
    v["categories"][0]["items"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"name": "신문 지", "name_en": "News"}));
    let problems = problems_of(v);
    assert!(
        problems.iter().any(|p| p.contains("used twice")),
        "{problems:?}"
    );
}

#[test]
fn validation_rejects_advice_missing_a_locale() {
    let mut v = minimal();
    v["general_advice"]["내용물_있음"]["en"] = "".into();
    let problems = problems_of(v);
    assert!(
        problems.iter().any(|p| p.contains("needs both ko and en")),
        "{problems:?}"
    );
}

#[test]
fn validation_rejects_an_exclusion_missing_a_locale() {
    let mut v = minimal();
    v["categories"][0]["exclusions"][0]["instead"]["ko"] = " ".into();
    let problems = problems_of(v);
    assert!(
        problems.iter().any(|p| p.contains("exclusion 0")),
        "{problems:?}"
    );
}

#[test]
fn validation_rejects_advice_for_a_tag_outside_the_vocabulary() {
    let mut v = minimal();
    v["categories"][1]["advice"] = serde_json::json!({"없는_태그": {"ko": "a", "en": "b"}});
    let problems = problems_of(v);
    assert!(
        problems.iter().any(|p| p.contains("없는_태그")),
        "{problems:?}"
    );
}

#[test]
fn validation_rejects_an_exclusion_pointing_nowhere() {
    let mut v = minimal();
    v["categories"][0]["exclusions"][0]["goes_to"] = serde_json::json!({"major": "없는분류"});
    let problems = problems_of(v);
    assert!(
        problems.iter().any(|p| p.contains("not a category")),
        "{problems:?}"
    );
}

#[test]
fn validation_rejects_a_category_of_an_unlisted_major() {
    let mut v = minimal();
    v["categories"][1]["major"] = "없는분류".into();
    let problems = problems_of(v);
    assert!(
        problems.iter().any(|p| p.contains("not in `majors`")),
        "{problems:?}"
    );
}

#[test]
fn unknown_fields_are_a_parse_error() {
    let mut v = minimal();
    v["categories"][0]["itmes"] = serde_json::json!([]);
    assert!(matches!(
        Dataset::from_json(&v.to_string()),
        Err(Error::ParseDataset(_))
    ));
}

#[test]
fn lookup_matches_names_ignoring_spaces_and_aliases() {
    let d = Dataset::embedded().unwrap();
    let r = d
        .lookup("재활용폐기물", "무색페트병", "음료 PET병")
        .unwrap();
    assert_eq!(r.item(), Some("음료PET병"));
    let r = d.lookup("일반종량제폐기물", "", "CD · DVD").unwrap();
    assert_eq!(r.item(), Some("CD/DVD"));
}

#[test]
fn lookup_infers_an_unambiguous_middle() {
    let d = Dataset::embedded().unwrap();
    let r = d.lookup("재활용폐기물", "", "음료PET병").unwrap();
    assert_eq!(r.middle(), "무색페트병");
    assert!(r.notes.iter().any(|n| n.contains("inferred")));
    // 식품용기 is both a plastic and a foam item: no guess.
    assert!(matches!(
        d.lookup("재활용폐기물", "", "식품용기"),
        Err(Error::MissingMiddle { .. })
    ));
}

#[test]
fn item_advice_overrides_category_advice_which_overrides_general_advice() {
    let d = Dataset::embedded().unwrap();
    let t = tags(&["가스_잔존_의심"]);
    let item = d
        .lookup("재활용폐기물", "금속류", "부탄가스")
        .unwrap()
        .rules(Locale::En, &t);
    let category = d
        .lookup("재활용폐기물", "금속류", "철캔")
        .unwrap()
        .rules(Locale::En, &t);
    let general = d
        .lookup("대형폐기물", "", "가구")
        .unwrap()
        .rules(Locale::En, &t);
    assert!(item.rules.situation_advice[0].contains("puncture"));
    assert!(category.rules.situation_advice[0].contains("butane or spray can"));
    assert!(general.rules.situation_advice[0].starts_with("Leftover gas"));
}

#[test]
fn unknown_and_repeated_tags_are_reported_not_applied() {
    let d = Dataset::embedded().unwrap();
    let r = d
        .lookup("재활용폐기물", "무색페트병", "음료PET병")
        .unwrap()
        .rules(
            Locale::Ko,
            &tags(&["내용물_있음", "내용물_있음", "없는_태그"]),
        );
    assert_eq!(r.rules.situation_advice.len(), 1);
    assert_eq!(r.unknown_tags, vec!["없는_태그".to_owned()]);
}

#[test]
fn list_caps_the_number_of_names() {
    let names: Vec<String> = (0..15).map(|i| i.to_string()).collect();
    let s = list(names.iter().map(String::as_str));
    assert!(s.ends_with("11 and 3 more"), "{s}");
}
