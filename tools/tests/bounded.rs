//! Every file a command reads is read with bounds: special files are refused, oversized
//! configs are refused before they are read, safetensors headers are checked before parsing.
//! Each command must fail within seconds with a message naming the file.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs the command, kills it after 10 s; returns (exit code, stderr).
fn run(args: &[&str]) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvstack"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("{args:?} still running after 10 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().unwrap();
    (out.status.code(), String::from_utf8(out.stderr).unwrap())
}

#[test]
fn special_files_are_refused_everywhere() {
    let csa2 = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/vectors/csa2");
    let cfg = format!("{csa2}/model_config.json");
    let cases: Vec<Vec<String>> = vec![
        vec!["calc".into(), "--config".into(), "/dev/zero".into()],
        vec![
            "calc".into(),
            "--compare".into(),
            "/dev/zero".into(),
            "/dev/zero".into(),
        ],
        vec![
            "codec".into(),
            "decode".into(),
            "--format".into(),
            "fp4-global".into(),
            "--input".into(),
            "/dev/zero".into(),
            "--output".into(),
            "/dev/null".into(),
        ],
        vec![
            "verify".into(),
            "model".into(),
            "--config".into(),
            cfg.clone(),
            "--weights".into(),
            "/dev/zero".into(),
            "--vectors".into(),
            "/dev/zero".into(),
        ],
        vec![
            "model".into(),
            "init".into(),
            "--config".into(),
            "/dev/zero".into(),
            "--out".into(),
            "/dev/null".into(),
        ],
    ];
    for c in cases {
        let args: Vec<&str> = c.iter().map(String::as_str).collect();
        let (code, err) = run(&args);
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(err.contains("/dev/zero"), "{args:?}: {err}");
        assert!(err.contains("not a regular file"), "{args:?}: {err}");
    }
}

#[test]
fn an_oversized_config_is_refused_unread() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("huge.json");
    let f = std::fs::File::create(&p).unwrap();
    f.set_len((16 << 20) + 1).unwrap(); // sparse: no 16 MiB written
    let (code, err) = run(&["calc", "--config", p.to_str().unwrap()]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("16777217 bytes is more than the 16777216-byte limit"),
        "{err}"
    );
}

#[test]
fn a_safetensors_header_length_is_checked_before_parsing() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("w.safetensors");
    let mut bytes = (1u64 << 40).to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&p, &bytes).unwrap();
    let csa2 = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/vectors/csa2");
    let (code, err) = run(&[
        "verify",
        "model",
        "--config",
        &format!("{csa2}/model_config.json"),
        "--weights",
        p.to_str().unwrap(),
        "--vectors",
        p.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("header length 1099511627776 exceeds"), "{err}");
}
