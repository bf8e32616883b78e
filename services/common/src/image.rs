//! The image types ecoscan takes, told from the bytes: the gateway, ingest and vision all check
//! a photo this way and must agree.

/// The image's MIME type from its first bytes: JPEG, PNG, GIF or WebP; `None` for anything else.
pub fn sniff(bytes: &[u8]) -> Option<&'static str> {
    if bytes.starts_with(&[0xFF, 0xD8, 0xFF]) {
        Some("image/jpeg")
    } else if bytes.starts_with(b"\x89PNG\r\n\x1a\n") {
        Some("image/png")
    } else if bytes.starts_with(b"GIF87a") || bytes.starts_with(b"GIF89a") {
        Some("image/gif")
    } else if bytes.len() >= 12 && &bytes[..4] == b"RIFF" && &bytes[8..12] == b"WEBP" {
        Some("image/webp")
    } else {
        None
    }
}

/// The one rule for a type the sender declared beside the bytes (a multipart part's
/// `Content-Type`, `SubmitRequest.content_type`), the same at the gateway and at ingest: no
/// declaration (empty, or `application/octet-stream`, which curl and many clients send for a file
/// of unknown type) defers to the bytes; any other must name the type the bytes are (`bytes_are`,
/// from [`sniff`]), parameters and case aside, `image/jpg` and `image/pjpeg` meaning JPEG.
/// A contradiction is refused, saying what the bytes are.
pub fn check_declared(declared: &str, bytes_are: &str) -> Result<(), String> {
    if matches!(essence(declared).as_str(), "" | "application/octet-stream")
        || declared_type(declared) == Some(bytes_are)
    {
        Ok(())
    } else {
        Err(format!(
            "the image is declared {declared:?} but its bytes are {bytes_are}; declare \
             {bytes_are}, or no type"
        ))
    }
}

/// The image type a declared MIME type names, parameters and case aside (`image/jpg` and
/// `image/pjpeg` meaning JPEG): one of those [`sniff`] tells, or `None` for any other type.
pub fn declared_type(declared: &str) -> Option<&'static str> {
    match essence(declared).as_str() {
        "image/jpeg" | "image/jpg" | "image/pjpeg" => Some("image/jpeg"),
        "image/png" => Some("image/png"),
        "image/webp" => Some("image/webp"),
        "image/gif" => Some("image/gif"),
        _ => None,
    }
}

/// A MIME type without its parameters, lower case.
fn essence(declared: &str) -> String {
    declared
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declared_types_are_the_four_image_types() {
        assert_eq!(declared_type("image/jpg"), Some("image/jpeg"));
        assert_eq!(declared_type("IMAGE/PNG; x=y"), Some("image/png"));
        assert_eq!(declared_type("image/webp"), Some("image/webp"));
        assert_eq!(declared_type("image/gif"), Some("image/gif"));
        for refused in [
            "",
            "application/octet-stream",
            "text/plain",
            "image/svg+xml",
        ] {
            assert_eq!(declared_type(refused), None, "{refused}");
        }
    }

    #[test]
    fn a_declared_type_must_name_what_the_bytes_are() {
        for agrees in [
            "",
            "application/octet-stream",
            "image/jpeg",
            "IMAGE/JPEG",
            "image/jpeg; charset=binary",
            "image/jpg",
            "image/pjpeg",
        ] {
            assert_eq!(check_declared(agrees, "image/jpeg"), Ok(()), "{agrees}");
        }
        let refused = check_declared("image/png", "image/jpeg").unwrap_err();
        assert!(
            refused.contains("\"image/png\"") && refused.contains("bytes are image/jpeg"),
            "{refused}"
        );
        assert!(check_declared("text/plain", "image/gif").is_err());
        assert!(check_declared("image/webp", "image/png").is_err());
    }

    #[test]
    fn sniffs_the_four_image_types_and_nothing_else() {
        assert_eq!(sniff(&[0xFF, 0xD8, 0xFF, 0xE0, 0]), Some("image/jpeg"));
        assert_eq!(sniff(b"\x89PNG\r\n\x1a\n...."), Some("image/png"));
        assert_eq!(sniff(b"GIF89a...."), Some("image/gif"));
        assert_eq!(sniff(b"RIFF\x10\0\0\0WEBPVP8 "), Some("image/webp"));
        assert_eq!(sniff(b"RIFF\x10\0\0\0WAVEfmt "), None);
        assert_eq!(sniff(b"%PDF-1.7"), None);
        assert_eq!(sniff(b""), None);
    }
}
