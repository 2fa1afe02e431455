//! Plots of replay reports, each as PNG and SVG (`docs/profile.md` explains each one):
//! hit rate per source over trace time, tier occupancy over time, SSD bandwidth over time,
//! latency CDFs, and for several runs hit rate against SSD capacity.
//!
//! Text needs a TrueType font: the first of `KVSTACK_PLOT_FONT` and the usual DejaVu and
//! Liberation paths that exists (read once, at run time).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::report::{ReplayReport, TokensBySource};
use crate::{Error, Result};

const SIZE: (u32, u32) = (1000, 600);
const FONT: &str = "sans-serif";

/// Where fonts usually are on Linux distributions.
const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
];

/// Registers a font once; the path used, or why none.
fn font() -> std::result::Result<&'static Path, String> {
    static FONT_FILE: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    FONT_FILE
        .get_or_init(|| {
            let env = std::env::var_os("KVSTACK_PLOT_FONT").map(PathBuf::from);
            let candidates = env.into_iter().chain(FONT_PATHS.iter().map(PathBuf::from));
            for p in candidates {
                let Ok(bytes) = kvstack_spec::files::read_regular(&p, 64 << 20) else {
                    continue;
                };
                // The font is used for the life of the process.
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font(FONT, FontStyle::Normal, bytes).is_ok() {
                    return Ok(p);
                }
            }
            Err(format!(
                "no TrueType font found (set KVSTACK_PLOT_FONT, or install fonts-dejavu-core); \
                 looked in {}",
                FONT_PATHS.join(", ")
            ))
        })
        .as_ref()
        .map(PathBuf::as_path)
        .map_err(Clone::clone)
}

/// Picks one part of a [`TokensBySource`].
type Part = dyn Fn(&TokensBySource) -> u64;

/// One line of a chart.
struct Line {
    name: String,
    color: RGBColor,
    points: Vec<(f64, f64)>,
}

/// A line chart.
struct Chart {
    title: String,
    x_label: String,
    y_label: String,
    log_x: bool,
    lines: Vec<Line>,
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

fn range(v: impl Iterator<Item = f64>, log: bool) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for x in v.filter(|x| x.is_finite() && (!log || *x > 0.0)) {
        lo = lo.min(x);
        hi = hi.max(x);
    }
    if !lo.is_finite() {
        return if log { (1e-3, 1.0) } else { (0.0, 1.0) };
    }
    if log {
        (lo * 0.8, hi * 1.25)
    } else {
        let lo = lo.min(0.0);
        let hi = if hi > lo { hi * 1.05 } else { lo + 1.0 };
        (lo, hi)
    }
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    c: &Chart,
) -> std::result::Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    root.fill(&WHITE)?;
    let xs = c.lines.iter().flat_map(|l| l.points.iter().map(|p| p.0));
    let ys = c.lines.iter().flat_map(|l| l.points.iter().map(|p| p.1));
    let (x0, x1) = range(xs, c.log_x);
    let (y0, y1) = range(ys, false);
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(&c.title, (FONT, 26))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(80);
    macro_rules! body {
        ($chart:expr) => {{
            let mut chart = $chart;
            chart
                .configure_mesh()
                .x_desc(c.x_label.as_str())
                .y_desc(c.y_label.as_str())
                .label_style((FONT, 16))
                .axis_desc_style((FONT, 18))
                .draw()?;
            for l in &c.lines {
                let color = l.color;
                chart
                    .draw_series(LineSeries::new(
                        l.points.iter().copied(),
                        color.stroke_width(2),
                    ))?
                    .label(l.name.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3))
                    });
            }
            chart
                .configure_series_labels()
                .label_font((FONT, 16))
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .position(SeriesLabelPosition::UpperLeft)
                .draw()?;
        }};
    }
    if c.log_x {
        body!(builder.build_cartesian_2d((x0..x1).log_scale(), y0..y1)?);
    } else {
        body!(builder.build_cartesian_2d(x0..x1, y0..y1)?);
    }
    root.present()
}

/// Writes `c` as `stem.png` and `stem.svg` in `dir`; returns both paths.
fn write(dir: &Path, stem: &str, c: &Chart) -> Result<Vec<PathBuf>> {
    font().map_err(|reason| Error::Plot {
        path: dir.join(stem),
        reason,
    })?;
    let png_path = dir.join(format!("{stem}.png"));
    let svg_path = dir.join(format!("{stem}.svg"));
    let fail = |path: &Path, reason: String| Error::Plot {
        path: path.to_path_buf(),
        reason,
    };
    let mut rgb = vec![255u8; (SIZE.0 * SIZE.1 * 3) as usize];
    draw(
        BitMapBackend::with_buffer(&mut rgb, SIZE).into_drawing_area(),
        c,
    )
    .map_err(|e| fail(&png_path, e.to_string()))?;
    let file =
        std::fs::File::create(&png_path).map_err(|e| Error::io("cannot create", &png_path, e))?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), SIZE.0, SIZE.1);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header()
        .and_then(|mut w| w.write_image_data(&rgb))
        .map_err(|e| fail(&png_path, e.to_string()))?;
    let mut svg = String::new();
    draw(
        SVGBackend::with_string(&mut svg, SIZE).into_drawing_area(),
        c,
    )
    .map_err(|e| fail(&svg_path, e.to_string()))?;
    std::fs::write(&svg_path, svg).map_err(|e| Error::io("cannot write", &svg_path, e))?;
    Ok(vec![png_path, svg_path])
}

fn minutes(r: &ReplayReport) -> Vec<f64> {
    r.series.t_s.iter().map(|t| t / 60.0).collect()
}

/// The CDF of `samples` (ms) as points.
fn cdf(samples: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = samples.iter().copied().filter(|x| *x > 0.0).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    // At most ~500 points: a long tail stays visible, the file stays small.
    let step = n.div_ceil(500).max(1);
    let mut pts: Vec<(f64, f64)> = v
        .iter()
        .enumerate()
        .step_by(step)
        .map(|(i, &x)| (x, (i + 1) as f64 / n as f64))
        .collect();
    if let Some(&last) = v.last() {
        pts.push((last, 1.0));
    }
    pts
}

/// Draws the plots of one run into `dir` with file names starting `prefix`; returns the
/// files written.
///
/// # Errors
/// [`Error::Plot`] (no font, drawing or encoding failed), [`Error::Io`].
pub fn plot_run(r: &ReplayReport, dir: &Path, prefix: &str) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io("cannot create", dir, e))?;
    let t = minutes(r);
    let mut files = Vec::new();
    let share = |f: &Part| -> Vec<(f64, f64)> {
        r.series
            .tokens
            .iter()
            .zip(&t)
            .filter(|(s, _)| s.total() > 0)
            .map(|(s, &x)| (x, f(s) as f64 / s.total() as f64))
            .collect()
    };
    let by_source: [(&str, &Part); 6] = [
        ("all tiers (hit rate)", &|s| s.hits()),
        ("live", &|s| s.live),
        ("dram paged cache", &|s| s.dram_cache),
        ("ssd", &|s| s.ssd),
        ("dram pool (window)", &|s| s.dram_pool),
        ("replayed", &|s| s.replayed),
    ];
    let lines = by_source
        .iter()
        .enumerate()
        .map(|(i, (name, f))| Line {
            name: (*name).to_owned(),
            color: COLORS[i],
            points: share(f),
        })
        .collect();
    let title = |what: &str| format!("{what}: {}", r.model);
    files.extend(write(
        dir,
        &format!("{prefix}hit-rate"),
        &Chart {
            title: title("input tokens by source"),
            x_label: "trace time (min)".into(),
            y_label: "share of input tokens".into(),
            log_x: false,
            lines,
        },
    )?);
    // Occupancy is sampled at each bucket's end.
    let bucket_min = r.series.bucket_ms as f64 / 6e4;
    let occ = |v: &[u64]| -> Vec<(f64, f64)> {
        v.iter()
            .zip(&t)
            .map(|(&b, &x)| (x + bucket_min, b as f64 / 1e9))
            .collect()
    };
    files.extend(write(
        dir,
        &format!("{prefix}occupancy"),
        &Chart {
            title: title("tier occupancy"),
            x_label: "trace time (min)".into(),
            y_label: "GB held".into(),
            log_x: false,
            lines: vec![
                Line {
                    name: "ssd (live records)".into(),
                    color: COLORS[0],
                    points: occ(&r.series.ssd_live_bytes),
                },
                Line {
                    name: "dram window pool".into(),
                    color: COLORS[1],
                    points: occ(&r.series.pool_bytes),
                },
                Line {
                    name: "paged cache (in use)".into(),
                    color: COLORS[2],
                    points: occ(&r.series.cache_bytes),
                },
            ],
        },
    )?);
    let bw =
        |v: &[f64]| -> Vec<(f64, f64)> { v.iter().zip(&t).map(|(&b, &x)| (x, b / 1e6)).collect() };
    files.extend(write(
        dir,
        &format!("{prefix}ssd-bandwidth"),
        &Chart {
            title: title("SSD traffic the trace asks for (per trace second)"),
            x_label: "trace time (min)".into(),
            y_label: "MB/s".into(),
            log_x: false,
            lines: vec![
                Line {
                    name: "read (KV restored)".into(),
                    color: COLORS[0],
                    points: bw(&r.series.ssd_read_bytes_per_s),
                },
                Line {
                    name: "written (device bytes)".into(),
                    color: COLORS[3],
                    points: bw(&r.series.ssd_write_bytes_per_s),
                },
            ],
        },
    )?);
    let s = &r.samples;
    let lat_lines: Vec<Line> = [
        ("lookup", &s.lookup),
        ("restore from ssd", &s.restore_ssd),
        ("restore from dram", &s.restore_dram),
        ("admission", &s.admission),
    ]
    .iter()
    .enumerate()
    .filter(|(_, (_, v))| !v.is_empty())
    .map(|(i, (name, v))| Line {
        name: (*name).to_owned(),
        color: COLORS[i],
        points: cdf(v),
    })
    .collect();
    files.extend(write(
        dir,
        &format!("{prefix}latency-cdf"),
        &Chart {
            title: title("latency CDFs (measured)"),
            x_label: "milliseconds (log)".into(),
            y_label: "fraction of requests".into(),
            log_x: true,
            lines: lat_lines,
        },
    )?);
    Ok(files)
}

/// Draws hit rate against SSD capacity for several runs (one line per model and DRAM pool
/// size); returns the files written.
///
/// # Errors
/// As [`plot_run`].
pub fn plot_sweep(runs: &[ReplayReport], dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io("cannot create", dir, e))?;
    let mut groups: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in runs {
        let name = format!(
            "{} ({} B/token), pool {:.1} GB",
            r.model,
            r.model_bytes_per_token,
            r.dram_pool.capacity_bytes as f64 / 1e9
        );
        let pt = (r.ssd.capacity_bytes as f64 / 1e9, r.hit_rate_tokens);
        match groups.iter_mut().find(|(n, _)| *n == name) {
            Some((_, v)) => v.push(pt),
            None => groups.push((name, vec![pt])),
        }
    }
    let lines = groups
        .into_iter()
        .enumerate()
        .map(|(i, (name, mut points))| {
            points.sort_by(|a, b| a.0.total_cmp(&b.0));
            Line {
                name,
                color: COLORS[i % COLORS.len()],
                points,
            }
        })
        .collect();
    write(
        dir,
        "hit-rate-vs-capacity",
        &Chart {
            title: "token hit rate against SSD capacity".into(),
            x_label: "SSD capacity (GB, log)".into(),
            y_label: "hit rate (input tokens)".into(),
            log_x: true,
            lines,
        },
    )
}
