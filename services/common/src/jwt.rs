//! Plain words for a refused JWT (a gateway token, an SSE ticket, an identity assertion), so
//! that no caller reads `jsonwebtoken`'s own text (`InvalidAudience`, `JSON error: unknown
//! variant ...`): each says what is wrong with the token, in words a person can act on.

use jsonwebtoken::errors::{Error, ErrorKind};

/// Why `e` refused a token, as the end of a sentence ("the token is not valid: …").
pub fn refusal(e: &Error) -> String {
    match e.kind() {
        ErrorKind::ExpiredSignature => "it has expired (`exp` is past)".to_owned(),
        ErrorKind::ImmatureSignature => "it is not valid yet (`nbf` is ahead)".to_owned(),
        ErrorKind::InvalidSignature => {
            "its signature does not match: it was signed with another key".to_owned()
        }
        ErrorKind::InvalidAudience => {
            "it is for another audience (`aud` names someone else)".to_owned()
        }
        ErrorKind::InvalidIssuer => "it comes from another issuer (`iss`)".to_owned(),
        ErrorKind::InvalidSubject => "its subject (`sub`) is not accepted".to_owned(),
        ErrorKind::MissingRequiredClaim(claim) => format!("it carries no `{claim}` claim"),
        ErrorKind::InvalidClaimFormat(claim) => {
            format!("its `{claim}` claim has the wrong type")
        }
        ErrorKind::InvalidAlgorithm
        | ErrorKind::UnsupportedAlgorithm
        | ErrorKind::InvalidAlgorithmName
        | ErrorKind::MissingAlgorithm => {
            "it is signed with an algorithm not accepted here".to_owned()
        }
        // A header naming an algorithm the library does not know (`none`) fails to parse.
        ErrorKind::Json(_) => "its header or claims cannot be read: an algorithm not accepted \
                               here (such as `none`) or a claim of the wrong type"
            .to_owned(),
        ErrorKind::InvalidToken | ErrorKind::Base64(_) | ErrorKind::Utf8(_) => {
            "it is not a JWT (three base64url parts: header, claims, signature)".to_owned()
        }
        _ => "it cannot be checked here".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};

    use super::*;

    fn decode(token: &str, v: &Validation) -> Error {
        jsonwebtoken::decode::<serde_json::Value>(
            token,
            &DecodingKey::from_secret(b"0123456789abcdef0123456789abcdef").unwrap(),
            v,
        )
        .unwrap_err()
    }

    #[test]
    fn no_refusal_shows_the_library_s_words() {
        let key = EncodingKey::from_secret(b"0123456789abcdef0123456789abcdef").unwrap();
        let signed = |claims: serde_json::Value| {
            jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &key).unwrap()
        };
        let mut v = Validation::new(Algorithm::HS256);
        v.set_audience(&["a"]);
        let far = u64::MAX / 4;
        // `alg: none`, which the library cannot even parse.
        let none = "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.eyJzdWIiOiJ4In0.";
        let cases = [
            (decode(none, &v), "algorithm not accepted"),
            (
                decode(&signed(serde_json::json!({"aud": "b", "exp": far})), &v),
                "another audience",
            ),
            (
                decode(&signed(serde_json::json!({"aud": "a", "exp": 1})), &v),
                "expired",
            ),
            (
                decode(&signed(serde_json::json!({"aud": "a"})), &v),
                "no `exp`",
            ),
            (decode("garbage", &v), "not a JWT"),
        ];
        for (e, expected) in cases {
            let words = refusal(&e);
            assert!(words.contains(expected), "{e}: {words}");
            for library in ["JSON error", "Invalid", "Expired", "variant", "Error"] {
                assert!(!words.contains(library), "{words}");
            }
        }
    }
}
