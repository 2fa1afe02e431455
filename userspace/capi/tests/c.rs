//! The C side of libkvstack: the C tests (`tests/*.c`), the C and Python examples and the
//! exported symbols, against the `libkvstack.so` cargo built for this test run and the
//! checked-in `include/kvstack.h`.
//!
//! Each C file is compiled with `cc` (or `$CC`) and run. When the compiler can build and run
//! a program with `-fsanitize=address,undefined`, every C program is built that way and runs
//! with leak checking on: any sanitizer report fails the test. Without that support the
//! programs run unsanitized and the reason is printed; `KVSTACK_REQUIRE_SANITIZERS=1` (set by
//! `.ci/run`) turns a missing sanitizer into a failure.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use kvstack_cache::CacheOptions;
use kvstack_driver::pinned::{HugePages, Locking, PinnedOptions};
use kvstack_engine::{
    EngineOptions, Event, ModelSource, RequestSpec, Service, ServiceOptions, SessionId,
};
use kvstack_kernels::model::Sampling;
use kvstack_tiers::{StoreLocation, StoreOptions, TierOptions};

const SANITIZE: &[&str] = &[
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
];

fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The directory of the libraries cargo built for this run: the test binary's own
/// (`target/<profile>/deps`), where the cdylib and staticlib of the package's lib land.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().to_path_buf();
    assert!(
        dir.join("libkvstack.so").is_file(),
        "libkvstack.so is not beside the test binary in {}",
        dir.display()
    );
    dir
}

fn cc() -> String {
    std::env::var("CC").unwrap_or_else(|_| "cc".into())
}

/// Environment of a sanitized run: leaks and every report are fatal.
fn sanitizer_env(cmd: &mut Command) {
    cmd.env(
        "ASAN_OPTIONS",
        "detect_leaks=1:halt_on_error=1:abort_on_error=0:strict_string_checks=1:\
         detect_stack_use_after_return=1:check_initialization_order=1",
    )
    .env("UBSAN_OPTIONS", "halt_on_error=1:print_stacktrace=1")
    .env("LSAN_OPTIONS", "report_objects=1");
}

/// Whether the compiler builds and runs sanitized programs here (probed once); the reason
/// when it does not.
fn sanitizers() -> bool {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    let probe = PROBE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        // A clean program must run clean, and a leaking one must be caught: only then is
        // "no report" evidence.
        let clean = "#include <stdlib.h>\nint main(void) { char *p = malloc(4); p[0] = 1; \
                     int r = p[0] - 1; free(p); return r; }\n";
        let leaky = "#include <stdlib.h>\nvoid *volatile keep;\nint main(void) { \
                     keep = malloc(64); keep = 0; return 0; }\n";
        for (name, src, leaks) in [("clean", clean, false), ("leaky", leaky, true)] {
            let path = dir.path().join(format!("{name}.c"));
            std::fs::write(&path, src).unwrap();
            let exe = dir.path().join(name);
            let out = Command::new(cc())
                .args(SANITIZE)
                .arg(&path)
                .arg("-o")
                .arg(&exe)
                .output()
                .map_err(|e| format!("cannot run {}: {e}", cc()))?;
            if !out.status.success() {
                return Err(format!(
                    "{} cannot build with {}: {}",
                    cc(),
                    SANITIZE.join(" "),
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            let mut run = Command::new(&exe);
            sanitizer_env(&mut run);
            let out = run
                .output()
                .map_err(|e| format!("cannot run a probe: {e}"))?;
            let stderr = String::from_utf8_lossy(&out.stderr);
            if !leaks && !out.status.success() {
                return Err(format!(
                    "a sanitized program does not run here: {}",
                    stderr.trim()
                ));
            }
            if leaks && (out.status.success() || !stderr.contains("detected memory leaks")) {
                return Err(format!(
                    "leak checking does not work here (a leak went unreported: {})",
                    stderr.trim()
                ));
            }
        }
        Ok(())
    });
    match probe {
        Ok(()) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| eprintln!("C programs built with {}", SANITIZE.join(" ")));
            true
        }
        Err(reason) => {
            assert!(
                std::env::var_os("KVSTACK_REQUIRE_SANITIZERS").is_none(),
                "sanitizers are required (KVSTACK_REQUIRE_SANITIZERS) but {reason} \
                 (scripts/install-test-deps installs libasan and libubsan)"
            );
            eprintln!("running the C tests WITHOUT sanitizers: {reason}");
            false
        }
    }
}

/// A C program built from `sources` against the header and `libkvstack.so`.
struct Program {
    exe: PathBuf,
    sanitized: bool,
    _dir: tempfile::TempDir,
}

fn build(sources: &[&Path]) -> Program {
    build_with(sources, &[], true)
}

fn build_with(sources: &[&Path], extra: &[&str], shared: bool) -> Program {
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("prog");
    let libs = lib_dir();
    let sanitized = sanitizers();
    let mut cmd = Command::new(cc());
    cmd.args([
        "-std=c11",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-pedantic",
        "-g",
        "-O1",
    ])
    .arg("-I")
    .arg(crate_dir().join("include"))
    .arg("-I")
    .arg(crate_dir().join("tests"));
    if sanitized {
        cmd.args(SANITIZE);
    }
    cmd.args(sources).arg("-o").arg(&exe);
    if shared {
        cmd.arg("-L")
            .arg(&libs)
            .arg("-lkvstack")
            .arg(format!("-Wl,-rpath,{}", libs.display()));
    }
    cmd.args(extra).arg("-lpthread");
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "compiling {sources:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Program {
        exe,
        sanitized,
        _dir: dir,
    }
}

impl Program {
    /// Runs the program; it must exit 0 with no sanitizer report. Returns its stdout.
    fn run(&self, args: &[&Path]) -> String {
        let mut cmd = Command::new(&self.exe);
        cmd.args(args);
        if self.sanitized {
            sanitizer_env(&mut cmd);
        }
        check_run(&format!("{}", self.exe.display()), cmd.output().unwrap())
    }
}

fn check_run(what: &str, out: Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    for report in [
        "AddressSanitizer",
        "LeakSanitizer",
        "UndefinedBehaviorSanitizer",
        "runtime error:",
    ] {
        assert!(
            !stderr.contains(report),
            "{what}: sanitizer report:\n{stderr}"
        );
    }
    stdout
}

fn test_c(name: &str) -> PathBuf {
    crate_dir().join("tests").join(name)
}

/// The built-in tiny V4.1 config as a file (a config the store and engine read from a path).
fn tiny_config_file(dir: &Path) -> PathBuf {
    let path = dir.join("config.json");
    std::fs::write(&path, kvstack_spec::builtin::TINY_V41_JSON).unwrap();
    path
}

#[test]
fn store_round_trip_in_c() {
    let dir = tempfile::tempdir().unwrap();
    let files = tempfile::tempdir().unwrap();
    let config = tiny_config_file(files.path());
    let out = build(&[&test_c("store_roundtrip.c")]).run(&[dir.path(), &config]);
    assert!(out.contains("store round trip: ok"), "{out}");
}

#[test]
fn misuse_gives_clear_codes_and_no_crash() {
    let dir = tempfile::tempdir().unwrap();
    let out = build(&[&test_c("errors.c")]).run(&[dir.path()]);
    assert!(out.contains("misuse: ok"), "{out}");
}

#[test]
fn damaged_segments_give_a_miss_and_no_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let out = build(&[&test_c("corrupt.c")]).run(&[dir.path()]);
    assert!(out.contains("damage: ok"), "{out}");
}

#[test]
fn two_threads_drive_their_own_sessions() {
    let dir = tempfile::tempdir().unwrap();
    let out = build(&[&test_c("threads.c")]).run(&[dir.path()]);
    assert!(out.contains("threads: ok"), "{out}");
}

/// The tokens of `engine_tokens.c`'s three turns, by `kvstack_engine::Service` directly.
fn rust_turns(model: ModelSource, data_dir: Option<&Path>) -> Vec<Vec<u32>> {
    let memory = PinnedOptions {
        huge_pages: HugePages::Never,
        locking: Locking::Never,
    };
    let mut opts = ServiceOptions::new(model);
    opts.engine = EngineOptions {
        chunk: 128,
        keep_live: data_dir.is_none(),
        cache: CacheOptions {
            context_limit: 8192,
            max_sequences: 4,
            memory,
            ..CacheOptions::default()
        },
        ..EngineOptions::default()
    };
    if let Some(dir) = data_dir {
        let mut store = StoreOptions::new(StoreLocation::Directory(dir.to_path_buf()));
        store.segment_bytes = 8 << 20;
        store.capacity_bytes = 16 * store.segment_bytes;
        store.memory = memory;
        let mut tiers = TierOptions::new(store);
        tiers.pool.capacity_bytes = Some(64 << 20);
        tiers.pool.memory = memory;
        opts.tiers = Some(tiers);
    }
    let mut service = Service::open(opts).unwrap();
    let s: SessionId = service.open_session("tenant");
    let prompt: Vec<u32> = (0..300u32).map(|i| (i * 131 + 7) % 1024).collect();
    let more: Vec<u32> = (0..50u32).map(|i| (i * 17 + 400) % 1024).collect();
    let turns = [
        (prompt.clone(), 8, Sampling::Greedy, 0),
        (more, 5, Sampling::Greedy, 0),
        (
            prompt[..20].to_vec(),
            6,
            Sampling::TopP {
                temperature: 0.8,
                top_p: 0.9,
            },
            77,
        ),
    ];
    let mut all = Vec::new();
    for (tokens, new, sampling, seed) in turns {
        service
            .submit(
                s,
                RequestSpec {
                    tokens,
                    max_new_tokens: new,
                    sampling,
                    seed,
                },
            )
            .unwrap();
        let mut got = None;
        while !service.is_idle() {
            for e in service.step().unwrap() {
                match e {
                    Event::Finished(c) => got = Some(c.tokens),
                    Event::Failed { error, .. } => panic!("turn failed: {error}"),
                    _ => {}
                }
            }
        }
        all.push(got.unwrap());
    }
    service.close().unwrap();
    all
}

fn parse_turns(out: &str) -> Vec<Vec<u32>> {
    out.lines()
        .filter_map(|l| l.split_once(':'))
        .filter(|(k, _)| k.starts_with("turn"))
        .map(|(_, v)| v.split_whitespace().map(|t| t.parse().unwrap()).collect())
        .collect()
}

#[test]
fn engine_tokens_equal_the_rust_engines() {
    let seed = 23u64;
    let builtin = || ModelSource::BuiltinTiny { seed };
    let prog = build(&[&test_c("engine_tokens.c")]);
    let seed_arg = PathBuf::from(seed.to_string());
    let live = PathBuf::from("-");
    let c_live = parse_turns(&prog.run(&[&seed_arg, &live]));
    assert_eq!(c_live.len(), 3);
    assert_eq!(
        c_live,
        rust_turns(builtin(), None),
        "C (live sessions) vs Rust"
    );

    // Sessions released between turns and restored from the tiers (the SSD store, and the
    // bounded replay where the unit has no window snapshot): the same tokens in C as in Rust.
    let c_dir = tempfile::tempdir().unwrap();
    let c_tiers = parse_turns(&prog.run(&[&seed_arg, c_dir.path()]));
    let r_dir = tempfile::tempdir().unwrap();
    let want_tiers = rust_turns(builtin(), Some(r_dir.path()));
    assert_eq!(c_tiers, want_tiers, "C (through the tiers) vs Rust");
    // The first turn has nothing to restore: it is the live run's.
    assert_eq!(c_tiers[0], c_live[0]);

    // A checkpoint given by config path and weights file (a seeded one of the tiny config).
    let files = tempfile::tempdir().unwrap();
    let config = tiny_config_file(files.path());
    let weights = files.path().join("weights.safetensors");
    let cfg = kvstack_spec::ModelConfig::from_file(&config).unwrap();
    kvstack_model::init::write_checkpoint(&cfg, seed + 1, &weights).unwrap();
    let c_ckpt = parse_turns(&prog.run(&[&seed_arg, &live, &config, &weights]));
    let want_ckpt = rust_turns(
        ModelSource::Checkpoint {
            config: config.clone(),
            weights: weights.clone(),
        },
        None,
    );
    assert_eq!(c_ckpt, want_ckpt, "C (checkpoint) vs Rust");
    assert_ne!(c_ckpt, c_live, "other weights, other tokens");
}

#[test]
fn struct_layouts_match_between_c_and_rust() {
    use kvstack::engine::{kvstack_engine_options, kvstack_request_params};
    use kvstack::store::{
        kvstack_hit, kvstack_store_options, kvstack_tier_stats, kvstack_unit, kvstack_unit_layout,
    };
    use std::mem::{offset_of, size_of};
    let out = build(&[&test_c("abi_layout.c")]).run(&[]);
    let c: std::collections::BTreeMap<&str, usize> = out
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(k, v)| (k, v.parse().unwrap()))
        .collect();
    let rust = [
        ("kvstack_store_options", size_of::<kvstack_store_options>()),
        (
            "kvstack_store_options.config_path",
            offset_of!(kvstack_store_options, config_path),
        ),
        (
            "kvstack_store_options.weights_id_len",
            offset_of!(kvstack_store_options, weights_id_len),
        ),
        (
            "kvstack_store_options.pool_ttl_ms",
            offset_of!(kvstack_store_options, pool_ttl_ms),
        ),
        (
            "kvstack_store_options.page_tokens",
            offset_of!(kvstack_store_options, page_tokens),
        ),
        (
            "kvstack_store_options.huge_pages",
            offset_of!(kvstack_store_options, huge_pages),
        ),
        ("kvstack_hit", size_of::<kvstack_hit>()),
        (
            "kvstack_hit.window_bytes",
            offset_of!(kvstack_hit, window_bytes),
        ),
        ("kvstack_unit", size_of::<kvstack_unit>()),
        (
            "kvstack_unit.window_bytes",
            offset_of!(kvstack_unit, window_bytes),
        ),
        ("kvstack_unit_layout", size_of::<kvstack_unit_layout>()),
        (
            "kvstack_unit_layout.kv_sources",
            offset_of!(kvstack_unit_layout, kv_sources),
        ),
        ("kvstack_tier_stats", size_of::<kvstack_tier_stats>()),
        (
            "kvstack_tier_stats.pool_evicted",
            offset_of!(kvstack_tier_stats, pool_evicted),
        ),
        (
            "kvstack_tier_stats.poisoned",
            offset_of!(kvstack_tier_stats, poisoned),
        ),
        (
            "kvstack_engine_options",
            size_of::<kvstack_engine_options>(),
        ),
        (
            "kvstack_engine_options.data_dir",
            offset_of!(kvstack_engine_options, data_dir),
        ),
        (
            "kvstack_engine_options.pool_capacity_bytes",
            offset_of!(kvstack_engine_options, pool_capacity_bytes),
        ),
        (
            "kvstack_engine_options.prefill",
            offset_of!(kvstack_engine_options, prefill),
        ),
        (
            "kvstack_engine_options.huge_pages",
            offset_of!(kvstack_engine_options, huge_pages),
        ),
        (
            "kvstack_request_params",
            size_of::<kvstack_request_params>(),
        ),
        (
            "kvstack_request_params.max_new_tokens",
            offset_of!(kvstack_request_params, max_new_tokens),
        ),
        (
            "kvstack_request_params.top_p",
            offset_of!(kvstack_request_params, top_p),
        ),
        ("kvstack_result", size_of::<kvstack::kvstack_result>()),
    ];
    assert_eq!(c.len(), rust.len(), "{out}");
    for (name, r) in rust {
        assert_eq!(c.get(name), Some(&r), "{name}");
    }
}

/// `kvstack_...(` declarations of the header.
fn header_functions() -> BTreeSet<String> {
    let h = std::fs::read_to_string(crate_dir().join("include/kvstack.h")).unwrap();
    let mut names = BTreeSet::new();
    for line in h.lines().filter(|l| !l.trim_start().starts_with("//")) {
        for (i, _) in line.match_indices("kvstack_") {
            let rest = &line[i..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            if rest[end..].starts_with('(') {
                names.insert(rest[..end].to_owned());
            }
        }
    }
    names
}

#[test]
fn only_kvstack_symbols_are_exported_and_the_header_declares_them_all() {
    let so = lib_dir().join("libkvstack.so");
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&so)
        .output()
        .expect("nm runs (binutils)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let exported: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .map(str::to_owned)
        .collect();
    let foreign: Vec<&String> = exported
        .iter()
        .filter(|s| !s.starts_with("kvstack_"))
        .collect();
    assert!(
        foreign.is_empty(),
        "exported without the prefix: {foreign:?}"
    );
    let declared = header_functions();
    assert!(declared.len() >= 25, "{declared:?}");
    assert_eq!(
        exported, declared,
        "exported symbols vs the header's functions"
    );
}

#[test]
fn the_static_library_links_a_c_program() {
    let a = lib_dir().join("libkvstack.a");
    let a = a.to_str().unwrap();
    // What a Rust staticlib needs from the system on Linux (also in kvstack.pc's
    // Libs.private).
    let prog = build_with(
        &[&test_c("store_roundtrip.c")],
        &[
            a,
            "-lgcc_s",
            "-lutil",
            "-lrt",
            "-lpthread",
            "-lm",
            "-ldl",
            "-lc",
        ],
        false,
    );
    let dir = tempfile::tempdir().unwrap();
    assert!(prog.run(&[dir.path()]).contains("store round trip: ok"));
}

#[test]
fn the_c_example_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = build(&[&crate_dir().join("examples/c/embed.c")]).run(&[dir.path()]);
    assert!(out.contains("generated:"), "{out}");
    assert!(out.contains("prefix found: 512 tokens"), "{out}");
}

#[test]
fn the_python_example_runs() {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    if Command::new(&python).arg("--version").output().is_err() {
        eprintln!("skipping the Python example: no {python} on this machine");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(&python)
        .arg(crate_dir().join("examples/python/embed.py"))
        .arg(lib_dir().join("libkvstack.so"))
        .arg(dir.path())
        .output()
        .unwrap();
    let out = check_run("embed.py", out);
    assert!(out.contains("generated:"), "{out}");
    assert!(out.contains("prefix found: 512 tokens"), "{out}");
}

#[test]
fn the_pkg_config_file_links_the_example() {
    if Command::new("pkg-config")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("skipping the pkg-config check: no pkg-config on this machine");
        return;
    }
    // The file `scripts/capi-build` writes, pointing at this build.
    let dir = tempfile::tempdir().unwrap();
    let template = std::fs::read_to_string(crate_dir().join("kvstack.pc.in")).unwrap();
    let pc = template
        .replace("@LIBDIR@", lib_dir().to_str().unwrap())
        .replace(
            "@INCLUDEDIR@",
            crate_dir().join("include").to_str().unwrap(),
        )
        .replace("@VERSION@", env!("CARGO_PKG_VERSION"));
    assert!(!pc.contains('@'), "{pc}");
    std::fs::write(dir.path().join("kvstack.pc"), pc).unwrap();
    let flags = Command::new("pkg-config")
        .args(["--cflags", "--libs", "kvstack"])
        .env("PKG_CONFIG_PATH", dir.path())
        .output()
        .unwrap();
    let flags = check_run("pkg-config", flags);
    let flags: Vec<&str> = flags.split_whitespace().collect();
    assert!(flags.contains(&"-lkvstack"), "{flags:?}");
    let rpath = format!("-Wl,-rpath,{}", lib_dir().display());
    let mut extra = flags.clone();
    extra.push(&rpath);
    let prog = build_with(&[&crate_dir().join("examples/c/embed.c")], &extra, false);
    let data = tempfile::tempdir().unwrap();
    assert!(prog.run(&[data.path()]).contains("generated:"));
}
