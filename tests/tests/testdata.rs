//! The repository's test data (`testdata/`) is the byte-identical copy of `../shared` it claims
//! to be (`testdata/README.md`): every file matches `testdata/SHA256SUMS`, nothing unlisted
//! sits beside them, and where `../shared` is beside the checkout, both trees hold the same files
//! with the same bytes.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata")
}

/// The copied folders and where each came from, relative to `../shared`.
const ORIGINS: [(&str, &str); 3] = [
    ("vectors", "vectors"),
    ("configs", "spec/configs"),
    ("traces", "traces"),
];

fn sha256_hex(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Every regular file under `dir`, as paths relative to `dir`, sorted.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().to_path_buf());
            }
        }
    }
    out.sort();
    out
}

fn manifest() -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(root().join("SHA256SUMS")).unwrap();
    text.lines()
        .map(|l| {
            let (hash, name) = l
                .split_once("  ")
                .unwrap_or_else(|| panic!("SHA256SUMS: malformed line {l:?}"));
            (name.to_string(), hash.to_string())
        })
        .collect()
}

#[test]
fn every_file_matches_sha256sums_and_none_is_unlisted() {
    let listed = manifest();
    let mut present = Vec::new();
    for (folder, _) in ORIGINS {
        for f in files(&root().join(folder)) {
            present.push(Path::new(folder).join(f).display().to_string());
        }
    }
    let unlisted: Vec<_> = present
        .iter()
        .filter(|p| !listed.contains_key(*p))
        .collect();
    assert!(
        unlisted.is_empty(),
        "files in testdata/ not in SHA256SUMS: {unlisted:?}"
    );
    for (name, hash) in &listed {
        let path = root().join(name);
        assert!(
            path.is_file(),
            "testdata/{name} listed in SHA256SUMS is missing"
        );
        assert_eq!(
            &sha256_hex(&path),
            hash,
            "testdata/{name} differs from SHA256SUMS"
        );
    }
    // The suite's vectors and configs are all here (a truncated copy would pass the loop above
    // only with a truncated manifest).
    assert!(
        listed.len() >= 30,
        "SHA256SUMS lists only {} files",
        listed.len()
    );
}

#[test]
fn copy_is_byte_identical_to_shared_when_it_is_beside_the_checkout() {
    let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared");
    if !shared.join("vectors").is_dir() {
        eprintln!("skipped: {} is not beside this checkout", shared.display());
        return;
    }
    for (folder, origin) in ORIGINS {
        let ours = root().join(folder);
        let theirs = shared.join(origin);
        let (a, b) = (files(&ours), files(&theirs));
        assert_eq!(
            a, b,
            "testdata/{folder} and ../shared/{origin} hold different files"
        );
        for f in a {
            let (x, y) = (std::fs::read(ours.join(&f)), std::fs::read(theirs.join(&f)));
            assert!(
                x.unwrap() == y.unwrap(),
                "testdata/{folder}/{} differs from ../shared/{origin}/{}",
                f.display(),
                f.display()
            );
        }
    }
}
