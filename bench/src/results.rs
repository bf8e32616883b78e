//! The results file of `all`: the scratch stores it runs on, where results files live, the
//! comparison of a run with the previous one, and the README table made from it.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    path::{Path, PathBuf},
};

use anyhow::Context as _;

use crate::report::Figure;

/// A change against the previous results larger than this share is flagged.
pub const CHANGE_FLAG: f64 = 0.10;

/// The README markers between which the table is regenerated.
pub const README_BEGIN: &str = "<!-- bench:begin -->";
pub const README_END: &str = "<!-- bench:end -->";

/// Redis, PostgreSQL and S3 (moto) on loopback as `infra/services.sh` starts them, with a
/// database, a bucket and Redis key prefixes of this run's own, removed by [`Self::remove`].
pub struct ScratchStores {
    id: String,
    env: Vec<(String, String)>,
}

const REDIS_URL: &str = "redis://127.0.0.1:6379";
const PG_ADMIN: [&str; 8] = [
    "-h",
    "127.0.0.1",
    "-p",
    "5432",
    "-U",
    "postgres",
    "-d",
    "postgres",
];
const S3_ENDPOINT: &str = "http://127.0.0.1:9000";

/// Deletes a bucket with everything in it (boto3 is there wherever moto is).
const S3_CLEAN: &str = r#"
import sys, boto3
s3 = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1",
                  aws_access_key_id="bench", aws_secret_access_key="bench")
b = sys.argv[2]
try:
    s3.head_bucket(Bucket=b)
except Exception:
    sys.exit(0)
for page in s3.get_paginator("list_objects_v2").paginate(Bucket=b):
    keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
    if keys:
        s3.delete_objects(Bucket=b, Delete={"Objects": keys, "Quiet": True})
s3.delete_bucket(Bucket=b)
"#;

impl ScratchStores {
    /// Runs `infra/services.sh` under `root`, then makes the database.
    pub async fn create(root: &Path) -> anyhow::Result<Self> {
        let status = tokio::process::Command::new(root.join("infra/services.sh"))
            .stdout(std::process::Stdio::from(std::io::stderr()))
            .status()
            .await
            .context("failed to run infra/services.sh")?;
        anyhow::ensure!(status.success(), "infra/services.sh failed: {status}");
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let id = format!("bench_{secs}_{}", std::process::id());
        psql(&format!("create database {id}")).await?;
        let bucket = id.replace('_', "-");
        let env = [
            ("REDIS_URL", REDIS_URL.to_owned()),
            ("INGEST_REDIS_PREFIX", format!("{id}:ingest:")),
            ("NOTIFICATION_REDIS_PREFIX", format!("{id}:notification:")),
            (
                "DATABASE_URL",
                format!("postgres://postgres@127.0.0.1:5432/{id}"),
            ),
            ("S3_ENDPOINT", S3_ENDPOINT.to_owned()),
            ("S3_BUCKET", bucket),
            ("S3_REGION", "us-east-1".to_owned()),
            ("S3_ACCESS_KEY_ID", "bench".to_owned()),
            ("S3_SECRET_ACCESS_KEY", "bench".to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        Ok(Self { id, env })
    }

    /// The variables that point the benchmarks at these stores.
    pub fn env(&self) -> Vec<(String, String)> {
        self.env.clone()
    }

    /// Drops the database, deletes the bucket and every Redis key under the prefixes.
    pub async fn remove(&self) -> anyhow::Result<()> {
        let mut errors = Vec::new();
        if let Err(e) = psql(&format!("drop database if exists {} with (force)", self.id)).await {
            errors.push(format!("{e:#}"));
        }
        if let Err(e) = self.remove_redis_keys().await {
            errors.push(format!("redis: {e:#}"));
        }
        let bucket = self.id.replace('_', "-");
        match tokio::process::Command::new("python3")
            .args(["-c", S3_CLEAN, S3_ENDPOINT, &bucket])
            .status()
            .await
        {
            Ok(s) if s.success() => {}
            other => errors.push(format!("bucket {bucket}: {other:?}")),
        }
        anyhow::ensure!(errors.is_empty(), "{}", errors.join("; "));
        Ok(())
    }

    async fn remove_redis_keys(&self) -> anyhow::Result<()> {
        let mut conn = redis::Client::open(REDIS_URL)?
            .get_multiplexed_async_connection()
            .await?;
        ecoscan_redis::unlink_prefixed(&mut conn, &format!("{}:", self.id)).await?;
        Ok(())
    }
}

async fn psql(sql: &str) -> anyhow::Result<()> {
    let status = tokio::process::Command::new("psql")
        .args(PG_ADMIN)
        .args(["-qc", sql])
        .status()
        .await
        .context("failed to run psql")?;
    anyhow::ensure!(status.success(), "psql -c {sql:?} failed: {status}");
    Ok(())
}

/// `git rev-parse HEAD` of `root`, with `-dirty` when the work tree has changes.
pub fn git_commit(root: &Path) -> String {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(root)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    let Some(head) = git(&["rev-parse", "HEAD"]) else {
        return "unknown".to_owned();
    };
    let dirty =
        git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    if dirty { format!("{head}-dirty") } else { head }
}

/// `2026-12-01T14-30-00Z.json` (`quick-…` for a quick run): names sort by date.
pub fn file_name(date: &str, quick: bool) -> String {
    format!(
        "{}{}.json",
        if quick { "quick-" } else { "" },
        date.replace(':', "-")
    )
}

/// The newest results file of the mode in `dir`, parsed.
pub fn latest(dir: &Path, quick: bool) -> Option<(PathBuf, serde_json::Value)> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| Some(e.ok()?.path()))
        .filter(|p| {
            p.extension().is_some_and(|e| e == "json")
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("quick-") == quick)
        })
        .collect();
    files.sort();
    let path = files.pop()?;
    let value = serde_json::from_str(&std::fs::read_to_string(&path).ok()?).ok()?;
    Some((path, value))
}

/// Every figure of a run beside its target and the previous run's value.
pub struct Comparison {
    rows: Vec<CompareRow>,
}

struct CompareRow {
    bench: String,
    figure: Figure,
    previous: Option<f64>,
}

impl CompareRow {
    /// The relative change against the previous value, when both exist.
    fn change(&self) -> Option<f64> {
        let (now, before) = (self.figure.value?, self.previous?);
        (before != 0.0).then(|| (now - before) / before.abs())
    }

    fn change_text(&self) -> String {
        match self.change() {
            None => String::new(),
            Some(c) if c.abs() > CHANGE_FLAG => format!("**{:+.0} %**", c * 100.0),
            Some(c) => format!("{:+.0} %", c * 100.0),
        }
    }

    fn verdict(&self) -> &'static str {
        match self.figure.met() {
            Some(true) => "met",
            Some(false) => "**missed**",
            None => "",
        }
    }
}

fn figures_of(results: &serde_json::Value) -> Vec<(String, Figure)> {
    results["benchmarks"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|b| {
            let name = b["name"].as_str().unwrap_or("?").to_owned();
            b["figures"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Figure::from_json)
                .map(move |f| (name.clone(), f))
                .collect::<Vec<_>>()
        })
        .collect()
}

impl Comparison {
    pub fn new(results: &serde_json::Value, previous: Option<&serde_json::Value>) -> Self {
        let before: BTreeMap<(String, String), Option<f64>> = previous
            .map(figures_of)
            .unwrap_or_default()
            .into_iter()
            .map(|(b, f)| ((b, f.name), f.value))
            .collect();
        let rows = figures_of(results)
            .into_iter()
            .map(|(bench, figure)| CompareRow {
                previous: before
                    .get(&(bench.clone(), figure.name.clone()))
                    .copied()
                    .flatten(),
                bench,
                figure,
            })
            .collect();
        Self { rows }
    }

    /// Figures whose change against the previous run exceeds [`CHANGE_FLAG`].
    pub fn flagged(&self) -> usize {
        self.rows
            .iter()
            .filter(|r| r.change().is_some_and(|c| c.abs() > CHANGE_FLAG))
            .count()
    }

    /// The comparison as a Markdown table.
    pub fn render(&self) -> String {
        let mut out = String::from(
            "| benchmark | figure | measured | runs | target | | previous | change |\n|---|---|---|---|---|---|---|---|\n",
        );
        for r in &self.rows {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                r.bench,
                r.figure.name,
                r.figure.value_text(),
                r.figure.runs_text(),
                r.figure.target_text(),
                r.verdict(),
                r.previous.map_or_else(String::new, |v| format!(
                    "{} {}",
                    crate::report::number(v),
                    r.figure.unit
                )),
                r.change_text()
            );
        }
        let _ = writeln!(
            out,
            "\n{} figures, {} missed, {} changed by more than {:.0} % against the previous run",
            self.rows.len(),
            self.rows
                .iter()
                .filter(|r| r.figure.met() == Some(false))
                .count(),
            self.flagged(),
            CHANGE_FLAG * 100.0
        );
        out
    }

    /// `bench/README.md`'s generated section: what ran where, then [`Self::render`]. Its link to
    /// the results file is relative to `bench/`.
    pub fn readme_table(&self, results: &serde_json::Value, file: &str) -> String {
        let s = |k: &str| results[k].as_str().unwrap_or("?").to_owned();
        let failed: Vec<String> = results["benchmarks"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|b| {
                Some(format!(
                    "{} ({})",
                    b["name"].as_str()?,
                    b["error"].as_str()?
                ))
            })
            .collect();
        let mut out = format!(
            "Generated by `bench/run-all` from [`bench/results/{file}`](results/{file}); do not edit by hand.\n\n\
             - date: {}, commit `{}`\n- machine: {}\n- load average (1/5/15 min) before: {}, after: {}\n- stores: {}\n",
            s("date"),
            s("git_commit"),
            s("machine"),
            s("load_before"),
            s("load_after"),
            s("stores"),
        );
        if !failed.is_empty() {
            let _ = writeln!(out, "- did not finish: {}", failed.join(", "));
        }
        out.push('\n');
        out.push_str(&self.render());
        out
    }
}

/// Replaces what lies between [`README_BEGIN`] and [`README_END`] in `readme` with `table`.
pub fn update_readme(readme: &Path, table: &str) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(readme)
        .with_context(|| format!("failed to read {}", readme.display()))?;
    let new = replace_between_markers(&text, table).with_context(|| {
        format!(
            "{} has no {README_BEGIN} … {README_END} markers",
            readme.display()
        )
    })?;
    std::fs::write(readme, new).with_context(|| format!("failed to write {}", readme.display()))
}

fn replace_between_markers(text: &str, table: &str) -> Option<String> {
    let begin = text.find(README_BEGIN)? + README_BEGIN.len();
    let end = begin + text[begin..].find(README_END)?;
    Some(format!(
        "{}\n{}\n{}",
        &text[..begin],
        table.trim_end(),
        &text[end..]
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(value: f64) -> serde_json::Value {
        serde_json::json!({ "benchmarks": [{ "name": "b", "figures": [
            Figure::new("p99", Some(value), "ms").at_most(20.0).to_json()
        ]}]})
    }

    #[test]
    fn a_change_of_more_than_ten_percent_is_flagged() {
        let before = run(10.0);
        assert_eq!(Comparison::new(&run(10.5), Some(&before)).flagged(), 0);
        let c = Comparison::new(&run(25.0), Some(&before));
        assert_eq!(c.flagged(), 1);
        let text = c.render();
        assert!(
            text.contains(
                "| b | p99 | 25 ms | 1 run | ≤ 20 ms | **missed** | 10 ms | **+150 %** |"
            ),
            "{text}"
        );
    }

    #[test]
    fn the_readme_table_replaces_only_what_lies_between_the_markers() {
        let text = format!("a\n{README_BEGIN}\nold\n{README_END}\nb\n");
        assert_eq!(
            replace_between_markers(&text, "new\n").as_deref(),
            Some(format!("a\n{README_BEGIN}\nnew\n{README_END}\nb\n").as_str())
        );
        assert_eq!(replace_between_markers("no markers", "x"), None);
    }

    #[test]
    fn results_files_sort_by_date_and_keep_their_mode() {
        assert_eq!(
            file_name("2026-12-01T14:30:00Z", false),
            "2026-12-01T14-30-00Z.json"
        );
        assert_eq!(
            file_name("2026-12-01T14:30:00Z", true),
            "quick-2026-12-01T14-30-00Z.json"
        );
        let dir = tempfile::tempdir().unwrap();
        for n in [
            "2026-11-01T00-00-00Z.json",
            "2026-12-01T00-00-00Z.json",
            "quick-2026-12-02T00-00-00Z.json",
        ] {
            std::fs::write(dir.path().join(n), "{}").unwrap();
        }
        let (path, _) = latest(dir.path(), false).unwrap();
        assert!(path.ends_with("2026-12-01T00-00-00Z.json"));
        let (path, _) = latest(dir.path(), true).unwrap();
        assert!(path.ends_with("quick-2026-12-02T00-00-00Z.json"));
    }
}
