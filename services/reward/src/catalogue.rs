//! The character catalogue: one character per recyclable middle category, and one default
//! character for a recyclable item whose middle category has none, embedded in the binary and
//! validated at start.

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
    /// The default character: it stands for no middle category (that field is empty).
    #[serde(default)]
    default: bool,
}

/// Characters indexed by code and by the middle category they stand for.
#[derive(Debug, Clone)]
pub struct Catalogue {
    by_code: HashMap<String, Character>,
    code_by_category: HashMap<String, String>,
    /// Every code, the default first, then in the file's order (the taxonomy's).
    order: Vec<String>,
    default_code: String,
}

impl Catalogue {
    /// The catalogue shipped in `data/characters.json`.
    pub fn embedded() -> anyhow::Result<Self> {
        Self::from_json(CHARACTERS_JSON).context("invalid embedded character catalogue")
    }

    /// Parses and validates a catalogue: codes and middle categories must be unique, exactly one
    /// character is the default (with no middle category), and no other field may be empty.
    pub fn from_json(json: &str) -> anyhow::Result<Self> {
        let entries: Vec<Entry> =
            serde_json::from_str(json).context("failed to parse catalogue")?;
        if entries.is_empty() {
            bail!("catalogue has no characters");
        }
        let mut by_code = HashMap::new();
        let mut code_by_category = HashMap::new();
        let mut order = Vec::new();
        let mut default_code: Option<String> = None;
        for e in entries {
            let fields = [
                &e.code,
                &e.name_ko,
                &e.name_en,
                &e.description_ko,
                &e.description_en,
            ];
            if fields.iter().any(|f| f.trim().is_empty()) {
                bail!("character {:?} has an empty field", e.code);
            }
            if e.default {
                if !e.middle_category.trim().is_empty() {
                    bail!(
                        "the default character {:?} stands for no middle category; leave it empty",
                        e.code
                    );
                }
                if let Some(first) = default_code.replace(e.code.clone()) {
                    bail!("two default characters: {first:?} and {:?}", e.code);
                }
                order.insert(0, e.code.clone());
            } else if e.middle_category.trim().is_empty() {
                bail!("character {:?} has an empty field", e.code);
            } else if code_by_category
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
            if !e.default {
                order.push(e.code);
            }
        }
        let Some(default_code) = default_code else {
            bail!("the catalogue has no default character (`\"default\": true`)");
        };
        Ok(Self {
            by_code,
            code_by_category,
            order,
            default_code,
        })
    }

    /// The default character: what a recyclable item whose middle category has no character
    /// of its own earns.
    pub fn default_character(&self) -> &Character {
        &self.by_code[&self.default_code]
    }

    /// Whether `code` is the default character's.
    pub fn is_default(&self, code: &str) -> bool {
        code == self.default_code
    }

    /// Every character, the default first, then in the taxonomy's order.
    pub fn all(&self) -> impl Iterator<Item = &Character> {
        self.order.iter().map(|code| &self.by_code[code])
    }

    /// The character a person names: its code, its Korean name, or its English name in any
    /// case (`char-petty`, `페티`, `petty`), surrounding spaces ignored.
    pub fn find(&self, name: &str) -> Option<&Character> {
        let name = name.trim();
        if let Some(c) = self.by_code.get(name) {
            return Some(c);
        }
        self.all()
            .find(|c| c.name_ko == name || c.name_en.eq_ignore_ascii_case(name))
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
        // One per category, and the default.
        assert_eq!(c.len(), categories.len() + 1);
        for cat in categories {
            assert!(c.for_category(cat).is_some(), "no character for {cat}");
        }
        assert_eq!(c.for_category("무색페트병").unwrap().code, "char-petty");
        assert_eq!(c.by_code("char-petty").unwrap().name_ko, "페티");
        let default = c.default_character();
        assert_eq!(default.code, "char-eco");
        assert!(default.middle_category.is_empty());
        assert!(c.is_default("char-eco") && !c.is_default("char-petty"));
        let listed: Vec<&str> = c.all().map(|ch| ch.middle_category.as_str()).collect();
        assert_eq!(listed[0], "", "the default first");
        assert_eq!(listed[1..], categories, "then the taxonomy's order");
    }

    #[test]
    fn a_character_is_found_by_its_code_or_either_name() {
        let c = Catalogue::embedded().unwrap();
        for name in ["char-petty", "페티", "Petty", "PETTY", " petty ", "페티 "] {
            assert_eq!(
                c.find(name).map(|ch| ch.code.as_str()),
                Some("char-petty"),
                "{name}"
            );
        }
        // A prefix is no name, and a code is matched exactly.
        for name in ["", "pet", "char-PETTY", "페트"] {
            assert_eq!(c.find(name).map(|ch| ch.code.as_str()), None, "{name:?}");
        }
    }

    fn entry(code: &str, category: &str) -> String {
        format!(
            r#"{{"code":"{code}","name_ko":"k","name_en":"e","middle_category":"{category}","description_ko":"d","description_en":"d"}}"#
        )
    }

    fn default_entry(code: &str) -> String {
        format!(
            r#"{{"code":"{code}","name_ko":"k","name_en":"e","middle_category":"","description_ko":"d","description_en":"d","default":true}}"#
        )
    }

    #[test]
    fn exactly_one_default_without_a_category_is_required() {
        let none = format!("[{}]", entry("a", "x"));
        let err = Catalogue::from_json(&none).unwrap_err();
        assert!(err.to_string().contains("no default character"), "{err}");
        let two = format!(
            "[{},{},{}]",
            default_entry("d"),
            default_entry("e"),
            entry("a", "x")
        );
        let err = Catalogue::from_json(&two).unwrap_err();
        assert!(err.to_string().contains("two default characters"), "{err}");
        let with_category = entry("d", "y").replace("\"d\"}", "\"d\",\"default\":true}");
        let err = Catalogue::from_json(&format!("[{with_category}]")).unwrap_err();
        assert!(
            err.to_string().contains("stands for no middle category"),
            "{err}"
        );
        let empty_category = format!("[{},{}]", default_entry("d"), entry("a", ""));
        let err = Catalogue::from_json(&empty_category).unwrap_err();
        assert!(err.to_string().contains("empty field"), "{err}");
    }

    #[test]
    fn duplicate_codes_are_rejected() {
        let json = format!(
            "[{},{},{}]",
            default_entry("d"),
            entry("a", "x"),
            entry("a", "y")
        );
        let err = Catalogue::from_json(&json).unwrap_err();
        assert!(err.to_string().contains("used twice"), "{err}");
    }

    #[test]
    fn duplicate_middle_categories_are_rejected() {
        let json = format!(
            "[{},{},{}]",
            default_entry("d"),
            entry("a", "x"),
            entry("b", "x")
        );
        let err = Catalogue::from_json(&json).unwrap_err();
        assert!(err.to_string().contains("more than one character"), "{err}");
    }
}
