//! The answer service's settings and where they come from.

use ecoscan_llm::LlmConfig;

/// Answer service settings.
///
/// Environment variables (defaults in brackets):
/// - `ANSWER_ADDR` — listen address of the `ecoscan-answer` binary [127.0.0.1:50054]
/// - `ANALYTICS_URL` — where model calls are reported [http://127.0.0.1:50056]; set it empty to
///   disable reporting
/// - the `LLM_*` variables of [`ecoscan_llm::LlmConfig`]
#[derive(Clone, Debug)]
pub struct Config {
    pub analytics_url: Option<String>,
    pub llm: LlmConfig,
}

impl Config {
    pub fn from_env() -> anyhow::Result<Self> {
        Ok(Self {
            analytics_url: ecoscan_llm::analytics_url_from_env(),
            llm: LlmConfig::from_env()?,
        })
    }
}
