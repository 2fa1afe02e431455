//! `include/kvstack.h` is what cbindgen makes of the crate with `cbindgen.toml`: regenerated
//! here and compared byte for byte, so the checked-in header never drifts from the code.
//! `KVSTACK_BLESS=1` writes the fresh header instead (then review the diff).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

fn generate() -> Vec<u8> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).unwrap();
    let bindings = cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen parses the crate");
    let mut out = Vec::new();
    bindings.write(&mut out);
    out
}

#[test]
fn the_checked_in_header_is_cbindgens_output() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("include/kvstack.h");
    let fresh = generate();
    if std::env::var_os("KVSTACK_BLESS").is_some() {
        std::fs::write(&path, &fresh).unwrap();
        return;
    }
    let current = std::fs::read(&path).unwrap_or_default();
    if current != fresh {
        let (cur, new) = (
            String::from_utf8_lossy(&current),
            String::from_utf8_lossy(&fresh),
        );
        let line = cur
            .lines()
            .zip(new.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| cur.lines().count().min(new.lines().count()));
        panic!(
            "{} is not what cbindgen generates from the crate (first difference at line {}: \
             checked in {:?}, generated {:?}); regenerate it with `KVSTACK_BLESS=1 cargo test \
             -p kvstack-capi --test header` and commit it",
            path.display(),
            line + 1,
            cur.lines().nth(line).unwrap_or(""),
            new.lines().nth(line).unwrap_or(""),
        );
    }
}
