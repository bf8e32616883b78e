//! Reading a classification out of what a model wrote. Servers that honour `json_schema`
//! answer with the bare object; others wrap it in a Markdown code fence or a sentence of prose
//! (older Ollama and llama.cpp servers, some LiteLLM backends). The reader takes the object
//! wherever it is, checks it against the request's taxonomy, and says precisely what is wrong
//! when it cannot: that sentence is what the repair request sends back to the model.

use serde::Deserialize;
use serde_json::Value;

use crate::{LlmError, types::TaxonomyPath};

/// A non-streamed chat completion, as far as we read it.
#[derive(Deserialize)]
struct Completion {
    #[serde(default)]
    model: String,
    #[serde(default)]
    choices: Vec<Choice>,
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Choice {
    message: Option<Message>,
}

#[derive(Deserialize)]
struct Message {
    content: Option<String>,
    refusal: Option<String>,
}

#[derive(Deserialize, Default, Clone, Copy, Debug, PartialEq)]
pub(crate) struct Usage {
    #[serde(default)]
    pub prompt_tokens: u32,
    #[serde(default)]
    pub completion_tokens: u32,
    /// OpenAI's (and LiteLLM's) breakdown of the prompt; absent or `null` from servers that
    /// keep no prompt cache.
    #[serde(default)]
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Deserialize, Default, Clone, Copy, Debug, PartialEq)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

impl Usage {
    /// Of `prompt_tokens`, those read from the provider's prompt cache (priced apart).
    pub(crate) fn cached_tokens(&self) -> u32 {
        self.prompt_tokens_details
            .and_then(|d| d.cached_tokens)
            .unwrap_or(0)
            .min(self.prompt_tokens)
    }
}

/// What a completion carried: the message text, the model that wrote it, the usage.
pub(super) struct Answered {
    pub content: String,
    /// Empty when the server did not say.
    pub model: String,
    pub usage: Usage,
}

/// Parses the completion envelope. A body that is no completion, or a refusal, is
/// [`LlmError::Malformed`] at once: asking the model again would not change either.
pub(super) fn completion(body: &str) -> Result<Answered, LlmError> {
    let completion: Completion = serde_json::from_str(body)
        .map_err(|e| LlmError::Malformed(format!("response is not a chat completion: {e}")))?;
    let message = completion
        .choices
        .into_iter()
        .next()
        .and_then(|c| c.message)
        .ok_or_else(|| LlmError::Malformed("completion has no message".into()))?;
    if let Some(refusal) = message.refusal.filter(|r| !r.is_empty()) {
        return Err(LlmError::Malformed(format!("model refused: {refusal}")));
    }
    Ok(Answered {
        content: message.content.unwrap_or_default(),
        model: completion.model,
        usage: completion.usage.unwrap_or_default(),
    })
}

/// A classification as the model wrote it. `middle` may be missing or null (a path without
/// one), and so may the tags; everything else is required.
#[derive(Deserialize, Debug, PartialEq)]
pub(super) struct Classification {
    pub major: String,
    #[serde(default, deserialize_with = "null_as_empty")]
    pub middle: String,
    pub minor: String,
    #[serde(default)]
    pub item_name: String,
    pub confidence: f32,
    #[serde(default)]
    pub situation_tags: Vec<String>,
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

/// Reads the classification in `content` and checks it against `taxonomy` (when given). The
/// error is one sentence for the model (and the logs): what was wrong.
pub(super) fn classification(
    content: &str,
    taxonomy: &[TaxonomyPath],
) -> Result<Classification, String> {
    let object = find_object(content).ok_or_else(|| {
        if content.trim().is_empty() {
            "the answer was empty".to_owned()
        } else {
            "the answer contains no JSON object".to_owned()
        }
    })?;
    let c: Classification = serde_json::from_value(object)
        .map_err(|e| format!("the JSON object does not have the classification's fields: {e}"))?;
    if !(0.0..=1.0).contains(&c.confidence) {
        return Err(format!("confidence {} is outside 0 to 1", c.confidence));
    }
    let on_path =
        |p: &TaxonomyPath| p.major == c.major && p.middle == c.middle && p.minor == c.minor;
    if !taxonomy.is_empty() && !taxonomy.iter().any(on_path) {
        return Err(format!(
            "major {:?}, middle {:?}, minor {:?} is not one of the taxonomy paths",
            c.major, c.middle, c.minor
        ));
    }
    Ok(c)
}

/// The JSON object in `text`: the whole text, the inside of a code fence, or the first
/// balanced `{…}` in prose that parses as an object.
fn find_object(text: &str) -> Option<Value> {
    let as_object = |s: &str| {
        serde_json::from_str::<Value>(s.trim())
            .ok()
            .filter(Value::is_object)
    };
    if let Some(v) = as_object(text) {
        return Some(v);
    }
    if let Some(v) = fenced(text).and_then(as_object) {
        return Some(v);
    }
    text.match_indices('{')
        .filter_map(|(start, _)| balanced(&text[start..]))
        .find_map(as_object)
}

/// The body of the first Markdown code fence (```` ```json … ``` ````, any info string).
fn fenced(text: &str) -> Option<&str> {
    let open = text.find("```")?;
    let after = &text[open + 3..];
    // The info string (`json`) runs to the end of the opening line.
    let body = &after[after.find('\n')? + 1..];
    let close = body.find("```")?;
    Some(&body[..close])
}

/// The prefix of `s` (which starts with `{`) up to its matching `}`, skipping braces inside
/// JSON strings.
fn balanced(s: &str) -> Option<&str> {
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    for (i, c) in s.char_indices() {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&s[..=i]);
                }
            }
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const OBJECT: &str = r#"{"major":"재활용폐기물","middle":"무색페트병","minor":"음료PET병","item_name":"bottle","confidence":0.93,"situation_tags":["내용물_있음"]}"#;

    fn taxonomy() -> Vec<TaxonomyPath> {
        vec![TaxonomyPath {
            major: "재활용폐기물".into(),
            middle: "무색페트병".into(),
            minor: "음료PET병".into(),
            name_en: "PET".into(),
        }]
    }

    #[test]
    fn the_object_is_found_bare_fenced_or_in_prose() {
        let fenced = format!("```json\n{OBJECT}\n```");
        let fenced_plain = format!("Here you go:\n```\n{OBJECT}\n```\nAnything else?");
        let prose = format!("Sure! The item is {OBJECT} — hope that helps {{smile}}.");
        let braces_in_strings = r#"Note {not json}. {"major":"재활용폐기물","middle":"무색페트병","minor":"음료PET병","item_name":"a {curly} bottle \"x\"","confidence":0.5}"#;
        for text in [OBJECT, &fenced, &fenced_plain, &prose, braces_in_strings] {
            let c = classification(text, &taxonomy()).unwrap_or_else(|e| panic!("{e}: {text}"));
            assert_eq!(c.minor, "음료PET병");
        }
        let c = classification(braces_in_strings, &taxonomy()).unwrap();
        assert_eq!(c.item_name, r#"a {curly} bottle "x""#);
        assert!(c.situation_tags.is_empty(), "missing tags are none");
    }

    #[test]
    fn a_null_or_missing_middle_is_an_empty_middle() {
        let taxonomy = vec![TaxonomyPath {
            major: "음식물류폐기물".into(),
            middle: String::new(),
            minor: "과일껍질".into(),
            name_en: "Food".into(),
        }];
        for text in [
            r#"{"major":"음식물류폐기물","middle":null,"minor":"과일껍질","confidence":1}"#,
            r#"{"major":"음식물류폐기물","minor":"과일껍질","confidence":1}"#,
        ] {
            assert!(classification(text, &taxonomy).is_ok(), "{text}");
        }
    }

    #[test]
    fn unusable_answers_say_what_is_wrong() {
        let cases = [
            ("", "the answer was empty"),
            ("It is a plastic bottle.", "contains no JSON object"),
            (
                r#"{"kind":"bottle"}"#,
                "does not have the classification's fields",
            ),
            (
                r#"{"major":"재활용폐기물","middle":"무색페트병","minor":"음료PET병","confidence":7}"#,
                "confidence 7 is outside 0 to 1",
            ),
            (
                r#"{"major":"재활용폐기물","middle":"","minor":"유리병","confidence":0.5}"#,
                "is not one of the taxonomy paths",
            ),
        ];
        for (text, needle) in cases {
            let err = classification(text, &taxonomy()).unwrap_err();
            assert!(err.contains(needle), "{text:?}: {err}");
        }
    }

    #[test]
    fn cached_prompt_tokens_are_read_where_the_server_reports_them() {
        let usage = |json: &str| {
            completion(&format!(
                r#"{{"choices":[{{"message":{{"content":"x"}}}}],"usage":{json}}}"#
            ))
            .unwrap()
            .usage
        };
        let openai = usage(
            r#"{"prompt_tokens":1200,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":1024,"audio_tokens":0}}"#,
        );
        assert_eq!((openai.prompt_tokens, openai.cached_tokens()), (1200, 1024));
        for plain in [
            r#"{"prompt_tokens":10,"completion_tokens":20}"#,
            r#"{"prompt_tokens":10,"completion_tokens":20,"prompt_tokens_details":null}"#,
            r#"{"prompt_tokens":10,"completion_tokens":20,"prompt_tokens_details":{"cached_tokens":null}}"#,
        ] {
            assert_eq!(usage(plain).cached_tokens(), 0, "{plain}");
        }
        // Never more cached than prompt tokens, whatever a server says.
        let odd = usage(r#"{"prompt_tokens":3,"prompt_tokens_details":{"cached_tokens":9}}"#);
        assert_eq!(odd.cached_tokens(), 3);
    }

    #[test]
    fn a_refusal_and_a_body_that_is_no_completion_are_malformed() {
        let refusal = r#"{"choices":[{"message":{"content":null,"refusal":"no"}}]}"#;
        assert!(matches!(completion(refusal), Err(LlmError::Malformed(_))));
        assert!(matches!(completion("<html>"), Err(LlmError::Malformed(_))));
    }
}
