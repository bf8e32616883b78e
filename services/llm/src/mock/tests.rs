use super::*;

/// The hint match as [`Mock::classify`] runs it, with the names normalized by a fresh mock.
fn best_hint_match<'a>(hint: &str, t: &'a [TaxonomyPath]) -> Option<&'a TaxonomyPath> {
    super::best_hint_match(hint, t, &Mock::new(Duration::ZERO, 0.0).normalized(t))
}

fn path(major: &str, middle: &str, minor: &str, en: &str) -> TaxonomyPath {
    TaxonomyPath {
        major: major.into(),
        middle: middle.into(),
        minor: minor.into(),
        name_en: en.into(),
    }
}

fn taxonomy() -> Vec<TaxonomyPath> {
    vec![
        path("재활용폐기물", "종이", "신문지", "Paper"),
        path(
            "재활용폐기물",
            "무색페트병",
            "먹는샘물PET병",
            "Clear PET bottles",
        ),
        path(
            "재활용폐기물",
            "무색페트병",
            "음료PET병",
            "Clear PET bottles",
        ),
        path(
            "재활용폐기물",
            "무색페트병",
            "주스PET병",
            "Clear PET bottles",
        ),
        path(
            "재활용폐기물",
            "무색페트병",
            "무색페트병(물병)",
            "Clear PET bottles",
        ),
        path("재활용폐기물", "플라스틱류", "PET용기", "Plastics"),
        path("재활용폐기물", "유리병", "투명유리병", "Glass bottles"),
        path("음식물류폐기물", "", "과일껍질", "Food waste"),
    ]
}

#[test]
fn korean_and_english_pet_bottle_hints_pick_the_beverage_pet_bottle() {
    let t = taxonomy();
    for hint in [
        "pet bottle",
        "페트병",
        "PET Bottle",
        "a pet bottle",
        "페트병 내용물 있음",
    ] {
        let p = best_hint_match(hint, &t).expect("hint matches");
        assert_eq!(
            (p.major.as_str(), p.middle.as_str(), p.minor.as_str()),
            ("재활용폐기물", "무색페트병", "음료PET병"),
            "hint {hint:?}"
        );
    }
}

#[test]
fn exact_item_names_and_majors_without_middle_match() {
    let t = taxonomy();
    assert_eq!(
        best_hint_match("투명 유리병", &t).unwrap().minor,
        "투명유리병"
    );
    assert_eq!(best_hint_match("과일껍질", &t).unwrap().minor, "과일껍질");
    assert_eq!(best_hint_match("newspaper", &t).unwrap().middle, "종이");
    assert_eq!(best_hint_match("zzz", &t), None);
}

#[test]
fn unmatched_hints_fall_back_to_a_stable_image_hash() {
    let t = taxonomy();
    let mock = Mock::new(Duration::ZERO, 0.0);
    let input = ClassifyInput {
        image: bytes::Bytes::from_static(b"some image"),
        hint: "zzz".into(),
        taxonomy: t.clone(),
        ..ClassifyInput::default()
    };
    let a = mock.classify(&input).unwrap();
    let b = mock.classify(&input).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.confidence, 0.5);
    assert!(t.iter().any(|p| p.minor == a.minor && p.middle == a.middle));
}

#[test]
fn chunks_concatenate_back_to_the_text() {
    let text = answer_text(
        Locale::Ko,
        "음료PET병",
        &["헹궈요".into(), "라벨을 떼요".into()],
    );
    let parts = chunks(&text);
    assert!(parts.len() > 5);
    assert_eq!(parts.concat(), text);
    assert!(text.starts_with("[모의 응답 · mock] "));
}

#[test]
fn hint_tags_come_only_from_the_vocabulary() {
    let vocab = vec!["내용물_있음".to_owned(), "뚜껑_열림".to_owned()];
    assert_eq!(hint_tags("내용물 있음 페트병", &vocab), vec!["내용물_있음"]);
    assert!(hint_tags("", &vocab).is_empty());
}

#[test]
fn token_formula_counts_text_and_image() {
    assert_eq!(input_tokens(8, None), 2);
    assert_eq!(input_tokens(8, Some(4096)), 2 + 85 + 2);
    assert_eq!(output_tokens(9), 3);
}

#[test]
fn latency_stays_within_the_jitter_band() {
    let mock = Mock::new(Duration::from_millis(100), 0.2);
    for _ in 0..100 {
        let d = mock.draw_latency();
        assert!(d >= Duration::from_millis(80) && d <= Duration::from_millis(120));
    }
}

#[test]
fn a_mock_that_saw_one_taxonomy_matches_against_the_next_one_it_is_given() {
    let mock = Mock::new(Duration::ZERO, 0.0);
    let input = |taxonomy: Vec<TaxonomyPath>| ClassifyInput {
        image: bytes::Bytes::from_static(b"photo"),
        hint: "투명 유리병".into(),
        taxonomy,
        ..ClassifyInput::default()
    };
    let paper = path("재활용폐기물", "종이", "신문지", "Paper");
    let glass = path("재활용폐기물", "유리병", "투명유리병", "Glass bottles");
    // Nothing matches the hint: the image hash picks the only path.
    let first = mock.classify(&input(vec![paper.clone()])).expect("a path");
    assert_eq!((first.minor.as_str(), first.confidence), ("신문지", 0.5));
    // A memo of the first taxonomy answering for the second would miss the glass bottle.
    let second = mock.classify(&input(vec![paper, glass])).expect("a path");
    assert_eq!(
        (second.minor.as_str(), second.confidence),
        ("투명유리병", 0.9)
    );
}
