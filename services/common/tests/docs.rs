//! The documentation holds together: the README stays short, every relative link and
//! `#fragment` in a tracked Markdown file (and every alert's `runbook:`) leads somewhere, the
//! book under `docs/` is reachable from its index, and `docs/configuration.md` names exactly the
//! environment variables the code reads (`services/common/src/known_env.txt`).
//!
//! `cargo test -p ecoscan-common --test docs`

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

/// The README is the front page; what is longer belongs in `docs/`.
const README_MAX_LINES: usize = 300;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root exists")
}

/// Tracked Markdown files (relative to the root), from git; without git, a walk of the tree.
fn markdown_files(root: &Path) -> Vec<PathBuf> {
    let out = std::process::Command::new("git")
        .args(["ls-files", "-z", "--", "*.md"])
        .current_dir(root)
        .output();
    if let Ok(out) = out
        && out.status.success()
    {
        let files: Vec<PathBuf> = out
            .stdout
            .split(|b| *b == 0)
            .filter(|s| !s.is_empty())
            .map(|s| PathBuf::from(String::from_utf8_lossy(s).into_owned()))
            .filter(|p| root.join(p).is_file())
            .collect();
        if !files.is_empty() {
            return files;
        }
    }
    let mut files = Vec::new();
    walk(root, root, &mut files);
    files.sort();
    files
}

fn walk(root: &Path, dir: &Path, files: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if !matches!(name.as_ref(), "target" | ".git" | "node_modules") {
                walk(root, &path, files);
            }
        } else if name.ends_with(".md") {
            files.push(path.strip_prefix(root).unwrap_or(&path).to_path_buf());
        }
    }
}

/// Lines outside fenced code blocks, with their 1-based numbers.
fn prose_lines(text: &str) -> Vec<(usize, &str)> {
    let mut fence: Option<(char, usize)> = None;
    let mut lines = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let marker = trimmed.chars().next().filter(|c| *c == '`' || *c == '~');
        if let Some(c) = marker {
            let run = trimmed.chars().take_while(|x| *x == c).count();
            if run >= 3 {
                match fence {
                    None => {
                        fence = Some((c, run));
                        continue;
                    }
                    Some((open, len)) if open == c && run >= len => {
                        if trimmed[run..].trim().is_empty() {
                            fence = None;
                            continue;
                        }
                    }
                    Some(_) => {}
                }
            }
        }
        if fence.is_none() {
            lines.push((i + 1, line));
        }
    }
    lines
}

/// `line` without its inline code spans (a link written in backticks is text, not a link).
fn without_code_spans(line: &str) -> String {
    let mut out = String::new();
    let mut rest = line;
    while let Some(start) = rest.find('`') {
        out.push_str(&rest[..start]);
        let ticks = rest[start..].chars().take_while(|c| *c == '`').count();
        let after = &rest[start + ticks..];
        let closing = "`".repeat(ticks);
        match after.find(&closing) {
            Some(end) => rest = &after[end + ticks..],
            None => {
                out.push_str(&rest[start..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// The targets of inline links and images (`[text](target)`) and of reference definitions
/// (`[label]: target`) in one line.
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code_spans(line);
    let mut targets = Vec::new();
    let trimmed = line.trim_start();
    if trimmed.starts_with('[')
        && let Some(close) = trimmed.find("]:")
    {
        let target = trimmed[close + 2..].split_whitespace().next().unwrap_or("");
        if !target.is_empty() {
            targets.push(target.trim_matches(['<', '>']).to_owned());
        }
    }
    let bytes = line.as_bytes();
    let mut i = 0;
    while let Some(pos) = line[i..].find("](") {
        let start = i + pos + 2;
        let mut depth = 1;
        let mut end = start;
        while end < bytes.len() {
            match bytes[end] {
                b'(' => depth += 1,
                b')' => {
                    depth -= 1;
                    if depth == 0 {
                        break;
                    }
                }
                _ => {}
            }
            end += 1;
        }
        let inner = line[start..end.min(line.len())].trim();
        // `(target "title")`
        let target = if let Some(rest) = inner.strip_prefix('<') {
            rest.split('>').next().unwrap_or("")
        } else {
            inner.split_whitespace().next().unwrap_or("")
        };
        if !target.is_empty() {
            targets.push(target.to_owned());
        }
        i = end.min(line.len());
        if i >= line.len() {
            break;
        }
    }
    targets
}

fn is_external(target: &str) -> bool {
    let lower = target.to_ascii_lowercase();
    ["http://", "https://", "mailto:", "ftp://", "tel:"]
        .iter()
        .any(|p| lower.starts_with(p))
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let Ok(b) = u8::from_str_radix(&s[i + 1..i + 3], 16)
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// GitHub's anchor for a heading's text: inline markup dropped, lowercase, every character but
/// letters, digits, spaces, `-` and `_` removed, spaces turned into `-`.
fn slug(heading: &str) -> String {
    // A link in a heading is its text.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        let Some(mid) = rest[open..].find("](") else {
            break;
        };
        let Some(close) = rest[open + mid..].find(')') else {
            break;
        };
        text.push_str(&rest[..open]);
        text.push_str(&rest[open + 1..open + mid]);
        rest = &rest[open + mid + close + 1..];
    }
    text.push_str(rest);
    // HTML tags are not text.
    let mut plain = String::new();
    let mut in_tag = false;
    for c in text.chars() {
        match c {
            '<' if !in_tag => in_tag = true,
            '>' if in_tag => in_tag = false,
            _ if !in_tag => plain.push(c),
            _ => {}
        }
    }
    plain
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor a Markdown file offers: its headings' slugs (a repeated one gets `-1`, `-2`, …)
/// and explicit `<a id=…>` / `<a name=…>` anchors.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut anchors = BTreeSet::new();
    let lines = prose_lines(text);
    let mut add = |heading: &str, anchors: &mut BTreeSet<String>| {
        let base = slug(heading);
        let n = seen.entry(base.clone()).or_insert(0);
        let anchor = if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        };
        *n += 1;
        anchors.insert(anchor);
    };
    for (k, (_, line)) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let hashes = trimmed.chars().take_while(|c| *c == '#').count();
        if (1..=6).contains(&hashes)
            && line.len() - trimmed.len() < 4
            && (trimmed.len() == hashes || trimmed[hashes..].starts_with([' ', '\t']))
        {
            let heading = trimmed[hashes..].trim().trim_end_matches('#').trim_end();
            add(heading, &mut anchors);
        } else if k > 0
            && !trimmed.is_empty()
            && (trimmed.trim_end().chars().all(|c| c == '=')
                || (trimmed.trim_end().chars().all(|c| c == '-') && trimmed.trim_end().len() >= 2))
        {
            let (prev_no, prev) = lines[k - 1];
            let prev_is_text = prev_no + 1 == lines[k].0
                && !prev.trim().is_empty()
                && !prev.trim_start().starts_with(['#', '|', '-', '*', '>'])
                && !prev.trim_start().starts_with("<!--");
            if prev_is_text {
                add(prev.trim(), &mut anchors);
            }
        }
        for attr in ["id=", "name="] {
            let mut rest = *line;
            while let Some(pos) = rest.find("<a ") {
                let tag_end = rest[pos..].find('>').map_or(rest.len(), |e| pos + e);
                let tag = &rest[pos..tag_end];
                if let Some(a) = tag.find(attr) {
                    let value = tag[a + attr.len()..].trim_start();
                    let value = value
                        .trim_start_matches(['"', '\''])
                        .split(['"', '\'', ' ', '>'])
                        .next()
                        .unwrap_or("");
                    if !value.is_empty() {
                        anchors.insert(value.to_owned());
                    }
                }
                rest = &rest[tag_end..];
            }
        }
    }
    anchors
}

/// Why a link from `from` (a file relative to the root) to `target` does not resolve, if it
/// does not. `root_relative` resolves a path from the repository root (a `runbook:` line).
fn broken(root: &Path, from: &Path, target: &str, root_relative: bool) -> Option<String> {
    let (path, fragment) = match target.split_once('#') {
        Some((p, f)) => (p, Some(f)),
        None => (target, None),
    };
    let path = percent_decode(path.split('?').next().unwrap_or(""));
    let file = if path.is_empty() {
        root.join(from)
    } else if let Some(abs) = path.strip_prefix('/') {
        root.join(abs)
    } else if root_relative {
        root.join(&path)
    } else {
        root.join(from).parent().unwrap_or(root).join(&path)
    };
    if !file.exists() {
        return Some(format!("{} does not exist", file.display()));
    }
    let fragment = fragment.filter(|f| !f.is_empty())?;
    let is_markdown = file
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("md"));
    if !is_markdown || !file.is_file() {
        return None;
    }
    let text = std::fs::read_to_string(&file).ok()?;
    let fragment = percent_decode(fragment).to_lowercase();
    if anchors(&text).contains(&fragment) {
        None
    } else {
        Some(format!(
            "{} has no heading or anchor `#{fragment}`",
            file.strip_prefix(root).unwrap_or(&file).display()
        ))
    }
}

/// The `runbook:` values of the Prometheus alert rules (and of any rule file in k8s/).
fn runbooks(root: &Path) -> Vec<(PathBuf, usize, String)> {
    let mut files = Vec::new();
    for dir in ["infra/prometheus", "k8s"] {
        let mut stack = vec![root.join(dir)];
        while let Some(d) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in entries.flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "yml" || x == "yaml") {
                    files.push(p);
                }
            }
        }
    }
    files.sort();
    let mut out = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        for (i, line) in text.lines().enumerate() {
            if let Some(value) = line.trim_start().strip_prefix("runbook:") {
                let value = value.trim().trim_matches(['"', '\'']).to_owned();
                let rel = file.strip_prefix(root).unwrap_or(&file).to_path_buf();
                out.push((rel, i + 1, value));
            }
        }
    }
    out
}

#[test]
fn the_readme_is_short() {
    let root = repo_root();
    let lines = std::fs::read_to_string(root.join("README.md"))
        .expect("README.md")
        .lines()
        .count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move the detail into docs/ \
         (docs/README.md is the book's index) and link it"
    );
}

#[test]
fn every_relative_link_and_fragment_resolves() {
    let root = repo_root();
    let files = markdown_files(&root);
    assert!(
        !files.is_empty(),
        "no Markdown files found under {}",
        root.display()
    );
    let mut problems = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(root.join(file)).unwrap_or_default();
        for (no, line) in prose_lines(&text) {
            for target in link_targets(line) {
                if is_external(&target) {
                    continue;
                }
                if let Some(why) = broken(&root, file, &target, false) {
                    problems.push(format!("{}:{no}: link `{target}`: {why}", file.display()));
                }
            }
        }
    }
    for (file, no, target) in runbooks(&root) {
        if is_external(&target) {
            continue;
        }
        if let Some(why) = broken(&root, &file, &target, true) {
            problems.push(format!(
                "{}:{no}: runbook `{target}` (relative to the repository root): {why}",
                file.display()
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "{} broken link(s):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn every_alert_has_a_runbook_heading() {
    let root = repo_root();
    let rules = std::fs::read_to_string(root.join("infra/prometheus/alerts.yml"))
        .expect("infra/prometheus/alerts.yml");
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("- alert:"))
        .map(str::trim)
        .collect();
    assert!(
        !alerts.is_empty(),
        "no alerts found in infra/prometheus/alerts.yml"
    );
    let books = runbooks(&root);
    let mut problems = Vec::new();
    for alert in alerts {
        let expected = format!("docs/operations.md#{}", alert.to_lowercase());
        let found = books
            .iter()
            .any(|(f, _, v)| f == Path::new("infra/prometheus/alerts.yml") && v == &expected);
        if !found {
            problems.push(format!(
                "alert {alert}: infra/prometheus/alerts.yml has no `runbook: {expected}`"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_docs_file_is_in_the_index() {
    let root = repo_root();
    let index_path = root.join("docs/README.md");
    let index = std::fs::read_to_string(&index_path).expect("docs/README.md, the book's index");
    let linked: BTreeSet<PathBuf> = prose_lines(&index)
        .into_iter()
        .flat_map(|(_, l)| link_targets(l))
        .filter(|t| !is_external(t))
        .filter_map(|t| {
            let path = t.split('#').next().unwrap_or("").to_owned();
            (!path.is_empty()).then(|| root.join("docs").join(percent_decode(&path)))
        })
        .filter_map(|p| p.canonicalize().ok())
        .collect();
    let mut missing = Vec::new();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .filter(|p| p.file_name().is_some_and(|n| n != "README.md"))
        .collect();
    entries.sort();
    for doc in entries {
        let canonical = doc.canonicalize().unwrap_or(doc.clone());
        if !linked.contains(&canonical) {
            missing.push(format!(
                "docs/{} is not linked from docs/README.md",
                doc.file_name().unwrap_or_default().to_string_lossy()
            ));
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}

/// Names of environment variables in a table cell: backticked words of capitals, digits and
/// underscores.
fn variable_names(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .filter(|w| {
            w.len() > 1
                && w.chars().next().is_some_and(|c| c.is_ascii_uppercase())
                && w.chars()
                    .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        })
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_configuration_table_names_every_known_variable() {
    let root = repo_root();
    let known: BTreeSet<String> =
        std::fs::read_to_string(root.join("services/common/src/known_env.txt"))
            .expect("services/common/src/known_env.txt")
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(str::to_owned)
            .collect();
    let doc =
        std::fs::read_to_string(root.join("docs/configuration.md")).expect("docs/configuration.md");
    // The settings tables: those whose header's first cell is `variable`.
    let mut documented: BTreeMap<String, usize> = BTreeMap::new();
    let mut problems = Vec::new();
    let mut in_table = false;
    for (no, line) in prose_lines(&doc) {
        let trimmed = line.trim();
        if !trimmed.starts_with('|') {
            in_table = false;
            continue;
        }
        let first = trimmed
            .trim_start_matches('|')
            .split('|')
            .next()
            .unwrap_or("");
        if first.trim() == "variable" {
            in_table = true;
            continue;
        }
        if !in_table || first.trim().chars().all(|c| c == '-' || c == ':') {
            continue;
        }
        let names = variable_names(first);
        if names.is_empty() {
            problems.push(format!(
                "docs/configuration.md:{no}: the row `{first}` names no variable"
            ));
        }
        for name in names {
            if !known.contains(&name) {
                problems.push(format!(
                    "docs/configuration.md:{no}: `{name}` is not in services/common/src/known_env.txt \
                     (no code reads it; regenerate the list with `python3 infra/k8s_check.py \
                     --write-env-registry` or remove the row)"
                ));
            }
            documented.entry(name).or_insert(no);
        }
    }
    assert!(
        !documented.is_empty(),
        "docs/configuration.md has no table whose first column is `variable`"
    );
    for name in &known {
        if !documented.contains_key(name) {
            problems.push(format!(
                "`{name}` (services/common/src/known_env.txt) has no row in docs/configuration.md's \
                 settings table"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_checks_catch_what_they_should() {
    assert_eq!(slug("The event path"), "the-event-path");
    assert_eq!(
        slug("start-to-ready: process start → `/readyz` 200"),
        "start-to-ready-process-start--readyz-200"
    );
    assert_eq!(
        slug("Production stores (Redis, PostgreSQL, S3)"),
        "production-stores-redis-postgresql-s3"
    );
    assert_eq!(slug("EcoscanInstanceDown"), "ecoscaninstancedown");
    let doc = "# A\n\n## A\n\n```\n# not a heading\n```\n\n<a id=\"here\"></a>\n\nB\n---\n";
    let a = anchors(doc);
    for want in ["a", "a-1", "here", "b"] {
        assert!(a.contains(want), "{want} missing from {a:?}");
    }
    assert!(!a.contains("not-a-heading"));
    assert_eq!(
        link_targets("see [x](docs/a.md#b \"t\") and `[y](z.md)` and ![i](p.png)"),
        vec!["docs/a.md#b".to_owned(), "p.png".to_owned()]
    );
    assert_eq!(
        link_targets("[ref]: ../x.md#y"),
        vec!["../x.md#y".to_owned()]
    );
    assert_eq!(
        variable_names("`S3_ENDPOINT` + `S3_BUCKET`, `4s`"),
        vec!["S3_ENDPOINT", "S3_BUCKET"]
    );
    let root = repo_root();
    assert!(broken(&root, Path::new("README.md"), "no-such-file.md", false).is_some());
    assert!(
        broken(
            &root,
            Path::new("README.md"),
            "#no-such-heading-here",
            false
        )
        .is_some()
    );
    assert!(broken(&root, Path::new("docs/README.md"), "../README.md", false).is_none());
}

/// What `grpcurl describe` shows is true of the identity: the user comes from the signed
/// `x-ecoscan-identity` assertion (plain `x-user-id` / `x-user-roles` are dropped by every
/// server), a call without one is UNAUTHENTICATED, and vision's content type is required.
#[test]
fn proto_comments_name_the_identity_services_believe() {
    let dir = repo_root().join("proto/ecoscan/v1");
    let mut problems = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        for (no, line) in text.lines().enumerate() {
            for stale in [
                "x-user-id",
                "x-user-roles",
                "fails with INVALID_ARGUMENT",
                "(exactly one is set)",
                // Vision refuses an empty content type (ingest does sniff one).
                "vision.proto:sniffed from the bytes when empty",
            ] {
                let stale = match stale.split_once(':') {
                    Some((file, words)) if path.ends_with(file) => words,
                    Some(_) => continue,
                    None => stale,
                };
                if line.contains(stale) {
                    problems.push(format!("{}:{}: {stale:?}", path.display(), no + 1));
                }
            }
        }
    }
    assert!(problems.is_empty(), "stale proto comments: {problems:#?}");
    for (file, says) in [
        ("ingest.proto", "DEADLINE_EXCEEDED"),
        ("ingest.proto", "UNAUTHENTICATED"),
        ("reward.proto", "PERMISSION_DENIED for any other caller"),
        ("analytics.proto", "Needs the admin role."),
    ] {
        let text = std::fs::read_to_string(dir.join(file)).unwrap();
        assert!(text.contains(says), "{file} should say {says:?}");
    }
}
