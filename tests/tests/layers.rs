//! The workspace's layering (`docs/ARCHITECTURE.md`): every crate sits on a rank and depends
//! only on crates of lower ranks. Reads the dependency graph from `cargo metadata`, so a new
//! dependency edge that points up or sideways fails here, in CI, before review.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::process::Command;

/// The rank of every workspace crate. A crate may depend on crates of strictly lower rank.
/// A new crate must be placed here deliberately (an unknown workspace crate fails the test).
const RANKS: &[(&str, u32)] = &[
    ("kvstack-firmware-interface", 0),
    ("kvstack-driver", 1),
    ("kvstack-kernels", 1),
    ("kvstack-spec", 2),
    ("kvstack-cache", 3),
    ("kvstack-tiers", 4),
    ("kvstack-model", 4),
    ("kvstack-engine", 5),
    ("kvstack-appliance", 6),
    ("kvstack-capi", 6),
    ("kvstack-bench", 7),
    ("kvstack-tools", 8),
    ("kvstack-tests", 9),
];

fn rank(name: &str) -> Option<u32> {
    RANKS.iter().find(|(n, _)| *n == name).map(|&(_, r)| r)
}

/// `(crate, [(dependency, kind)])` for every workspace member, from `cargo metadata`.
fn workspace_edges() -> BTreeMap<String, Vec<(String, String)>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut edges = BTreeMap::new();
    for p in meta["packages"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap().to_owned();
        let deps = p["dependencies"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["path"].is_string())
            .map(|d| {
                let kind = d["kind"].as_str().unwrap_or("normal").to_owned();
                (d["name"].as_str().unwrap().to_owned(), kind)
            })
            .collect();
        edges.insert(name, deps);
    }
    edges
}

#[test]
fn every_dependency_points_down() {
    let edges = workspace_edges();
    let mut wrong = Vec::new();
    for (name, deps) in &edges {
        let Some(r) = rank(name) else {
            wrong.push(format!("{name} has no rank in tests/tests/layers.rs"));
            continue;
        };
        for (dep, kind) in deps {
            match rank(dep) {
                Some(d) if d < r => {}
                Some(d) => wrong.push(format!(
                    "{name} (rank {r}) depends on {dep} (rank {d}, {kind} dependency): \
                     dependencies must point down"
                )),
                None => wrong.push(format!("{name} depends on unranked path crate {dep}")),
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "layering violations:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_check_sees_the_whole_workspace() {
    // A vacuous pass (metadata parsed to nothing) must not hide violations.
    let edges = workspace_edges();
    for name in [
        "kvstack-spec",
        "kvstack-engine",
        "kvstack-tools",
        "kvstack-tests",
    ] {
        assert!(
            edges.contains_key(name),
            "{name} missing from cargo metadata"
        );
    }
    let engine = &edges["kvstack-engine"];
    assert!(engine.iter().any(|(d, _)| d == "kvstack-tiers"));
    // And a violation would be reported: the engine must not be below the model it drives.
    assert!(rank("kvstack-model") < rank("kvstack-engine"));
}
