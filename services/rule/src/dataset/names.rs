//! How taxonomy names compare (ignoring whitespace and ASCII case, by name, English name or
//! alias), how a category path is written, and how lists of valid names appear in errors: the
//! same for lookup and for validation at load.

use super::model::{CategoryRules, Item};

/// How many valid names an error message lists before it says "and N more".
const LISTED_IN_ERRORS: usize = 12;

/// Names compare ignoring whitespace and ASCII case ("음료 PET병" is "음료PET병").
pub(super) fn normalize(s: &str) -> String {
    s.chars()
        .filter(|c| !c.is_whitespace())
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

/// Whether two names are the same name, as [`normalize`] compares them.
pub(super) fn same(a: &str, b: &str) -> bool {
    normalize(a) == normalize(b)
}

/// The item of `category` that answers to `name` (see [`item_keys`]), if any.
pub(super) fn find_item<'a>(category: &'a CategoryRules, name: &str) -> Option<&'a Item> {
    let wanted = normalize(name);
    category
        .items
        .iter()
        .find(|i| item_keys(i).any(|k| normalize(k) == wanted))
}

/// Every name an item answers to.
pub(super) fn item_keys(item: &Item) -> impl Iterator<Item = &str> {
    std::iter::once(item.name.as_str())
        .chain(std::iter::once(item.name_en.as_str()))
        .chain(item.aliases.iter().map(String::as_str))
}

/// `major / middle`, or `major` for a category without a middle level.
pub(super) fn path_name(c: &CategoryRules) -> String {
    if c.middle.is_empty() {
        c.major.clone()
    } else {
        format!("{} / {}", c.major, c.middle)
    }
}

/// `a, b, c` — at most [`LISTED_IN_ERRORS`] names, then how many more.
pub(super) fn list<'a>(names: impl Iterator<Item = &'a str>) -> String {
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
