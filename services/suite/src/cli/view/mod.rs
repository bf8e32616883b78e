//! `ScanView`: a scan's events drawn on a terminal (a bar per stage, the answer as it streams)
//! or printed as JSON lines, with the answer text built by the SSE contract's delta rule.

use std::{io::Write, time::Duration};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{Value, json};

/// The stages a person sees, in order.
const STAGES: [&str; 4] = ["vision", "rule", "answer", "reward"];

/// Draws a scan's events: a bar per stage and the answer as it streams (on a terminal), or one
/// JSON line per event (`json`).
pub struct ScanView {
    json: bool,
    bars: Vec<ProgressBar>,
    multi: MultiProgress,
    answer: String,
    /// A delta went past the end of the text we have (one was missed): the text waits for
    /// the answer's `completed` (or a result) to be whole again.
    answer_hole: bool,
    result: Option<Value>,
    error: Option<Value>,
}

impl ScanView {
    pub fn new(json: bool) -> Self {
        let multi = MultiProgress::with_draw_target(if json {
            ProgressDrawTarget::hidden()
        } else {
            ProgressDrawTarget::stderr()
        });
        let style = ProgressStyle::with_template("{prefix:>7} {spinner} {wide_msg} {elapsed:>4}")
            .expect("a valid template")
            .tick_chars("⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏✔");
        let bars = STAGES
            .iter()
            .map(|s| {
                let bar = multi.add(ProgressBar::new_spinner());
                bar.set_style(style.clone());
                bar.set_prefix(*s);
                bar.set_message("waiting");
                bar
            })
            .collect();
        Self {
            json,
            bars,
            multi,
            answer: String::new(),
            answer_hole: false,
            result: None,
            error: None,
        }
    }

    fn bar(&self, stage: &str) -> Option<&ProgressBar> {
        STAGES
            .iter()
            .position(|s| *s == stage)
            .map(|i| &self.bars[i])
    }

    pub fn event(&mut self, name: &str, data: &Value) {
        if self.json {
            println!("{}", json!({"event": name, "data": data}));
        }
        let stage = data["stage"].as_str().unwrap_or_default();
        let status = data["status"].as_str().unwrap_or_default();
        match name {
            "delta" => {
                if !self.answer_hole {
                    self.answer_hole = !apply_delta(
                        &mut self.answer,
                        data["offset"].as_u64(),
                        data["delta"].as_str().unwrap_or_default(),
                    );
                }
                if let Some(bar) = self.bar("answer") {
                    // The tail of the answer so far, on one line.
                    let tail: String = self.answer.chars().rev().take(60).collect();
                    let tail: String = tail.chars().rev().collect();
                    bar.set_message(tail.replace('\n', " "));
                }
            }
            "stage" => {
                // A new run of the answer stage: what an earlier run wrote is void.
                if stage == "answer" && matches!(status, "started" | "restarted") {
                    self.answer.clear();
                    self.answer_hole = false;
                }
                if let Some(bar) = self.bar(stage) {
                    match status {
                        "started" | "progress" => {
                            bar.enable_steady_tick(Duration::from_millis(100));
                            bar.set_message("running");
                        }
                        "restarted" => {
                            bar.enable_steady_tick(Duration::from_millis(100));
                            bar.set_message("running again");
                        }
                        "completed" => {
                            bar.finish_with_message(summary(stage, data));
                        }
                        "failed" => bar.abandon_with_message("failed"),
                        _ => {}
                    }
                }
                if status == "completed"
                    && stage == "answer"
                    && let Some(text) = data["answer"]["text"].as_str()
                {
                    self.answer = text.to_owned();
                    self.answer_hole = false;
                }
                if status == "completed" && stage == "reward" {
                    self.result = Some(data["reward"].clone());
                }
            }
            "error" => {
                for bar in &self.bars {
                    if !bar.is_finished() {
                        bar.abandon_with_message("not run");
                    }
                }
                self.error = Some(data["error"].clone());
            }
            "ready" => {
                for bar in &self.bars {
                    if !bar.is_finished() {
                        bar.finish_with_message("done");
                    }
                }
            }
            // After a `resync`: the job as its result says, in place of the missed events.
            "result" => {
                self.answer = data["answer"]["text"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                self.answer_hole = false;
                if data["reward"].is_object() {
                    self.result = Some(data["reward"].clone());
                }
            }
            _ => {}
        }
    }

    /// The answer text as it stands.
    pub fn answer(&self) -> &str {
        &self.answer
    }

    /// The closing lines: the answer and the character, or the error.
    pub fn finish(&self, job_id: &str) {
        let _ = self.multi.clear();
        if self.json {
            return;
        }
        let mut out = std::io::stdout().lock();
        if let Some(err) = &self.error {
            let _ = writeln!(
                out,
                "scan {job_id} failed: {} {}",
                err["code"].as_str().unwrap_or("?"),
                err["message"].as_str().unwrap_or_default()
            );
            return;
        }
        if !self.answer.is_empty() {
            let _ = writeln!(out, "\n{}\n", self.answer.trim());
        }
        if let Some(reward) = &self.result {
            let c = &reward["character"];
            match c["code"].as_str() {
                Some(code) if !code.is_empty() => {
                    let name = c["name_en"]
                        .as_str()
                        .filter(|n| !n.is_empty())
                        .or(c["name_ko"].as_str())
                        .unwrap_or(code);
                    let new = reward["newly_granted"].as_bool().unwrap_or(false);
                    let _ = writeln!(
                        out,
                        "character: {name} ({code}){}",
                        if new {
                            " — new!"
                        } else {
                            " — already yours"
                        }
                    );
                }
                _ => {
                    let _ = writeln!(
                        out,
                        "no character: {}",
                        reward["reason"].as_str().unwrap_or("not eligible")
                    );
                }
            }
        }
        let _ = writeln!(out, "job {job_id}");
    }
}

/// Applies an answer delta as the SSE contract says: keep the first `offset` code points of
/// `text`, append `delta`. False (and `text` unchanged) when `offset` is past the end of
/// `text`: a delta was missed. A delta without an offset (an older gateway) appends.
fn apply_delta(text: &mut String, offset: Option<u64>, delta: &str) -> bool {
    let have = text.chars().count();
    let offset = offset.map_or(have, |o| usize::try_from(o).unwrap_or(usize::MAX));
    if offset > have {
        return false;
    }
    if let Some((cut, _)) = text.char_indices().nth(offset) {
        text.truncate(cut);
    }
    text.push_str(delta);
    true
}

/// One line for a completed stage.
fn summary(stage: &str, data: &Value) -> String {
    match stage {
        "vision" => {
            let c = &data["classification"];
            format!(
                "{} / {} ({:.0} %)",
                c["major_category"].as_str().unwrap_or("?"),
                c["middle_category"].as_str().unwrap_or("?"),
                c["confidence"].as_f64().unwrap_or(0.0) * 100.0
            )
        }
        "rule" => data["rules"]["stream_name"]
            .as_str()
            .filter(|s| !s.is_empty())
            .unwrap_or("rules found")
            .to_owned(),
        "answer" => "written".into(),
        "reward" => data["reward"]["reason"]
            .as_str()
            .unwrap_or("evaluated")
            .to_owned(),
        _ => "done".into(),
    }
}

#[cfg(test)]
mod tests;
