//! What a benchmark prints: a header (command, date, machine, load, stores, settings) and a
//! Markdown table of figures beside their targets from DESIGN.md, ready to paste into the
//! README.

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

    /// Prints the report on stdout.
    pub fn print(&self) {
        println!("{}", self.render());
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
}
