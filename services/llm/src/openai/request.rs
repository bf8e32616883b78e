//! The request bodies: the classification (with its JSON schema, in the dialect the server
//! takes), its repair, and the streamed answer.

use base64::Engine;
use serde_json::{Value, json};

use crate::{
    ResponseFormat,
    types::{AnswerInput, ClassifyInput},
};

/// Tokens budgeted per image before the call (a high-detail 512×512 tile costs ~255 + 85 for
/// gpt-4o models; a photo is a few tiles).
const IMAGE_TOKEN_ESTIMATE: u32 = 1_000;
const CLASSIFY_OUTPUT_ESTIMATE: u32 = 200;
const ANSWER_OUTPUT_ESTIMATE: u32 = 800;

/// The shape is spelt out in words too: with `json_object` or no `response_format` the prompt
/// is all a model has to go by (and OpenAI requires the word JSON with `json_object`).
const CLASSIFY_SYSTEM_PROMPT: &str = "You classify a photo of one item for household waste \
sorting in Korea. Answer with exactly one path of the taxonomy given by the user (major, middle, \
minor exactly as written there; middle is empty when the path has none), a short item_name \
describing the object, a confidence between 0 and 1, and only those situation tags from the \
given vocabulary that the photo clearly shows. Reply with only a JSON object with the keys \
major, middle, minor, item_name, confidence and situation_tags (an array of strings).";

/// `data:<mime>;base64,...` for the request, and the placeholder that replaces it in reports.
pub(crate) fn image_urls(input: &ClassifyInput) -> (String, String) {
    let mime = if input.content_type.is_empty() {
        "application/octet-stream"
    } else {
        input.content_type.as_str()
    };
    let data = base64::engine::general_purpose::STANDARD.encode(&input.image);
    (
        format!("data:{mime};base64,{data}"),
        format!("data:{mime};base64,<{} bytes>", input.image.len()),
    )
}

/// A classification answer that could not be used, and why: sent back to the model once.
pub(super) struct Repair<'a> {
    pub answer: &'a str,
    pub problem: &'a str,
}

/// The classification request; `image_url` is the data URL (or its redacted stand-in).
pub(super) fn classify_body(
    input: &ClassifyInput,
    model: &str,
    image_url: &str,
    format: ResponseFormat,
    repair: Option<&Repair<'_>>,
) -> Value {
    let mut majors = Vec::new();
    let mut middles = Vec::new();
    let mut minors = Vec::new();
    let mut lines = String::new();
    for p in &input.taxonomy {
        push_unique(&mut majors, &p.major);
        push_unique(&mut middles, &p.middle);
        push_unique(&mut minors, &p.minor);
        lines.push_str(&format!(
            "- major: {} | middle: {} | minor: {} | ({})\n",
            p.major, p.middle, p.minor, p.name_en
        ));
    }
    let hint = if input.hint.trim().is_empty() {
        "(none)"
    } else {
        input.hint.trim()
    };
    let text = format!(
        "Hint from the person: {hint}\n\nTaxonomy paths:\n{lines}\nSituation tag vocabulary: {}",
        input.situation_tags.join(", ")
    );
    let mut messages = vec![
        json!({"role": "system", "content": CLASSIFY_SYSTEM_PROMPT}),
        json!({"role": "user", "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": image_url}},
        ]}),
    ];
    if let Some(repair) = repair {
        messages.push(json!({"role": "assistant", "content": repair.answer}));
        messages.push(json!({"role": "user", "content": format!(
            "That answer could not be used: {}. Answer again with only the JSON object, \
             choosing major, middle and minor together from one of the taxonomy paths listed \
             above, exactly as written there.",
            repair.problem
        )}));
    }
    let mut body = json!({"model": model, "messages": messages});
    match format {
        ResponseFormat::JsonSchema => {
            let schema = json!({
                "type": "object",
                "properties": {
                    "major": {"type": "string", "enum": majors},
                    "middle": {"type": "string", "enum": middles},
                    "minor": {"type": "string", "enum": minors},
                    "item_name": {"type": "string"},
                    "confidence": {"type": "number"},
                    "situation_tags": {
                        "type": "array",
                        "items": {"type": "string", "enum": input.situation_tags},
                    },
                },
                "required": ["major", "middle", "minor", "item_name", "confidence", "situation_tags"],
                "additionalProperties": false,
            });
            body["response_format"] = json!({
                "type": "json_schema",
                "json_schema": {"name": "waste_classification", "strict": true, "schema": schema},
            });
        }
        ResponseFormat::JsonObject => body["response_format"] = json!({"type": "json_object"}),
        ResponseFormat::None => {}
    }
    body
}

fn push_unique(v: &mut Vec<String>, s: &str) {
    if !v.iter().any(|x| x == s) {
        v.push(s.to_owned());
    }
}

pub(super) fn classify_estimate(input: &ClassifyInput) -> u32 {
    let text: usize = input
        .taxonomy
        .iter()
        .map(|p| p.major.len() + p.middle.len() + p.minor.len() + p.name_en.len() + 32)
        .sum::<usize>()
        + input.hint.len()
        + CLASSIFY_SYSTEM_PROMPT.len();
    u32::try_from(text / 4).unwrap_or(u32::MAX) + IMAGE_TOKEN_ESTIMATE + CLASSIFY_OUTPUT_ESTIMATE
}

/// The streamed answer request; `stream_options` asks for a last chunk with the usage (some
/// servers refuse the field: `LLM_STREAM_OPTIONS=false` leaves it out).
pub(crate) fn answer_body(input: &AnswerInput, model: &str, stream_options: bool) -> Value {
    let mut body = json!({
        "model": model,
        "messages": [
            {"role": "system", "content": input.system_prompt},
            {"role": "user", "content": input.user_prompt},
        ],
        "stream": true,
    });
    if stream_options {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

pub(crate) fn answer_estimate(input: &AnswerInput) -> u32 {
    u32::try_from((input.system_prompt.len() + input.user_prompt.len()) / 4).unwrap_or(u32::MAX)
        + ANSWER_OUTPUT_ESTIMATE
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TaxonomyPath;

    fn input() -> ClassifyInput {
        ClassifyInput {
            image: bytes::Bytes::from_static(&[1, 2, 3]),
            content_type: "image/png".into(),
            taxonomy: vec![TaxonomyPath {
                major: "a".into(),
                middle: String::new(),
                minor: "c".into(),
                name_en: "A".into(),
            }],
            ..ClassifyInput::default()
        }
    }

    #[test]
    fn redacted_image_url_keeps_the_type_and_size_only() {
        let (real, redacted) = image_urls(&input());
        assert_eq!(real, "data:image/png;base64,AQID");
        assert_eq!(redacted, "data:image/png;base64,<3 bytes>");
    }

    #[test]
    fn each_response_format_asks_in_its_own_dialect() {
        let schema = classify_body(&input(), "m", "u", ResponseFormat::JsonSchema, None);
        assert_eq!(schema["response_format"]["type"], "json_schema");
        let object = classify_body(&input(), "m", "u", ResponseFormat::JsonObject, None);
        assert_eq!(object["response_format"], json!({"type": "json_object"}));
        let none = classify_body(&input(), "m", "u", ResponseFormat::None, None);
        assert!(none.get("response_format").is_none());
        assert!(
            none["messages"][0]["content"]
                .as_str()
                .unwrap()
                .contains("JSON object")
        );
    }

    #[test]
    fn a_repair_carries_the_answer_and_what_was_wrong_with_it() {
        let repair = Repair {
            answer: "it is a bottle",
            problem: "no JSON object in the answer",
        };
        let body = classify_body(
            &input(),
            "m",
            "u",
            ResponseFormat::JsonSchema,
            Some(&repair),
        );
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 4);
        assert_eq!(messages[2]["role"], "assistant");
        assert_eq!(messages[2]["content"], "it is a bottle");
        assert!(
            messages[3]["content"]
                .as_str()
                .unwrap()
                .contains("no JSON object in the answer")
        );
    }

    #[test]
    fn stream_options_can_be_left_out() {
        let input = AnswerInput {
            job_id: String::new(),
            locale: crate::Locale::En,
            system_prompt: "s".into(),
            user_prompt: "u".into(),
            subject: String::new(),
            steps: vec![],
            model: None,
        };
        assert_eq!(
            answer_body(&input, "m", true)["stream_options"]["include_usage"],
            true
        );
        assert!(
            answer_body(&input, "m", false)
                .get("stream_options")
                .is_none()
        );
    }
}
