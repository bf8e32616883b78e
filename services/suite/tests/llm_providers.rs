//! The whole suite against model providers as they really behave: LiteLLM's proxy (an
//! independent OpenAI-compatible server, installed by `infra/test.sh`, on loopback, with mock
//! responses per model), a scripted provider that fails, and the mock. What a person sees: a
//! scan that reaches `ready`, progress that never goes backwards, numbers as stored, and one
//! plain message when the provider fails. Nothing here leaves loopback.

mod common;

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use common::{Sse, TestSuite, image_form, read_sse, wait_result};
use ecoscan_common::models::OfferedModels;
use ecoscan_llm::{LlmConfig, Provider};
use serde_json::Value;

/// The LiteLLM release `infra/test.sh` installs (held equal by
/// [`the_litellm_release_is_the_one_the_test_command_installs`]).
const LITELLM_VERSION: &str = "1.106.12";

#[test]
fn the_litellm_release_is_the_one_the_test_command_installs() {
    let script =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../infra/test.sh"))
            .expect("infra/test.sh");
    let installed = script
        .lines()
        .find_map(|l| l.trim().strip_prefix("LITELLM_VERSION="))
        .expect("infra/test.sh sets LITELLM_VERSION");
    assert_eq!(installed, LITELLM_VERSION);
}

const VISION_ANSWER: &str = r#"{"major":"재활용폐기물","middle":"무색페트병","minor":"음료PET병","item_name":"a clear soda bottle","confidence":0.93,"situation_tags":["내용물_있음"]}"#;
const ANSWER_TEXT: &str = "Empty the bottle and rinse it. Peel off the label, squash it flat and put the cap back on. Put it out with clear PET bottles.";

/// Where the `litellm` command is: `ECOSCAN_LITELLM`, the virtualenv `infra/test.sh` installs
/// it into, or the `PATH`.
fn litellm_command() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("ECOSCAN_LITELLM") {
        return Some(PathBuf::from(path));
    }
    let tools = std::env::var_os("ECOSCAN_TOOLS_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/ecoscan-tools")))?;
    let venv = tools.join(format!("litellm-{LITELLM_VERSION}/bin/litellm"));
    if venv.is_file() {
        return Some(venv);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("litellm"))
            .find(|p| p.is_file())
    })
}

/// A LiteLLM proxy on a loopback port, stopped when dropped.
struct LiteLlm {
    base_url: String,
    key: String,
    child: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Drop for LiteLlm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl LiteLlm {
    /// Starts the proxy with `models` (YAML `model_list` entries). Panics, saying how to
    /// install it, when LiteLLM is not installed: like the Redis and PostgreSQL tests, a test
    /// of a real peer that skipped would pass without testing anything.
    async fn start(models: &str) -> Self {
        Self::start_with(models, false).await
    }

    /// [`Self::start`]; with `cost_log`, a callback of the proxy's own (a `CustomLogger`, in
    /// the config's directory) writes each call's `response_cost` as LiteLLM computes it to
    /// [`Self::costs`].
    async fn start_with(models: &str, cost_log: bool) -> Self {
        let command = litellm_command().unwrap_or_else(|| {
            panic!(
                "LiteLLM is not installed: infra/test.sh installs litellm[proxy]=={LITELLM_VERSION} \
                 into a virtualenv under ~/.cache/ecoscan-tools; or set ECOSCAN_LITELLM to a \
                 litellm command"
            )
        });
        let dir = tempfile::tempdir().unwrap();
        // Nothing leaves the machine: no callbacks but the local cost log, no telemetry, the
        // model-cost map from the package instead of the network, LiteLLM's own retries off
        // (ours are under test), and every proxy variable pointing at a closed loopback port as
        // a guard.
        let callbacks = if cost_log {
            std::fs::write(dir.path().join("cost_log.py"), COST_LOG_CALLBACK).unwrap();
            "[cost_log.instance]"
        } else {
            "[]"
        };
        let config = format!(
            "model_list:\n{models}\nlitellm_settings:\n  telemetry: false\n  \
             callbacks: {callbacks}\n  success_callback: []\n  failure_callback: []\n  \
             num_retries: 0\nrouter_settings:\n  num_retries: 0\n"
        );
        let config_path = dir.path().join("config.yaml");
        std::fs::write(&config_path, config).unwrap();
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let key = format!("sk-ecoscan-test-{}", uuid::Uuid::new_v4().simple());
        let log = std::fs::File::create(dir.path().join("litellm.log")).unwrap();
        let child = std::process::Command::new(&command)
            .args(["--config"])
            .arg(&config_path)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .env("LITELLM_MASTER_KEY", &key)
            .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
            .env("LITELLM_TELEMETRY", "False")
            .env("DISABLE_ADMIN_UI", "True")
            .env("HTTP_PROXY", "http://127.0.0.1:9")
            .env("HTTPS_PROXY", "http://127.0.0.1:9")
            .env("ALL_PROXY", "http://127.0.0.1:9")
            .env("NO_PROXY", "127.0.0.1,localhost")
            .env("ECOSCAN_COST_LOG", dir.path().join("costs.jsonl"))
            .env_remove("DATABASE_URL")
            // The callback module is found beside the config.
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("{} does not start: {e}", command.display()));
        let mut proxy = Self {
            base_url: format!("http://127.0.0.1:{port}/v1"),
            key,
            child,
            _dir: dir,
        };
        proxy.wait_ready().await;
        proxy
    }

    async fn wait_ready(&mut self) {
        let http = reqwest::Client::new();
        let url = self.base_url.replace("/v1", "/health/liveliness");
        // Importing LiteLLM takes a while on a busy 2-core machine.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("litellm exited with {status}: {}", self.log());
            }
            if let Ok(res) = http.get(&url).send().await
                && res.status().is_success()
            {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "litellm not ready within 180 s: {}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// `(stream, response_cost)` of each successful call, as LiteLLM computed it (see
    /// [`Self::start_with`]).
    fn costs(&self) -> Vec<(bool, f64)> {
        std::fs::read_to_string(self._dir.path().join("costs.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let v: Value = serde_json::from_str(l).unwrap();
                (
                    v["stream"].as_bool().unwrap(),
                    v["response_cost"].as_f64().unwrap(),
                )
            })
            .collect()
    }

    /// LiteLLM's own copy of its price table, in the installed package.
    fn price_file() -> PathBuf {
        let command = litellm_command().unwrap();
        let venv = command.parent().and_then(Path::parent).unwrap();
        std::fs::read_dir(venv.join("lib"))
            .unwrap()
            .filter_map(Result::ok)
            .map(|d| {
                d.path()
                    .join("site-packages/litellm/model_prices_and_context_window_backup.json")
            })
            .find(|p| p.is_file())
            .expect("LiteLLM's model_prices_and_context_window_backup.json")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self._dir.path().join("litellm.log")).unwrap_or_default()
    }

    fn llm(&self, classify_model: &str, answer_model: &str) -> LlmConfig {
        LlmConfig {
            provider: Provider::OpenAi,
            base_url: self.base_url.clone(),
            api_key: Some(self.key.clone()),
            classify_model: classify_model.into(),
            answer_model: answer_model.into(),
            max_retries: 2,
            retry_base_delay: Duration::from_millis(10),
            retry_budget: Duration::from_secs(60),
            timeout: Duration::from_secs(60),
            ..LlmConfig::default()
        }
    }
}

/// A LiteLLM `CustomLogger` that appends each successful call's cost, as LiteLLM computes it
/// (`response_cost`, from its own price table), to the file `ECOSCAN_COST_LOG` names.
const COST_LOG_CALLBACK: &str = r#"
import json, os
from litellm.integrations.custom_logger import CustomLogger

class CostLog(CustomLogger):
    async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):
        with open(os.environ["ECOSCAN_COST_LOG"], "a") as f:
            f.write(json.dumps({"stream": bool(kwargs.get("stream")),
                                "response_cost": kwargs.get("response_cost")}) + "\n")

instance = CostLog()
"#;

fn mock_model(name: &str, response: &str) -> String {
    // A JSON string is a YAML string; the api_base is never called (closed loopback port).
    format!(
        "  - model_name: {name}\n    litellm_params:\n      model: openai/{name}\n      \
         api_key: sk-none\n      api_base: http://127.0.0.1:9/v1\n      mock_response: {}\n",
        serde_json::to_string(response).unwrap()
    )
}

async fn scan(suite: &TestSuite, user: &str) -> Vec<Sse> {
    let res = suite
        .http
        .post(suite.url("/api/v1/scan/completion"))
        .header("x-user-id", user)
        .multipart(image_form("pet bottle"))
        .send()
        .await
        .unwrap();
    read_sse(res).await
}

fn assert_progress_never_goes_backwards(events: &[Sse]) {
    let mut last = 0.0;
    for e in events.iter().filter(|e| e.data["progress"].is_number()) {
        let p = e.data["progress"].as_f64().unwrap();
        assert!(
            p >= last,
            "progress went from {last} to {p} at {}: {events:#?}",
            e.data
        );
        last = p;
    }
}

fn as_u64(v: &Value) -> u64 {
    v.as_u64().or_else(|| v.as_str()?.parse().ok()).unwrap_or(0)
}

#[tokio::test]
async fn a_scan_reaches_ready_through_litellm_with_streamed_deltas_and_usage_in_analytics() {
    let models = format!(
        "{}{}",
        mock_model("vision-mock", VISION_ANSWER),
        mock_model("answer-mock", ANSWER_TEXT)
    );
    let litellm = LiteLlm::start(&models).await;
    let suite = TestSuite::start_with(|c| c.llm = litellm.llm("vision-mock", "answer-mock")).await;

    let events = scan(&suite, "alice").await;

    let last = events.last().unwrap();
    assert_eq!(last.event, "ready", "{events:#?}\n{}", litellm.log());
    let classified = events
        .iter()
        .find(|e| e.data["stage"] == "vision" && e.data["status"] == "completed")
        .expect("a vision completed event");
    let c = &classified.data["classification"];
    assert_eq!(c["minor_category"], "음료PET병");
    assert_eq!(c["provider"], "openai");
    assert_eq!(c["model"], "vision-mock");
    let deltas: Vec<&str> = events
        .iter()
        .filter(|e| e.event == "delta")
        .map(|e| e.data["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas.concat(), ANSWER_TEXT);
    assert_progress_never_goes_backwards(&events);

    let job_id = last.data["job_id"].as_str().unwrap();
    let result = wait_result(&suite, job_id, "alice").await;
    assert_eq!(
        result["classification"]["confidence"].as_f64(),
        Some(0.93),
        "served as stored: {}",
        result["classification"]
    );
    assert_eq!(result["answer"]["text"], ANSWER_TEXT);
    assert_eq!(result["answer"]["model"], "answer-mock");

    // Both calls, with LiteLLM's token counts, reach analytics.
    let admin = suite.token("ops", true);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let usage: Value = suite.usage(&admin).await;
        let rows = usage["rows"].as_array().cloned().unwrap_or_default();
        let row = |service: &str, model: &str| {
            rows.iter()
                .find(|r| r["service"] == service && r["model"] == model)
                .cloned()
        };
        if let (Some(vision), Some(answer)) =
            (row("vision", "vision-mock"), row("answer", "answer-mock"))
        {
            assert_eq!(as_u64(&vision["errors"]), 0, "{usage:#}");
            assert!(
                as_u64(&answer["output_tokens"]) > 0,
                "stream usage: {usage:#}"
            );
            assert!(as_u64(&vision["input_tokens"]) > 0, "{usage:#}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "usage never reached analytics: {usage:#}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn a_scan_that_chooses_an_offered_model_is_served_by_it_at_every_stage() {
    // Three models behind LiteLLM: the two configured per stage and one a scan may choose
    // (its mock answer is the classification, so as an answer its text is that JSON).
    let models = format!(
        "{}{}{}",
        mock_model("vision-mock", VISION_ANSWER),
        mock_model("answer-mock", ANSWER_TEXT),
        mock_model("chosen-mock", VISION_ANSWER),
    );
    let litellm = LiteLlm::start(&models).await;
    let suite = TestSuite::start_with(|c| {
        c.llm = LlmConfig {
            offered: OfferedModels::parse("chosen-mock=gemini, answer-mock").unwrap(),
            ..litellm.llm("vision-mock", "answer-mock")
        };
    })
    .await;

    // A model that is not offered is refused at submit, naming the offered ones: no job.
    let res = suite
        .http
        .post(suite.url("/api/v1/scan"))
        .header("x-user-id", "carol")
        .multipart(image_form("pet bottle").text("model", "gpt-5"))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 400);
    let body: Value = res.json().await.unwrap();
    let message = body["detail"].as_str().unwrap_or_default();
    assert!(
        message.contains("gpt-5") && message.contains("chosen-mock, answer-mock"),
        "{body:#}"
    );
    assert_eq!(body["reason"], "INVALID_FIELD", "{body:#}");
    assert_eq!(body["errors"][0]["field"], "model", "{body:#}");

    let res = suite
        .http
        .post(suite.url("/api/v1/scan/completion"))
        .header("x-user-id", "carol")
        .multipart(image_form("pet bottle").text("model", "chosen-mock"))
        .send()
        .await
        .unwrap();
    let events = read_sse(res).await;
    let last = events.last().unwrap();
    assert_eq!(last.event, "ready", "{events:#?}\n{}", litellm.log());
    // The events carry the model each stage used.
    let completed = |stage: &str| {
        events
            .iter()
            .find(|e| e.data["stage"] == stage && e.data["status"] == "completed")
            .unwrap_or_else(|| panic!("a {stage} completed event: {events:#?}"))
    };
    let c = &completed("vision").data["classification"];
    assert_eq!(c["model"], "chosen-mock", "{c:#}");
    assert_eq!(
        c["provider"], "gemini",
        "the vendor LLM_MODELS names: {c:#}"
    );
    assert_eq!(completed("answer").data["answer"]["model"], "chosen-mock");

    // The result says which model the scan chose, and each stage's output which it used.
    let job_id = last.data["job_id"].as_str().unwrap();
    let result = wait_result(&suite, job_id, "carol").await;
    assert_eq!(result["model"], "chosen-mock", "{result:#}");
    assert_eq!(result["classification"]["model"], "chosen-mock");
    assert_eq!(result["answer"]["model"], "chosen-mock");
    assert_eq!(
        result["answer"]["text"], VISION_ANSWER,
        "the chosen model wrote it"
    );

    // Analytics records both calls under the chosen model.
    let admin = suite.token("ops", true);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let usage: Value = suite.usage(&admin).await;
        let rows = usage["rows"].as_array().cloned().unwrap_or_default();
        let chosen: Vec<&Value> = rows
            .iter()
            .filter(|r| r["model"] == "chosen-mock")
            .collect();
        let services: Vec<&str> = chosen
            .iter()
            .filter_map(|r| r["service"].as_str())
            .collect();
        if services.contains(&"vision") && services.contains(&"answer") {
            assert!(
                rows.iter().all(|r| r["model"] != "vision-mock"),
                "the configured model was not called: {usage:#}"
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the chosen model's calls never reached analytics: {usage:#}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn what_the_suite_records_a_call_cost_is_what_litellm_computes_from_the_same_table() {
    // Both stages' models are gpt-4o-mini, which LiteLLM's table prices, under two names (so
    // each stage has its own mock answer): the answer's as a router's `vendor/model` name.
    let route = |name: &str, response: &str| {
        format!(
            "  - model_name: {name}\n    litellm_params:\n      model: openai/gpt-4o-mini\n      \
             api_key: sk-none\n      api_base: http://127.0.0.1:9/v1\n      mock_response: {}\n",
            serde_json::to_string(response).unwrap()
        )
    };
    let models = format!(
        "{}{}",
        route("gpt-4o-mini", VISION_ANSWER),
        route("openai/gpt-4o-mini", ANSWER_TEXT)
    );
    let litellm = LiteLlm::start_with(&models, true).await;
    let prices = std::fs::read(LiteLlm::price_file()).unwrap();
    let suite = TestSuite::start_with(|c| {
        c.llm = litellm.llm("gpt-4o-mini", "openai/gpt-4o-mini");
        c.analytics_prices = std::sync::Arc::new(
            ecoscan_analytics::prices::PriceTable::from_json(None, &prices).unwrap(),
        );
    })
    .await;

    let events = scan(&suite, "dana").await;
    assert_eq!(
        events.last().unwrap().event,
        "ready",
        "{events:#?}\n{}",
        litellm.log()
    );

    // LiteLLM's figures: one unstreamed call (the classification), one streamed (the answer).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let costs = loop {
        let costs = litellm.costs();
        if costs.len() >= 2 {
            break costs;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "LiteLLM logged {costs:?}\n{}",
            litellm.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let litellm_micros = |stream: bool| {
        let (_, usd) = costs.iter().find(|(s, _)| *s == stream).unwrap();
        assert!(*usd > 0.0, "LiteLLM priced the call: {costs:?}");
        // Micro-dollars, rounded half up as the suite rounds.
        (usd * 1e6).round() as i64
    };

    // The suite's, from analytics' usage per service.
    let admin = suite.token("ops", true);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let usage: Value = suite.usage(&admin).await;
        let rows = usage["rows"].as_array().cloned().unwrap_or_default();
        let cost = |service: &str, model: &str| {
            rows.iter()
                .find(|r| r["service"] == service && r["model"] == model)
                .map(|r| (as_u64(&r["cost_micros"]), as_u64(&r["unpriced_calls"])))
        };
        if let (Some(vision), Some(answer)) = (
            cost("vision", "gpt-4o-mini"),
            cost("answer", "openai/gpt-4o-mini"),
        ) {
            assert_eq!(vision, (litellm_micros(false) as u64, 0), "{usage:#}");
            assert_eq!(answer, (litellm_micros(true) as u64, 0), "{usage:#}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the priced calls never reached analytics: {usage:#}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// An upstream behind LiteLLM that answers its first request 429 with `Retry-After: 2`, and
/// completions after.
async fn limited_upstream() -> (String, Arc<AtomicUsize>) {
    use axum::{Json, Router, http::StatusCode, response::IntoResponse, routing::post};
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    let app = Router::new().route(
        "/v1/chat/completions",
        post(move || {
            let counter = counter.clone();
            async move {
                if counter.fetch_add(1, Ordering::SeqCst) == 0 {
                    return (
                        StatusCode::TOO_MANY_REQUESTS,
                        [("retry-after", "2")],
                        Json(serde_json::json!({"error": {"message": "slow down", "type": "rate_limit_error", "code": "rate_limit_exceeded"}})),
                    )
                        .into_response();
                }
                Json(serde_json::json!({
                    "id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "upstream-1",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": VISION_ANSWER}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
                }))
                .into_response()
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}/v1"), hits)
}

#[tokio::test]
async fn an_upstream_retry_hint_forwarded_by_litellm_is_honoured() {
    let (upstream, hits) = limited_upstream().await;
    let models = format!(
        "  - model_name: limited\n    litellm_params:\n      model: openai/upstream-1\n      \
         api_key: sk-none\n      api_base: {upstream}\n      max_retries: 0\n"
    );
    let litellm = LiteLlm::start(&models).await;
    let config = LlmConfig {
        retry_budget: Duration::from_secs(1),
        ..litellm.llm("limited", "limited")
    };
    let llm = ecoscan_llm::Llm::new(config, "test", None).unwrap();
    let input = ecoscan_llm::ClassifyInput {
        image: common::PNG.to_vec().into(),
        content_type: "image/png".into(),
        taxonomy: vec![ecoscan_llm::TaxonomyPath {
            major: "재활용폐기물".into(),
            middle: "무색페트병".into(),
            minor: "음료PET병".into(),
            name_en: "Clear PET bottles".into(),
        }],
        ..Default::default()
    };

    let err = llm.classify(input).await.unwrap_err();

    // The upstream asked for 2 s, which does not fit in this call's 1 s budget: the call gives
    // up at once instead of retrying after the backoff's 10 ms. That it knows the 2 s at all
    // is LiteLLM's `llm_provider-retry-after`, the only hint the proxy passes on.
    assert!(
        matches!(
            err.cause(),
            ecoscan_llm::LlmError::RateLimited { retry_after: Some(d) } if *d == Duration::from_secs(2)
        ),
        "{err:?}\n{}",
        litellm.log()
    );
    assert!(err.retries_exhausted(), "{err:?}");
    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "no retry inside the hinted wait"
    );
}

#[tokio::test]
async fn progress_never_goes_backwards_and_confidence_is_served_as_stored() {
    // An answer slow enough to arrive in several delta events (one per 250 ms), the way a real
    // model's does: the first of them used to sit below the answer's earlier progress step.
    let suite = TestSuite::start_with(|c| c.llm.mock_latency = Duration::from_secs(3)).await;

    let events = scan(&suite, "bob").await;

    assert_eq!(events.last().unwrap().event, "ready", "{events:#?}");
    assert_progress_never_goes_backwards(&events);
    let job_id = events.last().unwrap().data["job_id"].as_str().unwrap();
    wait_result(&suite, job_id, "bob").await;
    let text = suite
        .http
        .get(suite.url(&format!("/api/v1/scan/{job_id}")))
        .header("x-user-id", "bob")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    // The mock is sure of a hinted item: 0.9, stored as an f32.
    assert!(text.contains("\"confidence\":0.9"), "{text}");
    assert!(!text.contains("0.8999999"), "f32 noise: {text}");
}

#[tokio::test]
async fn a_provider_failure_shows_people_one_plain_message_without_the_provider_text() {
    use axum::{Router, http::StatusCode, routing::post};
    let app = Router::new().route(
        "/v1/chat/completions",
        post(|| async {
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "upstream 10.9.8.7 overloaded; account acct-secret-42",
            )
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let suite = TestSuite::start_with(|c| {
        c.llm = LlmConfig {
            provider: Provider::OpenAi,
            base_url: format!("http://{addr}/v1"),
            max_retries: 1,
            retry_base_delay: Duration::from_millis(10),
            ..LlmConfig::default()
        }
    })
    .await;

    let events = scan(&suite, "carol").await;

    let last = events.last().unwrap();
    assert_eq!(last.event, "error", "{events:#?}");
    let error = &last.data["error"];
    let message = error["message"].as_str().unwrap();
    assert_eq!(
        message,
        "vision stage failed: a service or model it needs is unavailable right now; try again later"
    );
    assert_eq!(error["code"], "UNAVAILABLE");
    for e in &events {
        let text = e.data.to_string();
        assert!(
            !text.contains("acct-secret-42") && !text.contains("10.9.8.7"),
            "provider text reached a person: {text}"
        );
    }
}

#[tokio::test]
async fn production_stores_refuse_to_start_vision_on_the_mock_and_name_what_to_set() {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_ecoscan"));
    cmd.args(["serve", "vision"]);
    for (var, _) in std::env::vars() {
        if var.starts_with("LLM_") || var == "ECOSCAN_STORES" {
            cmd.env_remove(var);
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let stderr = std::fs::File::create(dir.path().join("stderr")).unwrap();
    let mut child = cmd
        .env("ECOSCAN_STORES", "production")
        .env("VISION_ADDR", "127.0.0.1:0")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap();

    // Were the mock allowed, vision would serve until stopped.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("vision started on the mock with ECOSCAN_STORES=production");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    assert!(!status.success());
    let err = std::fs::read_to_string(dir.path().join("stderr")).unwrap();
    for needle in [
        "ECOSCAN_STORES=production",
        "LLM_PROVIDER=openai",
        "LLM_BASE_URL",
    ] {
        assert!(err.contains(needle), "{needle:?} in {err}");
    }
}
