//! Inputs and outputs of the two operations.

use std::time::Duration;

use bytes::Bytes;
pub use ecoscan_common::models::OfferedModel;

/// One leaf of the taxonomy a classification may answer with.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TaxonomyPath {
    pub major: String,
    /// Empty for majors without a middle level.
    pub middle: String,
    pub minor: String,
    /// English name of the middle (or major) category, to help matching and prompting.
    pub name_en: String,
}

impl TaxonomyPath {
    /// `major/middle/minor`, skipping an empty middle.
    pub fn display(major: &str, middle: &str, minor: &str) -> String {
        if middle.is_empty() {
            format!("{major}/{minor}")
        } else {
            format!("{major}/{middle}/{minor}")
        }
    }
}

/// A classification request.
#[derive(Clone, Debug, Default)]
pub struct ClassifyInput {
    /// Job the call belongs to (reported to analytics); may be empty.
    pub job_id: String,
    pub image: Bytes,
    /// MIME type of `image`, e.g. `image/jpeg`.
    pub content_type: String,
    /// Free-text hint from the person; may be empty.
    pub hint: String,
    /// Every path the answer may choose from.
    pub taxonomy: Vec<TaxonomyPath>,
    /// The situation-tag vocabulary the answer may choose from.
    pub situation_tags: Vec<String>,
    /// The model the caller chose from the offered ones; `None` for the configured one.
    pub model: Option<OfferedModel>,
}

/// What the model answered. The shape is checked; whether the path belongs to the taxonomy is
/// the caller's check (a JSON schema constrains each field alone, not the combination).
#[derive(Clone, Debug, PartialEq)]
pub struct ClassifyOutput {
    pub major: String,
    pub middle: String,
    pub minor: String,
    pub item_name: String,
    pub confidence: f32,
    pub situation_tags: Vec<String>,
    /// The model's vendor ("openai", or as `LLM_MODELS` names it) or "mock".
    pub provider: String,
    pub model: String,
}

/// Answer language.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Locale {
    Ko,
    En,
}

impl Locale {
    pub fn as_str(self) -> &'static str {
        match self {
            Locale::Ko => "ko",
            Locale::En => "en",
        }
    }
}

/// A request for written instructions.
///
/// The prompts are what a real model reads; `subject` and `steps` are the facts the answer
/// must cover, in order, and what the mock provider writes its text from.
#[derive(Clone, Debug)]
pub struct AnswerInput {
    pub job_id: String,
    pub locale: Locale,
    pub system_prompt: String,
    pub user_prompt: String,
    /// What is being disposed of, e.g. "음료PET병".
    pub subject: String,
    pub steps: Vec<String>,
    /// The model the caller chose from the offered ones; `None` for the configured one.
    pub model: Option<OfferedModel>,
}

/// One item of an answer stream: text deltas in order, then exactly one `Done`.
#[derive(Clone, Debug, PartialEq)]
pub enum AnswerChunk {
    Delta(String),
    Done(AnswerUsage),
}

/// How an answer was produced.
#[derive(Clone, Debug, PartialEq)]
pub struct AnswerUsage {
    /// The model's vendor ("openai", or as `LLM_MODELS` names it) or "mock".
    pub provider: String,
    pub model: String,
    pub input_tokens: u32,
    pub output_tokens: u32,
    /// Time from the call to the first delta.
    pub ttft: Option<Duration>,
}
