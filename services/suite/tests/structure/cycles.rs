//! Import circles among a crate's modules, read from its sources (no compiler needed).
//!
//! A module's edges are the modules its `use crate::…` / `use super::…` imports and its
//! `crate::a::b` / `super::…` paths in code name (comments and test modules left out). An edge
//! counts between siblings: from module `a::x` to `a::y::z` is the edge `x -> y` in folder `a`.
//! A module that uses its own parent (or any ancestor) or its own children adds no edge: a
//! folder's `mod.rs` assembling its children, and a child taking a type its folder defines, are
//! one room, not two that need each other. A circle of sibling edges is a circle.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

/// A module path inside its crate (`[]` is the crate root).
type Module = Vec<String>;

/// The crate's modules under `src` with their source text, test modules and comments removed.
pub fn modules(src: &Path) -> BTreeMap<Module, String> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).expect("readable directory") {
            let path = entry.expect("readable entry").path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
                continue;
            };
            if path.extension().is_none_or(|e| e != "rs") || stem == "tests" || stem == "main" {
                continue;
            }
            let rel = path.strip_prefix(src).expect("under src");
            let mut module: Module = rel
                .parent()
                .into_iter()
                .flat_map(|p| p.components())
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if stem != "mod" && stem != "lib" {
                module.push(stem.to_owned());
            }
            let text = std::fs::read_to_string(&path).expect("readable source");
            out.insert(module, without_tests(&without_comments(&text)));
        }
    }
    out
}

/// The text without `//` and `/* */` comments (string literals are not special-cased: a
/// `//` inside a string only hides the rest of its line, which names no module).
fn without_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find('/') {
        out.push_str(&rest[..i]);
        let after = &rest[i..];
        if after.starts_with("//") {
            rest = after.find('\n').map_or("", |n| &after[n..]);
        } else if after.starts_with("/*") {
            rest = after.find("*/").map_or("", |n| &after[n + 2..]);
        } else {
            out.push('/');
            rest = &after[1..];
        }
    }
    out.push_str(rest);
    out
}

/// The text without `#[cfg(test)] mod … { … }` blocks.
fn without_tests(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..i]);
        let after = &rest[i + "#[cfg(test)]".len()..];
        let trimmed = after.trim_start();
        let block = trimmed.starts_with("mod ")
            && trimmed
                .find('{')
                .is_some_and(|open| trimmed.find(';').is_none_or(|semi| open < semi));
        if block {
            let open = after.find('{').expect("a block");
            let mut depth = 0usize;
            let mut end = after.len();
            for (j, c) in after[open..].char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = open + j + 1;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            rest = &after[end..];
        } else {
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The paths a module names: `use` trees expanded, and `crate::…`/`super::…` paths in code.
fn paths(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    // `use` statements: a line that starts with one (`pub`, `pub(crate)` … before it), to the `;`.
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        let start = offset;
        offset += line.len();
        let mut t = line.trim_start();
        if let Some(rest) = t.strip_prefix("pub") {
            t = match rest.strip_prefix('(') {
                Some(vis) => vis.split_once(')').map_or("", |(_, rest)| rest),
                None => rest,
            }
            .trim_start();
        }
        let Some(tree) = t.strip_prefix("use ") else {
            continue;
        };
        let from = start + (line.len() - tree.len());
        let Some(end) = text[from..].find(';') else {
            break;
        };
        let tree: String = text[from..from + end]
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        expand("", &tree, &mut out);
    }
    for start in ["crate::", "super::"] {
        let mut rest = text;
        while let Some(i) = rest.find(start) {
            let preceded = rest[..i].chars().next_back();
            let path: String = rest[i..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            if !preceded.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                out.push(path.trim_end_matches(':').to_owned());
            }
            rest = &rest[i + start.len()..];
        }
    }
    out
}

/// `a::{b, c::{d}}` → `a::b`, `a::c::d`.
fn expand(prefix: &str, tree: &str, out: &mut Vec<String>) {
    let Some(open) = tree.find('{') else {
        out.push(format!("{prefix}{tree}"));
        return;
    };
    let head = &tree[..open];
    let close = tree.rfind('}').filter(|&c| c > open).unwrap_or(tree.len());
    let body = &tree[open + 1..close];
    let mut depth = 0;
    let mut start = 0;
    for (i, c) in body.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                expand(&format!("{prefix}{head}"), &body[start..i], out);
                start = i + 1;
            }
            _ => {}
        }
    }
    if start < body.len() {
        expand(&format!("{prefix}{head}"), &body[start..], out);
    }
}

/// The module `path` names, seen from `from`: its longest prefix that is a module.
fn target(from: &Module, path: &str, modules: &BTreeMap<Module, String>) -> Option<Module> {
    let parts: Vec<&str> = path.split("::").filter(|p| !p.is_empty()).collect();
    let (mut base, rest): (Module, &[&str]) = match parts.first() {
        Some(&"crate") => (Vec::new(), &parts[1..]),
        Some(&"super") => {
            let mut base = from.clone();
            let mut i = 0;
            while parts.get(i) == Some(&"super") {
                base.pop();
                i += 1;
            }
            (base, &parts[i..])
        }
        _ => return None,
    };
    for part in rest {
        let mut next = base.clone();
        next.push((*part).to_owned());
        if !modules.contains_key(&next) {
            break;
        }
        base = next;
    }
    Some(base)
}

/// Every circle of sibling edges, one per folder and set of modules, as `folder: a -> b -> a`.
pub fn circles(modules: &BTreeMap<Module, String>) -> Vec<String> {
    // folder -> sibling -> siblings it uses
    let mut edges: BTreeMap<Module, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for (from, text) in modules {
        for path in paths(text) {
            let Some(to) = target(from, &path, modules) else {
                continue;
            };
            let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
            if common == from.len() || common == to.len() {
                continue; // itself, an ancestor or a descendant
            }
            edges
                .entry(from[..common].to_vec())
                .or_default()
                .entry(from[common].clone())
                .or_default()
                .insert(to[common].clone());
        }
    }
    let mut found: BTreeSet<(Module, BTreeSet<String>)> = BTreeSet::new();
    let mut out = Vec::new();
    for (folder, graph) in &edges {
        for start in graph.keys() {
            let mut stack = vec![start.clone()];
            walk(graph, &mut stack, &mut |cycle| {
                let members: BTreeSet<String> = cycle.iter().cloned().collect();
                if found.insert((folder.clone(), members)) {
                    let name = if folder.is_empty() {
                        "crate".to_owned()
                    } else {
                        folder.join("::")
                    };
                    out.push(format!("{name}: {}", cycle.join(" -> ")));
                }
            });
        }
    }
    out
}

fn walk(
    graph: &BTreeMap<String, BTreeSet<String>>,
    stack: &mut Vec<String>,
    found: &mut dyn FnMut(Vec<String>),
) {
    let last = stack.last().expect("a start").clone();
    for next in graph.get(&last).into_iter().flatten() {
        if let Some(i) = stack.iter().position(|m| m == next) {
            let mut cycle = stack[i..].to_vec();
            cycle.push(next.clone());
            found(cycle);
        } else if stack.len() < 12 {
            stack.push(next.clone());
            walk(graph, stack, found);
            stack.pop();
        }
    }
}

#[test]
fn the_circle_finder_finds_circles_and_only_them() {
    let m = |src: &[(&str, &str)]| -> BTreeMap<Module, String> {
        src.iter()
            .map(|(path, text)| {
                let module: Module = path
                    .split("::")
                    .filter(|p| !p.is_empty())
                    .map(str::to_owned)
                    .collect();
                (module, without_tests(&without_comments(text)))
            })
            .collect()
    };
    // Siblings that use each other, directly and through a third.
    let knot = m(&[
        ("", "mod a; mod b; mod c;"),
        ("a", "use crate::b::B;"),
        ("b", "fn f() { crate::c::g() }"),
        ("c", "use crate::{x, a::{A}};"),
    ]);
    assert_eq!(circles(&knot), ["crate: a -> b -> c -> a"]);
    // A folder and its children, a child and its parent, comments and tests: no circle.
    let rooms = m(&[
        ("", "mod a; use a::A;"),
        ("a", "mod x; pub use x::X; pub struct A;"),
        (
            "a::x",
            "use super::A; use crate::a::A as B; // use crate::b;",
        ),
        (
            "b",
            "#[cfg(test)]\nmod tests { use crate::a::A; }\n/* crate::a */",
        ),
        ("c", "use crate::b;"),
    ]);
    assert_eq!(circles(&rooms), Vec::<String>::new());
    // A test module in a file of its own, and `use` inside a string, name nothing.
    let quiet = m(&[
        ("", "mod a; mod b;"),
        (
            "a",
            "#[cfg(test)]\nmod tests;\nconst S: &str = \"a single-use {ticket\";",
        ),
        ("b", "use crate::a;"),
    ]);
    assert_eq!(circles(&quiet), Vec::<String>::new());
    // Inside a folder.
    let inner = m(&[
        ("f", "mod p; mod q;"),
        ("f::p", "use super::q::Q;"),
        ("f::q", "use crate::f::p::P;"),
    ]);
    assert_eq!(circles(&inner), ["f: p -> q -> p"]);
}
