//! The binary framing of the KV-cache API's unit bodies: the response of `POST /v1/kv/get`
//! and the request of `POST /v1/kv/put` (`docs/kv-protocol.md` has it byte by byte).
//!
//! A frame is a 12-byte prefix (magic, version, flags, header length), a JSON header that
//! gives every section's length and CRC-32C, then the sections: the unit's token ids (`put`
//! only), its block payloads in the stored byte format (`docs/ssd-format.md`, "Block
//! payload"), and the window snapshot when there is one. The header is JSON so that a client
//! in any language reads it with what it has; the bulk is raw bytes so that nothing is
//! re-encoded on the way to or from the tiers.
//!
//! Decoding checks the frame itself (magic, version, flags, lengths that add up to the body,
//! every CRC); whether the sizes fit the model is the tiers' check
//! ([`kvstack_tiers::Tiers::write_unit`]), which names the block.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The first four bytes of a frame.
pub const MAGIC: [u8; 4] = *b"KVSU";
/// The framing version this build reads and writes.
pub const VERSION: u16 = 1;
/// Flag bit: a window snapshot section is present.
pub const FLAG_WINDOW: u16 = 1;
/// Bytes before the JSON header.
pub const PREFIX_BYTES: usize = 12;
/// The largest JSON header accepted (a million-token unit in 256-token pages has 4,096
/// blocks: about 100 KB of header).
pub const MAX_HEADER_BYTES: usize = 1 << 20;

/// The JSON header of a frame.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Header {
    /// Tokens the unit covers.
    pub tokens: u64,
    /// Token ids that follow the header, 4 bytes each, little-endian (`put`: the unit's
    /// tokens, so equal to `tokens`; `get`: 0, the caller has them).
    pub token_ids: u64,
    /// Tokens per block (the server's page size: every block but the last holds this many).
    pub page_tokens: u32,
    /// The model fingerprint (hex), as `GET /v1/models` reports it; optional on `put`, where
    /// a different one is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Byte length of each block payload, first to last.
    pub blocks: Vec<u64>,
    /// CRC-32C (Castagnoli) of each block payload.
    pub crc32c: Vec<u32>,
    /// Bytes of the window snapshot (0: none).
    #[serde(default)]
    pub window_bytes: u64,
    /// CRC-32C of the window snapshot (required when `window_bytes` > 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_crc32c: Option<u32>,
}

/// A decoded frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Its header.
    pub header: Header,
    /// The token ids section.
    pub token_ids: Vec<u32>,
    /// The block payloads.
    pub blocks: Vec<Vec<u8>>,
    /// The window snapshot.
    pub window: Option<Vec<u8>>,
}

fn bad(field: &str, reason: impl Into<String>) -> Error {
    Error::Frame {
        field: field.into(),
        reason: reason.into(),
    }
}

/// Encodes a frame: `header`'s lengths and CRCs are computed here from the sections.
pub fn encode(
    tokens: u64,
    page_tokens: u32,
    model: Option<String>,
    token_ids: &[u32],
    blocks: &[Vec<u8>],
    window: Option<&[u8]>,
) -> Vec<u8> {
    let header = Header {
        tokens,
        token_ids: token_ids.len() as u64,
        page_tokens,
        model,
        blocks: blocks.iter().map(|b| b.len() as u64).collect(),
        crc32c: blocks.iter().map(|b| crc32c::crc32c(b)).collect(),
        window_bytes: window.map_or(0, |w| w.len() as u64),
        window_crc32c: window.map(crc32c::crc32c),
    };
    // A struct of numbers, strings and vectors always serialises.
    let json = serde_json::to_vec(&header).unwrap_or_default();
    let payload: usize = blocks.iter().map(Vec::len).sum();
    let mut out = Vec::with_capacity(
        PREFIX_BYTES + json.len() + 4 * token_ids.len() + payload + window.map_or(0, <[u8]>::len),
    );
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    let flags = if window.is_some() { FLAG_WINDOW } else { 0 };
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&(json.len() as u32).to_le_bytes());
    out.extend_from_slice(&json);
    for t in token_ids {
        out.extend_from_slice(&t.to_le_bytes());
    }
    for b in blocks {
        out.extend_from_slice(b);
    }
    if let Some(w) = window {
        out.extend_from_slice(w);
    }
    out
}

/// Takes `n` bytes at `*at` of `body`, or says which section runs past the end.
fn take<'a>(body: &'a [u8], at: &mut usize, n: u64, field: &str) -> Result<&'a [u8]> {
    let end = usize::try_from(n)
        .ok()
        .and_then(|n| at.checked_add(n))
        .filter(|&e| e <= body.len())
        .ok_or_else(|| {
            bad(
                field,
                format!(
                    "{n} bytes at offset {at} run past the end of the {}-byte body",
                    body.len()
                ),
            )
        })?;
    let s = &body[*at..end];
    *at = end;
    Ok(s)
}

/// Decodes and checks a frame (module docs): every error names the field or section.
///
/// # Errors
/// [`Error::Frame`].
pub fn decode(body: &[u8]) -> Result<Frame> {
    if body.len() < PREFIX_BYTES {
        return Err(bad(
            "frame",
            format!(
                "{} bytes, shorter than the {PREFIX_BYTES}-byte prefix",
                body.len()
            ),
        ));
    }
    if body[..4] != MAGIC {
        return Err(bad(
            "magic",
            format!("{:02x?}, expected \"KVSU\"", &body[..4]),
        ));
    }
    let version = u16::from_le_bytes([body[4], body[5]]);
    if version != VERSION {
        return Err(bad(
            "version",
            format!("{version}, this server reads version {VERSION}"),
        ));
    }
    let flags = u16::from_le_bytes([body[6], body[7]]);
    if flags & !FLAG_WINDOW != 0 {
        return Err(bad("flags", format!("unknown bits {:#06x}", flags)));
    }
    let header_len = u32::from_le_bytes([body[8], body[9], body[10], body[11]]) as usize;
    if header_len > MAX_HEADER_BYTES {
        return Err(bad(
            "header_len",
            format!("{header_len} bytes, more than the {MAX_HEADER_BYTES} accepted"),
        ));
    }
    let mut at = PREFIX_BYTES;
    let json = take(body, &mut at, header_len as u64, "header")?;
    let header: Header = serde_json::from_slice(json)
        .map_err(|e| bad("header", format!("not a valid header: {e}")))?;
    if header.crc32c.len() != header.blocks.len() {
        return Err(bad(
            "crc32c",
            format!(
                "{} CRCs for {} blocks",
                header.crc32c.len(),
                header.blocks.len()
            ),
        ));
    }
    let window_flag = flags & FLAG_WINDOW != 0;
    if window_flag != (header.window_bytes > 0) {
        return Err(bad(
            "window_bytes",
            format!(
                "{} while the window flag is {}",
                header.window_bytes,
                if window_flag { "set" } else { "clear" }
            ),
        ));
    }
    if window_flag != header.window_crc32c.is_some() {
        return Err(bad(
            "window_crc32c",
            if window_flag {
                "missing while a window is present"
            } else {
                "given without a window"
            },
        ));
    }
    let ids_bytes = header
        .token_ids
        .checked_mul(4)
        .ok_or_else(|| bad("token_ids", "too many"))?;
    let ids = take(body, &mut at, ids_bytes, "token_ids")?;
    let token_ids: Vec<u32> = ids
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let mut blocks = Vec::with_capacity(header.blocks.len().min(body.len()));
    for (i, (&len, &crc)) in header.blocks.iter().zip(&header.crc32c).enumerate() {
        let field = format!("blocks[{i}]");
        let b = take(body, &mut at, len, &field)?;
        let got = crc32c::crc32c(b);
        if got != crc {
            return Err(bad(
                &format!("crc32c[{i}]"),
                format!("block {i} has CRC-32C {got:#010x}, the header says {crc:#010x}"),
            ));
        }
        blocks.push(b.to_vec());
    }
    let window = if window_flag {
        let w = take(body, &mut at, header.window_bytes, "window")?;
        let got = crc32c::crc32c(w);
        let want = header.window_crc32c.unwrap_or_default();
        if got != want {
            return Err(bad(
                "window_crc32c",
                format!("the window has CRC-32C {got:#010x}, the header says {want:#010x}"),
            ));
        }
        Some(w.to_vec())
    } else {
        None
    };
    if at != body.len() {
        return Err(bad(
            "frame",
            format!(
                "{} bytes after the last section (the header accounts for {at} of {})",
                body.len() - at,
                body.len()
            ),
        ));
    }
    Ok(Frame {
        header,
        token_ids,
        blocks,
        window,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(window: bool) -> Vec<u8> {
        let blocks = vec![vec![1u8; 40], vec![2u8; 17]];
        let w = vec![9u8; 33];
        encode(
            5,
            4,
            Some("ab".into()),
            &[1, 2, 3, 4, 5],
            &blocks,
            window.then_some(w.as_slice()),
        )
    }

    fn field_of(e: Error) -> String {
        match e {
            Error::Frame { field, .. } => field,
            other => panic!("not a frame error: {other}"),
        }
    }

    #[test]
    fn round_trip() {
        for window in [false, true] {
            let f = decode(&sample(window)).unwrap();
            assert_eq!(f.token_ids, vec![1, 2, 3, 4, 5]);
            assert_eq!(f.blocks, vec![vec![1u8; 40], vec![2u8; 17]]);
            assert_eq!(f.window, window.then(|| vec![9u8; 33]));
            assert_eq!(f.header.tokens, 5);
            assert_eq!(f.header.page_tokens, 4);
            assert_eq!(f.header.model.as_deref(), Some("ab"));
        }
    }

    #[test]
    fn every_damage_names_its_field() {
        let good = sample(true);
        let header_len = u32::from_le_bytes(good[8..12].try_into().unwrap()) as usize;
        let sections = PREFIX_BYTES + header_len;
        let case = |f: &dyn Fn(&mut Vec<u8>), want: &str| {
            let mut b = good.clone();
            f(&mut b);
            assert_eq!(field_of(decode(&b).unwrap_err()), want, "case {want}");
        };
        case(&|b| b.truncate(5), "frame");
        case(&|b| b[0] = b'X', "magic");
        case(&|b| b[4] = 2, "version");
        case(&|b| b[6] |= 4, "flags");
        case(&|b| b[6] &= !1, "window_bytes");
        case(
            &|b| b[8..12].copy_from_slice(&u32::MAX.to_le_bytes()),
            "header_len",
        );
        case(
            &|b| b[8..12].copy_from_slice(&((header_len + 10_000) as u32).to_le_bytes()),
            "header",
        );
        case(&|b| b[PREFIX_BYTES] = b'[', "header");
        // A flipped byte in each section.
        case(&|b| b[sections + 20 + 3] ^= 1, "crc32c[0]");
        case(&|b| b[sections + 20 + 45] ^= 1, "crc32c[1]");
        case(&|b| *b.last_mut().unwrap() ^= 1, "window_crc32c");
        case(&|b| b.truncate(b.len() - 1), "window");
        case(&|b| b.push(0), "frame");
        // Every prefix of a good frame is refused, never read past its end.
        for n in 0..good.len() {
            assert!(decode(&good[..n]).is_err(), "prefix of {n} bytes accepted");
        }
    }

    #[test]
    fn a_window_crc_without_a_window_is_refused() {
        // Decoding must be canonical: what decodes re-encodes to the same frame.
        let json = br#"{"tokens":1,"token_ids":0,"page_tokens":4,"blocks":[],"crc32c":[],"window_crc32c":7}"#;
        let mut b = Vec::new();
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&0u16.to_le_bytes());
        b.extend_from_slice(&(json.len() as u32).to_le_bytes());
        b.extend_from_slice(json);
        assert_eq!(field_of(decode(&b).unwrap_err()), "window_crc32c");
    }

    #[test]
    fn unknown_header_fields_are_refused() {
        let json =
            br#"{"tokens":1,"token_ids":0,"page_tokens":4,"blocks":[],"crc32c":[],"extra":1}"#;
        let mut b = Vec::new();
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&0u16.to_le_bytes());
        b.extend_from_slice(&(json.len() as u32).to_le_bytes());
        b.extend_from_slice(json);
        let e = decode(&b).unwrap_err();
        assert!(e.to_string().contains("extra"), "{e}");
    }
}
