//! `kvstack store stats|fsck|inspect`: look at an SSD store without writing to it (and
//! `fsck --repair`, which does write).
//!
//! Reads take the location's shared lock, so a writer cannot start under them; while a writer
//! (`kvstack run`, `kvstackd`) holds the location they read it live and say so. `--repair`
//! needs the exclusive lock: it is refused while any other process uses the store.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, Subcommand};
use kvstack_tiers::fsck::{fsck, inspect};
use kvstack_tiers::{SsdStore, StoreLocation, StoreOptions, SystemClock};

use crate::error::CliError;

/// Where the store is.
#[derive(Args)]
pub struct StoreArgs {
    /// Directory of segment files.
    #[arg(
        long,
        value_name = "D",
        required_unless_present_any = ["device", "io_engine"],
        conflicts_with = "device"
    )]
    dir: Option<PathBuf>,
    /// A preallocated file or raw block device holding the store.
    #[arg(long, value_name = "PATH")]
    device: Option<PathBuf>,
    /// The I/O engine: auto, io_uring, sync, sync-direct, or vfio:PCI-ADDRESS (the store
    /// on namespace 1 of that NVMe controller, bound to vfio-pci, through the userspace
    /// driver, in place of --dir/--device).
    #[arg(long, value_name = "ENGINE")]
    io_engine: Option<String>,
    /// Segment size in MiB the store was created with (needed for devices).
    #[arg(long, value_name = "MIB", default_value_t = 64, value_parser = crate::flags::count::<u64>(1, 1 << 16))]
    segment_mib: u64,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// `kvstack store ...`.
#[derive(Subcommand)]
pub enum StoreOp {
    /// Open the store read-only (rebuilding its index) and print its counters, sizes and what
    /// recovery found.
    Stats(StoreArgs),
    /// Verify every record (headers, checksums, unit chains) and report damage with its
    /// location. Exit code 1 when damage is found.
    Fsck {
        #[command(flatten)]
        args: StoreArgs,
        /// First repair what recovery can: open the store for writing (which drops files
        /// that are not segments and incomplete units, and seals the segments it found),
        /// evict units past retention and compact mostly dead segments, then check. Needs
        /// the store to be unused by any other process.
        #[arg(long)]
        repair: bool,
    },
    /// List segments (and with --records every valid record).
    Inspect {
        #[command(flatten)]
        args: StoreArgs,
        /// List every record too.
        #[arg(long)]
        records: bool,
    },
}

fn options(a: &StoreArgs) -> Result<StoreOptions, CliError> {
    let location = match (&a.dir, &a.device) {
        (_, Some(d)) => StoreLocation::Device(d.clone()),
        (Some(d), None) => StoreLocation::Directory(d.clone()),
        (None, None) => StoreLocation::Directory(PathBuf::from(crate::DEFAULT_DATA_DIR)),
    };
    let mut o = StoreOptions::new(location);
    o.segment_bytes = a.segment_mib << 20;
    o.read_only = true;
    if let Some(e) = &a.io_engine {
        o.set_io_engine(e).map_err(|e| CliError::Usage {
            flag: "--io-engine",
            reason: e.to_string(),
        })?;
        if matches!(o.location, StoreLocation::Namespace(_))
            && (a.dir.is_some() || a.device.is_some())
        {
            return Err(CliError::Usage {
                flag: "--io-engine",
                reason: "vfio:<pci-address> is the store's location: drop --dir/--device".into(),
            });
        }
    }
    Ok(o)
}

fn print_json(v: &impl serde::Serialize) -> Result<(), CliError> {
    let text = serde_json::to_string_pretty(v).map_err(CliError::Json)?;
    writeln!(std::io::stdout().lock(), "{text}").map_err(CliError::Stdout)
}

/// Runs `kvstack store ...`.
pub fn run(op: &StoreOp) -> Result<(), CliError> {
    match op {
        StoreOp::Stats(a) => stats(a),
        StoreOp::Fsck { args, repair } => {
            if *repair {
                self::repair(args)?;
            }
            check(args)
        }
        StoreOp::Inspect { args, records } => list(args, *records),
    }
}

fn stats(a: &StoreArgs) -> Result<(), CliError> {
    let store = SsdStore::open(options(a)?, Arc::new(SystemClock)).map_err(CliError::Store)?;
    let s = store.stats();
    if a.json {
        return print_json(&s);
    }
    let r = &s.recovery;
    let mut out = std::io::stdout().lock();
    let w = |out: &mut std::io::StdoutLock<'_>| -> std::io::Result<()> {
        writeln!(out, "store        {}", s.location.path().display())?;
        if let Some(w) = &r.live_writers {
            writeln!(
                out,
                "live         being written by {w}: a snapshot (units written meanwhile may be \
                 missing or show as torn tails)"
            )?;
        }
        writeln!(
            out,
            "engine       {} (direct I/O {})",
            s.engine.kind.name(),
            s.engine.direct
        )?;
        writeln!(
            out,
            "segments     {} of {} ({} bytes each)",
            s.segments, s.segment_slots, s.segment_bytes
        )?;
        if let Some(c) = &s.nvme_copies {
            writeln!(
                out,
                "nvme         {} operations zero copy, {} through bounce slots ({} bytes copied)",
                c.zero_copy_ops, c.bounced_ops, c.bounce_bytes
            )?;
        }
        writeln!(out, "units        {}", s.units)?;
        writeln!(
            out,
            "deletes      {} kept ({} units deleted at the last open)",
            s.tombstones, r.units_deleted
        )?;
        writeln!(out, "blocks       {}", s.blocks)?;
        writeln!(
            out,
            "bytes        {} live of {} written",
            s.live_bytes, s.written_bytes
        )?;
        writeln!(
            out,
            "recovery     {:.3} s: {} records, {} bytes read, {} torn tails discarded, {} units \
             discarded",
            r.seconds, r.records, r.bytes_read, r.torn_tail_ranges, r.units_discarded
        )?;
        for d in &r.damaged {
            writeln!(
                out,
                "damaged      {} offset {} ({} bytes): {}",
                d.path.display(),
                d.offset,
                d.bytes,
                d.reason
            )?;
        }
        for x in &r.invalid_segments {
            writeln!(out, "invalid      {x}")?;
        }
        Ok(())
    };
    w(&mut out).map_err(CliError::Stdout)
}

fn check(a: &StoreArgs) -> Result<(), CliError> {
    let r = fsck(&options(a)?).map_err(CliError::Store)?;
    if a.json {
        print_json(&r)?;
    } else {
        let mut out = std::io::stdout().lock();
        let w = |out: &mut std::io::StdoutLock<'_>| -> std::io::Result<()> {
            if let Some(w) = &r.live_writers {
                writeln!(
                    out,
                    "live store, being written by {w}: checking a snapshot (torn tails of \
                     writes in flight are expected)"
                )?;
            }
            writeln!(
                out,
                "{} segments, {} records ({} blocks, {} commits, {} deletes), {} complete \
                 units, {} deleted, {} bytes read in {:.3} s",
                r.segments,
                r.records,
                r.blocks,
                r.commits,
                r.deletes,
                r.units_complete,
                r.units_deleted,
                r.bytes_read,
                r.seconds
            )?;
            for d in &r.damaged {
                writeln!(
                    out,
                    "DAMAGED {} offset {} ({} bytes){}{}: {}",
                    d.path.display(),
                    d.offset,
                    d.bytes,
                    d.kind.map(|k| format!(" {k}")).unwrap_or_default(),
                    d.key
                        .as_ref()
                        .map(|k| format!(" key {k}"))
                        .unwrap_or_default(),
                    d.reason
                )?;
            }
            for x in &r.invalid_segments {
                writeln!(out, "INVALID SEGMENT {x}")?;
            }
            for d in &r.torn {
                writeln!(
                    out,
                    "torn tail (a write cut short, discarded) {} offset {} ({} bytes): {}",
                    d.path.display(),
                    d.offset,
                    d.bytes,
                    d.reason
                )?;
            }
            for u in &r.units_incomplete {
                writeln!(out, "incomplete (not visible) {u}")?;
            }
            writeln!(out, "{}", if r.clean() { "clean" } else { "DAMAGED" })
        };
        w(&mut out).map_err(CliError::Stdout)?;
    }
    if r.clean() {
        Ok(())
    } else {
        Err(CliError::Damaged(
            r.damaged.len() + r.invalid_segments.len(),
        ))
    }
}

/// `fsck --repair`: what a writer's open and an explicit reclaim repair.
fn repair(a: &StoreArgs) -> Result<(), CliError> {
    let mut o = options(a)?;
    if let StoreLocation::Directory(d) = &o.location
        && !d.is_dir()
    {
        // Opening for writing would create an empty store where the user expected one.
        return Err(CliError::Store(kvstack_tiers::Error::Location {
            path: d.clone(),
            reason: "no such store directory".into(),
        }));
    }
    o.read_only = false;
    let store = SsdStore::open(o, Arc::new(SystemClock)).map_err(CliError::Store)?;
    let rec = store.recovery().clone();
    let reclaimed = store.reclaim().map_err(CliError::Store)?;
    store.close().map_err(CliError::Store)?;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "repair: recovery kept {} units ({} incomplete discarded, {} torn tails, {} damaged \
         ranges, {} invalid segments); reclaim evicted {} units, compacted {} segments, freed {}",
        rec.units,
        rec.units_discarded,
        rec.torn_tail_ranges,
        rec.damaged.len(),
        rec.invalid_segments.len(),
        reclaimed.units_evicted,
        reclaimed.segments_compacted,
        reclaimed.segments_freed
    )
    .map_err(CliError::Stdout)
}

fn list(a: &StoreArgs, records: bool) -> Result<(), CliError> {
    let r = inspect(&options(a)?, records).map_err(CliError::Store)?;
    if a.json {
        return print_json(&r);
    }
    let mut out = std::io::stdout().lock();
    let w = |out: &mut std::io::StdoutLock<'_>| -> std::io::Result<()> {
        if let Some(w) = &r.live_writers {
            writeln!(out, "live store, being written by {w}: a snapshot")?;
        }
        writeln!(
            out,
            "{:<6} {:<8} {:>8} {:>12} {:>7}  path",
            "slot", "segment", "records", "written", "damaged"
        )?;
        for s in &r.segments {
            writeln!(
                out,
                "{:<6} {:<8} {:>8} {:>12} {:>7}  {}{}",
                s.slot,
                s.id.map_or_else(|| "-".to_owned(), |i| i.to_string()),
                s.records,
                s.written_bytes,
                s.damaged_ranges,
                s.path,
                s.header_error
                    .as_ref()
                    .map(|e| format!(" ({e})"))
                    .unwrap_or_default()
            )?;
        }
        if records {
            writeln!(
                out,
                "{:<8} {:>10} {:<6} {:>8} {:<16} {:>6} {:>6} {:>8} {:>8}",
                "segment", "offset", "kind", "seq", "key", "tokens", "count", "payload", "horizon"
            )?;
            for x in &r.records {
                writeln!(
                    out,
                    "{:<8} {:>10} {:<6} {:>8} {:<16} {:>6} {:>6} {:>8} {:>8}",
                    x.segment,
                    x.offset,
                    x.kind,
                    x.seq,
                    &x.key[..16.min(x.key.len())],
                    x.tokens,
                    x.count,
                    x.payload_len,
                    x.horizon.map_or_else(|| "-".to_owned(), |h| h.to_string())
                )?;
            }
        }
        Ok(())
    };
    w(&mut out).map_err(CliError::Stdout)
}
