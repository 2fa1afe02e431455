//! Crash consistency: a child process (this test binary, re-executed) writes units and prints
//! each one's id after its durable acknowledgement; the parent kills it with SIGKILL at random
//! moments, many times, and after each restart checks that every acknowledged unit is readable
//! and bit-identical and that no unit that was cut short is partly visible.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod tiers_common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvstack_tiers::Error;
use kvstack_tiers::{SystemClock, Tenant};
use rand::{Rng, SeedableRng};
use tiers_common::*;

const CHILD_DIR: &str = "KVSTACK_TIERS_CRASH_DIR";
const CHILD_RUN: &str = "KVSTACK_TIERS_CRASH_RUN";
const KILLS: u32 = 20;
const UNITS_PER_RUN: u32 = 400;

fn crash_opts(dir: &std::path::Path) -> kvstack_tiers::StoreOptions {
    let mut o = small_opts(dir);
    // Room for most runs; a fast machine fills it in the later ones, and then writes are
    // refused, segments compacted and the parent's close-time touch commits compete for the
    // last slots: the crash checks hold there too.
    o.capacity_bytes = 400 * o.segment_bytes;
    o
}

/// Tokens of unit `u` of run `run` (families 100-102; units share blocks across runs; every
/// tenth unit is long enough to be queued in several parts).
fn crash_tokens(run: u32, u: u32) -> Vec<u32> {
    mixed_unit_tokens(100, 1_000_000, 10_000, 40, run, u)
}

/// The writer: only active when re-executed by the crash test.
#[test]
fn crash_child_writer() {
    let Ok(dir) = std::env::var(CHILD_DIR) else {
        return;
    };
    let run: u32 = std::env::var(CHILD_RUN).unwrap().parse().unwrap();
    let store = open(
        crash_opts(std::path::Path::new(&dir)),
        Arc::new(SystemClock),
    );
    let t = Tenant::new("crash");
    let mut out = std::io::stdout().lock();
    writeln!(out, "@@OPEN {run}").unwrap();
    out.flush().unwrap();
    for u in 0..UNITS_PER_RUN {
        let tokens = crash_tokens(run, u);
        writeln!(out, "@@BEGIN {run} {u}").unwrap();
        out.flush().unwrap();
        match put(&store, &t, &tokens).and_then(|tk| tk.wait()) {
            Ok(()) => {
                writeln!(out, "@@ACK {run} {u}").unwrap();
                out.flush().unwrap();
            }
            Err(Error::StoreFull { .. }) => {}
            Err(e) => panic!("{e}"),
        }
    }
    writeln!(out, "@@DONE {run}").unwrap();
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[test]
fn sigkill_at_random_points_never_loses_or_exposes_partial_units() {
    let dir = TempDir::new("crash");
    let exe = std::env::current_exe().unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x5EED_C4A5);
    let t = Tenant::new("crash");
    let mut acked: BTreeSet<(u32, u32)> = BTreeSet::new();
    let mut begun: BTreeSet<(u32, u32)> = BTreeSet::new();
    let mut killed_mid_write = 0;
    for run in 0..KILLS {
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "crash_child_writer",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_DIR, dir.path())
            .env(CHILD_RUN, run.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        let stdout = child.stdout.take().unwrap();
        let sink = lines.clone();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap().push(line);
            }
        });
        // Wait until the store is open, then let it write for a random while.
        for _ in 0..2000 {
            if lines.lock().unwrap().iter().any(|l| l.contains("@@OPEN")) {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(5..150)));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        reader.join().unwrap();
        let lines = lines.lock().unwrap().clone();
        if !lines.iter().any(|l| l.contains("@@DONE")) {
            killed_mid_write += 1;
        }
        for l in &lines {
            // The test harness may print on the same line before the marker.
            let Some(at) = l.find("@@") else { continue };
            let parts: Vec<&str> = l[at + 2..].split_whitespace().collect();
            if let [kind, r, u] = parts.as_slice() {
                let id = (r.parse().unwrap(), u.parse().unwrap());
                match *kind {
                    "ACK" => {
                        acked.insert(id);
                    }
                    "BEGIN" => {
                        begun.insert(id);
                    }
                    _ => {}
                }
            }
        }

        // Restart and check.
        let t0 = std::time::Instant::now();
        let store = open(crash_opts(dir.path()), Arc::new(SystemClock));
        eprintln!(
            "run {run}: {} lines, recovery {:.3} s ({} units, {} discarded, {} torn ranges)",
            lines.len(),
            store.recovery().seconds,
            store.recovery().units,
            store.recovery().units_discarded,
            store.recovery().torn_tail_ranges
        );
        store
            .check_index()
            .unwrap_or_else(|e| panic!("run {run}: {e}"));
        assert!(
            store.recovery().damaged.is_empty(),
            "run {run}: {:?}",
            store.recovery().damaged
        );
        let visible: Vec<Vec<u32>> = begun
            .iter()
            .map(|&(r, u)| crash_tokens(r, u))
            .filter(|tok| store.lookup(&model(), &t, tok, P).tokens == tok.len() as u64)
            .collect();
        for &(r, u) in &acked {
            let tok = crash_tokens(r, u);
            let (n, _) = read_and_check(&store, &t, &tok);
            assert_eq!(
                n,
                tok.len() as u64,
                "run {run}: acknowledged unit {r}/{u} lost"
            );
        }
        for &(r, u) in begun.difference(&acked) {
            let tok = crash_tokens(r, u);
            let hit = store.lookup(&model(), &t, &tok, P).tokens as usize;
            if hit == tok.len() {
                continue; // durable, the kill came before its acknowledgement was printed
            }
            // Otherwise only what complete units share with it may be visible.
            let shared = visible
                .iter()
                .filter(|v| **v != tok)
                .map(|v| {
                    let c = common_prefix(v, &tok);
                    if c == v.len() { c } else { c / P * P }
                })
                .max()
                .unwrap_or(0);
            assert!(
                hit <= shared,
                "run {run}: unit {r}/{u} partly visible ({hit} of {} tokens, {shared} shared)",
                tok.len()
            );
            let (n, _) = read_and_check(&store, &t, &tok);
            assert_eq!(n as usize, hit);
        }
        let s = store.stats();
        assert_eq!(s.failed_writes, 0, "run {run}: {s:#?}");
        store
            .check_index()
            .unwrap_or_else(|e| panic!("run {run}: {e}"));
        store.close().unwrap();
        eprintln!(
            "  checked in {:.3} s ({} segments compacted, {} writes refused)",
            t0.elapsed().as_secs_f64(),
            s.segments_compacted,
            s.refused_full
        );
    }
    eprintln!(
        "{} acknowledged, {killed_mid_write} kills mid-write",
        acked.len()
    );
    assert!(acked.len() > 50, "{} units acknowledged", acked.len());
    assert!(
        killed_mid_write > KILLS / 2,
        "{killed_mid_write} kills landed mid-write"
    );
}
