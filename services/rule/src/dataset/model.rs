//! The dataset's data model: the JSON schema of `data/rules.json` as it is deserialized, the
//! [`Dataset`] holding it once validated, and the [`Locale`] its texts are read in.

use std::collections::BTreeMap;

use ecoscan_proto::v1::Category;
use serde::Deserialize;

use crate::error::Error;

/// Language of the returned rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Locale {
    Ko,
    En,
}

impl Locale {
    /// `""` and `"ko"` are Korean, `"en"` is English; anything else is refused.
    pub fn parse(s: &str) -> Result<Self, Error> {
        match s {
            "" | "ko" => Ok(Self::Ko),
            "en" => Ok(Self::En),
            other => Err(Error::UnsupportedLocale(other.to_owned())),
        }
    }

    pub fn code(self) -> &'static str {
        match self {
            Self::Ko => "ko",
            Self::En => "en",
        }
    }
}

/// One sentence or name in both locales.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Text {
    ko: String,
    en: String,
}

impl Text {
    pub(super) fn get(&self, locale: Locale) -> &str {
        match locale {
            Locale::Ko => &self.ko,
            Locale::En => &self.en,
        }
    }

    pub(super) fn is_complete(&self) -> bool {
        !self.ko.trim().is_empty() && !self.en.trim().is_empty()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDataset {
    pub(super) dataset: String,
    pub(super) version: String,
    pub(super) jurisdiction: String,
    pub(super) source: Text,
    pub(super) situation_tags: Vec<String>,
    pub(super) general_advice: BTreeMap<String, Text>,
    pub(super) majors: Vec<Major>,
    pub(super) categories: Vec<CategoryRules>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Major {
    pub(super) name: String,
    pub(super) name_en: String,
}

/// The rules of one collection stream: a major category without a middle level, or one middle
/// category under a major.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CategoryRules {
    pub(super) major: String,
    /// Empty for majors without a middle level.
    #[serde(default)]
    pub(super) middle: String,
    pub(super) name_en: String,
    pub(super) recyclable: bool,
    pub(super) stream: Text,
    pub(super) targets: Vec<Text>,
    pub(super) common_steps: Vec<Text>,
    pub(super) items: Vec<Item>,
    #[serde(default)]
    pub(super) exclusions: Vec<Exclusion>,
    /// Situation-tag advice that overrides the general advice in this category.
    #[serde(default)]
    pub(super) advice: BTreeMap<String, Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Item {
    /// The taxonomy's name, what a classifier answers with.
    pub(super) name: String,
    pub(super) name_en: String,
    /// Other spellings the taxonomy uses for the same item.
    #[serde(default)]
    pub(super) aliases: Vec<String>,
    #[serde(default)]
    pub(super) steps: Vec<Text>,
    /// Situation-tag advice that overrides the category's and the general advice for this item.
    #[serde(default)]
    pub(super) advice: BTreeMap<String, Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct Exclusion {
    pub(super) item: Text,
    pub(super) instead: Text,
    /// The category the excluded item belongs to, when it is one of ours; checked at load.
    #[serde(default)]
    pub(super) goes_to: Option<PathRef>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PathRef {
    pub(super) major: String,
    #[serde(default)]
    pub(super) middle: String,
}

/// The validated disposal-rule dataset.
#[derive(Debug)]
pub struct Dataset {
    pub(super) raw: RawDataset,
}

impl Dataset {
    /// Name and version, e.g. `ecoscan-disposal-rules-kr@1`.
    pub fn id(&self) -> String {
        format!("{}@{}", self.raw.dataset, self.raw.version)
    }

    /// Where the facts come from, in `locale`.
    pub fn source(&self, locale: Locale) -> &str {
        self.raw.source.get(locale)
    }

    /// The situation-tag vocabulary.
    pub fn situation_tags(&self) -> &[String] {
        &self.raw.situation_tags
    }

    /// Every category with its items, in dataset order: the taxonomy the dataset covers.
    pub fn categories(&self) -> Vec<Category> {
        self.raw
            .categories
            .iter()
            .map(|c| Category {
                major_category: c.major.clone(),
                middle_category: c.middle.clone(),
                name_en: c.name_en.clone(),
                recyclable: c.recyclable,
                items: c.items.iter().map(|i| i.name.clone()).collect(),
                major_name_en: self
                    .raw
                    .majors
                    .iter()
                    .find(|m| m.name == c.major)
                    .map(|m| m.name_en.clone())
                    .unwrap_or_default(),
                items_en: c.items.iter().map(|i| i.name_en.clone()).collect(),
            })
            .collect()
    }
}
