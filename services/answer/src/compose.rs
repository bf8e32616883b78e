//! What the answer is written from: the prompts for a real model, the ordered steps, and the
//! short message to the person.

use ecoscan_llm::Locale;
use ecoscan_proto::v1::{Classification, DisposalRules};

/// What is being disposed of, as the person would call it.
pub(crate) fn subject(c: &Classification) -> &str {
    [
        &c.item_name,
        &c.minor_category,
        &c.middle_category,
        &c.major_category,
    ]
    .into_iter()
    .map(|s| s.trim())
    .find(|s| !s.is_empty())
    .unwrap_or_default()
}

/// The steps in order: the stream's common steps, the item's own, then the advice for the
/// situation the photo showed; blanks and repeats removed.
pub(crate) fn steps(rules: &DisposalRules) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for s in rules
        .common_steps
        .iter()
        .chain(&rules.item_steps)
        .chain(&rules.situation_advice)
    {
        let s = s.trim();
        if !s.is_empty() && !out.iter().any(|x| x == s) {
            out.push(s.to_owned());
        }
    }
    out
}

/// Numbered lines ("1. ...", "2) ...") of a model's text, for rules that carry no steps.
pub(crate) fn steps_from_text(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim();
            let digits = line.find(|c: char| !c.is_ascii_digit())?;
            if digits == 0 {
                return None;
            }
            let rest = line[digits..].strip_prefix(['.', ')'])?.trim();
            (!rest.is_empty()).then(|| rest.to_owned())
        })
        .collect()
}

/// One sentence telling the person where the item goes.
pub(crate) fn message(locale: Locale, subject: &str, rules: &DisposalRules) -> String {
    let stream = [
        &rules.stream_name,
        &rules.middle_category,
        &rules.major_category,
    ]
    .into_iter()
    .map(|s| s.trim())
    .find(|s| !s.is_empty())
    .unwrap_or_default();
    match (locale, rules.recyclable) {
        (Locale::Ko, true) => format!("{subject}은(는) {stream}(으)로 분리배출해 주세요."),
        (Locale::Ko, false) => {
            format!("{subject}은(는) 재활용되지 않아요. {stream}(으)로 배출해 주세요.")
        }
        (Locale::En, true) => format!("Put {subject} out with {stream}."),
        (Locale::En, false) => {
            format!("{subject} is not recyclable; dispose of it as {stream}.")
        }
    }
}

pub(crate) fn system_prompt(locale: Locale) -> &'static str {
    match locale {
        Locale::Ko => {
            "당신은 한국의 분리배출 안내 도우미입니다. 주어진 규칙만 근거로, 친절하고 짧게 \
             번호를 매긴 단계로 배출 방법을 한국어로 설명하세요. 규칙에 없는 내용은 지어내지 마세요."
        }
        Locale::En => {
            "You help people in Korea sort their household waste. Using only the rules given, \
             explain in English, in short numbered steps, how to dispose of the item. Do not \
             invent rules that are not given."
        }
    }
}

pub(crate) fn user_prompt(c: &Classification, rules: &DisposalRules, subject: &str) -> String {
    let list = |items: &[String]| {
        if items.is_empty() {
            "(none)".to_owned()
        } else {
            items
                .iter()
                .map(|s| format!("\n  - {s}"))
                .collect::<String>()
        }
    };
    let exclusions: Vec<String> = rules
        .exclusions
        .iter()
        .map(|e| format!("{} → {}", e.item, e.instead))
        .collect();
    format!(
        "Item: {subject}\nCategory: {} / {} / {}\nSituation tags: {}\nCollection stream: {} \
         (recyclable: {})\nBelongs in this stream: {}\nCommon steps: {}\nItem steps: {}\n\
         Situation advice: {}\nNot in this stream: {}\nSource: {}",
        c.major_category,
        c.middle_category,
        c.minor_category,
        if c.situation_tags.is_empty() {
            "(none)".to_owned()
        } else {
            c.situation_tags.join(", ")
        },
        rules.stream_name,
        rules.recyclable,
        list(&rules.targets),
        list(&rules.common_steps),
        list(&rules.item_steps),
        list(&rules.situation_advice),
        list(&exclusions),
        rules.source,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_keep_rule_order_and_drop_blanks_and_repeats() {
        let rules = DisposalRules {
            common_steps: vec!["Rinse".into(), " ".into()],
            item_steps: vec!["Remove the label".into(), "Rinse".into()],
            situation_advice: vec!["Empty it first".into()],
            ..DisposalRules::default()
        };
        assert_eq!(
            steps(&rules),
            ["Rinse", "Remove the label", "Empty it first"]
        );
    }

    #[test]
    fn numbered_lines_are_read_back_as_steps() {
        let text = "[mock answer] Intro\n1. Rinse\n2) Crush it\nno number\n10. Close the cap";
        assert_eq!(
            steps_from_text(text),
            ["Rinse", "Crush it", "Close the cap"]
        );
    }

    #[test]
    fn subject_falls_back_from_item_name_to_the_category() {
        let c = Classification {
            minor_category: "음료PET병".into(),
            major_category: "재활용폐기물".into(),
            ..Classification::default()
        };
        assert_eq!(subject(&c), "음료PET병");
    }
}
