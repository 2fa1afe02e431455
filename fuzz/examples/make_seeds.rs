//! Writes the seed corpora of every target into `fuzz/corpus/<target>/` (or the directory
//! given as the first argument): stores written by a real `SsdStore`, records taken from them,
//! the configs of `testdata/configs` and the built-in ones, a small safetensors file in
//! every storage type the loader decodes, and reference-encoded entries.
//!
//! `cargo run --release --example make-seeds` in fuzz/. Deterministic apart from the store's
//! random id and creation times, so rerunning rewrites the store seeds with other bytes.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use kvstack_firmware_interface::entry::{
    quantize_global_fp4, quantize_index_mxfp4, quantize_window_fp8,
};
use kvstack_firmware_interface::record::{ALIGN, RecordHeader, RecordKind, SEGMENT_MAGIC};
use kvstack_fuzz::image::{self, Image};
use kvstack_fuzz::{
    DEVICE_FILE, Layout, P, ScratchDir, SeedSource, clock, model, store_options, tenants, units,
};
use kvstack_tiers::{SsdStore, UnitWrite};
use safetensors::tensor::{Dtype, TensorView};
use zerocopy::IntoBytes;

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(name), bytes).unwrap();
    println!("{} ({} bytes)", dir.join(name).display(), bytes.len());
}

/// Writes the seed units into a fresh store at `dir` and closes it.
fn build_store(dir: &Path, layout: Layout, segment_bytes: u64) {
    if layout == Layout::Device {
        let f = std::fs::File::create(dir.join(DEVICE_FILE)).unwrap();
        f.set_len(12 * segment_bytes).unwrap();
    }
    let store = SsdStore::open(store_options(dir, layout, segment_bytes, false), clock()).unwrap();
    let tenants = tenants();
    for (t, tokens) in units() {
        let tenant = &tenants[t];
        let ticket = store
            .put_unit(&UnitWrite {
                model: &model(),
                tenant,
                tokens: &tokens,
                page_tokens: P,
                align: 2,
                source: &SeedSource {
                    tokens: &tokens,
                    tenant,
                },
            })
            .unwrap();
        ticket.wait().unwrap();
    }
    store.close().unwrap();
}

/// The image of a store, checked to reproduce its files exactly.
fn store_image(dir: &Path, layout: Layout, segment_bytes: u64) -> Image {
    let size_bits = match segment_bytes {
        0x8000 => 1,
        0x10000 => 2,
        _ => 0,
    } << 1;
    let img = Image::from_dir(dir, layout, size_bits).unwrap();
    let again = Image::parse(&img.encode());
    assert_eq!(again, img);
    let scratch = ScratchDir::new("seed-check");
    img.write_to(scratch.path()).unwrap();
    for (id, bytes) in img.files() {
        let name = match layout {
            Layout::Directory => format!("seg-{id:016x}.kvs"),
            Layout::Device => DEVICE_FILE.to_owned(),
        };
        assert!(
            std::fs::read(dir.join(&name)).unwrap() == bytes,
            "{name} differs"
        );
    }
    img
}

fn store_seeds(out: &Path) -> Vec<(RecordKind, Vec<u8>)> {
    let target = out.join("store_recovery");
    let mut records = Vec::new();
    for (layout, seg, name) in [
        (Layout::Directory, 32 << 10, "dir-32k"),
        (Layout::Directory, 16 << 10, "dir-16k"),
        (Layout::Device, 32 << 10, "device-32k"),
    ] {
        let scratch = ScratchDir::new("seed");
        build_store(scratch.path(), layout, seg);
        let img = store_image(scratch.path(), layout, seg);
        write(&target, &format!("seed-{name}"), &img.encode());
        if layout == Layout::Directory && seg == 32 << 10 {
            // Records and a segment header, whole, for record_parse.
            for (_, bytes) in img.files() {
                for p in (0..bytes.len()).step_by(ALIGN) {
                    let Ok(h) = RecordHeader::decode(&bytes[p..]) else {
                        if bytes[p..].starts_with(&SEGMENT_MAGIC) {
                            records.push((RecordKind::Block, bytes[p..p + 128].to_vec()));
                        }
                        continue;
                    };
                    let end = p + ALIGN + h.payload_len as usize;
                    records.push((h.kind, bytes[p..end].to_vec()));
                }
            }
            // The same store with its last segment cut short (a crash mid-write) and with
            // its newest commit gone (a unit whose commit never reached the disk).
            let mut torn = img.clone();
            let last = torn.chunks.iter().map(|c| c.file).max().unwrap();
            torn.chunks.retain(|c| c.file != last || c.page < 2);
            write(&target, "seed-dir-32k-torn", &torn.encode());
            let mut no_commit = img.clone();
            let files = img.files();
            let newest_commit = files
                .iter()
                .flat_map(|(id, b)| {
                    (0..b.len()).step_by(ALIGN).filter_map(move |p| {
                        let h = RecordHeader::decode(&b[p..]).ok()?;
                        (h.kind == RecordKind::Commit).then_some((h.seq, *id, p / ALIGN))
                    })
                })
                .max()
                .unwrap();
            no_commit.chunks.retain(|c| {
                !(u64::from(c.file) == newest_commit.1 && usize::from(c.page) == newest_commit.2)
            });
            write(&target, "seed-dir-32k-no-commit", &no_commit.encode());
        }
    }
    // An empty directory, and one page of zeros (a segment created just before a crash).
    write(&target, "seed-empty", &[0]);
    write(
        &target,
        "seed-zero-segment",
        &Image {
            flags: 0,
            chunks: vec![image::Chunk {
                file: 1,
                page: 3,
                fix: image::EXTEND,
                data: Vec::new(),
            }],
        }
        .encode(),
    );
    records
}

fn record_seeds(out: &Path, records: &[(RecordKind, Vec<u8>)]) {
    let target = out.join("record_parse");
    let mut seen: HashMap<(RecordKind, usize), usize> = HashMap::new();
    for (kind, bytes) in records {
        // One of each kind and length is enough.
        let n = seen.entry((*kind, bytes.len())).or_default();
        *n += 1;
        if *n > 1 {
            continue;
        }
        let mut input = vec![0u8];
        input.extend_from_slice(bytes);
        let name = if bytes.len() == 128 {
            "seed-segment-header".to_owned()
        } else {
            format!("seed-{}-{}", kind.name(), bytes.len())
        };
        write(&target, &name, &input);
    }
}

fn config_seeds(out: &Path, testdata: &Path) {
    let target = out.join("config_plan");
    let builtin = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../userspace/spec/src/builtin");
    for (prefix, dir) in [
        ("seed-", testdata.join("configs")),
        ("seed-builtin-", builtin),
    ] {
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        names.sort();
        for p in names {
            let mut input = vec![0u8];
            input.extend_from_slice(&std::fs::read(&p).unwrap());
            let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
            write(&target, &format!("{prefix}{stem}"), &input);
        }
    }
}

fn safetensors_seeds(out: &Path) {
    let target = out.join("safetensors_load");
    let f32s: Vec<u8> = (0..8)
        .flat_map(|i| (i as f32 * 0.25).to_le_bytes())
        .collect();
    let bf16: Vec<u8> = (0..8u16).flat_map(|i| (0x3F80 + i).to_le_bytes()).collect();
    let fp8: Vec<u8> = (0..8u8).map(|i| 0x30 + i).collect();
    let fp8_scale = vec![127u8, 128];
    let fp4 = vec![0x21u8, 0x43, 0x65, 0x87];
    let fp4_scale = vec![127u8, 126];
    let i64s: Vec<u8> = (0..3i64).flat_map(|i| (i - 1).to_le_bytes()).collect();
    let views = [
        ("a.weight", Dtype::F32, vec![2, 4], &f32s),
        ("b.weight", Dtype::BF16, vec![2, 4], &bf16),
        ("c.weight", Dtype::F8_E4M3, vec![2, 4], &fp8),
        ("c.scale", Dtype::F8_E8M0, vec![1, 2], &fp8_scale),
        ("d.weight", Dtype::U8, vec![2, 2], &fp4),
        ("d.scale", Dtype::U8, vec![2, 1], &fp4_scale),
        ("e", Dtype::I64, vec![3], &i64s),
    ];
    let tensors: Vec<(String, TensorView<'_>)> = views
        .iter()
        .map(|(n, d, s, b)| ((*n).to_owned(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let meta = Some(HashMap::from([("format".to_owned(), "pt".to_owned())]));
    let bytes = safetensors::serialize(tensors, meta).unwrap();
    write(&target, "seed-mixed", &bytes);
    let empty = safetensors::serialize(Vec::<(String, TensorView<'_>)>::new(), None).unwrap();
    write(&target, "seed-empty", &empty);
}

fn entry_seeds(out: &Path) {
    let target = out.join("entry_decode");
    let row =
        |n: usize, k: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * k).sin() * 3.0).collect() };
    let x512 = row(512, 0.37);
    let x128 = row(128, 0.91);
    let fp8 = quantize_window_fp8(&x512.clone().try_into().unwrap());
    let fp4 = quantize_global_fp4(&x512.clone().try_into().unwrap());
    let mx = quantize_index_mxfp4(&x128.clone().try_into().unwrap());
    for (mode, name, entry, x) in [
        (0u8, "fp8-window", fp8.as_bytes(), &x512),
        (1, "fp4-global", fp4.as_bytes(), &x512),
        (2, "mxfp4-index", mx.as_bytes(), &x128),
    ] {
        let mut input = vec![mode];
        input.extend_from_slice(entry);
        input.extend_from_slice(entry);
        write(&target, &format!("seed-{name}-entries"), &input);
        let mut input = vec![mode];
        input.extend(x.iter().flat_map(|v| v.to_le_bytes()));
        write(&target, &format!("seed-{name}-values"), &input);
    }
}

/// kvstackd's parsers: unit frames (byte 0 even) and config files (byte 0 odd).
fn appliance_seeds(out: &Path) {
    use kvstack_appliance::frame;
    let target = out.join("appliance_parse");
    let blocks = vec![vec![0x11u8; 96], vec![0x22u8; 40]];
    let window = vec![0x33u8; 64];
    for (name, ids, w) in [
        ("frame-get", &[][..], None),
        ("frame-put", &[1u32, 2, 3, 4, 5][..], None),
        (
            "frame-put-window",
            &[1u32, 2, 3, 4, 5][..],
            Some(window.as_slice()),
        ),
    ] {
        let mut input = vec![0u8];
        input.extend(frame::encode(5, 4, Some("00ff".into()), ids, &blocks, w));
        write(&target, &format!("seed-{name}"), &input);
    }
    let configs = [
        ("config-empty", String::new()),
        (
            "config-full",
            format!(
                "data_dir = \"/var/lib/kvstack\"\nlisten = [\"unix:/run/kvstack/kvstackd.sock\", \"tcp:127.0.0.1:8080\"]\n\
                 [engine]\nthreads = 2\nchunk = 256\nqueue_depth = 64\nmax_sessions = 16\ncontext_limit = 8192\n\
                 [limits]\nmax_body_bytes = 1048576\nmax_header_bytes = 16384\nmax_prompt_tokens = 4096\nmax_connections = 32\n\
                 [window_pool]\ncapacity_bytes = 67108864\nttl_ms = 60000\n[ssd]\nretention_hours = 24\n\
                 [[tenant]]\nname = \"a\"\napi_key_sha256 = \"{}\"\nmax_concurrent = 4\n\
                 [[tenant]]\nname = \"b\"\napi_key_sha256 = \"{}\"\nmax_prompt_tokens = 100\n",
                kvstack_appliance::config::key_digest_hex("a"),
                kvstack_appliance::config::key_digest_hex("b")
            ),
        ),
    ];
    for (name, text) in configs {
        let mut input = vec![1u8];
        input.extend_from_slice(text.as_bytes());
        write(&target, &format!("seed-{name}"), &input);
    }
}

/// Device and cluster data (`device_cluster_parse`): byte 0 picks the parser (0 CAP, 1 Identify
/// Controller, 2 Identify Namespace, 3 a status field, 4 a Redis window value, 5 a shared
/// index entry); the identities are the target's constants.
fn device_cluster_seeds(out: &Path) {
    use kvstack_tiers::ModelFingerprint;
    use kvstack_tiers::redis_pool::{SnapshotId, encode_value};
    use kvstack_tiers::shared_index::encode_entry;
    let target = out.join("device_cluster_parse");
    // CAP: MQES 1023, CQR, TO 20 (10 s), DSTRD 0, CSS NVM, MPSMIN 0, MPSMAX 4.
    let cap: u64 = 1023 | 1 << 16 | 20 << 24 | 1 << 37 | 4 << 52;
    let mut input = vec![0u8];
    input.extend_from_slice(&cap.to_le_bytes());
    write(&target, "seed-cap", &input);
    let mut ctrl = vec![0u8; 4096];
    ctrl[4..11].copy_from_slice(b"KVSTACK");
    ctrl[24..34].copy_from_slice(b"QEMU NVMe ");
    ctrl[512] = 0x66; // SQES: 64-byte entries
    ctrl[513] = 0x44; // CQES: 16-byte entries
    ctrl[516] = 1; // NN
    let mut input = vec![1u8];
    input.extend_from_slice(&ctrl);
    write(&target, "seed-identify-controller", &input);
    let mut ns = vec![0u8; 4096];
    ns[0..8].copy_from_slice(&2048u64.to_le_bytes()); // NSZE
    ns[8..16].copy_from_slice(&2048u64.to_le_bytes()); // NCAP
    ns[128..132].copy_from_slice(&(12u32 << 16).to_le_bytes()); // LBAF0: 4 KiB blocks
    let mut input = vec![2u8];
    input.extend_from_slice(&ns);
    write(&target, "seed-identify-namespace", &input);
    write(&target, "seed-status", &[3u8, 0x02, 0x40]);
    let model = ModelFingerprint([7; 32]);
    let key = [9u8; 32];
    let id = SnapshotId {
        tenant: 0x1234_5678,
        model: &model,
        key: &key,
    };
    let mut input = vec![4u8];
    input.extend(encode_value(id, &[0x5Au8; 96]));
    write(&target, "seed-redis-value", &input);
    let mut input = vec![5u8];
    input.extend(encode_entry(0x1234_5678, &model, &key, 283, "node-a"));
    write(&target, "seed-index-entry", &input);
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let out = std::env::args_os()
        .nth(1)
        .map_or_else(|| root.join("corpus"), PathBuf::from);
    let testdata = root.join("../testdata");
    let records = store_seeds(&out);
    record_seeds(&out, &records);
    config_seeds(&out, &testdata);
    safetensors_seeds(&out);
    entry_seeds(&out);
    appliance_seeds(&out);
    device_cluster_seeds(&out);
}
