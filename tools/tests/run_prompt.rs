//! `kvstack run --prompt TEXT`: one text completion on the built-in model (byte-level tokens,
//! served through the tiers, a longer prompt reuses the first one's unit from the SSD) and on
//! a seeded checkpoint, sharded or not, with its own `tokenizer.json`: both give the same
//! tokens; `model init --shards` writes the released layout.

// Test code: a failed unwrap is a failed test, with its message.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn kvstack(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvstack"))
        .args(args)
        .output()
        .expect("run kvstack")
}

fn ok(args: &[&str]) -> String {
    let o = kvstack(args);
    assert!(
        o.status.success(),
        "kvstack {args:?}: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

fn json(args: &[&str]) -> serde_json::Value {
    let text = ok(args);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

#[test]
fn a_text_prompt_streams_its_completion_and_a_longer_one_reuses_it() {
    let tmp = tempfile::tempdir().unwrap();
    let data = path(&tmp.path().join("data"));
    let first = "The KV cache lives on the SSD";
    let a = json(&[
        "run",
        "--prompt",
        first,
        "--data-dir",
        &data,
        "--decode-tokens",
        "8",
        "--json",
    ]);
    assert_eq!(a["prompt_tokens"], first.len(), "byte-level: {a}");
    assert_eq!(a["tokenizer"], "byte-level");
    let n = a["tokens"].as_array().unwrap().len();
    assert!((1..=8).contains(&n), "{a}");
    assert_eq!(a["reuse"]["ssd_tokens"], 0, "{a}");
    // The streamed text is the same completion (another data directory, the same seed).
    let other = path(&tmp.path().join("other"));
    let streamed = ok(&[
        "run",
        "--prompt",
        first,
        "--data-dir",
        &other,
        "--decode-tokens",
        "8",
    ]);
    assert_eq!(streamed.trim_end_matches('\n'), a["text"].as_str().unwrap());
    // A longer prompt starting with the first is served from the SSD in part.
    let b = json(&[
        "run",
        "--prompt",
        &format!("{first} for 72 hours"),
        "--data-dir",
        &data,
        "--decode-tokens",
        "4",
        "--json",
    ]);
    assert!(b["reuse"]["ssd_tokens"].as_u64() > Some(0), "{b}");
    // Prompts do not mix with the workload's flags.
    let o = kvstack(&["run", "--prompt", "x", "--sessions", "2"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--sessions"));
}

/// A word-level `tokenizer.json` (the `tokenizers` crate's format) whose ids fit the model.
const TOKENIZER: &str = r#"{"version": "1.0", "truncation": null, "padding": null,
  "added_tokens": [], "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
  "post_processor": null, "decoder": null,
  "model": {"type": "WordLevel", "vocab": {"[UNK]": 3, "hello": 10, "kv": 11, "cache": 12},
    "unk_token": "[UNK]"}}"#;

#[test]
fn a_sharded_checkpoint_with_its_tokenizer_completes_as_the_single_file_does() {
    let tmp = tempfile::tempdir().unwrap();
    let config = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../userspace/spec/src/builtin/kvstack-tiny-v4.1.json")
        .display()
        .to_string();
    let sharded = tmp.path().join("sharded");
    let out = ok(&[
        "model",
        "init",
        "--config",
        &config,
        "--seed",
        "11",
        "--shards",
        "3",
        "--out",
        &path(&sharded),
    ]);
    assert!(out.contains("3 shards"), "{out}");
    for i in 1..=3 {
        assert!(
            sharded
                .join(format!("model-{i:05}-of-00003.safetensors"))
                .is_file()
        );
    }
    let single_dir = tmp.path().join("single");
    std::fs::create_dir_all(&single_dir).unwrap();
    let single: PathBuf = single_dir.join("model.safetensors");
    ok(&[
        "model",
        "init",
        "--config",
        &config,
        "--seed",
        "11",
        "--out",
        &path(&single),
    ]);
    for d in [&sharded, &single_dir] {
        std::fs::write(d.join("tokenizer.json"), TOKENIZER).unwrap();
    }
    let complete = |weights: &Path| {
        json(&[
            "run",
            "--config",
            &config,
            "--weights",
            &path(weights),
            "--prompt",
            "hello kv cache hello",
            "--decode-tokens",
            "6",
            "--no-tiers",
            "--json",
        ])
    };
    let s = complete(&sharded);
    assert_eq!(s["prompt_tokens"], 4, "{s}");
    assert!(
        s["tokenizer"].as_str().unwrap().ends_with("tokenizer.json"),
        "{s}"
    );
    let f = complete(&single);
    assert_eq!(s["tokens"], f["tokens"], "sharded {s}\nsingle {f}");
    assert!(!s["tokens"].as_array().unwrap().is_empty());
    // The index file names the same checkpoint as its directory.
    let by_index = complete(&sharded.join("model.safetensors.index.json"));
    assert_eq!(by_index["tokens"], s["tokens"]);
    // A missing shard is named.
    std::fs::remove_file(sharded.join("model-00002-of-00003.safetensors")).unwrap();
    let o = kvstack(&[
        "run",
        "--config",
        &config,
        "--weights",
        &path(&sharded),
        "--prompt",
        "hello",
        "--no-tiers",
    ]);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("model-00002-of-00003.safetensors"), "{e}");
    // --config alone is refused by the parser.
    let o = kvstack(&["run", "--config", &config, "--prompt", "hello"]);
    assert_eq!(o.status.code(), Some(2));
}
