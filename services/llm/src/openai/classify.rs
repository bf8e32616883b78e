//! One classification call: ask in the configured JSON dialect (falling back once from
//! `json_schema` to `json_object` for a server that refuses the first), read the answer
//! tolerantly, and when it cannot be used, ask once more with what was wrong — all within the
//! call's retry budget.

use crate::{
    CallLog, LlmError, ResponseFormat,
    types::{ClassifyInput, ClassifyOutput},
};

use super::{
    OpenAi, read_body,
    request::{self, Repair},
    structured::{self, Usage},
};

impl OpenAi {
    pub(crate) async fn classify(
        &self,
        input: &ClassifyInput,
        model: &str,
        log: &mut CallLog,
    ) -> Result<ClassifyOutput, LlmError> {
        let mut budget = self.budget();
        let mut format = self.format_for(model);
        let mut usage = Usage::default();
        let mut repaired = false;
        let (image_url, redacted) = request::image_urls(input);
        let estimate = request::classify_estimate(input);
        // The answer that could not be used and why, once one was seen.
        let mut repair: Option<(String, String)> = None;
        loop {
            let repair_ref = repair
                .as_ref()
                .map(|(answer, problem)| Repair { answer, problem });
            let body =
                request::classify_body(input, model, &image_url, format, repair_ref.as_ref());
            log.request_body =
                request::classify_body(input, model, &redacted, format, repair_ref.as_ref())
                    .to_string();
            let admitted = match self.send(&body, estimate, &mut budget).await {
                Err(LlmError::Upstream { status: 400, body })
                    if format == ResponseFormat::JsonSchema =>
                {
                    // Older servers (and some proxies' backends) refuse `json_schema`; ask
                    // once more with `json_object`, which they take.
                    tracing::info!(model, error = %body, "json_schema refused with 400, trying json_object");
                    format = ResponseFormat::JsonObject;
                    let body = request::classify_body(
                        input,
                        model,
                        &image_url,
                        format,
                        repair_ref.as_ref(),
                    );
                    log.request_body = request::classify_body(
                        input,
                        model,
                        &redacted,
                        format,
                        repair_ref.as_ref(),
                    )
                    .to_string();
                    let admitted = self.send(&body, estimate, &mut budget).await?;
                    self.remember_json_schema_rejected(model);
                    admitted
                }
                other => other?,
            };
            let text = read_body(admitted, self.timeout).await?;
            log.response_body = text.clone();
            let answered = structured::completion(&text)?;
            usage.prompt_tokens += answered.usage.prompt_tokens;
            usage.completion_tokens += answered.usage.completion_tokens;
            log.input_tokens = usage.prompt_tokens;
            log.output_tokens = usage.completion_tokens;
            log.cached_input_tokens += answered.usage.cached_tokens();
            if !answered.model.is_empty() {
                log.model = answered.model.clone();
            }
            let problem = match structured::classification(&answered.content, &input.taxonomy) {
                Ok(c) => {
                    if repaired {
                        tracing::info!("the repaired classification was usable");
                    }
                    return Ok(ClassifyOutput {
                        major: c.major,
                        middle: c.middle,
                        minor: c.minor,
                        item_name: c.item_name,
                        confidence: c.confidence,
                        situation_tags: c.situation_tags,
                        provider: log.system.clone(),
                        model: log.model.clone(),
                    });
                }
                Err(problem) => problem,
            };
            if repaired || !budget.take_extra() {
                return Err(LlmError::Malformed(format!(
                    "the classification could not be used{}: {problem}",
                    if repaired {
                        " after a repair request"
                    } else {
                        ""
                    }
                )));
            }
            tracing::warn!(problem = %problem, attempts = budget.attempts(), "classification unusable, asking the model to repair it");
            repaired = true;
            repair = Some((answered.content, problem));
        }
    }
}
