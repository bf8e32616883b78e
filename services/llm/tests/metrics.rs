//! Model calls are counted in the service's metrics: calls by status, tokens, latency.

use std::time::Duration;

use bytes::Bytes;
use ecoscan_common::metrics::Metrics;
use ecoscan_llm::{ClassifyInput, Llm, LlmConfig, LlmMetrics, TaxonomyPath};

fn input(taxonomy: Vec<TaxonomyPath>) -> ClassifyInput {
    ClassifyInput {
        job_id: String::new(),
        image: Bytes::from_static(b"img"),
        content_type: "image/png".into(),
        hint: "paper".into(),
        taxonomy,
        situation_tags: Vec::new(),
        model: None,
    }
}

/// The value of the sample whose line starts with `series` (name and labels, in encoder order).
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

#[tokio::test]
async fn calls_and_failures_are_counted_with_their_tokens() {
    ecoscan_common::telemetry::init_for_tests();
    let mut metrics = Metrics::new("vision");
    let llm_metrics = LlmMetrics::register(&mut metrics, None);
    let config = LlmConfig {
        mock_latency: Duration::from_millis(5),
        ..LlmConfig::default()
    };
    let llm = Llm::new(config, "vision", None)
        .unwrap()
        .with_metrics(llm_metrics);
    let paper = TaxonomyPath {
        major: "재활용폐기물".into(),
        middle: "종이".into(),
        minor: "신문지".into(),
        name_en: "Paper".into(),
    };

    llm.classify(input(vec![paper])).await.unwrap();
    // The mock cannot classify into an empty taxonomy: a failed call.
    llm.classify(input(Vec::new())).await.unwrap_err();
    let text = metrics.render().await;

    let labels = format!(
        r#"provider="mock",model="{}",operation="classify""#,
        ecoscan_llm::MOCK_MODEL
    );
    let calls = |status: &str| {
        sample(
            &text,
            &format!(r#"llm_calls_total{{service="vision",{labels},status="{status}"}}"#),
        )
    };
    assert_eq!(calls("ok"), Some(1.0), "{text}");
    assert_eq!(calls("malformed"), Some(1.0), "{text}");
    let input_tokens = sample(
        &text,
        &format!(r#"llm_tokens_total{{service="vision",{labels},direction="input"}}"#),
    );
    assert!(input_tokens.is_some_and(|t| t > 0.0), "{text}");
    let durations = sample(
        &text,
        &format!(r#"llm_call_duration_seconds_count{{service="vision",{labels}}}"#),
    );
    assert_eq!(durations, Some(2.0), "{text}");
    assert_eq!(
        sample(&text, r#"llm_reports_dropped_total{service="vision"}"#),
        Some(0.0),
        "{text}"
    );
}
