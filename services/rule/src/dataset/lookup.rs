//! Lookup: one taxonomy path (major → middle → item) resolved to a category and an item, and
//! the resolution read out as the rules in one locale, with the advice its situation tags call
//! for.

use std::collections::HashSet;

use ecoscan_proto::v1::{DisposalRules, Exclusion as ProtoExclusion};

use super::{
    model::{CategoryRules, Dataset, Item, Locale, Text},
    names::{find_item, list, path_name, same},
};
use crate::error::Error;

/// A request resolved to one category and, when it matched, one item of it.
#[derive(Debug)]
pub struct Resolved<'a> {
    dataset: &'a Dataset,
    category: &'a CategoryRules,
    item: Option<&'a Item>,
    /// How the category was resolved, for progress messages: what was inferred or ignored.
    pub notes: Vec<String>,
    /// Why no item matched, when none did.
    pub item_note: Option<String>,
}

/// The rules for one resolved path in one locale, plus what happened to the situation tags.
#[derive(Debug)]
pub struct Rules {
    pub rules: DisposalRules,
    /// Request tags that are not in the situation-tag vocabulary (ignored).
    pub unknown_tags: Vec<String>,
    /// Known request tags for which no advice exists.
    pub tags_without_advice: Vec<String>,
}

impl Dataset {
    /// Resolves a taxonomy path. `major` must match; `middle` must match when the major has a
    /// middle level (when it is empty, it is inferred from an item only one middle has); an
    /// empty or unknown `minor` resolves to the category alone. Names match ignoring whitespace
    /// and ASCII case, by Korean name, alias or English name.
    pub fn lookup(&self, major: &str, middle: &str, minor: &str) -> Result<Resolved<'_>, Error> {
        let (major, middle, minor) = (major.trim(), middle.trim(), minor.trim());
        let mut notes = Vec::new();
        if major.is_empty() {
            return Err(Error::EmptyMajor {
                valid: self.major_names(),
            });
        }
        let Some(major_entry) = self
            .raw
            .majors
            .iter()
            .find(|m| same(&m.name, major) || same(&m.name_en, major))
        else {
            return Err(Error::UnknownMajor {
                major: major.to_owned(),
                valid: self.major_names(),
            });
        };
        let in_major: Vec<&CategoryRules> = self
            .raw
            .categories
            .iter()
            .filter(|c| c.major == major_entry.name)
            .collect();
        let has_middles = in_major.iter().any(|c| !c.middle.is_empty());

        let (category, minor) = if !has_middles {
            // Validation guarantees exactly one category for a major without middles.
            let category = in_major[0];
            let mut minor = minor;
            if !middle.is_empty() {
                if minor.is_empty() && find_item(category, middle).is_some() {
                    notes.push(format!(
                        "{} has no middle level; used middle_category {middle:?} as the item",
                        category.major
                    ));
                    minor = middle;
                } else {
                    notes.push(format!(
                        "{} has no middle level; ignored middle_category {middle:?}",
                        category.major
                    ));
                }
            }
            (category, minor)
        } else if middle.is_empty() {
            let candidates: Vec<&CategoryRules> = if minor.is_empty() {
                Vec::new()
            } else {
                in_major
                    .iter()
                    .copied()
                    .filter(|c| find_item(c, minor).is_some())
                    .collect()
            };
            match candidates.as_slice() {
                [only] => {
                    notes.push(format!(
                        "middle_category was empty; inferred {} from the item {minor:?}",
                        only.middle
                    ));
                    (*only, minor)
                }
                _ => {
                    return Err(Error::MissingMiddle {
                        major: major_entry.name.clone(),
                        valid: list(in_major.iter().map(|c| c.middle.as_str())),
                    });
                }
            }
        } else {
            let Some(category) = in_major
                .iter()
                .copied()
                .find(|c| same(&c.middle, middle) || same(&c.name_en, middle))
            else {
                return Err(Error::UnknownMiddle {
                    major: major_entry.name.clone(),
                    middle: middle.to_owned(),
                    valid: list(in_major.iter().map(|c| c.middle.as_str())),
                });
            };
            (category, minor)
        };

        let item = if minor.is_empty() {
            None
        } else {
            find_item(category, minor)
        };
        let item_note = match item {
            Some(_) => None,
            None if minor.is_empty() => {
                Some("no item given; returning the category rules without item steps".to_owned())
            }
            None => Some(format!(
                "item {minor:?} is not in {}; returning the category rules without item steps",
                path_name(category)
            )),
        };
        Ok(Resolved {
            dataset: self,
            category,
            item,
            notes,
            item_note,
        })
    }

    fn major_names(&self) -> String {
        list(self.raw.majors.iter().map(|m| m.name.as_str()))
    }
}

impl Resolved<'_> {
    pub fn major(&self) -> &str {
        &self.category.major
    }

    pub fn middle(&self) -> &str {
        &self.category.middle
    }

    /// The matched item's taxonomy name, if an item matched.
    pub fn item(&self) -> Option<&str> {
        self.item.map(|i| i.name.as_str())
    }

    /// `major / middle` or `major`.
    pub fn category_path(&self) -> String {
        path_name(self.category)
    }

    pub fn item_step_count(&self) -> usize {
        self.item.map_or(0, |i| i.steps.len())
    }

    /// The rules in `locale`, with advice for each known tag of `tags` (item advice first, then
    /// the category's, then the general advice). Unknown tags are reported, not refused: the
    /// classifier may be newer than the dataset.
    pub fn rules(&self, locale: Locale, tags: &[String]) -> Rules {
        let c = self.category;
        let localize = |texts: &[Text]| -> Vec<String> {
            texts.iter().map(|t| t.get(locale).to_owned()).collect()
        };
        let vocabulary: HashSet<&str> = self
            .dataset
            .raw
            .situation_tags
            .iter()
            .map(String::as_str)
            .collect();

        let mut seen = HashSet::new();
        let mut advice = Vec::new();
        let mut unknown_tags = Vec::new();
        let mut tags_without_advice = Vec::new();
        for tag in tags.iter().map(|t| t.trim()).filter(|t| !t.is_empty()) {
            if !seen.insert(tag) {
                continue;
            }
            if !vocabulary.contains(tag) {
                unknown_tags.push(tag.to_owned());
                continue;
            }
            let text = self
                .item
                .and_then(|i| i.advice.get(tag))
                .or_else(|| c.advice.get(tag))
                .or_else(|| self.dataset.raw.general_advice.get(tag));
            match text {
                Some(t) => {
                    let t = t.get(locale).to_owned();
                    if !advice.contains(&t) {
                        advice.push(t);
                    }
                }
                None => tags_without_advice.push(tag.to_owned()),
            }
        }

        Rules {
            rules: DisposalRules {
                locale: locale.code().to_owned(),
                major_category: c.major.clone(),
                middle_category: c.middle.clone(),
                minor_category: self.item.map(|i| i.name.clone()).unwrap_or_default(),
                recyclable: c.recyclable,
                stream_name: c.stream.get(locale).to_owned(),
                targets: localize(&c.targets),
                common_steps: localize(&c.common_steps),
                item_steps: self.item.map(|i| localize(&i.steps)).unwrap_or_default(),
                exclusions: c
                    .exclusions
                    .iter()
                    .map(|e| ProtoExclusion {
                        item: e.item.get(locale).to_owned(),
                        instead: e.instead.get(locale).to_owned(),
                    })
                    .collect(),
                situation_advice: advice,
                source: self.dataset.source(locale).to_owned(),
            },
            unknown_tags,
            tags_without_advice,
        }
    }
}
