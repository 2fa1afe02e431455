//! Layers with 512-wide heads (the built-in models, V4.1-Flash) attend through the tiled
//! decode kernel of `kvstack_kernels::attn`; it must agree with the general per-key path
//! (`kvstack_kernels::csa2::attention`) to f32 rounding, give every query the same bits
//! whether it is attended alone or in a step of many, on one thread or two, and name what
//! is missing when the store lacks a row.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_firmware_interface::EntryFormat;
use kvstack_model::attention::{AttentionDims, AttentionPath, Csa2Attention, TopK};
use kvstack_model::init::random_model;
use kvstack_spec::builtin::{default_config, tiny_config};
use kvstack_spec::plan::{LayerMode, LayerPlan};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// One layer's inputs: queries at `positions`, the window rows of every position up to the
/// last, `entries` compressed entries and a top-k row per query (with `-1` slots).
struct Case {
    layer: usize,
    q: Vec<f32>,
    positions: Vec<u64>,
    window: Vec<u8>,
    entries: Vec<u8>,
    topk: TopK,
}

fn case(attn: &Csa2Attention, n: usize, rng: &mut StdRng) -> Case {
    let d = attn.dims();
    assert_eq!(d.head_dim, 512, "the built-in model has 512-wide heads");
    let layer = attn
        .plan()
        .layers
        .iter()
        .find(|s| s.mode == LayerMode::Full)
        .unwrap()
        .index;
    let first = 300u64;
    let positions: Vec<u64> = (first..first + n as u64).collect();
    let rows = |format: EntryFormat, count: usize, scale: f32, rng: &mut StdRng| {
        let x: Vec<f32> = (0..count * 512)
            .map(|_| rng.random_range(-scale..scale))
            .collect();
        let mut out = vec![0u8; count * format.entry_bytes()];
        kvstack_kernels::quantize(format, &x, &mut out).unwrap();
        out
    };
    let window = rows(EntryFormat::WindowFp8, first as usize + n, 3.0, rng);
    let n_entries = 2000;
    let entries = rows(EntryFormat::GlobalFp4, n_entries, 3.0, rng);
    let q: Vec<f32> = (0..n * d.q_width())
        .map(|_| rng.random_range(-0.3..0.3))
        .collect();
    let k = d.index_topk;
    let mut topk = TopK {
        source: layer,
        k,
        rows: vec![-1; n * k],
    };
    for (i, row) in topk.rows.chunks_mut(k).enumerate() {
        // A full row, one with a few `-1` slots, and one mostly empty.
        let used = match i % 3 {
            0 => k,
            1 => k - 7,
            _ => 5,
        };
        for (s, slot) in row.iter_mut().take(used).enumerate() {
            *slot = ((s * 37 + i * 11) % n_entries) as i32;
        }
    }
    Case {
        layer,
        q,
        positions,
        window,
        entries,
        topk,
    }
}

fn attend(attn: &Csa2Attention, c: &Case, range: std::ops::Range<usize>) -> Vec<f32> {
    let wb = EntryFormat::WindowFp8.entry_bytes();
    let eb = EntryFormat::GlobalFp4.entry_bytes();
    let window = |p: u64| c.window.get(p as usize * wb..(p as usize + 1) * wb);
    let entry = |j: u64| c.entries.get(j as usize * eb..(j as usize + 1) * eb);
    let qw = attn.dims().q_width();
    let k = c.topk.k;
    let topk = TopK {
        source: c.topk.source,
        k,
        rows: c.topk.rows[range.start * k..range.end * k].to_vec(),
    };
    attn.attend(
        c.layer,
        &c.q[range.start * qw..range.end * qw],
        &c.positions[range],
        &window,
        &entry,
        Some(&topk),
    )
    .unwrap()
}

/// Largest `|a - b|` over a head's output, relative to the head's largest `|b|`.
fn worst_rel(a: &[f32], b: &[f32]) -> f64 {
    a.chunks(512)
        .zip(b.chunks(512))
        .map(|(x, y)| {
            let scale = y.iter().fold(1e-30f64, |m, v| m.max(f64::from(v.abs())));
            x.iter()
                .zip(y)
                .map(|(p, q)| f64::from((p - q).abs()) / scale)
                .fold(0.0, f64::max)
        })
        .fold(0.0, f64::max)
}

/// Both paths are f32 with sums in different orders and different `exp` implementations;
/// each is within about 1e-6 of an f64 reference (observed; the kernel's own test bounds it
/// by 2e-5), so they differ by at most about twice that.
const PATH_TOL: f64 = 4e-5;

#[test]
fn tiled_attention_matches_the_general_path() {
    let cfg = tiny_config().unwrap();
    let model = random_model(&cfg, 5).unwrap();
    // The built-in model's 4 heads take the general path by default; force each.
    assert!(!model.attention().tiled_attention());
    let mut tiled = model.attention().clone();
    tiled.set_attention_path(AttentionPath::Tiled);
    assert!(tiled.tiled_attention());
    let mut general = tiled.clone();
    general.set_attention_path(AttentionPath::General);
    let n = 24;
    let c = case(&tiled, n, &mut StdRng::seed_from_u64(0x5eed));
    let want = attend(&general, &c, 0..n);
    for threads in [1, 2] {
        tiled.set_threads(threads);
        let many = attend(&tiled, &c, 0..n);
        let rel = worst_rel(&many, &want);
        eprintln!(
            "tiled vs general, {threads} thread(s): worst {rel:e} of a head's largest output"
        );
        assert!(rel <= PATH_TOL, "{threads} thread(s): {rel:e}");
        assert!(
            rel > 0.0,
            "different sum orders giving equal bits everywhere is suspicious"
        );
        // A query alone gives the bits it gets in a step of many.
        let qw = tiled.dims().q_width();
        for i in [0, 1, 2, n - 1] {
            let one = attend(&tiled, &c, i..i + 1);
            assert!(
                one == many[i * qw..(i + 1) * qw],
                "{threads} thread(s): query {i} alone differs from the step"
            );
        }
    }
}

#[test]
fn tiled_attention_names_a_missing_row() {
    let cfg = tiny_config().unwrap();
    let model = random_model(&cfg, 5).unwrap();
    let mut tiled = model.attention().clone();
    tiled.set_attention_path(AttentionPath::Tiled);
    let attn = &tiled;
    let c = case(attn, 2, &mut StdRng::seed_from_u64(9));
    let wb = EntryFormat::WindowFp8.entry_bytes();
    let eb = EntryFormat::GlobalFp4.entry_bytes();
    let qw = attn.dims().q_width();
    let window = |p: u64| c.window.get(p as usize * wb..(p as usize + 1) * wb);
    let no_window = |p: u64| (p != 250).then(|| window(p)).flatten();
    let entry = |j: u64| c.entries.get(j as usize * eb..(j as usize + 1) * eb);
    let short_entry = |j: u64| entry(j).map(|e| &e[..e.len() - 1]);
    let err = attn
        .attend(
            c.layer,
            &c.q[..qw],
            &c.positions[..1],
            &no_window,
            &entry,
            Some(&c.topk),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("window row of position 250"), "{err}");
    let err = attn
        .attend(
            c.layer,
            &c.q[..qw],
            &c.positions[..1],
            &window,
            &short_entry,
            Some(&c.topk),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("has 287 bytes, not 288"), "{err}");
}

#[test]
fn auto_path_is_tiled_at_v41_flash_dimensions() {
    let dims = |cfg: kvstack_spec::ModelConfig| {
        let plan = LayerPlan::from_config(&cfg).unwrap();
        AttentionDims::from_config(&cfg, &plan).unwrap()
    };
    let flash = dims(default_config().unwrap());
    assert_eq!((flash.heads, flash.head_dim), (64, 512));
    assert!(AttentionPath::Auto.is_tiled(&flash));
    assert!(!AttentionPath::General.is_tiled(&flash));
    let tiny = dims(tiny_config().unwrap());
    assert_eq!((tiny.heads, tiny.head_dim), (4, 512));
    assert!(!AttentionPath::Auto.is_tiled(&tiny));
    assert!(AttentionPath::Tiled.is_tiled(&tiny));
}
