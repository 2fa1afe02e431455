//! `verify attention`: runs the CSA2 attention chain on a reference dump and compares every
//! recorded stage (spec §4; the dump format is that of `shared/vectors/csa2`, README
//! "attn_vectors.safetensors").
//!
//! Two passes, both reported per layer and stage:
//!
//! - **chain**: every layer runs [`Csa2Attention::forward`] on the recorded layer input
//!   (`layers.{l}.input`) as one prefill step, threading its OWN state (compressed KV, index
//!   keys, top-k, candidates) from layer to layer; every intermediate the dump records is
//!   compared, and after each layer the state the next layer receives (`state.{l}.*`);
//! - **stage**: every stage is fed the reference's own inputs for that stage (recorded query
//!   latent, pre-quantization values, index queries and keys, scores, top-k, attended values),
//!   isolating each block (README "How to compare").
//!
//! Comparisons and tolerances:
//!
//! - f32 values: per row (the last axis: one token's vector, one head's vector), the worst
//!   absolute difference relative to the row's largest reference magnitude (a norm-wise
//!   relative error, meaningful for rows with cancellations); a stage passes when its worst
//!   row is within `rel_tol` (1e-4). `-inf` must match `-inf` exactly (masked scores);
//! - quantized caches (window KV, compressed KV, index keys, index queries; the dump records
//!   them dequantized): bit-exact, except elements the dump flags in `*.fragile_elements`
//!   or inside blocks flagged in `*.fragile_blocks` (a ±1e-5 relative change of the
//!   quantizer input flips them), which are counted separately;
//! - selections (top-k, candidate pools): exact as sets per token (`-1` slots ignored).
//!
//! Any config of this shape works (dimensions come from `config.json`); stages a dump does
//! not record are skipped with a note, recorded tensors of the wrong shape or dtype are
//! errors naming the tensor and the expected shape.

use std::collections::BTreeSet;
use std::fmt;
use std::path::Path;

use kvstack_kernels::csa2::quant::RowCodec;
use kvstack_kernels::csa2::topk::canonicalize;
use serde::Serialize;

use crate::Error;
use crate::attention::{Csa2Attention, LayerTrace, StepState, TopK};
use crate::weights::TensorFile;
use kvstack_spec::plan::{LayerMode, LayerSpec};

/// Which pass a result belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pass {
    /// Own state threaded through the layers.
    Chain,
    /// Each stage fed the reference's inputs.
    Stage,
}

impl fmt::Display for Pass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Pass::Chain => "chain",
            Pass::Stage => "stage",
        })
    }
}

/// What kind of comparison a stage is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// f32 values within the relative tolerance.
    Values,
    /// Quantized values, bit-exact except fragile elements.
    Quantized,
    /// Index sets, exact.
    Selection,
}

/// The comparison of one stage of one layer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StageResult {
    /// The layer (the state entries `state.{l}.*` are reported under layer `l`).
    pub layer: usize,
    /// The pass.
    pub pass: Pass,
    /// The recorded tensor's name without the `layers.{l}.` prefix (`state.*` for state).
    pub stage: String,
    /// The comparison.
    pub kind: Kind,
    /// Elements (values) or rows (selections) compared.
    pub compared: usize,
    /// Worst absolute difference (values and quantized).
    pub max_abs: f64,
    /// Worst norm-wise relative difference of a row (values and quantized).
    pub max_rel: f64,
    /// Elements that differ beyond the tolerance (quantized: differing bits on elements not
    /// flagged fragile), or rows whose selected sets differ.
    pub mismatches: usize,
    /// Quantized: differing elements that the dump flags as fragile (allowed).
    pub fragile: usize,
    /// Whether the stage is within tolerance.
    pub passed: bool,
}

/// Options of [`verify_attention`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VerifyOptions {
    /// Run the chain pass.
    pub chain: bool,
    /// Run the stage pass.
    pub stage: bool,
    /// Norm-wise relative tolerance of f32 stages.
    pub rel_tol: f64,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        VerifyOptions {
            chain: true,
            stage: true,
            rel_tol: 1e-4,
        }
    }
}

/// The result of [`verify_attention`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct VerifyReport {
    /// Tokens in the dump.
    pub tokens: usize,
    /// Layers of the model.
    pub layers: usize,
    /// The tolerance used for f32 stages.
    pub rel_tol: f64,
    /// Every comparison, by pass, layer and stage order.
    pub stages: Vec<StageResult>,
    /// Stages the dump does not record (`layers.{l}.<stage>` names), skipped.
    pub skipped: Vec<String>,
}

impl VerifyReport {
    /// Whether every compared stage passed.
    pub fn passed(&self) -> bool {
        self.stages.iter().all(|s| s.passed)
    }
}

/// The reference dump: a tensor file with `T` tokens.
struct Dump<'f> {
    file: &'f TensorFile,
    tokens: usize,
}

impl Dump<'_> {
    fn f32(&self, name: &str, shape: &[usize]) -> Result<Option<Vec<f32>>, Error> {
        if !self.file.contains(name) {
            return Ok(None);
        }
        Ok(Some(self.file.f32(name, shape)?))
    }

    fn u8(&self, name: &str, shape: &[usize]) -> Result<Option<Vec<u8>>, Error> {
        if !self.file.contains(name) {
            return Ok(None);
        }
        Ok(Some(self.file.u8(name, shape)?))
    }

    fn i64(&self, name: &str, shape: &[usize]) -> Result<Option<Vec<i64>>, Error> {
        if !self.file.contains(name) {
            return Ok(None);
        }
        Ok(Some(self.file.i64(name, shape)?))
    }
}

/// Per-element and per-block fragility flags of a recorded quantized tensor.
type FragileMasks = (Option<Vec<u8>>, Option<Vec<u8>>);

/// Collects results.
struct Sink {
    pass: Pass,
    rel_tol: f64,
    out: Vec<StageResult>,
    skipped: Vec<String>,
}

/// Norm-wise row errors of `ours` against `theirs`, rows of `row` values. Returns
/// (max_abs, max_rel, rows over tolerance, elements compared, infinity mismatches).
fn value_errors(ours: &[f32], theirs: &[f32], row: usize, rel_tol: f64) -> (f64, f64, usize) {
    let mut max_abs = 0f64;
    let mut max_rel = 0f64;
    let mut bad = 0usize;
    for (a, b) in ours.chunks(row.max(1)).zip(theirs.chunks(row.max(1))) {
        let mut num = 0f64;
        let mut den = 0f64;
        let mut inf_mismatch = 0usize;
        for (&x, &y) in a.iter().zip(b) {
            if !y.is_finite() || !x.is_finite() {
                if x.to_bits() != y.to_bits() && !(x.is_nan() && y.is_nan()) {
                    inf_mismatch += 1;
                }
                continue;
            }
            num = num.max((f64::from(x) - f64::from(y)).abs());
            den = den.max(f64::from(y).abs());
        }
        let rel = if num == 0.0 {
            0.0
        } else if den == 0.0 {
            f64::INFINITY
        } else {
            num / den
        };
        max_abs = max_abs.max(num);
        max_rel = max_rel.max(rel);
        if rel > rel_tol {
            bad += 1;
        }
        bad += inf_mismatch;
        if inf_mismatch > 0 {
            max_rel = f64::INFINITY;
        }
    }
    (max_abs, max_rel, bad)
}

impl Sink {
    fn skip(&mut self, name: String) {
        if !self.skipped.contains(&name) {
            self.skipped.push(name);
        }
    }

    fn values(
        &mut self,
        layer: usize,
        stage: &str,
        ours: &[f32],
        theirs: Option<&[f32]>,
        row: usize,
    ) {
        let Some(theirs) = theirs else {
            self.skip(format!("layers.{layer}.{stage}"));
            return;
        };
        let (max_abs, max_rel, bad) = if ours.len() == theirs.len() {
            value_errors(ours, theirs, row, self.rel_tol)
        } else {
            (
                f64::INFINITY,
                f64::INFINITY,
                ours.len().abs_diff(theirs.len()).max(1),
            )
        };
        self.out.push(StageResult {
            layer,
            pass: self.pass,
            stage: stage.to_owned(),
            kind: Kind::Values,
            compared: theirs.len(),
            max_abs,
            max_rel,
            mismatches: bad,
            fragile: 0,
            passed: bad == 0,
        });
    }

    /// `fragile`: per-element flags; `blocks`: per-block flags with `tile` elements per block.
    #[allow(clippy::too_many_arguments)]
    fn quantized(
        &mut self,
        layer: usize,
        stage: &str,
        ours: &[f32],
        theirs: Option<&[f32]>,
        row: usize,
        fragile: Option<&[u8]>,
        blocks: Option<(&[u8], usize)>,
    ) {
        let Some(theirs) = theirs else {
            self.skip(format!("layers.{layer}.{stage}"));
            return;
        };
        let (max_abs, max_rel, _) = value_errors(ours, theirs, row, f64::INFINITY);
        let mut mismatches = 0usize;
        let mut flagged = 0usize;
        if ours.len() != theirs.len() {
            mismatches = ours.len().abs_diff(theirs.len()).max(1);
        } else {
            for (i, (x, y)) in ours.iter().zip(theirs).enumerate() {
                if x.to_bits() == y.to_bits() {
                    continue;
                }
                let f = fragile.and_then(|f| f.get(i)).is_some_and(|&b| b != 0)
                    || blocks
                        .and_then(|(b, tile)| b.get(i / tile.max(1)))
                        .is_some_and(|&b| b != 0);
                if f {
                    flagged += 1;
                } else {
                    mismatches += 1;
                }
            }
        }
        self.out.push(StageResult {
            layer,
            pass: self.pass,
            stage: stage.to_owned(),
            kind: Kind::Quantized,
            compared: theirs.len(),
            max_abs,
            max_rel,
            mismatches,
            fragile: flagged,
            passed: mismatches == 0,
        });
    }

    fn sets(
        &mut self,
        layer: usize,
        stage: &str,
        ours: &[BTreeSet<i64>],
        theirs: Option<&[BTreeSet<i64>]>,
    ) {
        let Some(theirs) = theirs else {
            self.skip(format!("layers.{layer}.{stage}"));
            return;
        };
        let mismatches = if ours.len() == theirs.len() {
            ours.iter().zip(theirs).filter(|(a, b)| a != b).count()
        } else {
            ours.len().abs_diff(theirs.len()).max(1)
        };
        self.out.push(StageResult {
            layer,
            pass: self.pass,
            stage: stage.to_owned(),
            kind: Kind::Selection,
            compared: theirs.len(),
            max_abs: 0.0,
            max_rel: 0.0,
            mismatches,
            fragile: 0,
            passed: mismatches == 0,
        });
    }
}

fn sets_i32(rows: &[i32], k: usize) -> Vec<BTreeSet<i64>> {
    rows.chunks(k.max(1))
        .map(|r| {
            r.iter()
                .filter(|&&j| j >= 0)
                .map(|&j| i64::from(j))
                .collect()
        })
        .collect()
}

fn sets_i64(rows: &[i64], k: usize) -> Vec<BTreeSet<i64>> {
    rows.chunks(k.max(1))
        .map(|r| r.iter().copied().filter(|&j| j >= 0).collect())
        .collect()
}

fn sets_mask(mask: &[u8], width: usize) -> Vec<BTreeSet<i64>> {
    mask.chunks(width.max(1))
        .map(|r| {
            r.iter()
                .enumerate()
                .filter(|(_, m)| **m != 0)
                .map(|(j, _)| j as i64)
                .collect()
        })
        .collect()
}

fn sets_lists(lists: &[Vec<u32>]) -> Vec<BTreeSet<i64>> {
    lists
        .iter()
        .map(|r| r.iter().map(|&j| i64::from(j)).collect())
        .collect()
}

fn dequantize(codec: RowCodec, rows: &[u8]) -> Result<Vec<f32>, Error> {
    let mut out = vec![0f32; rows.len() / codec.bytes().max(1) * codec.dim()];
    codec
        .dequantize(rows, &mut out)
        .map_err(|source| Error::Kernel {
            layer: 0,
            what: "dequantize",
            source,
        })?;
    Ok(out)
}

fn quantize(codec: RowCodec, x: &[f32]) -> Result<Vec<u8>, Error> {
    let mut out = vec![0u8; x.len() / codec.dim().max(1) * codec.bytes()];
    codec
        .quantize(x, &mut out)
        .map_err(|source| Error::Kernel {
            layer: 0,
            what: "quantize",
            source,
        })?;
    Ok(out)
}

fn angles(attn: &Csa2Attention, layer: usize, positions: impl Iterator<Item = u64>) -> Vec<f32> {
    let Some(rope) = attn.rope(layer) else {
        return Vec::new();
    };
    let half = rope.rope_dim() / 2;
    let mut out = Vec::new();
    let mut a = vec![0f32; half];
    for p in positions {
        if rope.angles(p, &mut a).is_ok() {
            out.extend_from_slice(&a);
        }
    }
    out
}

/// Compressed entries of `layer`'s KV source in a dump of `tokens` tokens.
fn entries_of(spec: &LayerSpec, tokens: usize) -> usize {
    if spec.compress_ratio == 0 {
        0
    } else {
        tokens / spec.compress_ratio as usize
    }
}

/// Runs `verify attention` (see the module documentation).
pub fn verify_attention(
    config: &Path,
    weights: &Path,
    vectors: &Path,
    opts: &VerifyOptions,
) -> Result<VerifyReport, Error> {
    let attn = Csa2Attention::from_files(config, weights)?;
    let file = TensorFile::open(vectors)?;
    verify_loaded(&attn, &file, opts)
}

/// [`verify_attention`] with the model and the dump already loaded.
pub fn verify_loaded(
    attn: &Csa2Attention,
    file: &TensorFile,
    opts: &VerifyOptions,
) -> Result<VerifyReport, Error> {
    let d = attn.dims();
    let first = "layers.0.input";
    let tokens = match file.shape(first) {
        Some([1, t, h]) if *h == d.hidden => *t,
        Some(s) => {
            return Err(Error::Vectors(format!(
                "{}: tensor `{first}` has shape {}, expected [1, T, {}] (batch 1, hidden_size {})",
                file.path().display(),
                crate::weights::Shape(s),
                d.hidden,
                d.hidden
            )));
        }
        None => {
            return Err(Error::Vectors(format!(
                "{}: tensor `{first}` is missing (expected F32 [1, T, {}])",
                file.path().display(),
                d.hidden
            )));
        }
    };
    let dump = Dump { file, tokens };
    let mut report = VerifyReport {
        tokens,
        layers: attn.plan().layers.len(),
        rel_tol: opts.rel_tol,
        stages: Vec::new(),
        skipped: Vec::new(),
    };
    if opts.chain {
        let mut sink = Sink {
            pass: Pass::Chain,
            rel_tol: opts.rel_tol,
            out: Vec::new(),
            skipped: Vec::new(),
        };
        chain(attn, &dump, &mut sink)?;
        report.stages.extend(sink.out);
        report.skipped.extend(sink.skipped);
    }
    if opts.stage {
        let mut sink = Sink {
            pass: Pass::Stage,
            rel_tol: opts.rel_tol,
            out: Vec::new(),
            skipped: Vec::new(),
        };
        stages(attn, &dump, &mut sink)?;
        report.stages.extend(sink.out);
        for s in sink.skipped {
            if !report.skipped.contains(&s) {
                report.skipped.push(s);
            }
        }
    }
    Ok(report)
}

fn input(dump: &Dump<'_>, layer: usize, hidden: usize) -> Result<Vec<f32>, Error> {
    let name = format!("layers.{layer}.input");
    dump.file.f32(&name, &[1, dump.tokens, hidden])
}

fn chain(attn: &Csa2Attention, dump: &Dump<'_>, sink: &mut Sink) -> Result<(), Error> {
    let d = attn.dims();
    let t = dump.tokens;
    let mut store = attn.new_store(None);
    let mut step = StepState::new(t);
    for spec in &attn.plan().layers {
        let l = spec.index;
        let x = input(dump, l, d.hidden)?;
        let mut tr = LayerTrace::default();
        attn.forward(l, &mut store, &mut step, &x, Some(&mut tr))?;
        compare_trace(attn, dump, sink, spec, &tr)?;
        // The state layer l + 1 receives.
        if spec.compress_ratio > 0 {
            let src = spec.kv_source.unwrap_or(l);
            let w = entries_of(spec, t);
            let p = format!("state.{l}");
            let frag = |what: &str| -> Result<FragileMasks, Error> {
                let width = if what == "compressed_kv" {
                    d.head_dim
                } else {
                    d.index_head_dim
                };
                let tile = if what == "compressed_kv" { 16 } else { 32 };
                Ok((
                    dump.u8(
                        &format!("layers.{src}.{what}.fragile_elements"),
                        &[1, w, width],
                    )?,
                    dump.u8(
                        &format!("layers.{src}.{what}.fragile_blocks"),
                        &[1, w, width / tile],
                    )?,
                ))
            };
            let ours = dequantize(attn.entry_codec(), store.compressed_rows(src))?;
            let (fe, fb) = frag("compressed_kv")?;
            sink.quantized(
                l,
                &format!("{p}.compressed_kv"),
                &ours,
                dump.f32(&format!("{p}.compressed_kv"), &[1, w, d.head_dim])?
                    .as_deref(),
                d.head_dim,
                fe.as_deref(),
                fb.as_deref().map(|b| (b, 16)),
            );
            if let Some(kc) = attn.key_codec() {
                let ours = dequantize(kc, store.index_key_rows(src))?;
                let (fe, fb) = frag("index_keys")?;
                sink.quantized(
                    l,
                    &format!("{p}.index_keys"),
                    &ours,
                    dump.f32(&format!("{p}.index_keys"), &[1, w, d.index_head_dim])?
                        .as_deref(),
                    d.index_head_dim,
                    fe.as_deref(),
                    fb.as_deref().map(|b| (b, 32)),
                );
            }
            let k = d.index_topk;
            if let Some(tk) = step.topk() {
                let theirs = dump.i64(&format!("{p}.topk_indices"), &[1, t, k])?;
                sink.sets(
                    l,
                    &format!("{p}.topk_indices"),
                    &sets_i32(&tk.rows, k),
                    theirs.map(|v| sets_i64(&v, k)).as_deref(),
                );
            }
            let valid = dump.u8(&format!("{p}.compressed_valid"), &[1, w])?;
            if let Some(v) = valid {
                let theirs: Vec<f32> = v.iter().map(|&b| f32::from(b)).collect();
                let n = store.compressed_rows(src).len() / attn.entry_codec().bytes();
                let ours: Vec<f32> = (0..w).map(|j| if j < n { 1.0 } else { 0.0 }).collect();
                sink.values(l, &format!("{p}.compressed_valid"), &ours, Some(&theirs), w);
            }
            let cand = dump.u8(&format!("{p}.candidates"), &[1, t, w])?;
            match (cand, step.candidates()) {
                (Some(c), Some(ours)) => {
                    sink.sets(
                        l,
                        &format!("{p}.candidates"),
                        &sets_lists(&ours.rows),
                        Some(&sets_mask(&c, w)),
                    );
                }
                (Some(c), None) => {
                    sink.sets(l, &format!("{p}.candidates"), &[], Some(&sets_mask(&c, w)));
                }
                (None, Some(ours)) => {
                    sink.sets(l, &format!("{p}.candidates"), &sets_lists(&ours.rows), None);
                }
                (None, None) => {}
            }
        }
    }
    use crate::attention::KvStore;
    store.commit(t as u64)?;
    Ok(())
}

fn compare_trace(
    attn: &Csa2Attention,
    dump: &Dump<'_>,
    sink: &mut Sink,
    spec: &LayerSpec,
    tr: &LayerTrace,
) -> Result<(), Error> {
    let d = attn.dims();
    let l = spec.index;
    let t = dump.tokens;
    let name = |s: &str| format!("layers.{l}.{s}");
    let half = d.rope_dim / 2;
    sink.values(
        l,
        "angles",
        &angles(attn, l, 0..t as u64),
        dump.f32(&name("angles"), &[1, t, half])?.as_deref(),
        half,
    );
    sink.values(
        l,
        "query_latent",
        &tr.query_latent,
        dump.f32(&name("query_latent"), &[1, t, d.q_lora_rank])?
            .as_deref(),
        d.q_lora_rank,
    );
    sink.values(
        l,
        "query",
        &tr.query,
        dump.f32(&name("query"), &[1, t, d.heads, d.head_dim])?
            .as_deref(),
        d.head_dim,
    );
    sink.values(
        l,
        "window_kv.pre_quant",
        &tr.window_pre_quant,
        dump.f32(&name("window_kv.pre_quant"), &[1, t, d.head_dim])?
            .as_deref(),
        d.head_dim,
    );
    let ours = dequantize(attn.window_codec(), &tr.window_rows)?;
    sink.quantized(
        l,
        "window_kv",
        &ours,
        dump.f32(&name("window_kv"), &[1, t, d.head_dim])?
            .as_deref(),
        d.head_dim,
        dump.u8(&name("window_kv.fragile_elements"), &[1, t, d.head_dim])?
            .as_deref(),
        dump.u8(&name("window_kv.fragile_blocks"), &[1, t, d.head_dim / 32])?
            .as_deref()
            .map(|b| (b, 32)),
    );
    if let Some(c) = &tr.compressed {
        let w = entries_of(spec, t);
        let dd = d.head_dim;
        let id = d.index_head_dim;
        sink.values(
            l,
            "compressor.latent",
            &c.latent,
            dump.f32(&name("compressor.latent"), &[1, w, dd])?
                .as_deref(),
            dd,
        );
        sink.values(
            l,
            "compressed_angles",
            &angles(
                attn,
                l,
                (0..w as u64).map(|j| j * u64::from(spec.compress_ratio)),
            ),
            dump.f32(&name("compressed_angles"), &[1, w, half])?
                .as_deref(),
            half,
        );
        sink.values(
            l,
            "compressed_kv.pre_quant",
            &c.pre_quant,
            dump.f32(&name("compressed_kv.pre_quant"), &[1, w, dd])?
                .as_deref(),
            dd,
        );
        sink.quantized(
            l,
            "compressed_kv",
            &dequantize(attn.entry_codec(), &c.rows)?,
            dump.f32(&name("compressed_kv"), &[1, w, dd])?.as_deref(),
            dd,
            dump.u8(&name("compressed_kv.fragile_elements"), &[1, w, dd])?
                .as_deref(),
            dump.u8(&name("compressed_kv.fragile_blocks"), &[1, w, dd / 16])?
                .as_deref()
                .map(|b| (b, 16)),
        );
        if let Some(kc) = attn.key_codec() {
            sink.values(
                l,
                "index_keys.pre_quant",
                &c.key_pre_quant,
                dump.f32(&name("index_keys.pre_quant"), &[1, w, id])?
                    .as_deref(),
                id,
            );
            sink.quantized(
                l,
                "index_keys",
                &dequantize(kc, &c.key_rows)?,
                dump.f32(&name("index_keys"), &[1, w, id])?.as_deref(),
                id,
                dump.u8(&name("index_keys.fragile_elements"), &[1, w, id])?
                    .as_deref(),
                dump.u8(&name("index_keys.fragile_blocks"), &[1, w, id / 32])?
                    .as_deref()
                    .map(|b| (b, 32)),
            );
        }
    }
    if let (Some(kc), false) = (attn.key_codec(), tr.index_weights.is_empty()) {
        let (ih, id) = (d.index_heads, d.index_head_dim);
        let w = tr.score_width;
        sink.values(
            l,
            "index_queries.pre_quant",
            &tr.index_queries_pre_quant,
            dump.f32(&name("index_queries.pre_quant"), &[1, t, ih, id])?
                .as_deref(),
            id,
        );
        sink.quantized(
            l,
            "index_queries",
            &dequantize(kc, &tr.index_query_rows)?,
            dump.f32(&name("index_queries"), &[1, t, ih, id])?
                .as_deref(),
            id,
            dump.u8(&name("index_queries.fragile_elements"), &[1, t, ih, id])?
                .as_deref(),
            dump.u8(&name("index_queries.fragile_blocks"), &[1, t, ih, id / 32])?
                .as_deref()
                .map(|b| (b, 32)),
        );
        sink.values(
            l,
            "index_weights",
            &tr.index_weights,
            dump.f32(&name("index_weights"), &[1, t, ih])?.as_deref(),
            ih,
        );
        sink.values(
            l,
            "index_scores",
            &tr.index_scores,
            dump.f32(&name("index_scores"), &[1, t, w])?.as_deref(),
            w,
        );
        let vis: Vec<f32> = tr.visible.iter().map(|&v| v as f32).collect();
        let theirs = dump
            .i64(&name("index_visible_lengths"), &[1, t])?
            .map(|v| v.iter().map(|&x| x as f32).collect::<Vec<_>>());
        sink.values(l, "index_visible_lengths", &vis, theirs.as_deref(), t);
        if spec.is_candidate_source {
            let blocks = d.candidates.map_or(0, |c| w.div_ceil(c.block));
            sink.values(
                l,
                "candidate_block_scores",
                &tr.candidate_block_scores,
                dump.f32(&name("candidate_block_scores"), &[1, t, blocks])?
                    .as_deref(),
                blocks,
            );
        }
        if let Some(after) = &tr.scores_after_candidates {
            sink.values(
                l,
                "index_scores_after_candidates",
                after,
                dump.f32(&name("index_scores_after_candidates"), &[1, t, w])?
                    .as_deref(),
                w,
            );
        }
        let k = d.index_topk;
        let theirs = dump.i64(&name("topk_indices"), &[1, t, k])?;
        sink.sets(
            l,
            "topk_indices",
            &sets_i32(&tr.topk, k),
            theirs.map(|v| sets_i64(&v, k)).as_deref(),
        );
    }
    sink.values(
        l,
        "attended",
        &tr.attended,
        dump.f32(&name("attended"), &[1, t, d.heads, d.head_dim])?
            .as_deref(),
        d.head_dim,
    );
    sink.values(
        l,
        "output",
        &tr.output,
        dump.f32(&name("output"), &[1, t, d.hidden])?.as_deref(),
        d.hidden,
    );
    Ok(())
}

fn stages(attn: &Csa2Attention, dump: &Dump<'_>, sink: &mut Sink) -> Result<(), Error> {
    let d = attn.dims();
    let t = dump.tokens;
    let positions: Vec<u64> = (0..t as u64).collect();
    let (dd, id, ih, k) = (d.head_dim, d.index_head_dim, d.index_heads, d.index_topk);
    for spec in &attn.plan().layers {
        let l = spec.index;
        let name = |s: &str| format!("layers.{l}.{s}");
        let x = input(dump, l, d.hidden)?;
        sink.values(
            l,
            "query_latent",
            &attn.query_latent(l, &x)?,
            dump.f32(&name("query_latent"), &[1, t, d.q_lora_rank])?
                .as_deref(),
            d.q_lora_rank,
        );
        let rec_ql = dump.f32(&name("query_latent"), &[1, t, d.q_lora_rank])?;
        if let Some(ql) = &rec_ql {
            sink.values(
                l,
                "query",
                &attn.query(l, ql, &positions)?,
                dump.f32(&name("query"), &[1, t, d.heads, dd])?.as_deref(),
                dd,
            );
        }
        let (wpre, _) = attn.window_kv(l, &x, &positions)?;
        sink.values(
            l,
            "window_kv.pre_quant",
            &wpre,
            dump.f32(&name("window_kv.pre_quant"), &[1, t, dd])?
                .as_deref(),
            dd,
        );
        if let Some(pre) = dump.f32(&name("window_kv.pre_quant"), &[1, t, dd])? {
            let ours = dequantize(attn.window_codec(), &quantize(attn.window_codec(), &pre)?)?;
            sink.quantized(
                l,
                "window_kv",
                &ours,
                dump.f32(&name("window_kv"), &[1, t, dd])?.as_deref(),
                dd,
                None,
                None,
            );
        }
        let w = entries_of(spec, t);
        if spec.mode == LayerMode::Full {
            let c = attn.compress(l, &x, &[], 0)?;
            sink.values(
                l,
                "compressor.latent",
                &c.latent,
                dump.f32(&name("compressor.latent"), &[1, w, dd])?
                    .as_deref(),
                dd,
            );
            if let Some(latent) = dump.f32(&name("compressor.latent"), &[1, w, dd])? {
                let (pre, _) = attn.compressed_entries(l, &latent, 0)?;
                sink.values(
                    l,
                    "compressed_kv.pre_quant",
                    &pre,
                    dump.f32(&name("compressed_kv.pre_quant"), &[1, w, dd])?
                        .as_deref(),
                    dd,
                );
                let (kpre, _) = attn.index_keys(l, &latent, 0)?;
                sink.values(
                    l,
                    "index_keys.pre_quant",
                    &kpre,
                    dump.f32(&name("index_keys.pre_quant"), &[1, w, id])?
                        .as_deref(),
                    id,
                );
            }
            if let Some(pre) = dump.f32(&name("compressed_kv.pre_quant"), &[1, w, dd])? {
                let ours = dequantize(attn.entry_codec(), &quantize(attn.entry_codec(), &pre)?)?;
                sink.quantized(
                    l,
                    "compressed_kv",
                    &ours,
                    dump.f32(&name("compressed_kv"), &[1, w, dd])?.as_deref(),
                    dd,
                    None,
                    None,
                );
            }
            if let (Some(pre), Some(kc)) = (
                dump.f32(&name("index_keys.pre_quant"), &[1, w, id])?,
                attn.key_codec(),
            ) {
                let ours = dequantize(kc, &quantize(kc, &pre)?)?;
                sink.quantized(
                    l,
                    "index_keys",
                    &ours,
                    dump.f32(&name("index_keys"), &[1, w, id])?.as_deref(),
                    id,
                    None,
                    None,
                );
            }
        }
        let kc = attn.key_codec();
        if let (Some(kc), true) = (kc, spec.compress_ratio > 0 && spec.index_source == Some(l)) {
            if let Some(ql) = &rec_ql {
                let (pre, _) = attn.index_queries(l, ql, &positions)?;
                sink.values(
                    l,
                    "index_queries.pre_quant",
                    &pre,
                    dump.f32(&name("index_queries.pre_quant"), &[1, t, ih, id])?
                        .as_deref(),
                    id,
                );
            }
            if let Some(pre) = dump.f32(&name("index_queries.pre_quant"), &[1, t, ih, id])? {
                let ours = dequantize(kc, &quantize(kc, &pre)?)?;
                sink.quantized(
                    l,
                    "index_queries",
                    &ours,
                    dump.f32(&name("index_queries"), &[1, t, ih, id])?
                        .as_deref(),
                    id,
                    None,
                    None,
                );
            }
            sink.values(
                l,
                "index_weights",
                &attn.index_weights(l, &x)?,
                dump.f32(&name("index_weights"), &[1, t, ih])?.as_deref(),
                ih,
            );
            // Scores from the recorded queries, weights and the keys this layer received.
            let keys_name = if spec.mode == LayerMode::Full {
                name("index_keys")
            } else {
                format!("state.{}.index_keys", l.saturating_sub(1))
            };
            let q = dump.f32(&name("index_queries"), &[1, t, ih, id])?;
            let wts = dump.f32(&name("index_weights"), &[1, t, ih])?;
            let keys = dump.f32(&keys_name, &[1, w, id])?;
            if let (Some(q), Some(wts), Some(keys)) = (q, wts, keys) {
                let qrows = quantize(kc, &q)?;
                let krows = quantize(kc, &keys)?;
                let kb = kc.bytes();
                let key = |j: u64| krows.get(j as usize * kb..(j as usize + 1) * kb);
                let scores = attn.index_scores(l, &qrows, &wts, &positions, w, &key)?;
                sink.values(
                    l,
                    "index_scores",
                    &scores,
                    dump.f32(&name("index_scores"), &[1, t, w])?.as_deref(),
                    w,
                );
            } else {
                sink.skip(name("index_scores"));
            }
            let rec_scores = dump.f32(&name("index_scores"), &[1, t, w])?;
            if let Some(scores) = &rec_scores {
                if spec.is_candidate_source {
                    let (pools, bs) = attn.candidate_pools(l, scores, &positions)?;
                    let blocks = d.candidates.map_or(0, |c| w.div_ceil(c.block));
                    sink.values(
                        l,
                        "candidate_block_scores",
                        &bs,
                        dump.f32(&name("candidate_block_scores"), &[1, t, blocks])?
                            .as_deref(),
                        blocks,
                    );
                    let theirs = dump.u8(&format!("state.{l}.candidates"), &[1, t, w])?;
                    sink.sets(
                        l,
                        "candidates",
                        &sets_lists(&pools),
                        theirs.map(|m| sets_mask(&m, w)).as_deref(),
                    );
                }
                let after_name = name("index_scores_after_candidates");
                let selected_from = if spec.uses_candidates {
                    let cand = dump.u8(
                        &format!("state.{}.candidates", l.saturating_sub(1)),
                        &[1, t, w],
                    )?;
                    match cand {
                        Some(mask) => {
                            let mut s = scores.clone();
                            for (row, m) in s
                                .chunks_exact_mut(w.max(1))
                                .zip(mask.chunks_exact(w.max(1)))
                            {
                                for (v, &keep) in row.iter_mut().zip(m) {
                                    if keep == 0 {
                                        *v = f32::NEG_INFINITY;
                                    }
                                }
                            }
                            sink.values(
                                l,
                                "index_scores_after_candidates",
                                &s,
                                dump.f32(&after_name, &[1, t, w])?.as_deref(),
                                w,
                            );
                            s
                        }
                        None => {
                            sink.skip(after_name);
                            scores.clone()
                        }
                    }
                } else {
                    scores.clone()
                };
                let sel = attn.select(l, &selected_from, t)?;
                let theirs = dump.i64(&name("topk_indices"), &[1, t, k])?;
                sink.sets(
                    l,
                    "topk_indices",
                    &sets_i32(&sel, k),
                    theirs.map(|v| sets_i64(&v, k)).as_deref(),
                );
            }
        }
        // Attention from the recorded query, window KV, the state's entries and top-k.
        let q = dump.f32(&name("query"), &[1, t, d.heads, dd])?;
        let win = dump.f32(&name("window_kv"), &[1, t, dd])?;
        if let (Some(q), Some(win)) = (q, win) {
            let wrows = quantize(attn.window_codec(), &win)?;
            let wb = attn.window_codec().bytes();
            let (erows, topk) = if spec.compress_ratio > 0 {
                let e = dump.f32(&format!("state.{l}.compressed_kv"), &[1, w, dd])?;
                let tk = dump.i64(&format!("state.{l}.topk_indices"), &[1, t, k])?;
                match (e, tk) {
                    (Some(e), Some(tk)) => {
                        let mut rows: Vec<i32> =
                            tk.iter().map(|&j| i32::try_from(j).unwrap_or(-1)).collect();
                        for r in rows.chunks_exact_mut(k.max(1)) {
                            canonicalize(r);
                        }
                        (
                            quantize(attn.entry_codec(), &e)?,
                            Some(TopK {
                                source: spec.index_source.unwrap_or(l),
                                k,
                                rows,
                            }),
                        )
                    }
                    _ => {
                        sink.skip(format!("state.{l}.compressed_kv"));
                        (Vec::new(), None)
                    }
                }
            } else {
                (Vec::new(), None)
            };
            if spec.compress_ratio == 0 || topk.is_some() {
                let eb = attn.entry_codec().bytes();
                let window = |p: u64| wrows.get(p as usize * wb..(p as usize + 1) * wb);
                let entry = |j: u64| erows.get(j as usize * eb..(j as usize + 1) * eb);
                let att = attn.attend(l, &q, &positions, &window, &entry, topk.as_ref())?;
                sink.values(
                    l,
                    "attended",
                    &att,
                    dump.f32(&name("attended"), &[1, t, d.heads, dd])?
                        .as_deref(),
                    dd,
                );
            }
        }
        if let Some(att) = dump.f32(&name("attended"), &[1, t, d.heads, dd])? {
            sink.values(
                l,
                "output",
                &attn.output(l, att, &positions)?,
                dump.f32(&name("output"), &[1, t, d.hidden])?.as_deref(),
                d.hidden,
            );
        }
    }
    Ok(())
}
