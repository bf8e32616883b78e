//! The repository stands alone: no tracked file may refer to a path outside it, neither by
//! climbing above its root with `../` nor by naming a directory of one developer's machine. A
//! user who clones ecoscan has nothing beside it.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root exists")
}

/// Every file of the repository, relative to its root: what git tracks, or (outside a git
/// checkout, e.g. an unpacked source archive) every file but build output and local data.
fn repository_files(root: &Path) -> Vec<PathBuf> {
    let listed = Command::new("git")
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ])
        .current_dir(root)
        .output();
    if let Ok(out) = listed
        && out.status.success()
    {
        return out
            .stdout
            .split(|b| *b == 0)
            .filter(|p| !p.is_empty())
            .map(|p| PathBuf::from(String::from_utf8_lossy(p).into_owned()))
            // A file deleted in the working tree but still in the index is not there to read.
            .filter(|p| root.join(p).is_file())
            .collect();
    }
    let mut out = Vec::new();
    let mut dirs = vec![PathBuf::new()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(root.join(&dir)).expect("readable directory") {
            let entry = entry.expect("readable entry");
            let rel = dir.join(entry.file_name());
            let name = entry.file_name();
            if matches!(
                name.to_str(),
                Some(".git" | "target" | "data" | "node_modules")
            ) {
                continue;
            }
            if entry.file_type().expect("file type").is_dir() {
                dirs.push(rel);
            } else {
                out.push(rel);
            }
        }
    }
    out
}

/// Directories that only exist on some developer's machine. Spelled in pieces so that this file
/// does not trip its own check.
fn machine_dirs() -> Vec<String> {
    ["home", "Users", "root", "work"]
        .iter()
        .map(|d| format!("/{d}/"))
        .collect()
}

/// Whether the byte before a match starts a path (so `https://host/home/x` is not a path of
/// this machine, but `"/home/x"` or ` /home/x` is).
fn starts_path(text: &str, at: usize) -> bool {
    at == 0
        || matches!(
            text.as_bytes()[at - 1],
            b' ' | b'\t' | b'\n' | b'"' | b'\'' | b'`' | b'(' | b'<' | b'=' | b',' | b'[' | b'{'
        )
}

/// How many directories below the root `dir` is.
fn depth(dir: &Path) -> usize {
    dir.components().count()
}

/// How deep the directory is that a relative path on `line` of `file` is resolved from: the
/// file's own directory, except in Rust code, where paths are relative to the crate's root
/// (`CARGO_MANIFEST_DIR`, and the working directory of tests) unless the line includes a file
/// by a path relative to itself (`include_str!`, `include_bytes!`, `#[path]`).
fn base_depth(root: &Path, file: &Path, line: &str) -> usize {
    let dir = file.parent().unwrap_or(Path::new("")).to_path_buf();
    let file_relative =
        line.contains("include_str!") || line.contains("include_bytes!") || line.contains("#[path");
    if file.extension().is_none_or(|e| e != "rs") || file_relative {
        return depth(&dir);
    }
    let mut crate_dir = dir.clone();
    loop {
        // The workspace's own Cargo.toml at the root is no crate a path is resolved from.
        if !crate_dir.as_os_str().is_empty() && root.join(&crate_dir).join("Cargo.toml").is_file() {
            return depth(&crate_dir);
        }
        if !crate_dir.pop() {
            return depth(&dir);
        }
    }
}

/// Problems of one file's text: lines that leave the repository.
fn outside_references(root: &Path, file: &Path, text: &str) -> Vec<String> {
    let mut found = Vec::new();
    let dirs = machine_dirs();
    for (n, line) in text.lines().enumerate() {
        let base = base_depth(root, file, line);
        let mut report = |why: String| {
            found.push(format!(
                "{}:{}: {why}: {}",
                file.display(),
                n + 1,
                line.trim()
            ));
        };
        for dir in &dirs {
            for (at, _) in line.match_indices(dir.as_str()) {
                if starts_path(line, at) {
                    report(format!("names {dir}, a directory of one machine"));
                }
            }
        }
        // Each maximal run of `../`: climbing more levels than the file sits below the root.
        let bytes = line.as_bytes();
        let mut i = 0;
        while i + 3 <= bytes.len() {
            let run_start = i == 0 || !matches!(bytes[i - 1], b'.' | b'/');
            if run_start && &bytes[i..i + 3] == b"../" {
                let mut ups = 0;
                let mut j = i;
                while j + 3 <= bytes.len() && &bytes[j..j + 3] == b"../" {
                    ups += 1;
                    j += 3;
                }
                if ups > base {
                    report(format!(
                        "climbs {ups} levels with `../` from {base} below the repository root"
                    ));
                }
                i = j;
            } else {
                i += 1;
            }
        }
    }
    found
}

#[test]
fn no_tracked_file_refers_to_a_path_outside_the_repository() {
    let root = repo_root();
    let files = repository_files(&root);
    assert!(
        files.iter().any(|f| f == Path::new("Cargo.toml")),
        "the repository listing looks wrong: {} files, no Cargo.toml",
        files.len()
    );
    let mut problems = Vec::new();
    // This file spells out the very paths it looks for, in its own examples.
    let this_file = Path::new(file!());
    for file in files.iter().filter(|f| !this_file.ends_with(f)) {
        // Binary files (images, descriptor sets) cannot hold a path a reader would follow.
        let Ok(text) = std::fs::read_to_string(root.join(file)) else {
            continue;
        };
        problems.extend(outside_references(&root, file, &text));
    }
    assert!(
        problems.is_empty(),
        "files refer to paths outside the repository (a user who clones it has nothing beside \
         it; move what is needed into the repository):\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_check_catches_paths_that_leave_the_repository() {
    let root = repo_root();
    let readme = Path::new("README.md");
    let climb = format!("see {}shared/DESIGN.md", "../");
    assert_eq!(outside_references(&root, readme, &climb).len(), 1);
    let machine = format!("data at \"{}me/alice/x\"", "/ho");
    assert_eq!(outside_references(&root, readme, &machine).len(), 1);
    // Rust sources resolve from their crate's root: three levels up from services/rule leaves.
    let test = Path::new("services/rule/tests/taxonomy.rs");
    let crate_relative = format!("join(\"{}shared/x\")", "../../../");
    assert_eq!(outside_references(&root, test, &crate_relative).len(), 1);
    // A file included relative to itself may climb to its crate's root.
    let routes = Path::new("gateway/src/routes/mod.rs");
    let include = format!("include_str!(\"{}static/index.html\")", "../../");
    assert!(outside_references(&root, routes, &include).is_empty());
    let include_out = format!("include_str!(\"{}x\")", "../../../../");
    assert_eq!(outside_references(&root, routes, &include_out).len(), 1);
    // Staying inside is fine, and so is a URL whose path happens to look alike.
    let inside = format!("join(\"{}infra/compose.yaml\")", "../../");
    assert!(outside_references(&root, test, &inside).is_empty());
    let url = format!("https://example.com{}x", "/home/");
    assert!(outside_references(&root, readme, &url).is_empty());
}
