//! The disposal-rule dataset: its JSON schema, validation at load time, and lookup of one
//! taxonomy path (major → middle → item) into localized rules.
//!
//! The embedded dataset (`data/rules.json`) is ecoscan's own Korean and English wording of the
//! Korean Ministry of Environment separate-collection guidelines, organised by the Eco² taxonomy.

use std::collections::{BTreeMap, HashSet};

use ecoscan_proto::v1::{Category, DisposalRules, Exclusion as ProtoExclusion};
use serde::Deserialize;

use crate::Error;

/// The dataset compiled into the binary.
const EMBEDDED: &str = include_str!("../data/rules.json");

/// How many valid names an error message lists before it says "and N more".
const LISTED_IN_ERRORS: usize = 12;

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
struct Text {
    ko: String,
    en: String,
}

impl Text {
    fn get(&self, locale: Locale) -> &str {
        match locale {
            Locale::Ko => &self.ko,
            Locale::En => &self.en,
        }
    }

    fn is_complete(&self) -> bool {
        !self.ko.trim().is_empty() && !self.en.trim().is_empty()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDataset {
    dataset: String,
    version: String,
    jurisdiction: String,
    source: Text,
    situation_tags: Vec<String>,
    general_advice: BTreeMap<String, Text>,
    majors: Vec<Major>,
    categories: Vec<CategoryRules>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Major {
    name: String,
    name_en: String,
}

/// The rules of one collection stream: a major category without a middle level, or one middle
/// category under a major.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CategoryRules {
    major: String,
    /// Empty for majors without a middle level.
    #[serde(default)]
    middle: String,
    name_en: String,
    recyclable: bool,
    stream: Text,
    targets: Vec<Text>,
    common_steps: Vec<Text>,
    items: Vec<Item>,
    #[serde(default)]
    exclusions: Vec<Exclusion>,
    /// Situation-tag advice that overrides the general advice in this category.
    #[serde(default)]
    advice: BTreeMap<String, Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Item {
    /// The taxonomy's name, what a classifier answers with.
    name: String,
    name_en: String,
    /// Other spellings the taxonomy uses for the same item.
    #[serde(default)]
    aliases: Vec<String>,
    #[serde(default)]
    steps: Vec<Text>,
    /// Situation-tag advice that overrides the category's and the general advice for this item.
    #[serde(default)]
    advice: BTreeMap<String, Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Exclusion {
    item: Text,
    instead: Text,
    /// The category the excluded item belongs to, when it is one of ours; checked at load.
    #[serde(default)]
    goes_to: Option<PathRef>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PathRef {
    major: String,
    #[serde(default)]
    middle: String,
}

/// The validated disposal-rule dataset.
#[derive(Debug)]
pub struct Dataset {
    raw: RawDataset,
}

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
    /// The dataset compiled into the binary, validated.
    pub fn embedded() -> Result<Self, Error> {
        Self::from_json(EMBEDDED)
    }

    /// Parses and validates a dataset in the `data/rules.json` schema.
    pub fn from_json(json: &str) -> Result<Self, Error> {
        let raw: RawDataset = serde_json::from_str(json).map_err(Error::ParseDataset)?;
        let problems = validate(&raw);
        if !problems.is_empty() {
            return Err(Error::InvalidDataset { problems });
        }
        Ok(Self { raw })
    }

    /// Reads, parses and validates a dataset file.
    pub async fn load(path: &std::path::Path) -> Result<Self, Error> {
        let json = tokio::fs::read_to_string(path)
            .await
            .map_err(|source| Error::ReadDataset {
                path: path.to_owned(),
                source,
            })?;
        Self::from_json(&json)
    }

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
            })
            .collect()
    }

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

/// Names compare ignoring whitespace and ASCII case ("음료 PET병" is "음료PET병").
fn normalize(s: &str) -> String {
    s.chars()
        .filter(|c| !c.is_whitespace())
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

fn same(a: &str, b: &str) -> bool {
    normalize(a) == normalize(b)
}

fn find_item<'a>(category: &'a CategoryRules, name: &str) -> Option<&'a Item> {
    let wanted = normalize(name);
    category
        .items
        .iter()
        .find(|i| item_keys(i).any(|k| normalize(k) == wanted))
}

/// Every name an item answers to.
fn item_keys(item: &Item) -> impl Iterator<Item = &str> {
    std::iter::once(item.name.as_str())
        .chain(std::iter::once(item.name_en.as_str()))
        .chain(item.aliases.iter().map(String::as_str))
}

fn path_name(c: &CategoryRules) -> String {
    if c.middle.is_empty() {
        c.major.clone()
    } else {
        format!("{} / {}", c.major, c.middle)
    }
}

/// `a, b, c` — at most [`LISTED_IN_ERRORS`] names, then how many more.
fn list<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let names: Vec<&str> = names.collect();
    let mut out = names
        .iter()
        .take(LISTED_IN_ERRORS)
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > LISTED_IN_ERRORS {
        out.push_str(&format!(" and {} more", names.len() - LISTED_IN_ERRORS));
    }
    out
}

/// Every problem in the dataset, so one run shows them all.
fn validate(raw: &RawDataset) -> Vec<String> {
    let mut problems = Vec::new();
    let mut check = |ok: bool, problem: String| {
        if !ok {
            problems.push(problem);
        }
    };

    check(!raw.dataset.trim().is_empty(), "`dataset` is empty".into());
    check(!raw.version.trim().is_empty(), "`version` is empty".into());
    check(
        !raw.jurisdiction.trim().is_empty(),
        "`jurisdiction` is empty".into(),
    );
    check(
        raw.source.is_complete(),
        "`source` needs both ko and en".into(),
    );

    let mut vocabulary = HashSet::new();
    check(
        !raw.situation_tags.is_empty(),
        "`situation_tags` is empty".into(),
    );
    for tag in &raw.situation_tags {
        check(
            !tag.trim().is_empty(),
            "`situation_tags` has an empty tag".into(),
        );
        check(
            vocabulary.insert(tag.as_str()),
            format!("situation tag {tag:?} is listed twice"),
        );
    }
    let check_advice =
        |check: &mut dyn FnMut(bool, String), at: &str, advice: &BTreeMap<String, Text>| {
            for (tag, text) in advice {
                check(
                    vocabulary.contains(tag.as_str()),
                    format!("{at}: advice for {tag:?}, which is not in `situation_tags`"),
                );
                check(
                    text.is_complete(),
                    format!("{at}: advice for {tag:?} needs both ko and en"),
                );
            }
        };
    check_advice(&mut check, "general_advice", &raw.general_advice);

    let mut majors = HashSet::new();
    for m in &raw.majors {
        check(
            !m.name.trim().is_empty(),
            "a major has an empty name".into(),
        );
        check(
            !m.name_en.trim().is_empty(),
            format!("major {:?} has no name_en", m.name),
        );
        check(
            majors.insert(normalize(&m.name)),
            format!("major {:?} is listed twice", m.name),
        );
    }

    let mut paths = HashSet::new();
    for c in &raw.categories {
        let at = path_name(c);
        check(
            majors.contains(&normalize(&c.major)),
            format!("{at}: major is not in `majors`"),
        );
        check(
            paths.insert((normalize(&c.major), normalize(&c.middle))),
            format!("{at}: duplicate category path"),
        );
        check(
            !c.name_en.trim().is_empty(),
            format!("{at}: name_en is empty"),
        );
        check(
            c.stream.is_complete(),
            format!("{at}: stream needs both ko and en"),
        );
        check(!c.targets.is_empty(), format!("{at}: no targets"));
        check(!c.common_steps.is_empty(), format!("{at}: no common_steps"));
        check(!c.items.is_empty(), format!("{at}: no items"));
        for (i, t) in c.targets.iter().enumerate() {
            check(
                t.is_complete(),
                format!("{at}: target {i} needs both ko and en"),
            );
        }
        for (i, s) in c.common_steps.iter().enumerate() {
            check(
                s.is_complete(),
                format!("{at}: common step {i} needs both ko and en"),
            );
        }
        let mut keys = HashSet::new();
        for item in &c.items {
            let item_at = format!("{at} / {}", item.name);
            check(
                !item.name.trim().is_empty(),
                format!("{at}: an item has an empty name"),
            );
            check(
                !item.name_en.trim().is_empty(),
                format!("{item_at}: name_en is empty"),
            );
            for key in item_keys(item) {
                check(
                    keys.insert(normalize(key)),
                    format!("{item_at}: name {key:?} is used twice in {at} (duplicate path)"),
                );
            }
            for (i, s) in item.steps.iter().enumerate() {
                check(
                    s.is_complete(),
                    format!("{item_at}: step {i} needs both ko and en"),
                );
            }
            check_advice(&mut check, &item_at, &item.advice);
        }
        for (i, e) in c.exclusions.iter().enumerate() {
            check(
                e.item.is_complete() && e.instead.is_complete(),
                format!("{at}: exclusion {i} needs item and instead in both ko and en"),
            );
        }
        check_advice(&mut check, &at, &c.advice);
    }

    // Checks that need every category in place.
    for m in &raw.majors {
        let in_major: Vec<&CategoryRules> = raw
            .categories
            .iter()
            .filter(|c| same(&c.major, &m.name))
            .collect();
        let flat = in_major.iter().filter(|c| c.middle.is_empty()).count();
        check(
            !in_major.is_empty(),
            format!("major {:?} has no category", m.name),
        );
        check(
            flat == 0 || in_major.len() == 1,
            format!(
                "major {:?} mixes a category without middle with middle categories",
                m.name
            ),
        );
    }
    for c in &raw.categories {
        for (i, e) in c.exclusions.iter().enumerate() {
            let Some(to) = &e.goes_to else { continue };
            let resolves = raw.categories.iter().any(|t| {
                same(&t.major, &to.major) && (to.middle.is_empty() || same(&t.middle, &to.middle))
            });
            check(
                resolves,
                format!(
                    "{}: exclusion {i} goes_to {:?} / {:?}, which is not a category",
                    path_name(c),
                    to.major,
                    to.middle
                ),
            );
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tags(t: &[&str]) -> Vec<String> {
        t.iter().map(|s| (*s).to_owned()).collect()
    }

    /// A small valid dataset to break one way at a time.
    fn minimal() -> serde_json::Value {
        serde_json::json!({
            "dataset": "t", "version": "1", "jurisdiction": "KR",
            "source": {"ko": "출처", "en": "source"},
            "situation_tags": ["내용물_있음", "깨짐"],
            "general_advice": {"내용물_있음": {"ko": "비우세요", "en": "empty it"}},
            "majors": [{"name": "재활용폐기물", "name_en": "Recyclables"}, {"name": "대형폐기물", "name_en": "Bulky"}],
            "categories": [
                {"major": "재활용폐기물", "middle": "종이", "name_en": "Paper", "recyclable": true,
                 "stream": {"ko": "종이", "en": "paper"},
                 "targets": [{"ko": "종이", "en": "paper"}],
                 "common_steps": [{"ko": "묶기", "en": "tie"}],
                 "items": [{"name": "신문지", "name_en": "Newspaper"}],
                 "exclusions": [{"item": {"ko": "영수증", "en": "receipt"}, "instead": {"ko": "일반", "en": "general"}, "goes_to": {"major": "대형폐기물"}}]},
                {"major": "대형폐기물", "name_en": "Bulky", "recyclable": false,
                 "stream": {"ko": "대형", "en": "bulky"},
                 "targets": [{"ko": "가구", "en": "furniture"}],
                 "common_steps": [{"ko": "스티커", "en": "sticker"}],
                 "items": [{"name": "가구", "name_en": "Furniture"}]}
            ]
        })
    }

    fn problems_of(v: serde_json::Value) -> Vec<String> {
        match Dataset::from_json(&v.to_string()) {
            Err(Error::InvalidDataset { problems }) => problems,
            other => panic!("expected a validation failure, got {other:?}"),
        }
    }

    #[test]
    fn the_embedded_dataset_is_valid() {
        let d = Dataset::embedded().expect("embedded dataset validates");
        assert_eq!(d.categories().len(), 18);
    }

    #[test]
    fn a_minimal_dataset_is_valid() {
        Dataset::from_json(&minimal().to_string()).expect("minimal dataset validates");
    }

    #[test]
    fn validation_rejects_a_duplicate_category_path() {
        let mut v = minimal();
        let dup = v["categories"][0].clone();
        v["categories"].as_array_mut().unwrap().push(dup);
        let problems = problems_of(v);
        assert!(
            problems
                .iter()
                .any(|p| p.contains("duplicate category path")),
            "{problems:?}"
        );
    }

    #[test]
    fn validation_rejects_a_duplicate_item_name() {
        let mut v = minimal();
        v["categories"][0]["items"]
            .as_array_mut()
            .unwrap()
            .push(serde_json::json!({"name": "신문 지", "name_en": "News"}));
        let problems = problems_of(v);
        assert!(
            problems.iter().any(|p| p.contains("used twice")),
            "{problems:?}"
        );
    }

    #[test]
    fn validation_rejects_advice_missing_a_locale() {
        let mut v = minimal();
        v["general_advice"]["내용물_있음"]["en"] = "".into();
        let problems = problems_of(v);
        assert!(
            problems.iter().any(|p| p.contains("needs both ko and en")),
            "{problems:?}"
        );
    }

    #[test]
    fn validation_rejects_an_exclusion_missing_a_locale() {
        let mut v = minimal();
        v["categories"][0]["exclusions"][0]["instead"]["ko"] = " ".into();
        let problems = problems_of(v);
        assert!(
            problems.iter().any(|p| p.contains("exclusion 0")),
            "{problems:?}"
        );
    }

    #[test]
    fn validation_rejects_advice_for_a_tag_outside_the_vocabulary() {
        let mut v = minimal();
        v["categories"][1]["advice"] = serde_json::json!({"없는_태그": {"ko": "a", "en": "b"}});
        let problems = problems_of(v);
        assert!(
            problems.iter().any(|p| p.contains("없는_태그")),
            "{problems:?}"
        );
    }

    #[test]
    fn validation_rejects_an_exclusion_pointing_nowhere() {
        let mut v = minimal();
        v["categories"][0]["exclusions"][0]["goes_to"] = serde_json::json!({"major": "없는분류"});
        let problems = problems_of(v);
        assert!(
            problems.iter().any(|p| p.contains("not a category")),
            "{problems:?}"
        );
    }

    #[test]
    fn validation_rejects_a_category_of_an_unlisted_major() {
        let mut v = minimal();
        v["categories"][1]["major"] = "없는분류".into();
        let problems = problems_of(v);
        assert!(
            problems.iter().any(|p| p.contains("not in `majors`")),
            "{problems:?}"
        );
    }

    #[test]
    fn unknown_fields_are_a_parse_error() {
        let mut v = minimal();
        v["categories"][0]["itmes"] = serde_json::json!([]);
        assert!(matches!(
            Dataset::from_json(&v.to_string()),
            Err(Error::ParseDataset(_))
        ));
    }

    #[test]
    fn lookup_matches_names_ignoring_spaces_and_aliases() {
        let d = Dataset::embedded().unwrap();
        let r = d
            .lookup("재활용폐기물", "무색페트병", "음료 PET병")
            .unwrap();
        assert_eq!(r.item(), Some("음료PET병"));
        let r = d.lookup("일반종량제폐기물", "", "CD · DVD").unwrap();
        assert_eq!(r.item(), Some("CD/DVD"));
    }

    #[test]
    fn lookup_infers_an_unambiguous_middle() {
        let d = Dataset::embedded().unwrap();
        let r = d.lookup("재활용폐기물", "", "음료PET병").unwrap();
        assert_eq!(r.middle(), "무색페트병");
        assert!(r.notes.iter().any(|n| n.contains("inferred")));
        // 식품용기 is both a plastic and a foam item: no guess.
        assert!(matches!(
            d.lookup("재활용폐기물", "", "식품용기"),
            Err(Error::MissingMiddle { .. })
        ));
    }

    #[test]
    fn item_advice_overrides_category_advice_which_overrides_general_advice() {
        let d = Dataset::embedded().unwrap();
        let t = tags(&["가스_잔존_의심"]);
        let item = d
            .lookup("재활용폐기물", "금속류", "부탄가스")
            .unwrap()
            .rules(Locale::En, &t);
        let category = d
            .lookup("재활용폐기물", "금속류", "철캔")
            .unwrap()
            .rules(Locale::En, &t);
        let general = d
            .lookup("대형폐기물", "", "가구")
            .unwrap()
            .rules(Locale::En, &t);
        assert!(item.rules.situation_advice[0].contains("puncture"));
        assert!(category.rules.situation_advice[0].contains("butane or spray can"));
        assert!(general.rules.situation_advice[0].starts_with("Leftover gas"));
    }

    #[test]
    fn unknown_and_repeated_tags_are_reported_not_applied() {
        let d = Dataset::embedded().unwrap();
        let r = d
            .lookup("재활용폐기물", "무색페트병", "음료PET병")
            .unwrap()
            .rules(
                Locale::Ko,
                &tags(&["내용물_있음", "내용물_있음", "없는_태그"]),
            );
        assert_eq!(r.rules.situation_advice.len(), 1);
        assert_eq!(r.unknown_tags, vec!["없는_태그".to_owned()]);
    }

    #[test]
    fn list_caps_the_number_of_names() {
        let names: Vec<String> = (0..15).map(|i| i.to_string()).collect();
        let s = list(names.iter().map(String::as_str));
        assert!(s.ends_with("11 and 3 more"), "{s}");
    }
}
