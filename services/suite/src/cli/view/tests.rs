//! The answer-delta rule of the SSE contract, as `ScanView` applies it.

use super::*;

fn view_of(events: &[(&str, Value)]) -> ScanView {
    let mut view = ScanView::new(false);
    for (name, data) in events {
        view.event(name, data);
    }
    view
}

#[test]
fn deltas_go_at_their_offset_and_a_restarted_answer_starts_again() {
    let delta = |text: &str, offset: u64| {
        (
            "delta",
            json!({"stage": "answer", "status": "delta", "delta": text, "offset": offset}),
        )
    };
    let stage = |status: &str| ("stage", json!({"stage": "answer", "status": status}));
    let view = view_of(&[
        stage("started"),
        delta("Rinse it. ", 0),
        delta("Remove the label. ", 10),
        stage("restarted"),
        delta("Remove the label, ", 0),
        delta("rinse, ", 18),
        // A repeat of a piece already applied changes nothing.
        delta("rinse, ", 18),
        delta("crush.", 25),
    ]);
    assert_eq!(view.answer, "Remove the label, rinse, crush.");
    assert!(!view.answer_hole);
}

#[test]
fn offsets_count_code_points_and_a_missed_delta_leaves_a_hole_until_completed() {
    let mut text = String::from("분리배출");
    assert!(apply_delta(&mut text, Some(2), "수거"));
    assert_eq!(text, "분리수거");
    assert!(!apply_delta(&mut text, Some(9), "x"));
    assert_eq!(text, "분리수거");
    assert!(apply_delta(&mut text, None, "!"));
    assert_eq!(text, "분리수거!");

    let mut view = view_of(&[(
        "delta",
        json!({"stage": "answer", "status": "delta", "delta": "late", "offset": 40}),
    )]);
    assert!(view.answer_hole);
    view.event(
        "stage",
        &json!({"stage": "answer", "status": "completed", "answer": {"text": "whole"}}),
    );
    assert_eq!(view.answer, "whole");
    view.event("result", &json!({"answer": {"text": "stored"}}));
    assert_eq!(view.answer, "stored");
}
