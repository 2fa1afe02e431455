//! `kvstack calc`: the cache-entry arithmetic of spec §6, derived by `kvstack_spec::calc`.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Args;
use kvstack_spec::{
    CacheReport, FormatOverrides, GlobalFormat, IndexFormat, ModelConfig, builtin, format_ratio,
};
use serde::Serialize;

use crate::error::CliError;

/// Arguments of `kvstack calc`.
#[derive(Args)]
pub struct CalcArgs {
    /// Model config.json (flat or with `text_config`). Default: the built-in
    /// DeepSeek-V4.1-Flash config.
    #[arg(long, conflicts_with = "compare")]
    config: Option<PathBuf>,
    /// Compare several configs side by side, with ratios to the first.
    #[arg(long, num_args = 1.., value_name = "FILE")]
    compare: Vec<PathBuf>,
    /// Context length for the size line: a token count, optionally with K or M (x1024, x1024^2).
    /// Default: the config's max_position_embeddings.
    #[arg(long, value_parser = crate::flags::calc_context, value_name = "N")]
    context: Option<u64>,
    /// Override the global (compressed KV) storage format: bf16, fp8, fp4 (also fp8-mla,
    /// fp8-nope-bf16-rope).
    #[arg(long, value_name = "FORMAT")]
    global_format: Option<GlobalFormat>,
    /// Override the indexer key format: fp8, mxfp4 (also bf16).
    #[arg(long, value_name = "FORMAT")]
    index_format: Option<IndexFormat>,
    /// Print JSON: one object per config (an array with --compare).
    #[arg(long)]
    json: bool,
}

/// One computed config: where it came from and its report.
struct Computed {
    source: String,
    context: u64,
    report: CacheReport,
}

/// The JSON shape of one config: the report plus the context line.
#[derive(Serialize)]
struct JsonReport<'a> {
    source: &'a str,
    context_tokens: u64,
    persistent_bytes_at_context: u64,
    persistent_gib_at_context: f64,
    #[serde(flatten)]
    report: &'a CacheReport,
    #[serde(skip_serializing_if = "Option::is_none")]
    ratio_to_first: Option<f64>,
}

fn load(path: Option<&Path>, args: &CalcArgs) -> Result<Computed, CliError> {
    let (source, cfg) = match path {
        Some(p) => (p.display().to_string(), ModelConfig::from_file(p)),
        None => (
            builtin::DEFAULT_CONFIG_NAME.to_owned(),
            builtin::default_config(),
        ),
    };
    // The runtime's load errors already name the file; the CLI adds nothing to them.
    let cfg = cfg.map_err(CliError::ConfigLoad)?;
    let overrides = FormatOverrides {
        global: args.global_format,
        index: args.index_format,
    };
    let report = CacheReport::compute(&cfg, &overrides).map_err(|e| CliError::Calc {
        config: source.clone(),
        source: e,
    })?;
    let context = args
        .context
        .or(cfg.max_position_embeddings)
        .unwrap_or(1 << 20);
    Ok(Computed {
        source,
        context,
        report,
    })
}

fn group(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Bytes per token with only the digits it needs (890, 3514.25, 5031.4375).
fn bpt(x: f64) -> String {
    let s = format!("{x:.4}");
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| v.to_string())
}

fn print_one(out: &mut impl Write, c: &Computed) -> std::io::Result<()> {
    let r = &c.report;
    let f = &r.formats;
    writeln!(out, "config               {}", c.source)?;
    writeln!(
        out,
        "model                {} ({}, {} layers{})",
        r.model_type.as_deref().unwrap_or("?"),
        r.generation,
        r.num_hidden_layers,
        if r.speculative_layers_excluded > 0 {
            format!(
                "; {} speculative layers excluded",
                r.speculative_layers_excluded
            )
        } else {
            String::new()
        }
    )?;
    let mut formats = format!("global {} ({} B/entry)", f.global, f.global_entry_bytes);
    if let (Some(i), Some(b)) = (f.index, f.index_entry_bytes) {
        formats.push_str(&format!(", index {i} ({b} B/key)"));
    }
    if let (Some(w), Some(b)) = (f.window, f.window_entry_bytes) {
        formats.push_str(&format!(", window {w} ({b} B/entry)"));
    }
    writeln!(out, "formats              {formats}")?;
    writeln!(
        out,
        "persistent cache     {} bytes/token",
        bpt(r.persistent_bytes_per_token)
    )?;
    writeln!(
        out,
        "per sequence         {} B = window {} B + pending compressor state {} B{}",
        group(r.per_sequence_bytes),
        group(r.window_bytes),
        group(r.pending_state_bytes),
        if r.per_sequence_is_approximate {
            " (approximate, see notes)"
        } else {
            ""
        }
    )?;
    writeln!(
        out,
        "at {} tokens  {:.3} GiB persistent ({} B), plus the per-sequence constant",
        group(c.context),
        r.gib_at_context(c.context),
        group(r.bytes_at_context(c.context))
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "{:>5}  {:<7}  {:>5}  {:<11}  {:>6}  {:>7}  {:>4}  {:>12}  {:>11}",
        "layer",
        "side",
        "ratio",
        "mode",
        "kv src",
        "idx src",
        "cand",
        "global B/tok",
        "index B/tok"
    )?;
    for l in &r.layers {
        writeln!(
            out,
            "{:>5}  {:<7}  {:>5}  {:<11}  {:>6}  {:>7}  {:>4}  {:>12}  {:>11}",
            l.layer,
            opt(l.side),
            l.compress_ratio,
            l.mode.to_string(),
            opt(l.kv_source),
            opt(l.index_source),
            if l.uses_candidates { "yes" } else { "" },
            bpt(l.global_bytes_per_token),
            bpt(l.index_bytes_per_token)
        )?;
    }
    let v = &r.levers;
    writeln!(out)?;
    writeln!(
        out,
        "levers (chain from a BF16 multi-head baseline of {} B/token; docs/cache-arithmetic.md)",
        bpt(v.baseline_bytes_per_token)
    )?;
    for (name, factor, after) in [
        ("entry sharing", v.entry_sharing, v.after_entry_sharing),
        (
            "sequence compression",
            v.sequence_compression,
            v.after_sequence_compression,
        ),
        (
            "cross-layer sharing",
            v.cross_layer_sharing,
            v.after_cross_layer_sharing,
        ),
        ("storage format", v.storage_format, v.after_storage_format),
    ] {
        writeln!(
            out,
            "  {name:<22} x{:<9} -> {} B/token",
            format_ratio(factor),
            bpt(after)
        )?;
    }
    writeln!(out, "  {:<22} x{}", "total", format_ratio(v.total))?;
    if !r.notes.is_empty() {
        writeln!(out)?;
        writeln!(out, "notes")?;
        for n in &r.notes {
            writeln!(out, "  - {n}")?;
        }
    }
    Ok(())
}

fn print_compare(out: &mut impl Write, all: &[Computed]) -> std::io::Result<()> {
    let reports: Vec<CacheReport> = all.iter().map(|c| c.report.clone()).collect();
    let cmp = kvstack_spec::compare(&reports);
    let name = |c: &Computed| {
        Path::new(&c.source)
            .file_stem()
            .map_or_else(|| c.source.clone(), |s| s.to_string_lossy().into_owned())
    };
    let width = all.iter().map(|c| name(c).len()).max().unwrap_or(0).max(14);
    let row = |out: &mut dyn Write, label: &str, cells: Vec<String>| -> std::io::Result<()> {
        write!(out, "{label:<28}")?;
        for c in cells {
            write!(out, "  {c:>width$}")?;
        }
        writeln!(out)
    };
    row(out, "", all.iter().map(name).collect())?;
    row(
        out,
        "model_type",
        reports
            .iter()
            .map(|r| opt(r.model_type.as_deref()))
            .collect(),
    )?;
    row(
        out,
        "generation",
        reports.iter().map(|r| r.generation.to_string()).collect(),
    )?;
    row(
        out,
        "layers",
        reports
            .iter()
            .map(|r| r.num_hidden_layers.to_string())
            .collect(),
    )?;
    row(
        out,
        "global format",
        reports
            .iter()
            .map(|r| r.formats.global.to_string())
            .collect(),
    )?;
    row(
        out,
        "index format",
        reports.iter().map(|r| opt(r.formats.index)).collect(),
    )?;
    row(
        out,
        "persistent bytes/token",
        reports
            .iter()
            .map(|r| bpt(r.persistent_bytes_per_token))
            .collect(),
    )?;
    row(
        out,
        "x smaller than first",
        cmp.iter().map(|c| c.display.clone()).collect(),
    )?;
    row(
        out,
        "x smaller than previous",
        reports
            .iter()
            .enumerate()
            .map(
                |(i, r)| match i.checked_sub(1).and_then(|p| reports.get(p)) {
                    Some(prev) => {
                        format_ratio(prev.persistent_bytes_per_token / r.persistent_bytes_per_token)
                    }
                    None => "-".to_owned(),
                },
            )
            .collect(),
    )?;
    row(
        out,
        "per-sequence bytes",
        reports
            .iter()
            .map(|r| group(r.per_sequence_bytes))
            .collect(),
    )?;
    let ctx = all.first().map_or(1 << 20, |c| c.context);
    row(
        out,
        &format!("GiB at {} tokens", group(ctx)),
        reports
            .iter()
            .map(|r| format!("{:.2}", r.gib_at_context(ctx)))
            .collect(),
    )?;
    for (label, get) in [
        (
            "lever: entry sharing",
            (|l: &kvstack_spec::Levers| l.entry_sharing) as fn(&_) -> f64,
        ),
        ("lever: sequence compression", |l| l.sequence_compression),
        ("lever: cross-layer sharing", |l| l.cross_layer_sharing),
        ("lever: storage format", |l| l.storage_format),
    ] {
        row(
            out,
            label,
            reports
                .iter()
                .map(|r| format_ratio(get(&r.levers)))
                .collect(),
        )?;
    }
    Ok(())
}

/// Runs `kvstack calc`.
pub fn run(args: &CalcArgs) -> Result<(), CliError> {
    let all: Vec<Computed> = if args.compare.is_empty() {
        vec![load(args.config.as_deref(), args)?]
    } else {
        let mut v = Vec::with_capacity(args.compare.len());
        for p in &args.compare {
            v.push(load(Some(p), args)?);
        }
        // A shared context makes the GiB row comparable.
        let ctx = args.context.unwrap_or(1 << 20);
        v.iter_mut().for_each(|c| c.context = ctx);
        v
    };
    let mut out = std::io::stdout().lock();
    if args.json {
        let first = all.first().map(|c| c.report.persistent_bytes_per_token);
        let objs: Vec<JsonReport<'_>> = all
            .iter()
            .map(|c| JsonReport {
                source: &c.source,
                context_tokens: c.context,
                persistent_bytes_at_context: c.report.bytes_at_context(c.context),
                persistent_gib_at_context: c.report.gib_at_context(c.context),
                report: &c.report,
                ratio_to_first: (!args.compare.is_empty())
                    .then(|| first.map(|f| f / c.report.persistent_bytes_per_token))
                    .flatten(),
            })
            .collect();
        let text = match objs.as_slice() {
            [one] if args.compare.is_empty() => serde_json::to_string_pretty(one),
            _ => serde_json::to_string_pretty(&objs),
        }
        .map_err(CliError::Json)?;
        return writeln!(out, "{text}").map_err(CliError::Stdout);
    }
    if args.compare.is_empty() {
        all.iter().try_for_each(|c| print_one(&mut out, c))
    } else {
        print_compare(&mut out, &all)
    }
    .map_err(CliError::Stdout)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_print_compactly() {
        assert_eq!(bpt(890.0), "890");
        assert_eq!(bpt(3514.25), "3514.25");
        assert_eq!(group(2_703_360), "2,703,360");
        assert_eq!(group(12), "12");
    }
}
