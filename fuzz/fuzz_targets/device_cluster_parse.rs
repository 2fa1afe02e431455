//! Parsers of bytes that come from outside the process and are not ours to trust: what an NVMe
//! controller reports (`kvstack_firmware_interface::nvme`: CAP, Identify Controller and
//! Namespace pages, completion status fields) and what a Redis Cluster hands back (window
//! snapshot values, `kvstack_tiers::redis_pool::decode_value`; shared prefix index entries,
//! `kvstack_tiers::shared_index::decode_entry`). Byte 0 picks the parser; the rest is the input.
//!
//! What must hold besides "no panic": decoded device data keeps the checks the driver relies on
//! (at least two queue entries, MPSMIN <= MPSMAX, printable strings, capacity within size, a
//! block size of 512 B to 64 KiB); a Redis value or index entry that decodes is one that
//! encodes back from what it decoded to (so nothing is served that its writer did not write),
//! and one for another tenant never decodes.
#![no_main]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_firmware_interface::nvme::{Capabilities, ControllerInfo, NamespaceInfo, Status};
use kvstack_tiers::ModelFingerprint;
use kvstack_tiers::redis_pool::{SnapshotId, decode_value, encode_value};
use kvstack_tiers::shared_index::{decode_entry, encode_entry};
use libfuzzer_sys::fuzz_target;

const MODEL: ModelFingerprint = ModelFingerprint([7; 32]);
const KEY: [u8; 32] = [9; 32];
const TENANT: u64 = 0x1234_5678;

fn page(rest: &[u8]) -> Vec<u8> {
    // Identify data is one 4 KiB page; shorter inputs are refused, so most inputs are padded
    // to reach the field checks.
    let mut p = rest.to_vec();
    if p.len() < 4096 && !p.is_empty() && p[0] & 1 == 0 {
        p.resize(4096, 0);
    }
    p
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    match which % 6 {
        0 => {
            let mut cap = [0u8; 8];
            for (c, &b) in cap.iter_mut().zip(rest) {
                *c = b;
            }
            if let Ok(c) = Capabilities::decode(u64::from_le_bytes(cap)) {
                assert!(c.max_queue_entries >= 2);
                assert!(c.mps_min <= c.mps_max);
            }
        }
        1 => {
            if let Ok(info) = ControllerInfo::decode(&page(rest)) {
                for s in [&info.serial, &info.model, &info.firmware] {
                    assert!(
                        s.bytes().all(|b| (0x20..0x7F).contains(&b) || b == 0),
                        "{s:?}"
                    );
                }
            }
        }
        2 => {
            if let Ok(ns) = NamespaceInfo::decode(&page(rest)) {
                assert!(ns.capacity_blocks <= ns.size_blocks && ns.size_blocks > 0);
                assert!((512..=65536).contains(&ns.block_bytes()));
            }
        }
        3 => {
            let mut f = [0u8; 2];
            for (c, &b) in f.iter_mut().zip(rest) {
                *c = b;
            }
            let s = Status::decode(u16::from_le_bytes(f));
            let _ = format!("{s:?}");
        }
        4 => {
            let id = SnapshotId {
                tenant: TENANT,
                model: &MODEL,
                key: &KEY,
            };
            if let Ok(snapshot) = decode_value(id, rest) {
                assert_eq!(snapshot, &rest[rest.len() - snapshot.len()..]);
                let again = encode_value(id, snapshot);
                assert_eq!(again.len(), rest.len());
                // The CRC covers the header up to it and the snapshot: everything but the 4
                // reserved bytes must be what the writer wrote.
                assert_eq!(again[..76], rest[..76]);
                assert_eq!(again[80..], rest[80..]);
                let other = SnapshotId {
                    tenant: TENANT + 1,
                    ..id
                };
                assert!(
                    decode_value(other, rest).is_err(),
                    "another tenant's value decoded"
                );
            }
            // A valid value built from the input, damaged at one byte, is refused.
            if rest.len() >= 2 {
                let mut v = encode_value(id, &rest[1..]);
                let at = usize::from(rest[0]) * 7 % v.len();
                if !(76..80).contains(&at) {
                    v[at] ^= 0x5A;
                    assert!(
                        decode_value(id, &v).is_err(),
                        "a damaged value decoded (byte {at})"
                    );
                }
            }
        }
        _ => {
            if let Some(e) = decode_entry(TENANT, &MODEL, &KEY, rest) {
                let again = encode_entry(TENANT, &MODEL, &KEY, e.unit_tokens, &e.node);
                assert_eq!(again, rest);
                assert!(decode_entry(TENANT + 1, &MODEL, &KEY, rest).is_none());
            }
        }
    }
});
