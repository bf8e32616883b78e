use super::*;

#[test]
fn the_short_names_are_the_protos_names_without_their_prefix() {
    for i in 0..32 {
        if let Ok(s) = Stage::try_from(i) {
            let want = s
                .as_str_name()
                .trim_start_matches("STAGE_")
                .to_ascii_lowercase();
            assert_eq!(stage_name(i), want);
        }
        if let Ok(s) = EventStatus::try_from(i) {
            let want = s
                .as_str_name()
                .trim_start_matches("EVENT_STATUS_")
                .to_ascii_lowercase();
            assert_eq!(status_name(i), want);
        }
        if let Ok(s) = JobStatus::try_from(i) {
            let want = s
                .as_str_name()
                .trim_start_matches("JOB_STATUS_")
                .to_ascii_lowercase();
            assert_eq!(job_status_name(i), want);
        }
    }
}

#[test]
fn event_ids_print_parse_and_order_as_numbers() {
    let id: EventId = "1732950000000-12".parse().unwrap();
    assert_eq!(
        id,
        EventId {
            ms: 1_732_950_000_000,
            n: 12
        }
    );
    assert_eq!(id.to_string(), "1732950000000-12");
    let earlier: EventId = "1732950000000-9".parse().unwrap();
    assert!(earlier < id, "9 comes before 12, whatever the text says");
    assert!(id < "1732950000001-0".parse().unwrap());
}

#[test]
fn malformed_event_ids_are_refused_with_the_expected_form() {
    for bad in [
        "",
        "12",
        "-1",
        "1-",
        "a-1",
        "1-2-3",
        "+1-2",
        "1 -2",
        "99999999999999999999-0",
    ] {
        let e = bad.parse::<EventId>().unwrap_err();
        assert_eq!(
            e,
            format!(
                "event id {bad:?} is malformed; expected <milliseconds>-<sequence>, e.g. \
                 1732950000000-0"
            )
        );
    }
}

#[test]
fn an_event_id_of_a_job_takes_the_jobs_uuidv7_time() {
    // 0x0193a5b00000 ms: the timestamp field of this UUIDv7.
    let id = EventId::of("0193a5b0-0000-7000-8000-000000000000", 7);
    assert_eq!(
        id,
        EventId {
            ms: 0x0193_a5b0_0000,
            n: 7
        }
    );
    assert_eq!(EventId::of("not-a-uuid", 3), EventId { ms: 0, n: 3 });
    assert_eq!(
        EventId::of("7f8e2a9c-1d2b-4c3d-8e9f-0a1b2c3d4e5f", 1).ms,
        0,
        "a UUIDv4 has no time"
    );
}

#[test]
fn well_formed_ids_have_two_runs_of_at_most_twenty_digits() {
    assert!(EventId::is_well_formed("1718000000000-0"));
    assert!(EventId::is_well_formed("1-12"));
    assert!(EventId::is_well_formed("99999999999999999999-0"));
    for bad in [
        "1718000000000",
        "abc-1",
        "1-",
        "-1",
        "1-2-3",
        "+1-2",
        "123456789012345678901-0",
    ] {
        assert!(!EventId::is_well_formed(bad), "{bad}");
    }
}

#[test]
fn names_are_short_and_lowercase_and_only_done_is_final() {
    assert_eq!(stage_name(Stage::Vision as i32), "vision");
    assert_eq!(stage_name(Stage::Done as i32), "done");
    assert_eq!(status_name(EventStatus::Completed as i32), "completed");
    assert_eq!(status_name(99), "unspecified");
    assert_eq!(job_status_name(JobStatus::Running as i32), "running");
    let ev = |stage: Stage| ScanEvent {
        stage: stage as i32,
        ..ScanEvent::default()
    };
    assert!(is_final(&ev(Stage::Done)));
    assert!(!is_final(&ev(Stage::Reward)));
}
