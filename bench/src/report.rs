//! What a benchmark prints: a header (command, date, machine, load, stores, settings) and a
//! Markdown table of figures beside their targets from DESIGN.md, ready to paste into the
//! README; and, when [`JSON_OUT_VAR`] names a file, its [`Figure`]s as JSON for `all`.

use std::{fmt::Write as _, time::SystemTime};

/// Whether a figure meets its target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Met,
    Missed,
    /// A figure without a target (context).
    Info,
}

impl Verdict {
    /// `Met` when `ok`, else `Missed`.
    pub fn of(ok: bool) -> Self {
        if ok { Self::Met } else { Self::Missed }
    }

    fn mark(self) -> &'static str {
        match self {
            Self::Met => "met",
            Self::Missed => "**missed**",
            Self::Info => "",
        }
    }
}

/// Variable naming a file to which [`Report::print`] also writes the report's figures as JSON
/// (the `all` benchmark sets it for each benchmark it runs).
pub const JSON_OUT_VAR: &str = "BENCH_JSON_OUT";

/// Which way a figure must lie from its target value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Bound {
    AtMost(f64),
    AtLeast(f64),
}

impl Bound {
    fn holds(self, v: f64) -> bool {
        match self {
            Self::AtMost(t) => v <= t,
            Self::AtLeast(t) => v >= t,
        }
    }
}

/// One measured number, as the results file keeps it: compared with its target and with the
/// previous run's.
#[derive(Clone, Debug, PartialEq)]
pub struct Figure {
    pub name: String,
    /// `None` when it could not be measured (counts as a missed target).
    pub value: Option<f64>,
    pub unit: String,
    pub target: Option<Bound>,
    /// Runs the value summarises (the median of them when more than one).
    pub runs: u32,
    /// Largest minus smallest value over the runs (`None` for a single run).
    pub spread: Option<f64>,
}

impl Figure {
    /// A figure of one run, without a target.
    pub fn new(name: &str, value: Option<f64>, unit: &str) -> Self {
        Self {
            name: name.to_owned(),
            value,
            unit: unit.to_owned(),
            target: None,
            runs: 1,
            spread: None,
        }
    }

    /// The median of `values` (one per run) with their spread.
    pub fn of_runs(name: &str, values: &[f64], unit: &str) -> Self {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        let median = (!v.is_empty()).then(|| {
            let n = v.len();
            if n % 2 == 1 {
                v[n / 2]
            } else {
                (v[n / 2 - 1] + v[n / 2]) / 2.0
            }
        });
        Self {
            runs: u32::try_from(values.len()).unwrap_or(u32::MAX),
            spread: (v.len() > 1).then(|| v[v.len() - 1] - v[0]),
            ..Self::new(name, median, unit)
        }
    }

    /// The largest of `values` (one per run) with their spread: for a target that every run
    /// must meet ("p99 ≤ 20 ms in each of five runs").
    pub fn worst_of_runs(name: &str, values: &[f64], unit: &str) -> Self {
        let max = values
            .iter()
            .copied()
            .filter(|x| x.is_finite())
            .max_by(f64::total_cmp);
        Self {
            value: max,
            ..Self::of_runs(name, values, unit)
        }
    }

    pub fn at_most(mut self, target: f64) -> Self {
        self.target = Some(Bound::AtMost(target));
        self
    }

    pub fn at_least(mut self, target: f64) -> Self {
        self.target = Some(Bound::AtLeast(target));
        self
    }

    /// Whether the value meets the target (`None` without a target).
    pub fn met(&self) -> Option<bool> {
        let target = self.target?;
        Some(self.value.is_some_and(|v| target.holds(v)))
    }

    /// `12.3 ms` (`–` when not measured).
    pub fn value_text(&self) -> String {
        self.value.map_or_else(
            || "–".to_owned(),
            |v| format!("{} {}", number(v), self.unit),
        )
    }

    /// `≤ 200 ms` (empty without a target).
    pub fn target_text(&self) -> String {
        match self.target {
            None => String::new(),
            Some(Bound::AtMost(t)) => format!("≤ {} {}", number(t), self.unit),
            Some(Bound::AtLeast(t)) => format!("≥ {} {}", number(t), self.unit),
        }
    }

    /// `5 runs, spread 1.2 ms` or `1 run`.
    pub fn runs_text(&self) -> String {
        match self.spread {
            Some(s) => format!("{} runs, spread {} {}", self.runs, number(s), self.unit),
            None if self.runs == 1 => "1 run".to_owned(),
            None => format!("{} runs", self.runs),
        }
    }

    pub fn to_json(&self) -> serde_json::Value {
        let (op, target) = match self.target {
            None => (None, None),
            Some(Bound::AtMost(t)) => (Some("<="), Some(t)),
            Some(Bound::AtLeast(t)) => (Some(">="), Some(t)),
        };
        serde_json::json!({
            "name": self.name,
            "value": self.value,
            "unit": self.unit,
            "target": target.map(|t| serde_json::json!({ "op": op, "value": t })),
            "met": self.met(),
            "runs": self.runs,
            "spread": self.spread,
        })
    }

    pub fn from_json(v: &serde_json::Value) -> Option<Self> {
        let target = v.get("target").filter(|t| !t.is_null()).and_then(|t| {
            let value = t.get("value")?.as_f64()?;
            match t.get("op")?.as_str()? {
                "<=" => Some(Bound::AtMost(value)),
                ">=" => Some(Bound::AtLeast(value)),
                _ => None,
            }
        });
        Some(Self {
            name: v.get("name")?.as_str()?.to_owned(),
            value: v.get("value").and_then(serde_json::Value::as_f64),
            unit: v.get("unit")?.as_str()?.to_owned(),
            target,
            runs: v
                .get("runs")
                .and_then(serde_json::Value::as_u64)
                .and_then(|n| u32::try_from(n).ok())
                .unwrap_or(1),
            spread: v.get("spread").and_then(serde_json::Value::as_f64),
        })
    }
}

/// A number with as many digits as it deserves: `1,234`, `12.3`, `0.152`.
pub fn number(v: f64) -> String {
    let a = v.abs();
    if a >= 1000.0 {
        crate::stats::thousands(v)
    } else if a >= 100.0 || a == 0.0 || (v.fract() == 0.0 && a >= 1.0) {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

struct Row {
    figure: String,
    measured: String,
    target: String,
    verdict: Verdict,
}

/// A benchmark's printed result.
pub struct Report {
    title: String,
    started: SystemTime,
    load_at_start: String,
    cpu_at_start: Option<(u64, u64)>,
    header: Vec<(String, String)>,
    rows: Vec<Row>,
    figures: Vec<Figure>,
    notes: Vec<String>,
}

impl Report {
    /// Starts a report now (the date and the load average are taken here, before the run).
    pub fn new(title: &str) -> Self {
        Self {
            title: title.to_owned(),
            started: SystemTime::now(),
            load_at_start: crate::system::loadavg(),
            cpu_at_start: crate::system::machine_cpu(),
            header: Vec::new(),
            rows: Vec::new(),
            figures: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// A line of the header (`settings`, `stores`, …).
    pub fn header(&mut self, key: &str, value: impl Into<String>) -> &mut Self {
        self.header.push((key.to_owned(), value.into()));
        self
    }

    /// A figure with its target.
    pub fn row(
        &mut self,
        figure: &str,
        measured: impl Into<String>,
        target: &str,
        verdict: Verdict,
    ) -> &mut Self {
        self.rows.push(Row {
            figure: figure.to_owned(),
            measured: measured.into(),
            target: target.to_owned(),
            verdict,
        });
        self
    }

    /// A figure without a target.
    pub fn info(&mut self, figure: &str, measured: impl Into<String>) -> &mut Self {
        self.row(figure, measured, "", Verdict::Info)
    }

    /// A figure for the results file only (the table says it in a row of its own words).
    pub fn figure(&mut self, figure: Figure) -> &mut Self {
        self.figures.push(figure);
        self
    }

    /// A figure both in the table (value, target, runs and spread) and in the results file.
    pub fn measure(&mut self, figure: Figure) -> &mut Self {
        let measured = if figure.runs > 1 {
            format!("{} ({})", figure.value_text(), figure.runs_text())
        } else {
            figure.value_text()
        };
        let verdict = figure.met().map_or(Verdict::Info, Verdict::of);
        let target = figure.target_text();
        let name = figure.name.clone();
        self.row(&name, measured, &target, verdict);
        self.figure(figure)
    }

    /// The figures for the results file.
    pub fn figures(&self) -> &[Figure] {
        &self.figures
    }

    /// A sentence printed under the table.
    pub fn note(&mut self, note: impl Into<String>) -> &mut Self {
        self.notes.push(note.into());
        self
    }

    /// Whether any figure missed its target.
    pub fn any_missed(&self) -> bool {
        self.rows.iter().any(|r| r.verdict == Verdict::Missed)
    }

    /// The report as text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let command: Vec<String> = std::env::args().skip(1).collect();
        let _ = writeln!(out, "\n## {}\n", self.title);
        let _ = writeln!(
            out,
            "- command: `cargo run --release -p ecoscan-bench --bin {} --{}{}`",
            self.title,
            if command.is_empty() { "" } else { " " },
            command.join(" ")
        );
        let _ = writeln!(
            out,
            "- date: {}",
            humantime::format_rfc3339_seconds(self.started)
        );
        let _ = writeln!(out, "- machine: {}", crate::system::machine());
        let _ = writeln!(
            out,
            "- load average (1/5/15 min) before: {}, after: {}",
            self.load_at_start,
            crate::system::loadavg()
        );
        if let Some(busy) = self
            .cpu_at_start
            .zip(crate::system::machine_cpu())
            .and_then(|(a, b)| crate::system::busy_percent(a, b))
        {
            let _ = writeln!(
                out,
                "- machine CPU busy during the run (all processes, all cores): {busy:.0} %"
            );
        }
        for (k, v) in &self.header {
            let _ = writeln!(out, "- {k}: {v}");
        }
        let _ = writeln!(out, "\n| figure | measured | target | |");
        let _ = writeln!(out, "|---|---|---|---|");
        for r in &self.rows {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} |",
                r.figure,
                r.measured,
                r.target,
                r.verdict.mark()
            );
        }
        for n in &self.notes {
            let _ = writeln!(out, "\n{n}");
        }
        out
    }

    /// The report as the results file holds it (the machine and the load are the caller's).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "name": self.title,
            "date": humantime::format_rfc3339_seconds(self.started).to_string(),
            "settings": self.header.iter().map(|(k, v)| serde_json::json!({ "key": k, "value": v })).collect::<Vec<_>>(),
            "load_before": self.load_at_start,
            "load_after": crate::system::loadavg(),
            "figures": self.figures.iter().map(Figure::to_json).collect::<Vec<_>>(),
            "notes": self.notes,
        })
    }

    /// Prints the report on stdout and, when [`JSON_OUT_VAR`] names a file, writes
    /// [`Self::to_json`] there.
    pub fn print(&self) {
        println!("{}", self.render());
        if let Some(path) = std::env::var_os(JSON_OUT_VAR).filter(|p| !p.is_empty())
            && let Err(e) = std::fs::write(&path, self.to_json().to_string())
        {
            eprintln!(
                "failed to write {}: {e}",
                std::path::Path::new(&path).display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_is_a_markdown_table_with_the_verdicts() {
        let mut r = Report::new("scan-load");
        r.header("settings", "1000 users")
            .row("success", "100 %", "100 %", Verdict::of(true))
            .row("E2E p95", "18 s", "≤ 17 s", Verdict::of(false))
            .info("scans", "42");
        let text = r.render();
        assert!(text.contains("- settings: 1000 users"));
        assert!(text.contains("| success | 100 % | 100 % | met |"));
        assert!(text.contains("| E2E p95 | 18 s | ≤ 17 s | **missed** |"));
        assert!(text.contains("| scans | 42 |  |  |"));
        assert!(r.any_missed());
    }

    #[test]
    fn a_figure_of_runs_is_their_median_with_the_spread() {
        let f = Figure::of_runs("p99", &[5.0, 1.0, 3.0, 9.0, 4.0], "ms").at_most(4.0);
        assert_eq!(f.value, Some(4.0));
        assert_eq!(f.spread, Some(8.0));
        assert_eq!(f.runs, 5);
        assert_eq!(f.met(), Some(true));
        assert_eq!(f.runs_text(), "5 runs, spread 8 ms");
        assert_eq!(Figure::from_json(&f.to_json()), Some(f));
    }

    #[test]
    fn an_unmeasured_figure_misses_its_target() {
        let worst = Figure::worst_of_runs("p99", &[5.0, 1.0, 3.0, 9.0, 4.0], "ms").at_most(8.0);
        assert_eq!(worst.value, Some(9.0));
        assert_eq!(
            worst.met(),
            Some(false),
            "one run above the target misses it"
        );
        let f = Figure::new("lost", None, "").at_most(0.0);
        assert_eq!(f.met(), Some(false));
        assert_eq!(f.value_text(), "–");
        assert_eq!(Figure::new("x", Some(1.0), "").met(), None);
    }
}
