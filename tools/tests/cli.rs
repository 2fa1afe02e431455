//! End-to-end tests of the `kvstack` binary: codec files against the shared vectors, error
//! messages for bad input, `info`, and `calc`'s required numbers.

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

/// The repository's test data (`testdata/`, a copy of `../shared`: vectors, configs, traces).
fn testdata() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata")
}

fn vectors(name: &str) -> PathBuf {
    testdata().join("vectors/codecs").join(name)
}

fn config(name: &str) -> String {
    testdata().join("configs").join(name).display().to_string()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvstack-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn codec_encode_and_decode_reproduce_the_vectors() {
    for (format, stem) in [
        ("fp8-window", "fp8_window"),
        ("fp4-global", "fp4_global"),
        ("mxfp4-index", "mxfp4_index"),
    ] {
        let encoded = scratch(&format!("{stem}.u8"));
        let input = vectors(&format!("{stem}.input.f32"));
        let o = kvstack(&[
            "codec",
            "encode",
            "--format",
            format,
            "--input",
            input.to_str().unwrap(),
            "--output",
            encoded.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{format}: {}", stderr(&o));
        let want = std::fs::read(vectors(&format!("{stem}.encoded.u8"))).unwrap();
        assert!(
            std::fs::read(&encoded).unwrap() == want,
            "{format}: encoded bytes differ"
        );

        let decoded = scratch(&format!("{stem}.f32"));
        let src = vectors(&format!("{stem}.encoded.u8"));
        let o = kvstack(&[
            "codec",
            "decode",
            "--format",
            format,
            "--input",
            src.to_str().unwrap(),
            "--output",
            decoded.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{format}: {}", stderr(&o));
        let want = std::fs::read(vectors(&format!("{stem}.decoded.f32"))).unwrap();
        assert!(
            std::fs::read(&decoded).unwrap() == want,
            "{format}: decoded bits differ"
        );
    }
}

#[test]
fn codec_rejects_wrong_sizes_unknown_formats_and_non_finite_values() {
    // 100 bytes is not a whole number of 512-value f32 rows.
    let bad = scratch("bad.f32");
    std::fs::write(&bad, [0u8; 100]).unwrap();
    let out = scratch("never-written.u8");
    let o = kvstack(&[
        "codec",
        "encode",
        "--format",
        "fp4-global",
        "--input",
        bad.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("100 bytes is not a whole number of 512-value f32 rows"),
        "{}",
        stderr(&o)
    );
    assert!(!out.exists(), "no output may be left behind on error");

    // Entries: 289 bytes is not a whole number of 288-byte entries.
    std::fs::write(&bad, [0u8; 289]).unwrap();
    let o = kvstack(&[
        "codec",
        "decode",
        "--format",
        "fp4-global",
        "--input",
        bad.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("288 bytes each"), "{}", stderr(&o));

    let o = kvstack(&[
        "codec",
        "encode",
        "--format",
        "fp4",
        "--input",
        bad.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("fp4-global"),
        "clap lists the valid formats: {}",
        stderr(&o)
    );

    // A NaN at row 1, column 7 of an MXFP4 input (128 values per row).
    let mut rows = vec![0.5f32; 3 * 128];
    rows[128 + 7] = f32::NAN;
    let bytes: Vec<u8> = rows.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(&bad, bytes).unwrap();
    let o = kvstack(&[
        "codec",
        "encode",
        "--format",
        "mxfp4-index",
        "--input",
        bad.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(err.contains("row 1") && err.contains("column 7"), "{err}");
    assert!(!out.exists());

    let missing = scratch("does-not-exist.f32");
    let o = kvstack(&[
        "codec",
        "encode",
        "--format",
        "fp8-window",
        "--input",
        missing.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("does-not-exist.f32"), "{}", stderr(&o));
}

#[test]
fn info_reports_without_crashing() {
    let dir = scratch("data");
    let o = kvstack(&["info", "--data-dir", dir.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    for key in [
        "simd kernels",
        "locked memory limit",
        "io_uring",
        "O_DIRECT",
        "cuda",
        "huge pages",
    ] {
        assert!(text.contains(key), "missing {key:?} in:\n{text}");
    }
    let o = kvstack(&["info", "--json", "--data-dir", dir.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["simd"]["picked"].is_string());
    assert!(v["io_uring"]["available"].is_boolean());
    assert!(v["o_direct"]["available"].is_boolean());
    assert!(v["cuda"]["driver_library"].is_boolean());
}

fn calc_json(args: &[&str]) -> serde_json::Value {
    let mut all = vec!["calc", "--json"];
    all.extend_from_slice(args);
    let o = kvstack(&all);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn calc_prints_the_spec_numbers_from_the_config_files() {
    for (file, bytes) in [
        ("deepseek-v4.1-flash.json", 890.0),
        ("deepseek-v4-flash.json", 3514.25),
        ("deepseek-llm-67b.json", 389120.0),
    ] {
        let v = calc_json(&["--config", &config(file)]);
        assert_eq!(
            v["persistent_bytes_per_token"].as_f64(),
            Some(bytes),
            "{file}"
        );
        assert!(v["model_type"].is_string(), "{file}");
        assert!(v["per_sequence_bytes"].is_u64(), "{file}");
        assert!(v["layers"].is_array(), "{file}");
    }
    let v = calc_json(&["--config", &config("deepseek-v4.1-flash.json")]);
    assert_eq!(v["layers"].as_array().unwrap().len(), 40);
    assert_eq!(v["window_bytes"].as_u64(), Some(40 * 128 * 528));

    // The embedded default is V4.1-Flash; the text output shows the number.
    let o = kvstack(&["calc"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("890 bytes/token"), "{}", stdout(&o));

    let o = kvstack(&[
        "calc",
        "--compare",
        &config("deepseek-llm-67b.json"),
        &config("deepseek-v4-flash.json"),
        &config("deepseek-v4.1-flash.json"),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains("437.2"), "{text}");
    assert!(text.contains("3.95"), "{text}");
    let o = kvstack(&[
        "calc",
        "--json",
        "--compare",
        &config("deepseek-llm-67b.json"),
        &config("deepseek-v4.1-flash.json"),
    ]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ratio = v[1]["ratio_to_first"].as_f64().unwrap();
    assert_eq!(format!("{ratio:.1}"), "437.2");
}

#[test]
fn calc_format_overrides_change_the_arithmetic() {
    let v = calc_json(&["--global-format", "bf16"]);
    assert_eq!(v["persistent_bytes_per_token"].as_f64(), Some(2730.0));
    let v = calc_json(&["--index-format", "fp8"]);
    assert_eq!(
        v["persistent_bytes_per_token"].as_f64(),
        Some(3.0 * (288.0 + 132.0) / 2.0 + 420.0)
    );
    let o = kvstack(&["calc", "--global-format", "fp5"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("fp5"), "{}", stderr(&o));
}

#[test]
fn calc_reports_bad_configs_with_file_and_field() {
    let text = std::fs::read_to_string(config("deepseek-v4.1-flash.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["num_key_value_heads"] = serde_json::json!(2);
    let bad = scratch("two-kv-heads.json");
    std::fs::write(&bad, serde_json::to_string(&v).unwrap()).unwrap();
    let o = kvstack(&["calc", "--config", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains("two-kv-heads.json") && err.contains("num_key_value_heads"),
        "{err}"
    );

    std::fs::write(&bad, "{ not json").unwrap();
    let o = kvstack(&["calc", "--config", bad.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("two-kv-heads.json"), "{}", stderr(&o));
}

#[test]
fn bench_footprint_measures_the_pools() {
    let o = kvstack(&["bench", "footprint", "--tokens", "64K", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // 65,536 tokens fill whole pages, so the allocation is exactly the entry arithmetic.
    assert_eq!(v["global_bytes_per_token"].as_f64(), Some(890.0));
    assert_eq!(v["window_bytes"].as_u64(), Some(40 * 128 * 528));
    assert!(v["per_sequence_bytes"].as_u64().unwrap() >= 40 * 128 * 528);
    assert!(v["peak_rss_bytes"].as_u64().unwrap() > 0);
}
