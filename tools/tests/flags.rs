//! Every numeric flag of every subcommand refuses zero, absurd and malformed values before any
//! work: a non-zero exit within seconds and a message naming the flag (and its range).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// (subcommand words, flag, bad values). Zero is listed only where it is not allowed.
const CASES: &[(&[&str], &str, &[&str])] = &[
    (&["run"], "--sessions", &["0", "100000", "-1", "x"]),
    (&["run"], "--turns", &["0", "100000"]),
    (&["run"], "--system-tokens", &["1000000", "-5"]),
    (&["run"], "--tool-tokens", &["1000000"]),
    (&["run"], "--user-tokens", &["0", "1000000"]),
    (&["run"], "--decode-tokens", &["0", "1000000"]),
    (&["run"], "--chunk", &["0", "1000000", "1.5"]),
    (&["run"], "--threads", &["0", "100000"]),
    (&["run"], "--seed", &["-1", "abc"]),
    (&["run"], "--temperature", &["0", "-1", "NaN", "1e9"]),
    (&["run"], "--top-p", &["0", "1.5", "inf"]),
    (&["calc"], "--context", &["0", "99999M", "lots"]),
    (&["bench", "codecs"], "--buffer-mib", &["0", "100000000"]),
    (&["bench", "codecs"], "--repetitions", &["0", "100000000"]),
    (&["bench", "footprint"], "--tokens", &["0", "1000M"]),
    (
        &["bench", "attention"],
        "--repetitions",
        &["0", "100000000"],
    ),
    (&["bench", "attention"], "--threads", &["0", "2,0"]),
    (&["bench", "tiers"], "--units", &["0", "100000"]),
    (
        &["bench", "tiers"],
        "--unit-tokens",
        &["0", "100", "300", "100000000"],
    ),
    (&["bench", "tiers"], "--snapshots", &["0", "1", "1000000"]),
    (&["bench", "tiers"], "--queue-depth", &["0", "100000"]),
    (&["bench", "tiers"], "--repeat", &["0", "100000"]),
    (&["bench", "runtime"], "--tokens", &["0", "100000000"]),
    (
        &["bench", "runtime"],
        "--suffix",
        &["0", "32768", "100000000"],
    ),
    (&["bench", "runtime"], "--threads", &["0", "1,0", "100000"]),
    (
        &["bench", "runtime"],
        "--prefill-tokens",
        &["0", "100000000"],
    ),
    (&["bench", "runtime"], "--decode-sessions", &["0", "100000"]),
    (
        &["bench", "runtime"],
        "--decode-tokens",
        &["0", "100000000"],
    ),
    (&["bench", "runtime"], "--ced-tokens", &["-1", "100000000"]),
    (&["store", "stats"], "--segment-mib", &["0", "100000000"]),
    (&["store", "fsck"], "--segment-mib", &["0"]),
    (&["store", "inspect"], "--segment-mib", &["0"]),
    (&["verify", "attention"], "--rel-tol", &["0", "-1", "2"]),
    (&["verify", "model"], "--rel-tol", &["0", "NaN"]),
    (&["model", "init"], "--seed", &["-3"]),
];

/// Arguments a subcommand needs besides the flag under test, so that only the flag is wrong.
fn required(words: &[&str]) -> Vec<&'static str> {
    match words {
        ["store", _] => vec!["--dir", "/nonexistent/kvstack-flags"],
        ["verify", _] => vec![
            "--config",
            "/nonexistent/c.json",
            "--weights",
            "/nonexistent/w",
            "--vectors",
            "/nonexistent/v",
        ],
        ["model", "init"] => vec!["--out", "/nonexistent/out.safetensors"],
        _ => Vec::new(),
    }
}

#[test]
fn every_numeric_flag_refuses_bad_values_naming_the_flag() {
    let mut failures = Vec::new();
    for (words, flag, values) in CASES {
        for v in *values {
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvstack"));
            cmd.args(*words)
                .args(required(words))
                .arg(format!("{flag}={v}"))
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let t = Instant::now();
            let mut child = cmd.spawn().unwrap();
            // A refusal is immediate; anything that starts working is a failure of the check.
            let status = loop {
                if let Some(s) = child.try_wait().unwrap() {
                    break Some(s);
                }
                if t.elapsed() > Duration::from_secs(10) {
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            let out = child.wait_with_output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            let case = format!("{} {flag}={v}", words.join(" "));
            match status {
                None => failures.push(format!("{case}: still running after 10 s")),
                Some(s) if s.success() => failures.push(format!("{case}: accepted")),
                Some(_) if !err.contains(flag) => {
                    failures.push(format!("{case}: message does not name {flag}: {err}"))
                }
                Some(_) => {}
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn a_session_longer_than_the_context_limit_is_refused_up_front() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvstack"))
        .args([
            "run",
            "--turns",
            "200",
            "--tool-tokens",
            "1000",
            "--no-tiers",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--turns"), "{err}");
    assert!(err.contains("65536-token context limit"), "{err}");
}

#[test]
fn range_errors_state_the_range() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvstack"))
        .args(["run", "--chunk", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--chunk"), "{err}");
    assert!(err.contains("1..=65536"), "{err}");
}
