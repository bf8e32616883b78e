//! The vision service's settings and where they come from.

use ecoscan_llm::LlmConfig;

/// Vision service settings.
///
/// Environment variables (defaults in brackets):
/// - `VISION_ADDR` — listen address of the `ecoscan-vision` binary [127.0.0.1:50052]
/// - `RULE_URL` — rule service, source of the taxonomy [http://127.0.0.1:50053]
/// - `ANALYTICS_URL` — where model calls are reported [http://127.0.0.1:50056]; set it empty to
///   disable reporting
/// - the `LLM_*` variables of [`ecoscan_llm::LlmConfig`]
#[derive(Clone, Debug)]
pub struct Config {
    pub rule_url: String,
    pub analytics_url: Option<String>,
    pub llm: LlmConfig,
}

impl Config {
    pub fn from_env() -> anyhow::Result<Self> {
        Ok(Self {
            rule_url: ecoscan_common::config::env_opt("RULE_URL")
                .unwrap_or_else(|| "http://127.0.0.1:50053".to_owned()),
            analytics_url: ecoscan_llm::analytics_url_from_env(),
            llm: LlmConfig::from_env()?,
        })
    }
}
