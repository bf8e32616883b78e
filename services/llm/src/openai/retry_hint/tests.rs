use super::*;

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (k, v) in pairs {
        h.insert(*k, http::HeaderValue::from_str(v).unwrap());
    }
    h
}

fn hint(pairs: &[(&'static str, &str)]) -> Option<Duration> {
    retry_after(&headers(pairs), SystemTime::now())
}

#[test]
fn retry_after_in_seconds_and_milliseconds_with_milliseconds_first() {
    assert_eq!(hint(&[("retry-after", "2")]), Some(Duration::from_secs(2)));
    assert_eq!(
        hint(&[("retry-after", "0.25")]),
        Some(Duration::from_millis(250))
    );
    assert_eq!(
        hint(&[("retry-after", "2"), ("retry-after-ms", "150")]),
        Some(Duration::from_millis(150))
    );
    assert_eq!(hint(&[("retry-after", "-1")]), None);
    assert_eq!(hint(&[("retry-after", "soon")]), None);
    assert_eq!(hint(&[]), None);
}

#[test]
fn retry_after_as_an_http_date_waits_until_that_time() {
    let now = httpdate::parse_http_date("Wed, 21 Oct 2015 07:28:00 GMT").unwrap();
    let h = headers(&[("retry-after", "Wed, 21 Oct 2015 07:28:05 GMT")]);
    assert_eq!(retry_after(&h, now), Some(Duration::from_secs(5)));
    let past = headers(&[("retry-after", "Wed, 21 Oct 2015 07:27:00 GMT")]);
    assert_eq!(retry_after(&past, now), Some(Duration::ZERO));
}

#[test]
fn litellm_forwards_the_upstream_hint_under_its_prefix() {
    assert_eq!(
        hint(&[("llm_provider-retry-after", "2")]),
        Some(Duration::from_secs(2))
    );
    // The proxy's own hint and the upstream's: the longer one.
    assert_eq!(
        hint(&[("retry-after", "1"), ("llm_provider-retry-after", "2")]),
        Some(Duration::from_secs(2))
    );
    assert_eq!(
        hint(&[("llm_provider-retry-after-ms", "700")]),
        Some(Duration::from_millis(700))
    );
}

#[test]
fn rate_limit_reset_times_in_openai_duration_format() {
    assert_eq!(
        hint(&[("x-ratelimit-reset-requests", "1s")]),
        Some(Duration::from_secs(1))
    );
    // The limit that ran out decides.
    assert_eq!(
        hint(&[
            ("x-ratelimit-reset-requests", "20ms"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-tokens", "6m0s"),
            ("x-ratelimit-remaining-tokens", "5000"),
        ]),
        Some(Duration::from_millis(20))
    );
    // Not saying which: the later reset.
    assert_eq!(
        hint(&[
            ("x-ratelimit-reset-requests", "20ms"),
            ("x-ratelimit-reset-tokens", "7.66s"),
        ]),
        Some(Duration::from_millis(7_660))
    );
    assert_eq!(
        hint(&[("llm_provider-x-ratelimit-reset-tokens", "1m30s")]),
        Some(Duration::from_secs(90))
    );
    // An explicit wait wins over a reset time.
    assert_eq!(
        hint(&[("retry-after", "3"), ("x-ratelimit-reset-tokens", "6m0s")]),
        Some(Duration::from_secs(3))
    );
}

#[test]
fn openai_durations_parse_like_go_durations_and_refuse_garbage() {
    for (s, d) in [
        ("1s", Duration::from_secs(1)),
        ("6m0s", Duration::from_secs(360)),
        ("20ms", Duration::from_millis(20)),
        ("1h2m3.5s", Duration::from_millis(3_723_500)),
        ("250us", Duration::from_micros(250)),
        ("0", Duration::ZERO),
    ] {
        assert_eq!(parse_openai_duration(s), Some(d), "{s}");
    }
    for s in ["", "s", "5", "5w", "1s2", "-1s", "abc"] {
        assert_eq!(parse_openai_duration(s), None, "{s}");
    }
}

#[test]
fn a_huge_hint_is_capped_at_a_day() {
    assert_eq!(hint(&[("retry-after", "1e12")]), Some(MAX_HINT));
}
