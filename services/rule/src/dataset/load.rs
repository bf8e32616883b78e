//! Loading the dataset: the one compiled into the binary or a file, parsed strictly (unknown
//! fields are an error) and validated as a whole, every problem reported at once.

use std::collections::{BTreeMap, HashSet};

use super::{
    model::{CategoryRules, Dataset, RawDataset, Text},
    names::{item_keys, normalize, path_name, same},
};
use crate::error::Error;

/// The dataset compiled into the binary.
const EMBEDDED: &str = include_str!("../../data/rules.json");

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
