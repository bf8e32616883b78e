//! The mock provider: deterministic, matched from the hint, and always marked as mock.

use std::time::Duration;

use bytes::Bytes;
use ecoscan_llm::{AnswerChunk, AnswerInput, ClassifyInput, Llm, LlmConfig, Locale, TaxonomyPath};
use tokio_stream::StreamExt;

fn llm() -> Llm {
    ecoscan_common::telemetry::init_for_tests();
    let config = LlmConfig {
        mock_latency: Duration::from_millis(20),
        ..LlmConfig::default()
    };
    Llm::new(config, "test", None).unwrap()
}

fn path(major: &str, middle: &str, minor: &str, en: &str) -> TaxonomyPath {
    TaxonomyPath {
        major: major.into(),
        middle: middle.into(),
        minor: minor.into(),
        name_en: en.into(),
    }
}

fn input(hint: &str, image: &'static [u8]) -> ClassifyInput {
    ClassifyInput {
        job_id: String::new(),
        image: Bytes::from_static(image),
        content_type: "image/png".into(),
        hint: hint.into(),
        taxonomy: vec![
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
            path("재활용폐기물", "유리병", "소주병", "Glass bottles"),
            path("음식물류폐기물", "", "과일껍질", "Food waste"),
        ],
        situation_tags: vec!["내용물_있음".into()],
        model: None,
    }
}

#[tokio::test]
async fn mock_classifies_pet_bottle_hints_in_either_language() {
    let llm = llm();
    for hint in ["pet bottle", "페트병"] {
        let out = llm.classify(input(hint, b"img")).await.unwrap();
        assert_eq!(
            (out.major.as_str(), out.middle.as_str(), out.minor.as_str()),
            ("재활용폐기물", "무색페트병", "음료PET병"),
            "hint {hint:?}"
        );
        assert_eq!(
            (out.provider.as_str(), out.model.as_str()),
            ("mock", "mock")
        );
    }
}

#[tokio::test]
async fn mock_without_a_hint_answers_the_same_path_for_the_same_image() {
    let llm = llm();

    let a = llm.classify(input("", b"image one")).await.unwrap();
    let b = llm.classify(input("", b"image one")).await.unwrap();

    assert_eq!(a, b);
    assert_eq!(a.provider, "mock");
}

async fn collect(llm: &Llm, locale: Locale) -> (String, ecoscan_llm::AnswerUsage) {
    let mut stream = llm
        .answer(AnswerInput {
            job_id: "j".into(),
            locale,
            system_prompt: "system".into(),
            user_prompt: "user".into(),
            subject: "음료PET병".into(),
            steps: vec!["Empty it".into(), "Remove the label".into()],
            model: None,
        })
        .await
        .unwrap();
    let mut text = String::new();
    let mut deltas = 0;
    while let Some(chunk) = stream.next().await {
        match chunk.unwrap() {
            AnswerChunk::Delta(d) => {
                deltas += 1;
                text.push_str(&d);
            }
            AnswerChunk::Done(usage) => {
                assert!(deltas > 3, "answer was not streamed in pieces");
                return (text, usage);
            }
        }
    }
    panic!("stream ended without a final usage item");
}

#[tokio::test]
async fn mock_answers_start_with_the_mock_marker_in_each_locale() {
    let llm = llm();

    let (ko, usage) = collect(&llm, Locale::Ko).await;
    let (en, _) = collect(&llm, Locale::En).await;

    assert!(ko.starts_with("[모의 응답 · mock] "), "{ko}");
    assert!(en.starts_with("[mock answer] "), "{en}");
    assert!(en.contains("1. Empty it\n2. Remove the label"), "{en}");
    assert_eq!(usage.provider, "mock");
    assert_eq!(usage.output_tokens as usize, ko.len().div_ceil(4));
    assert!(usage.ttft.is_some());
}
