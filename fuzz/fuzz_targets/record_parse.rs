//! The SSD record and segment header decoders on arbitrary bytes: never a panic, and whatever
//! decodes re-encodes to exactly the bytes it came from (so decode checks every byte that
//! encode writes), and its payload checks and lengths are consistent.
//!
//! Byte 0 of the input is a mode: bit 0 recomputes the header CRC (record or segment, by magic)
//! and bit 1 the payload CRC before decoding, so the fuzzer reaches the field checks behind
//! them. The rest is the header page followed by the payload.
#![no_main]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_firmware_interface::record::{
    ALIGN, KEY_BYTES, MAX_PAYLOAD, RecordHeader, RecordKind, SegmentHeader, align_up, commit_keys,
    encode_record, record_len,
};
use kvstack_fuzz::fix_crcs;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut bytes = rest.to_vec();
    if mode & 3 != 0 {
        let cut = bytes.len().min(ALIGN);
        let (page, payload) = bytes.split_at_mut(cut);
        fix_crcs(page, (mode & 2 != 0).then_some(&*payload));
    }

    if let Ok(h) = RecordHeader::decode(&bytes) {
        assert_eq!(
            h.encode()[..],
            bytes[..RecordHeader::BYTES],
            "decode accepted bytes encode does not write"
        );
        assert!(h.payload_len <= MAX_PAYLOAD);
        let len = h.record_len();
        assert_eq!(len, record_len(h.payload_len));
        assert!(len >= ALIGN as u64 && len % ALIGN as u64 == 0);
        assert!(
            len - ALIGN as u64 >= h.payload_len
                && len - ALIGN as u64 - h.payload_len < ALIGN as u64
        );
        if h.kind == RecordKind::Commit {
            assert!(h.count > 0 && u64::from(h.count) * KEY_BYTES as u64 == h.payload_len);
        }
        let payload = bytes.get(ALIGN..).unwrap_or_default();
        let cut = payload.get(..h.payload_len as usize);
        if let Some(p) = cut
            && h.verify_payload(p).is_ok()
        {
            if h.kind == RecordKind::Commit {
                let keys: Vec<_> = commit_keys(p).collect();
                assert_eq!(keys.len(), h.count as usize);
            }
            // The record re-encodes byte for byte (header page zero past the header).
            let mut out = vec![0xAAu8; len as usize];
            let n = encode_record(&h, p, &mut out).unwrap();
            assert_eq!(n as u64, len);
            let again = RecordHeader::decode(&out).unwrap();
            assert_eq!(again, h);
            again.verify_payload(&out[ALIGN..ALIGN + p.len()]).unwrap();
        }
        // A payload of any other length is refused.
        let other = payload.get(
            ..(h.payload_len as usize)
                .saturating_sub(1)
                .min(payload.len()),
        );
        if let Some(o) = other
            && o.len() as u64 != h.payload_len
        {
            assert!(h.verify_payload(o).is_err());
        }
    }

    if let Ok(s) = SegmentHeader::decode(&bytes) {
        assert_eq!(
            s.encode()[..],
            bytes[..SegmentHeader::BYTES],
            "decode accepted bytes encode does not write"
        );
        assert!(s.segment_bytes >= 2 * ALIGN as u64 && s.segment_bytes % ALIGN as u64 == 0);
        assert_eq!(SegmentHeader::decode(&s.encode()), Ok(s));
    }

    // Length arithmetic on arbitrary values saturates rather than wraps.
    if let Some(v) = rest.get(..8) {
        let v = u64::from_le_bytes(v.try_into().unwrap());
        if let Some(a) = align_up(v) {
            assert!(a >= v && a % ALIGN as u64 == 0 && a - v < ALIGN as u64);
        } else {
            assert!(v > u64::MAX - (ALIGN as u64 - 1));
        }
        let r = record_len(v);
        assert!(r == u64::MAX || r > v);
    }
});
