//! `verify model`: runs the whole forward pass on the recorded `input_ids` of a reference dump
//! (`shared/vectors/csa2/model_vectors.safetensors`, README "model_vectors") and compares the
//! logits, the final hidden state and every recorded per-block tensor.
//!
//! Passes:
//! - **prefill** (end to end): all tokens in one exact step, own state threaded through every
//!   layer; every recorded tensor compared;
//! - **decode** (end to end): the same tokens one step each (the decode path over the store);
//!   logits compared;
//! - **teacher-forced**: one exact step in which every block starts from the reference's own
//!   `streams_in` (and the previous block's recorded `ffn_hc.pre`, which its attention input
//!   is collapsed with), so each block is checked on its own inputs: every block tensor, the
//!   streams leaving it against the next block's `streams_in`, and the logits the LM head
//!   makes of the reference's own `final_hidden`.
//!
//! The end-to-end mode also counts, per layer, the quantized cache elements (FP8 window rows,
//! FP4 compressed entries, MXFP4 index keys, dequantized) that differ from those of the
//! teacher-forced step, whose quantizer inputs come from the reference's own block inputs: a
//! quantizer input that drifted across a rounding boundary is named by layer, not guessed.
//!
//! Comparisons: f32 tensors by the worst absolute difference relative to the tensor's largest
//! reference magnitude; a tensor passes within `rel_tol` (1e-4). The stricter per-row figure
//! (relative to each row's largest magnitude) is reported too: end to end, an FP8/FP4 quantizer
//! input next to a rounding boundary can flip to the neighbouring code (README "How to
//! compare"), which moves a small-magnitude row by more than 1e-4 of itself. Selections
//! (router experts, top-k, candidate pools) are compared as sets per token, exactly; router
//! weights are matched by expert and compared like values.

use std::collections::BTreeSet;
use std::path::Path;

use serde::Serialize;

use crate::weights::TensorFile;
use kvstack_spec::config::ModelConfig;

use crate::Error;
use crate::attention::{ContiguousStore, KvStore};
use crate::checkpoint::Naming;
use crate::forward::{ForcedInput, Logits, Model, ModelTrace};
use kvstack_kernels::csa2::quant::RowCodec;

/// One compared tensor.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TensorResult {
    /// `prefill` or `decode`.
    pub pass: &'static str,
    /// The recorded tensor's name.
    pub name: String,
    /// `values` or `selection`.
    pub kind: &'static str,
    /// Rows compared.
    pub rows: usize,
    /// Worst absolute difference relative to the tensor's largest magnitude (values).
    pub max_rel: f64,
    /// Worst absolute difference of a row relative to that row's largest magnitude (values).
    pub row_rel: f64,
    /// Elements out of tolerance (values) or rows with a different set (selections).
    pub mismatches: usize,
    /// Within tolerance.
    pub passed: bool,
}

/// Quantized cache elements of one layer and kind that the end-to-end pass stored differently
/// from the teacher-forced pass.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CacheFlips {
    /// The layer (for compressed entries and index keys: the KV or index source).
    pub layer: usize,
    /// `window`, `compressed` or `index_keys`.
    pub kind: &'static str,
    /// Elements compared.
    pub elements: usize,
    /// Elements whose dequantized values differ.
    pub differ: usize,
}

/// Which passes [`verify_model_with`] runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelVerifyOptions {
    /// Relative tolerance of f32 tensors (1e-4).
    pub rel_tol: f64,
    /// The prefill and decode passes, and the cache flips.
    pub end_to_end: bool,
    /// The teacher-forced pass.
    pub teacher_forced: bool,
}

/// The result of [`verify_model`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelVerifyReport {
    /// Tokens in the dump.
    pub tokens: usize,
    /// Layers.
    pub layers: usize,
    /// The weights' naming.
    pub naming: String,
    /// Tolerance of f32 tensors.
    pub rel_tol: f64,
    /// Every comparison.
    pub tensors: Vec<TensorResult>,
    /// Recorded tensors the model did not produce, or produced tensors the dump lacks.
    pub skipped: Vec<String>,
    /// Tokens whose greedy choice (argmax of the logits) matches the reference's, prefill pass
    /// (teacher-forced pass when that runs alone).
    pub greedy_agreement: usize,
    /// End to end: per layer and kind, quantized cache elements that differ from the
    /// teacher-forced step's (empty when the end-to-end mode did not run).
    pub cache_flips: Vec<CacheFlips>,
}

impl ModelVerifyReport {
    /// Whether every comparison passed.
    pub fn passed(&self) -> bool {
        self.tensors.iter().all(|t| t.passed)
    }

    /// The worst relative error over the value tensors.
    pub fn worst(&self) -> f64 {
        self.tensors
            .iter()
            .filter(|t| t.kind == "values")
            .fold(0.0, |m, t| m.max(t.max_rel))
    }
}

/// Norm-wise worst row error and rows beyond `tol`.
pub fn row_errors(ours: &[f32], theirs: &[f32], row: usize, tol: f64) -> (f64, usize) {
    if ours.len() != theirs.len() {
        return (f64::INFINITY, ours.len().abs_diff(theirs.len()).max(1));
    }
    let mut worst = 0f64;
    let mut bad = 0;
    for (a, b) in ours.chunks(row.max(1)).zip(theirs.chunks(row.max(1))) {
        let mut num = 0f64;
        let mut den = 0f64;
        for (&x, &y) in a.iter().zip(b) {
            num = num.max((f64::from(x) - f64::from(y)).abs());
            den = den.max(f64::from(y).abs());
        }
        let rel = if num == 0.0 {
            0.0
        } else if den == 0.0 || num.is_nan() {
            f64::INFINITY
        } else {
            num / den
        };
        worst = worst.max(rel);
        if rel > tol {
            bad += 1;
        }
    }
    (worst, bad)
}

/// Worst absolute difference relative to the largest reference magnitude of the whole tensor,
/// and the elements beyond `tol` of it (NaN anywhere counts as infinitely wrong).
pub fn tensor_errors(ours: &[f32], theirs: &[f32], tol: f64) -> (f64, usize) {
    if ours.len() != theirs.len() {
        return (f64::INFINITY, ours.len().abs_diff(theirs.len()).max(1));
    }
    let den = theirs
        .iter()
        .fold(0f64, |m, &y| m.max(f64::from(y).abs()))
        .max(f64::MIN_POSITIVE);
    let mut worst = 0f64;
    let mut bad = 0;
    for (&x, &y) in ours.iter().zip(theirs) {
        let d = (f64::from(x) - f64::from(y)).abs();
        let rel = if d.is_nan() { f64::INFINITY } else { d / den };
        worst = worst.max(rel);
        if rel > tol {
            bad += 1;
        }
    }
    (worst, bad)
}

struct Sink<'f> {
    file: &'f TensorFile,
    tol: f64,
    out: Vec<TensorResult>,
    skipped: Vec<String>,
}

impl Sink<'_> {
    fn values(
        &mut self,
        pass: &'static str,
        name: &str,
        ours: &[f32],
        row: usize,
    ) -> Result<(), Error> {
        self.values_as(pass, name, name, ours, row)
    }

    /// `ours` against the recorded tensor `name`, reported as `label`.
    fn values_as(
        &mut self,
        pass: &'static str,
        label: &str,
        name: &str,
        ours: &[f32],
        row: usize,
    ) -> Result<(), Error> {
        let Some(shape) = self.file.shape(name).map(<[usize]>::to_vec) else {
            self.skipped.push(name.to_owned());
            return Ok(());
        };
        let theirs = self.file.f32(name, &shape)?;
        let (row_rel, _) = row_errors(ours, &theirs, row, self.tol);
        let (max_rel, mismatches) = tensor_errors(ours, &theirs, self.tol);
        self.out.push(TensorResult {
            pass,
            name: label.to_owned(),
            kind: "values",
            rows: theirs.len() / row.max(1),
            max_rel,
            row_rel,
            mismatches,
            passed: mismatches == 0,
        });
        Ok(())
    }

    fn sets(
        &mut self,
        pass: &'static str,
        name: &str,
        ours: &[BTreeSet<i64>],
        theirs: Option<Vec<BTreeSet<i64>>>,
    ) {
        let Some(theirs) = theirs else {
            self.skipped.push(name.to_owned());
            return;
        };
        let mismatches = if ours.len() == theirs.len() {
            ours.iter().zip(&theirs).filter(|(a, b)| a != b).count()
        } else {
            ours.len().abs_diff(theirs.len()).max(1)
        };
        self.out.push(TensorResult {
            pass,
            name: name.to_owned(),
            kind: "selection",
            rows: theirs.len(),
            max_rel: 0.0,
            row_rel: 0.0,
            mismatches,
            passed: mismatches == 0,
        });
    }

    fn i64_rows(&self, name: &str) -> Result<Option<(Vec<i64>, usize)>, Error> {
        let Some(shape) = self.file.shape(name).map(<[usize]>::to_vec) else {
            return Ok(None);
        };
        let k = shape.last().copied().unwrap_or(1);
        Ok(Some((self.file.i64(name, &shape)?, k)))
    }
}

fn flat(
    m: &[kvstack_kernels::model::HcMix],
    f: impl Fn(&kvstack_kernels::model::HcMix) -> &[f32],
) -> Vec<f32> {
    m.iter().flat_map(|x| f(x).iter().copied()).collect()
}

/// Runs `verify model` from files, end to end (prefill, decode, cache flips).
pub fn verify_model(
    config: &Path,
    weights: &Path,
    vectors: &Path,
    rel_tol: f64,
) -> Result<ModelVerifyReport, Error> {
    let opts = ModelVerifyOptions {
        rel_tol,
        end_to_end: true,
        teacher_forced: false,
    };
    verify_model_with(config, weights, vectors, &opts)
}

/// Runs `verify model` from files with the passes of `opts`.
pub fn verify_model_with(
    config: &Path,
    weights: &Path,
    vectors: &Path,
    opts: &ModelVerifyOptions,
) -> Result<ModelVerifyReport, Error> {
    let cfg = ModelConfig::from_file(config).map_err(Error::ModelConfig)?;
    let ck = crate::Checkpoint::open(weights)?;
    let model = Model::load_from(&cfg, ck.source())?;
    let naming = crate::checkpoint::Naming::detect(ck.source())?;
    let vfile = TensorFile::open(vectors)?;
    verify_loaded(&model, naming, &vfile, opts)
}

/// The reference's own inputs of every block: its `streams_in`, and the `ffn_hc.pre` of the
/// block before (one-hot on stream 0 for the first).
fn forced_inputs(model: &Model, file: &TensorFile, t: usize) -> Result<Vec<ForcedInput>, Error> {
    let d = model.dims();
    let (h, ns) = (d.hidden, d.hc_mult);
    let mut one_hot = vec![0f32; t * ns];
    one_hot.iter_mut().step_by(ns.max(1)).for_each(|x| *x = 1.0);
    let mut out = Vec::with_capacity(d.layers);
    for l in 0..d.layers {
        let pre = if l == 0 {
            one_hot.clone()
        } else {
            file.f32(&format!("layers.{}.ffn_hc.pre", l - 1), &[1, t, ns])?
        };
        out.push(ForcedInput {
            streams: file.f32(&format!("layers.{l}.streams_in"), &[1, t, ns, h])?,
            pre,
        });
    }
    Ok(out)
}

/// Every recorded tensor of every block of `trace`, under `pass`.
fn compare_blocks(
    sink: &mut Sink<'_>,
    pass: &'static str,
    model: &Model,
    trace: &ModelTrace,
    forced: bool,
) -> Result<(), Error> {
    let (h, n) = (model.dims().hidden, model.dims().hc_mult);
    let file = sink.file;
    for (l, b) in trace.blocks.iter().enumerate() {
        let p = |s: &str| format!("layers.{l}.{s}");
        if forced {
            // The input is the reference's own; what leaves the block is the next one's.
            if l + 1 < trace.blocks.len() {
                let next = format!("layers.{}.streams_in", l + 1);
                sink.values_as(pass, &p("streams_out"), &next, &b.streams_out, h)?;
            }
        } else {
            sink.values(pass, &p("streams_in"), &b.streams_in, h)?;
        }
        sink.values(pass, &p("attn_input"), &b.attn_input, h)?;
        sink.values(pass, &p("attn_output"), &b.attn_output, h)?;
        sink.values(pass, &p("ffn_input"), &b.ffn_input, h)?;
        sink.values(pass, &p("ffn_output"), &b.ffn_output, h)?;
        for (site, mix) in [("attn_hc", &b.attn_hc), ("ffn_hc", &b.ffn_hc)] {
            sink.values(pass, &p(&format!("{site}.pre")), &flat(mix, |m| &m.pre), n)?;
            sink.values(
                pass,
                &p(&format!("{site}.post")),
                &flat(mix, |m| &m.post),
                n,
            )?;
            sink.values(
                pass,
                &p(&format!("{site}.comb")),
                &flat(mix, |m| &m.comb),
                n * n,
            )?;
        }
        // Router: experts as sets, weights matched by expert.
        let k = model.dims().top_k;
        let ours: Vec<BTreeSet<i64>> = b
            .routes
            .iter()
            .map(|r| r.experts.iter().map(|&e| e as i64).collect())
            .collect();
        let rec = sink.i64_rows(&p("router.indices"))?;
        if let Some((idx, kk)) = &rec {
            let theirs: Vec<BTreeSet<i64>> = idx
                .chunks(*kk)
                .map(|r| r.iter().copied().collect())
                .collect();
            sink.sets(pass, &p("router.indices"), &ours, Some(theirs));
            // Our weights in the reference's expert order.
            let mut w = Vec::with_capacity(idx.len());
            for (r, row) in b.routes.iter().zip(idx.chunks(*kk)) {
                for &e in row {
                    let pos = r.experts.iter().position(|&x| x as i64 == e);
                    w.push(
                        pos.and_then(|i| r.weights.get(i).copied())
                            .unwrap_or(f32::NAN),
                    );
                }
            }
            sink.values(pass, &p("router.weights"), &w, k)?;
        } else {
            sink.skipped.push(p("router.indices"));
        }
        let tk = &b.attention.topk;
        if !tk.is_empty() {
            let kk = model.attention().dims().index_topk.max(1);
            let ours: Vec<BTreeSet<i64>> = tk
                .chunks(kk)
                .map(|r| {
                    r.iter()
                        .filter(|&&j| j >= 0)
                        .map(|&j| i64::from(j))
                        .collect()
                })
                .collect();
            let theirs = sink.i64_rows(&p("topk_indices"))?.map(|(v, k)| {
                v.chunks(k)
                    .map(|r| r.iter().copied().filter(|&j| j >= 0).collect())
                    .collect()
            });
            sink.sets(pass, &p("topk_indices"), &ours, theirs);
        }
        if let Some(c) = &b.candidates {
            let name = p("candidates");
            let theirs = match file.shape(&name).map(<[usize]>::to_vec) {
                Some(shape) => {
                    let w = shape.last().copied().unwrap_or(1).max(1);
                    let m = file.u8(&name, &shape)?;
                    Some(
                        m.chunks(w)
                            .map(|r| {
                                r.iter()
                                    .enumerate()
                                    .filter(|(_, x)| **x != 0)
                                    .map(|(j, _)| j as i64)
                                    .collect()
                            })
                            .collect(),
                    )
                }
                None => None,
            };
            let ours: Vec<BTreeSet<i64>> = c
                .iter()
                .map(|r| r.iter().map(|&j| i64::from(j)).collect())
                .collect();
            sink.sets(pass, &name, &ours, theirs);
        }
    }
    Ok(())
}

/// Tokens whose greedy choice from `logits` matches the reference's.
fn greedy(file: &TensorFile, logits: &[f32], v: usize) -> Result<usize, Error> {
    Ok(match file.shape("logits").map(<[usize]>::to_vec) {
        Some(shape) => {
            let theirs = file.f32("logits", &shape)?;
            logits
                .chunks(v.max(1))
                .zip(theirs.chunks(v.max(1)))
                .filter(|(a, b)| {
                    kvstack_kernels::model::argmax(a) == kvstack_kernels::model::argmax(b)
                })
                .count()
        }
        None => 0,
    })
}

/// Dequantized rows of `bytes` (whole rows of `codec`), compared element by element.
fn count_flips(codec: RowCodec, ours: &[u8], theirs: &[u8]) -> Result<(usize, usize), Error> {
    let rows = ours.len().min(theirs.len()) / codec.bytes().max(1);
    let n = rows * codec.bytes();
    let mut a = vec![0f32; rows * codec.dim()];
    let mut b = vec![0f32; rows * codec.dim()];
    let what = "cache flips: dequantize";
    codec
        .dequantize(&ours[..n], &mut a)
        .map_err(Error::model_kernel(what))?;
    codec
        .dequantize(&theirs[..n], &mut b)
        .map_err(Error::model_kernel(what))?;
    let differ = a
        .iter()
        .zip(&b)
        .filter(|(x, y)| x.to_bits() != y.to_bits())
        .count();
    // Rows only one of them holds count as differing whole.
    let extra = ours.len().abs_diff(theirs.len()) / codec.bytes().max(1) * codec.dim();
    Ok((a.len() + extra, differ + extra))
}

/// Per layer, the quantized cache elements the end-to-end store holds differently from the
/// teacher-forced one.
fn cache_flips(
    model: &Model,
    ours: &ContiguousStore,
    forced: &ContiguousStore,
) -> Result<Vec<CacheFlips>, Error> {
    let attn = model.attention();
    let wc = attn.window_codec();
    let mut out = Vec::new();
    for l in 0..model.dims().layers {
        let rows = |s: &ContiguousStore| -> Vec<u8> {
            (0..s.len())
                .filter_map(|p| s.window_row(l, p))
                .flat_map(|r| r.iter().copied())
                .collect()
        };
        let (elements, differ) = count_flips(wc, &rows(ours), &rows(forced))?;
        out.push(CacheFlips {
            layer: l,
            kind: "window",
            elements,
            differ,
        });
        let (a, b) = (ours.compressed_rows(l), forced.compressed_rows(l));
        if !a.is_empty() || !b.is_empty() {
            let (elements, differ) = count_flips(attn.entry_codec(), a, b)?;
            out.push(CacheFlips {
                layer: l,
                kind: "compressed",
                elements,
                differ,
            });
        }
        let (a, b) = (ours.index_key_rows(l), forced.index_key_rows(l));
        if let Some(kc) = attn.key_codec()
            && (!a.is_empty() || !b.is_empty())
        {
            let (elements, differ) = count_flips(kc, a, b)?;
            out.push(CacheFlips {
                layer: l,
                kind: "index_keys",
                elements,
                differ,
            });
        }
    }
    Ok(out)
}

/// [`verify_model_with`] with the model and the dump loaded.
pub fn verify_loaded(
    model: &Model,
    naming: Naming,
    file: &TensorFile,
    opts: &ModelVerifyOptions,
) -> Result<ModelVerifyReport, Error> {
    let ids = match file.shape("input_ids") {
        Some([1, t]) => file.i64("input_ids", &[1, *t])?,
        other => {
            return Err(Error::ModelVectors(format!(
                "{}: `input_ids` has shape {:?}, expected [1, T]",
                file.path().display(),
                other
            )));
        }
    };
    let tokens: Vec<u32> = ids
        .iter()
        .map(|&t| u32::try_from(t).map_err(|_| Error::ModelVectors(format!("token id {t}"))))
        .collect::<Result<_, _>>()?;
    let (t, h, v) = (tokens.len(), model.dims().hidden, model.dims().vocab);
    let mut sink = Sink {
        file,
        tol: opts.rel_tol,
        out: Vec::new(),
        skipped: Vec::new(),
    };
    // The teacher-forced step runs for either mode: its store is what the end-to-end cache
    // is compared with.
    let forced = forced_inputs(model, file, t)?;
    let mut forced_store = model.new_store(None);
    let mut ft = ModelTrace::default();
    let forced_logits = model.step_teacher_forced(&mut forced_store, &tokens, &forced, &mut ft)?;
    let mut greedy_agreement = 0;
    if opts.teacher_forced {
        let pass = "teacher-forced";
        sink.values(pass, "logits", &forced_logits, v)?;
        sink.values(pass, "final_hidden", &ft.final_hidden, h)?;
        let theirs = file.f32("final_hidden", &[1, t, h])?;
        let head = model.lm_head(&theirs)?;
        sink.values_as(pass, "logits(reference final_hidden)", "logits", &head, v)?;
        compare_blocks(&mut sink, pass, model, &ft, true)?;
        greedy_agreement = greedy(file, &forced_logits, v)?;
    }
    let mut flips = Vec::new();
    if opts.end_to_end {
        let mut store = model.new_store(None);
        let mut trace = ModelTrace::default();
        let logits = model.step(&mut store, &tokens, Logits::All, Some(&mut trace))?;
        sink.values("prefill", "logits", &logits, v)?;
        sink.values("prefill", "final_hidden", &trace.final_hidden, h)?;
        compare_blocks(&mut sink, "prefill", model, &trace, false)?;
        greedy_agreement = greedy(file, &logits, v)?;
        flips = cache_flips(model, &store, &forced_store)?;
        // Decode pass: one token per step.
        let mut store = model.new_store(None);
        let mut all = Vec::with_capacity(t * v);
        for &tok in &tokens {
            all.extend(model.decode(&mut store, tok)?);
        }
        sink.values("decode", "logits", &all, v)?;
    }
    Ok(ModelVerifyReport {
        tokens: t,
        layers: model.dims().layers,
        naming: format!("{naming:?}"),
        rel_tol: opts.rel_tol,
        tensors: sink.out,
        skipped: sink.skipped,
        greedy_agreement,
        cache_flips: flips,
    })
}
