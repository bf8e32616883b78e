//! The format of one spool file: `ECOSPOOL`, a version, the body key and the rows, the body
//! object, and a CRC-32 of it all. Written by [`write_frame`] and read back by [`decode`], here
//! only.

use std::io::{self, Write};

use anyhow::{Context, ensure};
use bytes::Bytes;

use crate::{batch::Batch, store::CallRow};

const MAGIC: &[u8; 8] = b"ECOSPOOL";
/// 2 adds each row's cached input tokens, images, cost and price version after its times; a
/// file of version 1 (spooled by an earlier release) is still read, its rows unpriced.
const VERSION: u32 = 2;

pub(super) fn len_u64(n: usize) -> u64 {
    u64::try_from(n).expect("lengths fit in u64")
}

/// Size of the file holding `meta` and an object of `object` bytes.
pub(super) fn file_len(meta: usize, object: usize) -> u64 {
    // magic, version, meta length, meta, object length, object, crc
    len_u64(8 + 4 + 8 + meta + 8 + object + 4)
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_i64(out: &mut Vec<u8>, v: i64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_u32(
        out,
        u32::try_from(s.len()).expect("a field is far below 4 GiB"),
    );
    out.extend_from_slice(s.as_bytes());
}

/// Writes a whole file to `out`: the magic, the version, `meta` and `object` each after its
/// length, and the checksum of all but the magic.
pub(super) fn write_frame(out: &mut impl Write, meta: &[u8], object: &[u8]) -> io::Result<()> {
    let mut crc = Crc::new();
    out.write_all(MAGIC)?;
    for piece in [
        &VERSION.to_le_bytes()[..],
        &len_u64(meta.len()).to_le_bytes(),
        meta,
        &len_u64(object.len()).to_le_bytes(),
        object,
    ] {
        crc.update(piece);
        out.write_all(piece)?;
    }
    out.write_all(&crc.finish().to_le_bytes())
}

/// The body key and the rows, each field in column order.
pub(super) fn encode_meta(key: &str, rows: &[CallRow]) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + rows.len() * 256);
    put_str(&mut out, key);
    put_u32(
        &mut out,
        u32::try_from(rows.len()).expect("a batch is far below 4G rows"),
    );
    for r in rows {
        put_str(&mut out, &r.call_id);
        put_str(&mut out, &r.service);
        put_str(&mut out, &r.provider);
        put_str(&mut out, &r.model);
        put_str(&mut out, &r.operation);
        put_i64(&mut out, r.input_tokens);
        put_i64(&mut out, r.output_tokens);
        out.extend_from_slice(&r.latency_ms.to_le_bytes());
        out.extend_from_slice(&r.ttft_ms.to_le_bytes());
        out.extend_from_slice(&r.status.to_le_bytes());
        put_str(&mut out, &r.error);
        put_str(&mut out, &r.body_key);
        put_i64(&mut out, r.body_offset);
        put_i64(&mut out, r.request_len);
        put_i64(&mut out, r.response_len);
        put_str(&mut out, &r.job_id);
        put_str(&mut out, &r.trace_id);
        put_i64(&mut out, r.started_at_us);
        put_i64(&mut out, r.recorded_at_us);
        put_i64(&mut out, r.cached_input_tokens);
        put_i64(&mut out, r.images);
        // Unknown is a flag, never a zero.
        out.push(u8::from(r.cost_micros.is_some()));
        put_i64(&mut out, r.cost_micros.unwrap_or(0));
        put_str(&mut out, &r.price_version);
    }
    out
}

/// Reads a spool file back (the body object is a slice of `file`, not a copy); any truncation,
/// checksum mismatch or malformed field is an error.
pub(super) fn decode(file: Bytes) -> anyhow::Result<Batch> {
    ensure!(file.len() >= 8 + 4 + 4, "truncated: {} bytes", file.len());
    ensure!(&file[..8] == MAGIC, "not a spool file (bad magic)");
    let (body, crc) = file[8..].split_at(file.len() - 8 - 4);
    let mut check = Crc::new();
    check.update(body);
    let stored = u32::from_le_bytes(crc.try_into().expect("4 bytes"));
    let mut r = Reader { buf: body, pos: 0 };
    let version = r.u32()?;
    ensure!(
        (1..=VERSION).contains(&version),
        "unknown spool format version {version}"
    );
    let meta_len = r.len()?;
    let meta = r.take(meta_len)?;
    let object_len = r.len()?;
    let object_at = 8 + r.pos;
    r.take(object_len)?;
    ensure!(
        r.pos == body.len(),
        "{} unexpected trailing bytes",
        body.len() - r.pos
    );
    ensure!(check.finish() == stored, "checksum mismatch");
    let mut m = Reader { buf: meta, pos: 0 };
    let key = m.str()?;
    let n = m.u32()?;
    let mut rows = Vec::with_capacity(usize::try_from(n)?.min(100_000));
    for _ in 0..n {
        rows.push(CallRow {
            call_id: m.str()?,
            service: m.str()?,
            provider: m.str()?,
            model: m.str()?,
            operation: m.str()?,
            input_tokens: m.i64()?,
            output_tokens: m.i64()?,
            latency_ms: m.f64()?,
            ttft_ms: m.f64()?,
            status: m.i32()?,
            error: m.str()?,
            body_key: m.str()?,
            body_offset: m.i64()?,
            request_len: m.i64()?,
            response_len: m.i64()?,
            job_id: m.str()?,
            trace_id: m.str()?,
            started_at_us: m.i64()?,
            recorded_at_us: m.i64()?,
            cached_input_tokens: 0,
            images: 0,
            cost_micros: None,
            price_version: String::new(),
        });
        if version >= 2 {
            let row = rows.last_mut().expect("just pushed");
            row.cached_input_tokens = m.i64()?;
            row.images = m.i64()?;
            let known = m.u8()? != 0;
            let cost = m.i64()?;
            row.cost_micros = known.then_some(cost);
            row.price_version = m.str()?;
        }
    }
    ensure!(m.pos == meta.len(), "unexpected bytes after the rows");
    Ok(Batch {
        key,
        object: file.slice(object_at..object_at + object_len),
        rows,
    })
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> anyhow::Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.buf.len())
            .with_context(|| format!("truncated at byte {}", self.pos))?;
        let bytes = &self.buf[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self) -> anyhow::Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("took N bytes"))
    }

    fn u8(&mut self) -> anyhow::Result<u8> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> anyhow::Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn len(&mut self) -> anyhow::Result<usize> {
        Ok(usize::try_from(u64::from_le_bytes(self.array()?))?)
    }

    fn i32(&mut self) -> anyhow::Result<i32> {
        Ok(i32::from_le_bytes(self.array()?))
    }

    fn i64(&mut self) -> anyhow::Result<i64> {
        Ok(i64::from_le_bytes(self.array()?))
    }

    fn f64(&mut self) -> anyhow::Result<f64> {
        Ok(f64::from_le_bytes(self.array()?))
    }

    fn str(&mut self) -> anyhow::Result<String> {
        let n = usize::try_from(self.u32()?)?;
        Ok(std::str::from_utf8(self.take(n)?)
            .context("a text field is not utf-8")?
            .to_owned())
    }
}

/// CRC-32 (IEEE 802.3, as zlib and gzip compute it).
pub(super) struct Crc(u32);

const CRC_TABLE: [u32; 256] = {
    let mut table = [0_u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 == 1 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
};

impl Crc {
    pub(super) fn new() -> Self {
        Self(!0)
    }

    pub(super) fn update(&mut self, data: &[u8]) {
        for &b in data {
            self.0 = CRC_TABLE[((self.0 ^ u32::from(b)) & 0xff) as usize] ^ (self.0 >> 8);
        }
    }

    pub(super) fn finish(&self) -> u32 {
        !self.0
    }
}
