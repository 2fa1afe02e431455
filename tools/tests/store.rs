//! `kvstack store stats|fsck|inspect` on a store written through the library, clean and
//! damaged, and `kvstack bench tiers` in a small configuration, with and without fio.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use kvstack_driver::pinned::{HugePages, Locking, PinnedOptions};
use kvstack_tiers::Result;
use kvstack_tiers::{
    BlockSource, ModelFingerprint, SsdStore, StoreLocation, StoreOptions, SystemClock, Tenant,
    UnitWrite,
};

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("kvstack-cli-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Bytes;

impl BlockSource for Bytes {
    fn block_payload(&self, i: usize, _: u64, n: usize, out: &mut Vec<u8>) -> Result<()> {
        out.extend((0..100 * n).map(|j| (i + j) as u8));
        Ok(())
    }
}

fn kvstack() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvstack"))
}

fn write_store(dir: &Path) {
    let mut o = StoreOptions::new(StoreLocation::Directory(dir.to_path_buf()));
    o.memory = PinnedOptions {
        huge_pages: HugePages::Never,
        locking: Locking::Never,
    };
    o.capacity_bytes = 4 * o.segment_bytes;
    let store = SsdStore::open(o, Arc::new(SystemClock)).unwrap();
    let t = Tenant::new("cli");
    for u in 0..4u32 {
        let tokens: Vec<u32> = (0..600).map(|i| i + u * 1000).collect();
        store
            .put_unit(&UnitWrite {
                model: &ModelFingerprint([1; 32]),
                tenant: &t,
                tokens: &tokens,
                page_tokens: 256,
                align: 2,
                source: &Bytes,
            })
            .unwrap()
            .wait()
            .unwrap();
    }
    store.close().unwrap();
}

#[test]
fn stats_fsck_and_inspect_clean_then_damaged() {
    let d = TempDir::new("store");
    write_store(&d.0);
    let dir = d.0.to_str().unwrap();

    let out = kvstack()
        .args(["store", "stats", "--dir", dir])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("units        4") && text.contains("recovery"),
        "{text}"
    );

    let out = kvstack()
        .args(["store", "fsck", "--dir", dir])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8(out.stdout).unwrap().contains("clean"));

    let out = kvstack()
        .args(["store", "inspect", "--dir", dir, "--records", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let records = v["records"].as_array().unwrap();
    assert_eq!(records.len(), 4 * 3 + 4, "3 blocks and a commit per unit");
    let block = records.iter().find(|r| r["kind"] == "block").unwrap();
    let offset = block["offset"].as_u64().unwrap();

    // Damage the first block's payload: fsck reports it with its location and fails.
    let seg = std::fs::read_dir(&d.0)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "kvs"))
        .unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&seg)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset + 4096 + 17).unwrap();
    f.write_all_at(&[b[0] ^ 0xFF], offset + 4096 + 17).unwrap();
    drop(f);
    let out = kvstack()
        .args(["store", "fsck", "--dir", dir])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("DAMAGED")
            && text.contains(&format!("offset {offset} "))
            && text.contains("payload checksum"),
        "{text}"
    );
    assert!(String::from_utf8(out.stderr).unwrap().contains("damaged"));
    // stats still opens it, and reports the damage.
    let out = kvstack()
        .args(["store", "stats", "--dir", dir, "--json"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["recovery"]["damaged"].as_array().unwrap().len(), 1);
    assert_eq!(v["units"], 3);
}

#[test]
fn missing_store_is_a_clear_error() {
    let out = kvstack()
        .args(["store", "stats", "--dir", "/nonexistent/kvstack-store"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8(out.stderr)
            .unwrap()
            .contains("no such store directory")
    );
}

#[test]
fn io_engine_values_are_checked_and_a_missing_controller_is_a_clear_error() {
    let run = |args: &[&str]| {
        let out = kvstack()
            .args(["store", "stats"])
            .args(args)
            .output()
            .unwrap();
        (out.status.code(), String::from_utf8(out.stderr).unwrap())
    };
    let (code, err) = run(&["--io-engine", "spdk"]);
    assert_ne!(code, Some(0));
    assert!(
        err.contains("--io-engine") && err.contains("vfio:<pci-address>"),
        "{err}"
    );
    let (code, err) = run(&["--io-engine", "vfio:00:04.0"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("DDDD:BB:DD.F"), "{err}");
    let (code, err) = run(&["--io-engine", "vfio:0000:00:04.0", "--dir", "/tmp"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("drop --dir"), "{err}");
    // A well-formed address with no controller bound to vfio-pci there: the driver's error,
    // naming the location, and no panic.
    let (code, err) = run(&["--io-engine", "vfio:0000:ff:1f.7"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("vfio:0000:ff:1f.7"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bench_tiers_runs_small_and_explains_missing_fio() {
    let d = TempDir::new("bench");
    // An empty PATH: fio cannot be found, and the report says how to install it.
    let out = kvstack()
        .env("PATH", "")
        .args([
            "bench",
            "tiers",
            "--dir",
            d.0.to_str().unwrap(),
            "--units",
            "1",
            "--unit-tokens",
            "2048",
            "--snapshots",
            "4",
            "--json",
        ])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    assert!(
        v["fio_missing"]
            .as_str()
            .unwrap()
            .contains("apt-get install fio")
    );
    assert!(v["write_ratio"].is_null() && v["read_ratio"].is_null());
    assert_eq!(v["restore"]["tokens"], 2048);
    assert!(v["ssd_write"]["gb_per_s"].as_f64().unwrap() > 0.0);
    assert!(v["dram"]["put_ratio"].as_f64().unwrap() > 0.0);
    assert!(v["recovery"]["seconds"].as_f64().is_some());
    // The work directory is removed.
    assert_eq!(std::fs::read_dir(&d.0).unwrap().count(), 0);
}
