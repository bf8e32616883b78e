use super::*;

fn parts(uri: &str, headers: &[(&str, &str)]) -> Parts {
    let mut req = axum::http::Request::builder().uri(uri);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.body(()).unwrap().into_parts().0
}

const SECRET: &str = "kq3Zx9LrT0vYp2WmB7nHc4JdF8sG1aE6";

fn auth() -> Authenticator {
    Authenticator::new(AuthConfig {
        hs256_secret: Some(SECRET.into()),
        issuer: Some("iss".into()),
        audience: Some("aud".into()),
        ..AuthConfig::default()
    })
    .unwrap()
}

#[test]
fn tokens_come_from_the_bearer_header_and_cookies_only() {
    let p = parts("/x", &[("authorization", "bearer abc")]);
    assert_eq!(bearer(&p).as_deref(), Some("abc"));
    assert_eq!(
        bearer(&parts("/x", &[("authorization", "Basic abc")])),
        None
    );
    let p = parts("/x?a=1&ticket=q1", &[("cookie", "a=b; ecoscan_token=c1")]);
    assert_eq!(query_param(&p, "ticket").as_deref(), Some("q1"));
    assert_eq!(token_cookie(&p).as_deref(), Some("c1"));
    assert_eq!(token_cookie(&parts("/x", &[("cookie", "other=1")])), None);
}

#[tokio::test]
async fn a_token_in_the_url_is_refused_and_nobody_is_anonymous() {
    let a = auth();
    let t = mint(
        SECRET,
        "alice",
        false,
        "iss",
        "aud",
        Duration::from_secs(60),
    )
    .unwrap();
    let p = parts(&format!("/x?access_token={t}"), &[]);
    assert_eq!(a.caller(&p).await, Err(AuthError::TokenInUrl));
    assert_eq!(a.caller(&parts("/x", &[])).await, Err(AuthError::Missing));
    assert_eq!(
        a.caller(&parts("/x", &[("x-user-id", "mallory")])).await,
        Err(AuthError::Missing)
    );
}

#[tokio::test]
async fn minted_tokens_verify_and_carry_the_admin_role() {
    let a = auth();
    let ttl = Duration::from_secs(60);
    let t = mint(SECRET, "alice", false, "iss", "aud", ttl).unwrap();
    assert_eq!(
        a.verify(&t).await.unwrap(),
        Caller {
            user: "alice".into(),
            admin: false
        }
    );
    let t = mint(SECRET, "root", true, "iss", "aud", ttl).unwrap();
    assert!(a.verify(&t).await.unwrap().admin);
    let t = mint(SECRET, "alice", false, "other", "aud", ttl).unwrap();
    assert!(matches!(a.verify(&t).await, Err(AuthError::Invalid(_))));
    // Without the `iss` and `aud` this gateway requires: refused, not waved through.
    let bare = |claims: serde_json::Value| {
        jsonwebtoken::encode(
            &jsonwebtoken::Header::new(Algorithm::HS256),
            &claims,
            &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()).unwrap(),
        )
        .unwrap()
    };
    let exp = u64::MAX / 4;
    for claims in [
        serde_json::json!({"sub": "alice", "exp": exp, "aud": "aud"}),
        serde_json::json!({"sub": "alice", "exp": exp, "iss": "iss"}),
    ] {
        assert!(a.verify(&bare(claims.clone())).await.is_err(), "{claims}");
    }
    let whole = serde_json::json!({"sub": "alice", "exp": exp, "iss": "iss", "aud": "aud"});
    assert!(a.verify(&bare(whole)).await.is_ok());
    assert!(mint(SECRET, "not a user", false, "iss", "aud", ttl).is_err());
}

#[tokio::test]
async fn refused_tokens_are_told_in_plain_words() {
    let a = auth();
    let ttl = Duration::from_secs(60);
    let none = "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.eyJzdWIiOiJ4In0.";
    let cases = [
        (none.to_owned(), "algorithm not accepted"),
        (
            mint(SECRET, "alice", false, "iss", "other", ttl).unwrap(),
            "another audience",
        ),
        (
            mint(
                "another secret of 32 bytes or more",
                "alice",
                false,
                "iss",
                "aud",
                ttl,
            )
            .unwrap(),
            "signed with another key",
        ),
        ("nonsense".to_owned(), "not a JWT"),
    ];
    for (token, expected) in cases {
        let words = a.verify(&token).await.unwrap_err().to_string();
        assert!(words.contains(expected), "{words}");
        for library in [
            "JSON error",
            "InvalidAudience",
            "InvalidSignature",
            "variant",
        ] {
            assert!(!words.contains(library), "{words}");
        }
    }
}

#[test]
fn only_api_routes_need_a_caller() {
    assert!(is_public(Some("/")));
    assert!(is_public(Some("/healthz")));
    assert!(is_public(Some("/api/v1/openapi.json")));
    assert!(is_public(None));
    assert!(!is_public(Some("/api/v1/scan")));
    assert!(!is_public(Some("/api/v1/sse-tickets")));
}
