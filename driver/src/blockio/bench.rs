//! Block engines measured on a real (or emulated) device, the same workload through
//! `&mut dyn BlockEngine` whatever the engine (docs/nvme.md, "Engines on the emulated
//! device"). Run by the ignored tests `bench_vfio_engine` (the userspace NVMe engine) and
//! `bench_uring_block_device` (io_uring with `O_DIRECT` on the kernel's block device), which
//! `scripts/vfio-rig` runs in its guest with `KVSTACK_VFIO_RIG_BENCH=1`.

use std::time::{Duration, Instant};

use nix::sys::resource::{UsageWho, getrusage};

use super::{BlockEngine, BufferPool, IoOp, IoTarget, OpKind};

/// Bytes of the device the workloads touch (from offset 0).
pub(crate) const SPAN: u64 = 64 << 20;

/// CPU seconds (user + system) of this process so far.
pub(crate) fn cpu_seconds() -> f64 {
    getrusage(UsageWho::RUSAGE_SELF).map_or(0.0, |u| {
        let t = |tv: nix::sys::time::TimeVal| tv.tv_sec() as f64 + tv.tv_usec() as f64 * 1e-6;
        t(u.user_time()) + t(u.system_time())
    })
}

/// One workload: `bytes` per operation, `depth` in flight, random or sequential offsets in
/// [`SPAN`], for `time` (or `max_ops`). Prints a table row: ops, IOPS, MB/s, mean µs, CPU µs
/// per operation.
#[allow(clippy::too_many_arguments)]
fn run(
    engine: &mut dyn BlockEngine,
    pool: &BufferPool,
    target: &IoTarget,
    label: &str,
    kind: OpKind,
    bytes: usize,
    depth: usize,
    random: bool,
    time: Duration,
) {
    let pages = SPAN / bytes as u64;
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = 0u64;
    let mut offset = || {
        if random {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % pages) * bytes as u64
        } else {
            let o = (next % pages) * bytes as u64;
            next += 1;
            o
        }
    };
    let (mut sent, mut done, mut errors) = (0u64, 0u64, 0u64);
    let mut out = Vec::new();
    let cpu0 = cpu_seconds();
    let start = Instant::now();
    let mut stop = false;
    while !stop || engine.in_flight() > 0 {
        while !stop && engine.in_flight() < depth {
            let Some(buf) = pool.try_get() else { break };
            let op = IoOp {
                kind,
                target: target.clone(),
                offset: offset(),
                len: bytes,
                buf,
                tag: sent,
            };
            if let Err(e) = engine.submit(op) {
                println!("{label}: submit failed: {}", e.error);
                return;
            }
            sent += 1;
        }
        out.clear();
        match engine.wait(1, &mut out) {
            Ok(_) => {}
            Err(e) => {
                println!("{label}: wait failed: {e}");
                return;
            }
        }
        done += out.len() as u64;
        errors += out.iter().filter(|c| c.result.is_err()).count() as u64;
        stop = stop || start.elapsed() >= time;
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu = cpu_seconds() - cpu0;
    println!(
        "| {label} | {} | {} KiB | {depth} | {done} | {:.0} | {:.1} | {:.1} | {:.1} | {errors} |",
        if random { "random" } else { "sequential" },
        bytes >> 10,
        done as f64 / secs,
        (done * bytes as u64) as f64 / secs / 1e6,
        secs * 1e6 / done.max(1) as f64 * depth as f64,
        cpu * 1e6 / done.max(1) as f64,
    );
}

/// Seconds per workload: `KVSTACK_BENCH_SECS`, else 3.
pub(crate) fn secs() -> u64 {
    std::env::var("KVSTACK_BENCH_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
}

/// The whole set on the engine `make` builds for the pool (64 buffers of 128 KiB): 128 KiB
/// sequential writes and reads at depth 16, then 4 KiB random reads at depth 1, 16 and 64;
/// [`secs`] seconds each.
pub(crate) fn measure(
    make: impl FnOnce(&BufferPool) -> Box<dyn BlockEngine>,
    target: &IoTarget,
    label: &str,
) {
    let secs = secs();
    let pool = match BufferPool::new(
        64,
        128 << 10,
        crate::pinned::PinnedOptions {
            huge_pages: crate::pinned::HugePages::Never,
            locking: crate::pinned::Locking::Never,
        },
    ) {
        Ok(p) => p,
        Err(e) => {
            println!("{label}: no buffer pool: {e}");
            return;
        }
    };
    let mut engine = make(&pool);
    let engine = engine.as_mut();
    println!(
        "| engine | pattern | size | depth | ops | IOPS | MB/s | mean us (depth x wall / ops) | CPU us per op | errors |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let t = Duration::from_secs(secs);
    run(
        engine,
        &pool,
        target,
        &format!("{label} write"),
        OpKind::Write,
        128 << 10,
        16,
        false,
        t,
    );
    if let Err(e) = engine.flush(target) {
        println!("{label}: flush failed: {e}");
    }
    run(
        engine,
        &pool,
        target,
        &format!("{label} read"),
        OpKind::Read,
        128 << 10,
        16,
        false,
        t,
    );
    for depth in [1, 16, 64] {
        run(
            engine,
            &pool,
            target,
            &format!("{label} read"),
            OpKind::Read,
            4096,
            depth,
            true,
            t,
        );
    }
}
