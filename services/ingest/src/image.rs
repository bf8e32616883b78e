//! Image intake: sniffing the type from the bytes. Fetching an image by URL is
//! [`crate::fetch`].

use crate::error::Error;

/// The image type the bytes really are, or `None` when they are not an image we accept.
pub use ecoscan_common::image::sniff;

/// Checks the bytes and returns their real content type.
pub fn validate(bytes: &[u8], declared: &str, max_bytes: usize) -> Result<&'static str, Error> {
    if bytes.is_empty() {
        return Err(Error::invalid(
            "image",
            "image is empty; send the photo's bytes in `image` or a URL in `image_url`",
        ));
    }
    if bytes.len() > max_bytes {
        return Err(Error::invalid(
            "image",
            format!(
                "image is {} bytes; the limit is {max_bytes} bytes",
                bytes.len()
            ),
        ));
    }
    let found = sniff(bytes).ok_or_else(|| {
        Error::invalid("image", "the bytes are not a JPEG, PNG, WebP or GIF image")
    })?;
    // The rule the gateway applies too: a declaration must name what the bytes are.
    ecoscan_common::image::check_declared(declared, found)
        .map_err(|why| Error::invalid("content_type", why))?;
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sniff_recognises_the_accepted_formats() {
        assert_eq!(sniff(&[0xFF, 0xD8, 0xFF, 0xE0]), Some("image/jpeg"));
        assert_eq!(sniff(b"\x89PNG\r\n\x1a\n...."), Some("image/png"));
        assert_eq!(sniff(b"GIF89a..."), Some("image/gif"));
        assert_eq!(sniff(b"RIFF\0\0\0\0WEBPVP8 "), Some("image/webp"));
        assert_eq!(sniff(b"%PDF-1.7"), None);
        assert_eq!(sniff(b""), None);
    }

    #[test]
    fn validate_rejects_empty_oversized_and_non_images() {
        assert!(validate(b"", "", 10).is_err());
        assert!(validate(&[0xFF, 0xD8, 0xFF, 0, 0, 0], "", 4).is_err());
        assert!(validate(b"hello world", "", 100).is_err());
        assert!(validate(&[0xFF, 0xD8, 0xFF, 0], "text/plain", 100).is_err());
        assert_eq!(
            validate(&[0xFF, 0xD8, 0xFF, 0], "", 100).unwrap(),
            "image/jpeg"
        );
        assert_eq!(
            validate(&[0xFF, 0xD8, 0xFF, 0], "image/jpeg", 100).unwrap(),
            "image/jpeg"
        );
        // A declaration that contradicts the bytes is refused, saying what they are.
        let Err(Error::InvalidArgument { field, message }) =
            validate(&[0xFF, 0xD8, 0xFF, 0], "image/png", 100)
        else {
            panic!("a PNG declaration of JPEG bytes is refused");
        };
        assert_eq!(field, "content_type");
        assert!(message.contains("bytes are image/jpeg"), "{message}");
    }
}
