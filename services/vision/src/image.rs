//! Checking that an upload is an image of a supported type.

use crate::error::Error;

/// Types the model accepts as image input.
const SUPPORTED: [&str; 4] = ["image/jpeg", "image/png", "image/webp", "image/gif"];

/// Checks the declared type and the bytes; returns the type the bytes really are (the one sent
/// to the model, since browsers sometimes label a JPEG as PNG).
pub(crate) fn check(image: &[u8], content_type: &str) -> Result<&'static str, Error> {
    if image.is_empty() {
        return Err(Error::EmptyImage);
    }
    // "image/jpeg; charset=binary" and "IMAGE/JPEG" mean image/jpeg.
    let declared = content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    if !SUPPORTED.contains(&declared.as_str()) {
        return Err(Error::UnsupportedContentType(content_type.to_owned()));
    }
    let sniffed = sniff(image).ok_or(Error::NotAnImage)?;
    if sniffed != declared {
        tracing::debug!(
            declared,
            sniffed,
            "image type differs from the declared one"
        );
    }
    Ok(sniffed)
}

use ecoscan_common::image::sniff;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_supported_format_is_recognised_by_its_magic_bytes() {
        assert_eq!(
            check(b"\xff\xd8\xff\xe0rest", "image/jpeg").unwrap(),
            "image/jpeg"
        );
        assert_eq!(
            check(b"\x89PNG\r\n\x1a\nrest", "image/png").unwrap(),
            "image/png"
        );
        assert_eq!(check(b"GIF89a....", "image/gif").unwrap(), "image/gif");
        assert_eq!(
            check(b"RIFF\0\0\0\0WEBPVP8 ", "image/webp").unwrap(),
            "image/webp"
        );
    }

    #[test]
    fn declared_type_parameters_and_case_are_ignored_but_the_bytes_win() {
        assert_eq!(
            check(b"\xff\xd8\xffx", "IMAGE/PNG; q=1").unwrap(),
            "image/jpeg"
        );
    }

    #[test]
    fn empty_unsupported_and_non_image_uploads_are_rejected() {
        assert!(matches!(check(b"", "image/png"), Err(Error::EmptyImage)));
        assert!(matches!(
            check(b"\xff\xd8\xff", "image/bmp"),
            Err(Error::UnsupportedContentType(_))
        ));
        assert!(matches!(
            check(b"\xff\xd8\xff", ""),
            Err(Error::UnsupportedContentType(_))
        ));
        assert!(matches!(
            check(b"%PDF-1.7", "image/png"),
            Err(Error::NotAnImage)
        ));
    }
}
