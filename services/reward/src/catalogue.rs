//! The character catalogue: one character per recyclable middle category, embedded in the binary
//! and validated at start.

use std::collections::HashMap;

use anyhow::{Context, bail};
use ecoscan_proto::v1::Character;
use serde::Deserialize;

const CHARACTERS_JSON: &str = include_str!("../data/characters.json");

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    code: String,
    name_ko: String,
    name_en: String,
    middle_category: String,
    description_ko: String,
    description_en: String,
}

/// Characters indexed by code and by the middle category they stand for.
#[derive(Debug, Clone)]
pub struct Catalogue {
    by_code: HashMap<String, Character>,
    code_by_category: HashMap<String, String>,
}

impl Catalogue {
    /// The catalogue shipped in `data/characters.json`.
    pub fn embedded() -> anyhow::Result<Self> {
        Self::from_json(CHARACTERS_JSON).context("invalid embedded character catalogue")
    }

    /// Parses and validates a catalogue: codes and middle categories must be unique and no field
    /// may be empty.
    pub fn from_json(json: &str) -> anyhow::Result<Self> {
        let entries: Vec<Entry> =
            serde_json::from_str(json).context("failed to parse catalogue")?;
        if entries.is_empty() {
            bail!("catalogue has no characters");
        }
        let mut by_code = HashMap::new();
        let mut code_by_category = HashMap::new();
        for e in entries {
            let fields = [
                &e.code,
                &e.name_ko,
                &e.name_en,
                &e.middle_category,
                &e.description_ko,
                &e.description_en,
            ];
            if fields.iter().any(|f| f.trim().is_empty()) {
                bail!("character {:?} has an empty field", e.code);
            }
            if code_by_category
                .insert(e.middle_category.clone(), e.code.clone())
                .is_some()
            {
                bail!(
                    "middle category {:?} has more than one character",
                    e.middle_category
                );
            }
            let character = Character {
                code: e.code.clone(),
                name_ko: e.name_ko,
                name_en: e.name_en,
                middle_category: e.middle_category,
                description_ko: e.description_ko,
                description_en: e.description_en,
            };
            if by_code.insert(e.code.clone(), character).is_some() {
                bail!("character code {:?} is used twice", e.code);
            }
        }
        Ok(Self {
            by_code,
            code_by_category,
        })
    }

    /// The character standing for `middle_category`, if there is one.
    pub fn for_category(&self, middle_category: &str) -> Option<&Character> {
        self.code_by_category
            .get(middle_category)
            .and_then(|code| self.by_code.get(code))
    }

    /// The character with `code`, if the catalogue has it.
    pub fn by_code(&self, code: &str) -> Option<&Character> {
        self.by_code.get(code)
    }

    /// Number of characters.
    pub fn len(&self) -> usize {
        self.by_code.len()
    }

    /// Whether the catalogue is empty (never true for a validated catalogue).
    pub fn is_empty(&self) -> bool {
        self.by_code.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_catalogue_has_one_character_per_recyclable_middle_category() {
        let c = Catalogue::embedded().unwrap();
        let categories = [
            "종이",
            "종이팩",
            "무색페트병",
            "플라스틱류",
            "비닐류",
            "발포합성수지",
            "유리병",
            "금속류",
            "의류및원단",
            "전지",
            "조명제품",
            "전기전자제품",
        ];
        assert_eq!(c.len(), categories.len());
        for cat in categories {
            assert!(c.for_category(cat).is_some(), "no character for {cat}");
        }
        assert_eq!(c.for_category("무색페트병").unwrap().code, "char-petty");
        assert_eq!(c.by_code("char-petty").unwrap().name_ko, "페티");
    }

    fn entry(code: &str, category: &str) -> String {
        format!(
            r#"{{"code":"{code}","name_ko":"k","name_en":"e","middle_category":"{category}","description_ko":"d","description_en":"d"}}"#
        )
    }

    #[test]
    fn duplicate_codes_are_rejected() {
        let json = format!("[{},{}]", entry("a", "x"), entry("a", "y"));
        let err = Catalogue::from_json(&json).unwrap_err();
        assert!(err.to_string().contains("used twice"), "{err}");
    }

    #[test]
    fn duplicate_middle_categories_are_rejected() {
        let json = format!("[{},{}]", entry("a", "x"), entry("b", "x"));
        let err = Catalogue::from_json(&json).unwrap_err();
        assert!(err.to_string().contains("more than one character"), "{err}");
    }
}
