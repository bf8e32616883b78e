//! The mock provider: no model, deterministic answers, a configurable latency, and a marker on
//! everything it writes.
//!
//! Token counts follow one documented formula so load tests see plausible usage:
//! - input tokens = ceil(prompt text bytes / 4), plus, for an image, 85 + ceil(image bytes / 2048)
//!   (85 is what OpenAI charges for a low-detail image; the second term grows with the photo);
//! - output tokens = ceil(answer text bytes / 4).

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use rand::Rng;
use sha2::{Digest, Sha256};

use crate::types::{ClassifyInput, ClassifyOutput, Locale, TaxonomyPath};

/// The model name the mock reports.
pub const MODEL: &str = "mock";

/// Marker every mock answer text starts with.
pub fn marker(locale: Locale) -> &'static str {
    match locale {
        Locale::Ko => "[모의 응답 · mock] ",
        Locale::En => "[mock answer] ",
    }
}

#[derive(Clone, Debug)]
pub(crate) struct Mock {
    latency: Duration,
    jitter: f64,
    /// The last taxonomy seen with its names normalized. Callers send the same taxonomy on
    /// every call, and normalizing its Hangul names each time was the larger part of a mock
    /// classification's CPU (a scan's `capacity` profile); one entry keeps it bounded.
    normalized: Arc<Mutex<Option<NormalizedTaxonomy>>>,
}

/// A taxonomy and its paths' names normalized: minor, middle, English, major.
#[derive(Debug)]
struct NormalizedTaxonomy {
    taxonomy: Vec<TaxonomyPath>,
    names: Arc<[[String; 4]]>,
}

impl Mock {
    pub(crate) fn new(latency: Duration, jitter: f64) -> Self {
        Self {
            latency,
            jitter,
            normalized: Arc::default(),
        }
    }

    /// The normalized names of `taxonomy`'s paths, from the memo when it holds this taxonomy.
    fn normalized(&self, taxonomy: &[TaxonomyPath]) -> Arc<[[String; 4]]> {
        let mut memo = self
            .normalized
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(m) = memo.as_ref().filter(|m| m.taxonomy == taxonomy) {
            return m.names.clone();
        }
        let names: Arc<[[String; 4]]> = taxonomy
            .iter()
            .map(|p| {
                [
                    normalize(&p.minor),
                    normalize(&p.middle),
                    normalize(&p.name_en),
                    normalize(&p.major),
                ]
            })
            .collect();
        *memo = Some(NormalizedTaxonomy {
            taxonomy: taxonomy.to_vec(),
            names: names.clone(),
        });
        names
    }

    /// A latency drawn uniformly from mean × (1 ± jitter).
    pub(crate) fn draw_latency(&self) -> Duration {
        if self.jitter <= 0.0 {
            return self.latency;
        }
        let factor = rand::rng().random_range(1.0 - self.jitter..=1.0 + self.jitter);
        self.latency.mul_f64(factor.max(0.0))
    }

    /// Picks a path from the hint, or else from the image hash.
    pub(crate) fn classify(&self, input: &ClassifyInput) -> Option<ClassifyOutput> {
        let names = self.normalized(&input.taxonomy);
        let (path, confidence) = match best_hint_match(&input.hint, &input.taxonomy, &names) {
            Some(path) => (path, 0.9),
            None => (hash_pick(&input.image, &input.taxonomy)?, 0.5),
        };
        Some(ClassifyOutput {
            major: path.major.clone(),
            middle: path.middle.clone(),
            minor: path.minor.clone(),
            item_name: path.minor.clone(),
            confidence,
            situation_tags: hint_tags(&input.hint, &input.situation_tags),
            provider: crate::Provider::Mock.as_str().to_owned(),
            model: MODEL.to_owned(),
        })
    }
}

/// The mock's answer text: the marker, one line naming the subject, then the numbered steps.
pub(crate) fn answer_text(locale: Locale, subject: &str, steps: &[String]) -> String {
    let mut text = String::from(marker(locale));
    match locale {
        Locale::Ko => text.push_str(&format!("{subject} 배출 방법을 안내해 드릴게요.\n")),
        Locale::En => text.push_str(&format!("Here is how to dispose of {subject}.\n")),
    }
    if steps.is_empty() {
        text.push_str(match locale {
            Locale::Ko => "이 품목에 대한 세부 배출 단계가 없어요. 지자체 안내를 확인해 주세요.\n",
            Locale::En => {
                "There are no detailed steps for this item; check your local council's guide.\n"
            }
        });
    }
    for (i, step) in steps.iter().enumerate() {
        text.push_str(&format!("{}. {}\n", i + 1, step.trim()));
    }
    text
}

/// Splits text into word-ish chunks (each keeps its trailing whitespace), so that the chunks
/// concatenate back to exactly `text`.
pub(crate) fn chunks(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for c in text.chars() {
        if !c.is_whitespace() && current.ends_with(char::is_whitespace) {
            out.push(std::mem::take(&mut current));
        }
        current.push(c);
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// See the module documentation for the formula.
pub(crate) fn input_tokens(text_bytes: usize, image_bytes: Option<usize>) -> u32 {
    let text = text_bytes.div_ceil(4);
    let image = image_bytes.map_or(0, |b| 85 + b.div_ceil(2048));
    u32::try_from(text + image).unwrap_or(u32::MAX)
}

pub(crate) fn output_tokens(text_bytes: usize) -> u32 {
    u32::try_from(text_bytes.div_ceil(4)).unwrap_or(u32::MAX)
}

fn hash_pick<'a>(image: &[u8], taxonomy: &'a [TaxonomyPath]) -> Option<&'a TaxonomyPath> {
    if taxonomy.is_empty() {
        return None;
    }
    let digest = Sha256::digest(image);
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    let index = u64::from_be_bytes(first) % taxonomy.len() as u64;
    taxonomy.get(usize::try_from(index).ok()?)
}

/// Lower-case letters and digits only; Korean labels write PET both as "PET" and "페트", so the
/// Hangul spelling is folded into the Latin one.
fn normalize(s: &str) -> String {
    let folded: String = s
        .chars()
        .filter(|c| c.is_alphanumeric())
        .flat_map(char::to_lowercase)
        .collect();
    folded.replace("페트", "pet")
}

struct Hint {
    joined: String,
    words: Vec<String>,
}

impl Hint {
    fn new(hint: &str) -> Self {
        Self {
            joined: normalize(hint),
            words: hint
                .split(|c: char| !c.is_alphanumeric())
                .map(normalize)
                .filter(|w| w.chars().count() >= 2)
                .collect(),
        }
    }
}

/// How well `name` matches the hint, from 0 (not at all) to 1 (the same words). The whole
/// hint is tried first; failing that, each hint word, weighted by its share of the hint, so that
/// "페트병 내용물 있음" still finds the bottle.
fn field_score(hint: &Hint, n: &str) -> f64 {
    if n.is_empty() || hint.joined.is_empty() {
        return 0.0;
    }
    let whole = text_score(&hint.joined, n);
    if whole > 0.0 {
        return whole;
    }
    let total: usize = hint.words.iter().map(|w| w.chars().count()).sum();
    if total == 0 {
        return 0.0;
    }
    hint.words
        .iter()
        .map(|w| text_score(w, n) * w.chars().count() as f64 / total as f64)
        .sum()
}

/// 1 for equal texts; otherwise how much of the longer text the shorter one covers.
fn text_score(hint: &str, name: &str) -> f64 {
    let nl = name.chars().count() as f64;
    let hl = hint.chars().count() as f64;
    if hint == name {
        1.0
    } else if name.contains(hint) {
        // "페트병" in "음료PET병": the more of the name the hint covers, the better.
        0.5 + 0.4 * hl / nl
    } else if hint.contains(name) {
        // "투명유리병하나" contains "투명유리병".
        0.4 + 0.4 * nl / hl
    } else {
        0.0
    }
}

/// The path whose item, middle, English or major name matches the hint best; ties go to the
/// earlier path. Item names weigh most; the item score also breaks ties inside a category.
/// `names` are the paths' names normalized ([`Mock::normalized`]), in the same order.
fn best_hint_match<'a>(
    hint: &str,
    taxonomy: &'a [TaxonomyPath],
    names: &[[String; 4]],
) -> Option<&'a TaxonomyPath> {
    let hint = Hint::new(hint);
    if hint.joined.is_empty() {
        return None;
    }
    let mut best: Option<(f64, &TaxonomyPath)> = None;
    for (path, [minor, middle, name_en, major]) in taxonomy.iter().zip(names) {
        let minor = field_score(&hint, minor);
        let score = (3.0 * minor)
            .max(2.0 * field_score(&hint, middle))
            .max(2.0 * field_score(&hint, name_en))
            .max(1.5 * field_score(&hint, major))
            + 0.1 * minor;
        if best.is_none_or(|(s, _)| score > s) {
            best = Some((score, path));
        }
    }
    // Below this, only a stray shared syllable matched: fall back to the image hash.
    best.filter(|(s, _)| *s >= 0.25).map(|(_, p)| p)
}

/// Tags of the vocabulary whose words all appear in the hint ("내용물 있음" → "내용물_있음").
fn hint_tags(hint: &str, vocabulary: &[String]) -> Vec<String> {
    let h = normalize(hint);
    if h.is_empty() {
        return Vec::new();
    }
    vocabulary
        .iter()
        .filter(|tag| {
            let t = normalize(tag);
            !t.is_empty() && h.contains(&t)
        })
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests;
