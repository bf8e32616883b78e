//! Provider choice and limits, from the environment.

use std::{fmt, str::FromStr, time::Duration};

use anyhow::{Context, anyhow};
use ecoscan_common::{
    config::{STORES_VAR, env_duration, env_opt, env_or},
    models::{OfferedModel, OfferedModels},
};

/// A setting whose value is one of a few names: the enum, and a `FromStr` that takes each
/// variant's name case-insensitively and around white space and refuses any other value with
/// the names to use instead (`$what` names the setting in that error). One table per setting
/// keeps the names it takes and the names its error lists from drifting apart.
macro_rules! named_setting {
    ($(#[$meta:meta])* pub enum $name:ident ($what:literal) {
        $($(#[$variant_meta:meta])* $text:literal => $variant:ident,)*
    }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum $name {
            $($(#[$variant_meta])* $variant,)*
        }

        impl FromStr for $name {
            type Err = anyhow::Error;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                choose(s, $what, &[$(($text, Self::$variant)),*])
            }
        }
    };
}

named_setting! {
    /// Which backend answers the calls.
    pub enum Provider("provider") {
        /// No model: deterministic answers chosen from the request, marked as mock.
        "mock" => Mock,
        /// Any OpenAI-compatible Chat Completions endpoint (OpenAI, vLLM, Ollama, LiteLLM).
        "openai" => OpenAi,
    }
}

impl Provider {
    /// The name reported as `gen_ai.system`, in analytics and in results.
    pub fn as_str(self) -> &'static str {
        match self {
            Provider::Mock => "mock",
            Provider::OpenAi => "openai",
        }
    }
}

impl fmt::Display for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One of a setting's `choices` by name, case-insensitively and around white space; any
/// other value is refused with the names to use instead (`what` names the setting).
fn choose<T: Copy>(s: &str, what: &str, choices: &[(&str, T)]) -> anyhow::Result<T> {
    let value = s.trim().to_ascii_lowercase();
    if let Some((_, choice)) = choices.iter().find(|(name, _)| *name == value) {
        return Ok(*choice);
    }
    let names: Vec<&str> = choices.iter().map(|(name, _)| *name).collect();
    let names = match names.split_last() {
        Some((last, [])) => (*last).to_owned(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    };
    Err(anyhow!("unknown {what} {value:?} (use {names})"))
}

/// LLM client settings.
///
/// Environment variables (defaults in brackets):
/// - `LLM_PROVIDER` — `mock` | `openai` [mock]
/// - `LLM_BASE_URL` — OpenAI-compatible base URL [https://api.openai.com/v1]
/// - `LLM_API_KEY` — bearer token; optional for local servers such as vLLM or Ollama
/// - `LLM_CLASSIFY_MODEL` — model for image classification [gpt-4o-mini]
/// - `LLM_ANSWER_MODEL` — model for the written answer [gpt-4o-mini]
/// - `LLM_MODELS` — the models a scan may choose instead, `name[=vendor]` separated by commas
///   (see [`ecoscan_common::models::MODELS_VAR`]) [none: no choice]; a chosen model is used by
///   both stages of its scan
/// - `LLM_TIMEOUT` — per-call timeout; for streams, the longest wait for the response head and
///   for each next chunk [60s]
/// - `LLM_MAX_RETRIES` — retries after the first attempt on 429, 5xx and connect errors [3];
///   a model call makes at most `1 + LLM_MAX_RETRIES` provider requests, and so does a stage
///   (vision, answer): once they are spent, the stage answers `UNAVAILABLE` marked as already
///   retried and ingest does not retry it on top
/// - `LLM_RETRY_BASE_DELAY` — first backoff delay, doubled per retry, with jitter [500ms]; a
///   provider's `retry-after-ms` or `Retry-After` (seconds) replaces it
/// - `LLM_RETRY_BUDGET` — the longest a model call keeps retrying: a wait that would end later
///   than this after the first attempt began is not started, the call fails at once as out of
///   retries [30s]. With `LLM_TIMEOUT` it bounds a call: about budget + one timeout
/// - `LLM_MAX_CONCURRENCY` — requests in flight to the provider at once [20]; a call waiting
///   between retries gives its slot up and queues again for the next attempt
/// - `LLM_TOKENS_PER_MINUTE` — provider token budget per minute, 0 = unlimited [0]
/// - `LLM_MOCK_LATENCY` — mean latency of a mock call [300ms]
/// - `LLM_MOCK_JITTER` — mock latency spread, ± fraction of the mean, uniform [0.2]
/// - `LLM_RESPONSE_FORMAT` — how a classification asks for JSON: `json_schema` | `json_object`
///   | `none` [json_schema]; a server that answers 400 to `json_schema` is asked once more with
///   `json_object`, and that model keeps `json_object` for the life of the process
/// - `LLM_STREAM_OPTIONS` — send `stream_options: {include_usage: true}` with answers [true];
///   `false` for servers that reject it (their answers then report no token usage)
/// - `LLM_PROPAGATE_TRACE` — `true` | `false` | `auto` [auto]: send `traceparent` to the
///   provider; `auto` sends it only to loopback and cluster-internal hosts (`localhost`,
///   `*.svc`, `*.cluster.local`), never to a third party
///
/// With `ECOSCAN_STORES=production`, `LLM_PROVIDER=mock` stops the start: a production
/// deployment must name its model provider.
///
/// Concurrency and token limits apply to the `openai` provider only: the mock stands in for a
/// provider in load tests, where its latency, not a local limit, is what is being simulated.
#[derive(Clone)]
pub struct LlmConfig {
    pub provider: Provider,
    pub base_url: String,
    pub api_key: Option<String>,
    pub classify_model: String,
    pub answer_model: String,
    pub offered: OfferedModels,
    pub timeout: Duration,
    pub max_retries: usize,
    pub retry_base_delay: Duration,
    pub retry_budget: Duration,
    pub max_concurrency: usize,
    pub tokens_per_minute: u32,
    pub mock_latency: Duration,
    pub mock_jitter: f64,
    pub response_format: ResponseFormat,
    pub stream_options: bool,
    pub propagate_trace: PropagateTrace,
}

impl Default for LlmConfig {
    /// The documented defaults, without reading the environment.
    fn default() -> Self {
        Self {
            provider: Provider::Mock,
            base_url: "https://api.openai.com/v1".to_owned(),
            api_key: None,
            classify_model: "gpt-4o-mini".to_owned(),
            answer_model: "gpt-4o-mini".to_owned(),
            offered: OfferedModels::default(),
            timeout: Duration::from_secs(60),
            max_retries: 3,
            retry_base_delay: Duration::from_millis(500),
            retry_budget: Duration::from_secs(30),
            max_concurrency: 20,
            tokens_per_minute: 0,
            mock_latency: Duration::from_millis(300),
            mock_jitter: 0.2,
            response_format: ResponseFormat::JsonSchema,
            stream_options: true,
            propagate_trace: PropagateTrace::Auto,
        }
    }
}

impl fmt::Debug for LlmConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The API key must never reach a log line.
        f.debug_struct("LlmConfig")
            .field("provider", &self.provider)
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("classify_model", &self.classify_model)
            .field("answer_model", &self.answer_model)
            .field("offered", &self.offered)
            .field("timeout", &self.timeout)
            .field("max_retries", &self.max_retries)
            .field("retry_base_delay", &self.retry_base_delay)
            .field("retry_budget", &self.retry_budget)
            .field("max_concurrency", &self.max_concurrency)
            .field("tokens_per_minute", &self.tokens_per_minute)
            .field("mock_latency", &self.mock_latency)
            .field("mock_jitter", &self.mock_jitter)
            .field("response_format", &self.response_format)
            .field("stream_options", &self.stream_options)
            .field("propagate_trace", &self.propagate_trace)
            .finish()
    }
}

impl LlmConfig {
    /// Reads the variables listed on [`LlmConfig`].
    pub fn from_env() -> anyhow::Result<Self> {
        let d = Self::default();
        let config = Self {
            provider: env_or("LLM_PROVIDER", d.provider)?,
            base_url: env_opt("LLM_BASE_URL").unwrap_or(d.base_url),
            api_key: env_opt("LLM_API_KEY"),
            classify_model: env_opt("LLM_CLASSIFY_MODEL").unwrap_or(d.classify_model),
            answer_model: env_opt("LLM_ANSWER_MODEL").unwrap_or(d.answer_model),
            offered: OfferedModels::from_env()?,
            timeout: env_duration("LLM_TIMEOUT", d.timeout)?,
            max_retries: env_or("LLM_MAX_RETRIES", d.max_retries)?,
            retry_base_delay: env_duration("LLM_RETRY_BASE_DELAY", d.retry_base_delay)?,
            retry_budget: env_duration("LLM_RETRY_BUDGET", d.retry_budget)?,
            max_concurrency: env_or("LLM_MAX_CONCURRENCY", d.max_concurrency)?,
            tokens_per_minute: env_or("LLM_TOKENS_PER_MINUTE", d.tokens_per_minute)?,
            mock_latency: env_duration("LLM_MOCK_LATENCY", d.mock_latency)?,
            mock_jitter: env_or("LLM_MOCK_JITTER", d.mock_jitter)?,
            response_format: env_or("LLM_RESPONSE_FORMAT", d.response_format)?,
            stream_options: env_or("LLM_STREAM_OPTIONS", d.stream_options)?,
            propagate_trace: env_or("LLM_PROPAGATE_TRACE", d.propagate_trace)?,
        };
        config.validate().context("invalid llm configuration")?;
        refuse_mock_in_production(env_opt(STORES_VAR).as_deref(), config.provider)?;
        Ok(config)
    }

    pub(crate) fn validate(&self) -> anyhow::Result<()> {
        if self.max_concurrency == 0 {
            return Err(anyhow!("LLM_MAX_CONCURRENCY must be at least 1"));
        }
        if !(0.0..=1.0).contains(&self.mock_jitter) {
            return Err(anyhow!("LLM_MOCK_JITTER must be between 0 and 1"));
        }
        if self.provider == Provider::OpenAi {
            reqwest::Url::parse(&self.base_url)
                .with_context(|| format!("LLM_BASE_URL {:?} is not a url", self.base_url))?;
        }
        Ok(())
    }

    /// The model asked for `operation` and its vendor (`gen_ai.system`): the caller's choice
    /// when it made one (already checked against [`LlmConfig::offered`]), the configured model
    /// otherwise. The mock answers as whichever model is named, and always as vendor "mock"
    /// ("mock" the model too when none is chosen).
    pub fn model_for(
        &self,
        operation: Operation,
        chosen: Option<&OfferedModel>,
    ) -> (String, String) {
        let configured = match operation {
            Operation::Classify => &self.classify_model,
            Operation::Answer => &self.answer_model,
        };
        match (self.provider, chosen) {
            (Provider::Mock, Some(m)) => (m.name.clone(), Provider::Mock.as_str().to_owned()),
            (Provider::Mock, None) => (
                crate::mock::MODEL.to_owned(),
                Provider::Mock.as_str().to_owned(),
            ),
            (Provider::OpenAi, Some(m)) => (
                m.name.clone(),
                m.system
                    .clone()
                    .unwrap_or_else(|| Provider::OpenAi.as_str().to_owned()),
            ),
            (Provider::OpenAi, None) => (configured.clone(), Provider::OpenAi.as_str().to_owned()),
        }
    }
}

/// A deployment that promises production stores (`ECOSCAN_STORES=production`) serves people,
/// and the mock's answers are not a model's: it must name a real provider.
fn refuse_mock_in_production(stores: Option<&str>, provider: Provider) -> anyhow::Result<()> {
    if stores.map(str::trim) == Some("production") && provider == Provider::Mock {
        return Err(anyhow!(
            "{STORES_VAR}=production, but LLM_PROVIDER is mock (the default when unset): the mock \
             writes no real answers. Set LLM_PROVIDER=openai with LLM_BASE_URL, LLM_API_KEY, \
             LLM_CLASSIFY_MODEL and LLM_ANSWER_MODEL for the model provider"
        ));
    }
    Ok(())
}

named_setting! {
    /// How a classification asks for JSON (`LLM_RESPONSE_FORMAT`).
    pub enum ResponseFormat("response format") {
        /// `response_format: {type: json_schema, …}` with the taxonomy as enums (OpenAI, vLLM,
        /// recent Ollama and llama.cpp servers, LiteLLM).
        "json_schema" => JsonSchema,
        /// `response_format: {type: json_object}`: any JSON object; the prompt describes the
        /// shape.
        "json_object" => JsonObject,
        /// No `response_format` at all, for servers that reject the field; the prompt asks for
        /// JSON and the reader finds it in the text.
        "none" => None,
    }
}

named_setting! {
    /// Whether the trace context goes to the provider (`LLM_PROPAGATE_TRACE`).
    pub enum PropagateTrace("value") {
        "true" => Always,
        "false" => Never,
        /// Only to loopback and cluster-internal hosts: a third party learns nothing of our
        /// traces.
        "auto" => Auto,
    }
}

/// What a call is for; reported to analytics as `operation`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    Classify,
    Answer,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::Classify => "classify",
            Operation::Answer => "answer",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn provider_parses_case_insensitively_and_rejects_unknown_names() {
        assert_eq!("OpenAI".parse::<Provider>().unwrap(), Provider::OpenAi);
        assert_eq!("mock".parse::<Provider>().unwrap(), Provider::Mock);
        assert!("anthropic".parse::<Provider>().is_err());
    }

    #[test]
    fn production_stores_refuse_the_mock_and_name_what_to_set() {
        let err = refuse_mock_in_production(Some("production"), Provider::Mock)
            .unwrap_err()
            .to_string();
        for needle in [
            "ECOSCAN_STORES=production",
            "LLM_PROVIDER=openai",
            "LLM_BASE_URL",
        ] {
            assert!(err.contains(needle), "{needle:?} in {err}");
        }
        refuse_mock_in_production(Some("production"), Provider::OpenAi).unwrap();
        refuse_mock_in_production(None, Provider::Mock).unwrap();
        refuse_mock_in_production(Some("auto"), Provider::Mock).unwrap();
    }

    #[test]
    fn response_format_and_trace_settings_parse_and_refuse_unknown_values() {
        assert_eq!(
            "JSON_OBJECT".parse::<ResponseFormat>().unwrap(),
            ResponseFormat::JsonObject
        );
        assert_eq!(
            "none".parse::<ResponseFormat>().unwrap(),
            ResponseFormat::None
        );
        assert!("json".parse::<ResponseFormat>().is_err());
        assert_eq!(
            "true".parse::<PropagateTrace>().unwrap(),
            PropagateTrace::Always
        );
        assert_eq!(
            "auto".parse::<PropagateTrace>().unwrap(),
            PropagateTrace::Auto
        );
        assert!("yes".parse::<PropagateTrace>().is_err());
    }

    #[test]
    fn an_unknown_setting_value_is_refused_with_the_names_to_use() {
        let refused = |err: anyhow::Error| err.to_string();
        assert_eq!(
            refused(" Anthropic".parse::<Provider>().unwrap_err()),
            "unknown provider \"anthropic\" (use mock or openai)"
        );
        assert_eq!(
            refused("json".parse::<ResponseFormat>().unwrap_err()),
            "unknown response format \"json\" (use json_schema, json_object or none)"
        );
        assert_eq!(
            refused("yes".parse::<PropagateTrace>().unwrap_err()),
            "unknown value \"yes\" (use true, false or auto)"
        );
    }

    #[test]
    fn debug_output_never_shows_the_api_key() {
        let config = LlmConfig {
            api_key: Some("sk-secret".into()),
            ..LlmConfig::default()
        };
        assert!(!format!("{config:?}").contains("sk-secret"));
    }
}
