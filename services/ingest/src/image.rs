//! Image intake: sniffing the type from the bytes, and fetching an image by URL with limits.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::StreamExt;

use crate::error::Error;

/// The image type the bytes really are, or `None` when they are not an image we accept.
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

/// Checks the bytes and returns their real content type.
pub fn validate(bytes: &[u8], declared: &str, max_bytes: usize) -> Result<&'static str, Error> {
    if bytes.is_empty() {
        return Err(Error::InvalidArgument(
            "image is empty; send the photo's bytes in `image` or a URL in `image_url`".into(),
        ));
    }
    if bytes.len() > max_bytes {
        return Err(Error::InvalidArgument(format!(
            "image is {} bytes; the limit is {max_bytes} bytes",
            bytes.len()
        )));
    }
    if !declared.is_empty() && !declared.starts_with("image/") {
        return Err(Error::InvalidArgument(format!(
            "content type {declared:?} is not an image; send JPEG, PNG, WebP or GIF"
        )));
    }
    sniff(bytes).ok_or_else(|| {
        Error::InvalidArgument("the bytes are not a JPEG, PNG, WebP or GIF image".into())
    })
}

/// Fetches an image from an http(s) URL, refusing anything larger than `max_bytes`.
pub async fn fetch(client: &reqwest::Client, url: &str, max_bytes: usize) -> Result<Bytes, Error> {
    let parsed = reqwest::Url::parse(url).map_err(|e| {
        Error::InvalidArgument(format!("image_url {url:?} is not a valid URL: {e}"))
    })?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(Error::InvalidArgument(format!(
            "image_url must be http or https, not {:?}",
            parsed.scheme()
        )));
    }
    let res = client
        .get(parsed)
        .timeout(Duration::from_secs(15))
        .send()
        .await
        .map_err(|e| Error::ImageFetch(e.without_url().to_string()))?;
    if !res.status().is_success() {
        return Err(Error::ImageFetch(format!(
            "the server answered {}",
            res.status()
        )));
    }
    if res.content_length().is_some_and(|n| n > max_bytes as u64) {
        return Err(Error::InvalidArgument(format!(
            "the image at image_url is larger than the limit of {max_bytes} bytes"
        )));
    }
    let mut body = BytesMut::new();
    let mut stream = res.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| Error::ImageFetch(e.without_url().to_string()))?;
        if body.len() + chunk.len() > max_bytes {
            return Err(Error::InvalidArgument(format!(
                "the image at image_url is larger than the limit of {max_bytes} bytes"
            )));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body.freeze())
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
    }
}
