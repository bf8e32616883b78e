//! The dataset against the reference taxonomy it was written from: every major, middle and item
//! of `item_class_list.yaml` (and every source file) must exist in the dataset, and every path of
//! the dataset must resolve.

use std::path::PathBuf;

use ecoscan_rule::{Dataset, Locale};

fn reference_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/reference")
}

fn read_reference(name: &str) -> String {
    let path = reference_dir().join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read the reference taxonomy at {} ({e}); it is part of the repository \
             (services/rule/data/reference, see its README)",
            path.display()
        )
    })
}

/// (major, middle, items) for every node of `item_class_list.yaml`; middle is empty for majors
/// without a middle level.
fn reference_taxonomy() -> Vec<(String, String, Vec<String>)> {
    let yaml: serde_yaml::Value =
        serde_yaml::from_str(&read_reference("item_class_list.yaml")).expect("valid yaml");
    let root = yaml
        .get("item_class_list")
        .and_then(|v| v.as_mapping())
        .expect("item_class_list is a mapping");
    let items = |v: &serde_yaml::Value| -> Vec<String> {
        v.as_sequence()
            .expect("items are a list")
            .iter()
            .map(|i| i.as_str().expect("item is a string").to_owned())
            .collect()
    };
    let mut out = Vec::new();
    for (major, body) in root {
        let major = major.as_str().expect("major is a string").to_owned();
        match body.as_mapping() {
            Some(middles) => {
                for (middle, list) in middles {
                    let middle = middle.as_str().expect("middle is a string").to_owned();
                    out.push((major.clone(), middle, items(list)));
                }
            }
            None => out.push((major, String::new(), items(body))),
        }
    }
    out
}

#[test]
fn every_major_middle_and_item_of_the_reference_taxonomy_is_in_the_dataset() {
    let dataset = Dataset::embedded().expect("embedded dataset validates");
    let categories = dataset.categories();
    let reference = reference_taxonomy();
    // 12 recyclable middles and 5 majors without middles (생활계유해폐기물 is only in source/).
    assert!(reference.len() >= 17, "reference taxonomy looks truncated");
    for (major, middle, items) in reference {
        assert!(
            categories
                .iter()
                .any(|c| c.major_category == major && c.middle_category == middle),
            "{major} / {middle} is missing from the dataset"
        );
        for item in items {
            let resolved = dataset
                .lookup(&major, &middle, &item)
                .unwrap_or_else(|e| panic!("{major} / {middle} / {item}: {e}"));
            assert!(
                resolved.item().is_some(),
                "{major} / {middle} / {item} does not match an item of the dataset"
            );
        }
    }
}

#[test]
fn every_source_file_of_the_reference_has_a_category_in_the_dataset() {
    let dataset = Dataset::embedded().expect("embedded dataset validates");
    let categories = dataset.categories();
    let dir = reference_dir().join("source");
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| {
        panic!(
            "cannot list the reference source files at {} ({e})",
            dir.display()
        )
    });
    let mut seen = 0;
    for entry in entries {
        let name = entry.expect("readable dir entry").file_name();
        let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(".json")) else {
            continue;
        };
        let (major, middle) = stem.split_once('_').unwrap_or((stem, ""));
        assert!(
            categories
                .iter()
                .any(|c| c.major_category == major && c.middle_category == middle),
            "source file {stem}.json has no category in the dataset"
        );
        seen += 1;
    }
    assert_eq!(seen, 18, "expected 18 reference source files");
}

#[test]
fn the_situation_tag_vocabulary_is_the_reference_one() {
    let dataset = Dataset::embedded().expect("embedded dataset validates");
    let text = read_reference("situation_tags.yaml");
    let yaml: serde_yaml::Value = serde_yaml::from_str(&text).expect("valid yaml");
    let mut reference: Vec<String> = Vec::new();
    for tag in yaml["situation_tags"]
        .as_sequence()
        .expect("a list of tags")
    {
        let tag = tag.as_str().expect("tag is a string").to_owned();
        if !reference.contains(&tag) {
            reference.push(tag);
        }
    }
    assert_eq!(dataset.situation_tags(), reference.as_slice());
}

#[test]
fn every_path_of_the_dataset_resolves_through_lookup() {
    let dataset = Dataset::embedded().expect("embedded dataset validates");
    let mut paths = 0;
    for c in dataset.categories() {
        let r = dataset
            .lookup(&c.major_category, &c.middle_category, "")
            .unwrap_or_else(|e| panic!("{} / {}: {e}", c.major_category, c.middle_category));
        assert_eq!(r.major(), c.major_category);
        assert_eq!(r.middle(), c.middle_category);
        for item in &c.items {
            let r = dataset
                .lookup(&c.major_category, &c.middle_category, item)
                .unwrap_or_else(|e| {
                    panic!("{} / {} / {item}: {e}", c.major_category, c.middle_category)
                });
            assert_eq!(r.item(), Some(item.as_str()));
            for locale in [Locale::Ko, Locale::En] {
                let rules = r.rules(locale, &[]).rules;
                assert!(!rules.stream_name.is_empty() && !rules.common_steps.is_empty());
            }
            paths += 1;
        }
    }
    assert!(paths > 150, "only {paths} item paths");
}

#[test]
fn the_dataset_covers_all_seven_majors_and_twelve_recyclable_middles() {
    let dataset = Dataset::embedded().expect("embedded dataset validates");
    let categories = dataset.categories();
    for major in [
        "재활용폐기물",
        "일반종량제폐기물",
        "불연성종량제폐기물",
        "음식물류폐기물",
        "공사장생활폐기물",
        "대형폐기물",
        "생활계유해폐기물",
    ] {
        assert!(
            categories.iter().any(|c| c.major_category == major),
            "{major} missing"
        );
    }
    for c in &categories {
        assert_eq!(
            c.recyclable,
            c.major_category == "재활용폐기물",
            "{} / {}: recyclable flag",
            c.major_category,
            c.middle_category
        );
    }
    assert_eq!(categories.iter().filter(|c| c.recyclable).count(), 12);
}
