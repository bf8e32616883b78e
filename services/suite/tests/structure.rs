//! The rules of what may depend on what (docs/architecture.md), and the rooms inside a crate:
//! a service crate never depends on another service crate, the gateway reaches no store client
//! (Redis, SQL, S3) even through a shared crate, no module of a service or of the gateway is
//! over [`MAX_MODULE_LINES`] (benchmarks and tests only from the reviewed list below), and no
//! two modules of a crate need each other ([`cycles`]), and a module with children is a folder
//! with its `mod.rs`.

#[path = "structure/cycles.rs"]
mod cycles;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

/// The services: each runs on its own and talks to the others over gRPC only.
const SERVICES: [&str; 8] = [
    "ecoscan-gateway",
    "ecoscan-ingest",
    "ecoscan-vision",
    "ecoscan-rule",
    "ecoscan-answer",
    "ecoscan-reward",
    "ecoscan-analytics",
    "ecoscan-notification",
];

/// Store clients the gateway must not link: it holds no state of its own.
fn is_store_client(name: &str) -> bool {
    matches!(
        name,
        "redis" | "sqlx" | "ecoscan-redis" | "ecoscan-sql" | "ecoscan-objects"
    ) || name.starts_with("aws-sdk-")
}

/// Lines past which a module should be split.
const MAX_MODULE_LINES: usize = 600;

/// Benchmark and test modules over the limit, reviewed and left as they are for now; a module
/// on this list must still be over the limit: once split, it leaves the list, so the list only
/// shrinks. A service's or the gateway's module is never on it.
const REVIEWED_LONG_MODULES: &[&str] = &[
    "bench/src/bin/gateway-throughput.rs",
    "bench/src/bin/notification-delivery.rs",
    "bench/src/bin/sse-fanout.rs",
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Each workspace package's normal and build dependencies (not dev-dependencies: tests may
/// start other services), by name, from `cargo metadata`.
fn dependencies() -> BTreeMap<String, BTreeSet<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(root())
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata is JSON");
    meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .expect("dependencies")
                .iter()
                .filter(|d| d["kind"].as_str() != Some("dev"))
                .map(|d| d["name"].as_str().expect("name").to_owned())
                .collect();
            (p["name"].as_str().expect("name").to_owned(), deps)
        })
        .collect()
}

/// Everything `package` links, following workspace packages.
fn reach(graph: &BTreeMap<String, BTreeSet<String>>, package: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![package.to_owned()];
    while let Some(p) = todo.pop() {
        for d in graph.get(&p).into_iter().flatten() {
            if seen.insert(d.clone()) {
                todo.push(d.clone());
            }
        }
    }
    seen
}

#[test]
fn no_service_crate_depends_on_another() {
    let graph = dependencies();
    for service in SERVICES {
        assert!(
            graph.contains_key(service),
            "{service} is a workspace package"
        );
        let others: Vec<_> = reach(&graph, service)
            .into_iter()
            .filter(|d| SERVICES.contains(&d.as_str()) && d != service)
            .collect();
        assert!(
            others.is_empty(),
            "{service} depends on {others:?}: services talk over gRPC, shared code goes into \
             a library crate (ecoscan-common, ecoscan-sql, …)"
        );
    }
}

#[test]
fn the_gateway_reaches_no_store_client() {
    let graph = dependencies();
    let stores: Vec<_> = reach(&graph, "ecoscan-gateway")
        .into_iter()
        .filter(|d| is_store_client(d))
        .collect();
    assert!(
        stores.is_empty(),
        "the gateway links {stores:?}: it keeps no state and reaches data through the services"
    );
}

/// Every `.rs` file under a `src/` of the workspace's crates, relative to the root.
fn source_modules() -> Vec<PathBuf> {
    let root = root();
    let mut out = Vec::new();
    let mut dirs: Vec<PathBuf> = ["services", "gateway", "bench", "proto"]
        .iter()
        .map(PathBuf::from)
        .collect();
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(root.join(&dir)).expect("readable directory") {
            let entry = entry.expect("readable entry");
            let rel = dir.join(entry.file_name());
            if entry.file_type().expect("file type").is_dir() {
                if !matches!(entry.file_name().to_str(), Some("target" | "data")) {
                    dirs.push(rel);
                }
            } else if rel.extension().is_some_and(|e| e == "rs")
                && rel.components().any(|c| c.as_os_str() == "src")
            {
                out.push(rel);
            }
        }
    }
    out.sort();
    out
}

#[test]
fn no_new_module_grows_past_the_limit() {
    let modules = source_modules();
    assert!(modules.len() > 50, "found the sources: {}", modules.len());
    let mut too_long = Vec::new();
    for module in &modules {
        let name = module.to_string_lossy().replace('\\', "/");
        let lines = std::fs::read_to_string(root().join(module))
            .expect("readable source")
            .lines()
            .count();
        let served = name.starts_with("gateway/src/")
            || (name.starts_with("services/") && name.contains("/src/"));
        if lines > MAX_MODULE_LINES && (served || !REVIEWED_LONG_MODULES.contains(&name.as_str())) {
            too_long.push(format!("{name}: {lines} lines"));
        }
    }
    assert!(
        too_long.is_empty(),
        "modules over {MAX_MODULE_LINES} lines: split them (one concern per module), or review \
         and list them in REVIEWED_LONG_MODULES: {too_long:#?}"
    );
    // The list names files that exist and are still over the limit: a module that was split
    // or renamed leaves it.
    for listed in REVIEWED_LONG_MODULES {
        let lines = std::fs::read_to_string(root().join(listed))
            .unwrap_or_else(|_| panic!("{listed} is on the reviewed list but does not exist"))
            .lines()
            .count();
        assert!(
            lines > MAX_MODULE_LINES,
            "{listed} is on the reviewed list but has {lines} lines: take it off the list"
        );
    }
}

#[test]
fn the_rules_catch_what_they_are_for() {
    // The checks themselves, on a made-up graph: a service reaching another through a shared
    // crate, and a store client two steps away.
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("ecoscan-ingest", vec!["shared"]),
        ("shared", vec!["ecoscan-reward", "sqlx"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.into_iter().map(str::to_owned).collect()))
    .collect();
    let reached = reach(&graph, "ecoscan-ingest");
    assert!(reached.contains("ecoscan-reward"));
    assert!(reached.iter().any(|d| is_store_client(d)));
    assert!(is_store_client("aws-sdk-s3") && !is_store_client("tonic"));
}

/// The crates whose modules are held to the circle rule: every library of the workspace.
fn crate_sources() -> Vec<PathBuf> {
    let root = root();
    let mut out = vec![
        root.join("gateway/src"),
        root.join("proto/src"),
        root.join("bench/src"),
    ];
    for entry in std::fs::read_dir(root.join("services")).expect("services/") {
        let src = entry.expect("an entry").path().join("src");
        if src.is_dir() {
            out.push(src);
        }
    }
    out.sort();
    out
}

#[test]
fn no_two_modules_of_a_crate_need_each_other() {
    let mut circles = Vec::new();
    for src in crate_sources() {
        let modules = cycles::modules(&src);
        let crate_name = src
            .parent()
            .and_then(|p| p.strip_prefix(root()).ok())
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        circles.extend(
            cycles::circles(&modules)
                .into_iter()
                .map(|c| format!("{crate_name}: {c}")),
        );
    }
    assert!(
        circles.is_empty(),
        "modules that import each other (give what both need a leaf module of its own, or \
         move it to the side that owns it): {circles:#?}"
    );
}

/// Modules that are both a file `foo.rs` and a folder `foo/`: a module with children is a
/// folder with its `mod.rs`, the one style of the workspace.
fn split_modules(modules: &[PathBuf]) -> Vec<String> {
    modules
        .iter()
        .filter(|m| {
            m.file_name()
                .is_some_and(|n| n != "mod.rs" && n != "lib.rs" && n != "main.rs")
        })
        .filter(|m| root().join(m.with_extension("")).is_dir())
        .map(|m| m.display().to_string())
        .collect()
}

#[test]
fn a_module_with_children_is_a_folder_with_its_mod_rs() {
    let split = split_modules(&source_modules());
    assert!(
        split.is_empty(),
        "modules written as foo.rs beside foo/ (move foo.rs to foo/mod.rs): {split:#?}"
    );
}
