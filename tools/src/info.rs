//! `kvstack info`: what this machine offers the stack.

use std::io::Write;
use std::path::Path;

use serde::Serialize;

use crate::error::CliError;

/// CPU features the kernels can use, and the SIMD level they picked.
#[derive(Serialize)]
struct SimdReport {
    picked: String,
    available_levels: Vec<String>,
    cpu_flags: Vec<&'static str>,
}

#[derive(Serialize)]
struct InfoReport {
    simd: SimdReport,
    #[serde(flatten)]
    host: kvstack_driver::HostReport,
}

fn cpu_flags() -> Vec<&'static str> {
    #[allow(unused_mut)]
    let mut flags = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! check {
            ($($f:tt),*) => {$(
                if std::arch::is_x86_feature_detected!($f) {
                    flags.push($f);
                }
            )*};
        }
        check!(
            "sse4.2",
            "avx",
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512vnni",
            "avx512bf16",
            "avxvnni"
        );
    }
    flags
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / f64::from(1u32 << 30))
}

fn limit(b: Option<u64>) -> String {
    match b {
        None => "unlimited".to_owned(),
        Some(b) if b >= 1 << 30 => gib(b),
        Some(b) => format!("{} KiB", b / 1024),
    }
}

fn yes_no(c: &kvstack_driver::probe::Capability) -> String {
    format!("{} ({})", if c.available { "yes" } else { "no" }, c.detail)
}

/// Runs `kvstack info`.
pub fn run(data_dir: &Path, json: bool) -> Result<(), CliError> {
    let report = InfoReport {
        simd: SimdReport {
            picked: kvstack_kernels::detected_level().to_string(),
            available_levels: kvstack_kernels::available_levels()
                .into_iter()
                .map(|l| l.to_string())
                .collect(),
            cpu_flags: cpu_flags(),
        },
        host: kvstack_driver::probe_host(data_dir),
    };
    let mut out = std::io::stdout().lock();
    if json {
        let text = serde_json::to_string_pretty(&report).map_err(CliError::Json)?;
        return writeln!(out, "{text}").map_err(CliError::Stdout);
    }
    let h = &report.host;
    let mut lines = vec![
        (
            "cpu",
            h.cpu_model.clone().unwrap_or_else(|| "unknown".to_owned()),
        ),
        ("logical cpus", h.logical_cpus.to_string()),
        ("cpu flags", report.simd.cpu_flags.join(" ")),
        (
            "simd kernels",
            format!(
                "{} (available: {})",
                report.simd.picked,
                report.simd.available_levels.join(", ")
            ),
        ),
    ];
    match (&h.memory, &h.meminfo_error) {
        (Some(m), _) => {
            lines.push((
                "memory",
                format!(
                    "{} total, {} available",
                    gib(m.total_bytes),
                    gib(m.available_bytes)
                ),
            ));
            lines.push((
                "huge pages",
                format!(
                    "{} reserved, {} free, {} KiB each; transparent: {}",
                    m.huge_pages_total,
                    m.huge_pages_free,
                    m.huge_page_bytes / 1024,
                    h.transparent_huge_pages
                        .as_deref()
                        .unwrap_or("not available")
                ),
            ));
        }
        (None, e) => lines.push(("memory", e.clone().unwrap_or_default())),
    }
    lines.push((
        "locked memory limit",
        match (&h.memlock, &h.memlock_error) {
            (Some(m), _) => {
                let mut s = format!("{} (hard {})", limit(m.soft_bytes), limit(m.hard_bytes));
                if m.soft_bytes.is_some_and(|b| b < 1 << 30) {
                    s.push_str(
                        "; pinned cache pools above this fall back to unpinned memory \
                         (raise with `ulimit -l` or LimitMEMLOCK= in the systemd unit)",
                    );
                }
                s
            }
            (None, e) => e.clone().unwrap_or_default(),
        },
    ));
    lines.push(("io_uring", yes_no(&h.io_uring)));
    lines.push(("data dir", h.data_dir.display().to_string()));
    lines.push(("O_DIRECT", yes_no(&h.o_direct)));
    let c = &h.cuda;
    lines.push((
        "cuda",
        match (c.compiled, c.driver_library, c.devices) {
            (false, _, _) => "not compiled in".to_owned(),
            (true, false, _) => "no (no CUDA driver library)".to_owned(),
            (true, true, Some(n)) if n > 0 => format!(
                "yes: {n} device(s), driver CUDA {}",
                c.driver_version.as_deref().unwrap_or("?")
            ),
            (true, true, _) => format!("no ({})", c.detail.as_deref().unwrap_or("no device")),
        },
    ));
    for (k, v) in lines {
        writeln!(out, "{k:<20} {v}").map_err(CliError::Stdout)?;
    }
    Ok(())
}
