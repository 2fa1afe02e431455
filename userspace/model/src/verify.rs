//! `verify model`: runs the whole forward pass on the recorded `input_ids` of a reference dump
//! (`shared/vectors/csa2/model_vectors.safetensors`, README "model_vectors") and compares the
//! logits, the final hidden state and every recorded per-block tensor.
//!
//! Passes:
//! - **prefill**: all tokens in one exact step, own state threaded through every layer; every
//!   recorded tensor compared;
//! - **decode**: the same tokens one step each (the decode path over the store); logits
//!   compared.
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
use crate::checkpoint::Naming;
use crate::forward::{Logits, Model, ModelTrace};

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
    /// Tokens whose greedy choice (argmax of the logits) matches the reference's, prefill pass.
    pub greedy_agreement: usize,
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
        let Some(shape) = self.file.shape(name).map(<[usize]>::to_vec) else {
            self.skipped.push(name.to_owned());
            return Ok(());
        };
        let theirs = self.file.f32(name, &shape)?;
        let (row_rel, _) = row_errors(ours, &theirs, row, self.tol);
        let (max_rel, mismatches) = tensor_errors(ours, &theirs, self.tol);
        self.out.push(TensorResult {
            pass,
            name: name.to_owned(),
            kind: "values",
            rows: theirs.len() / row.max(1),
            max_rel,
            row_rel,
            mismatches,
            passed: mismatches == 0,
        });
        Ok(())
    }

    fn sets(&mut self, name: &str, ours: &[BTreeSet<i64>], theirs: Option<Vec<BTreeSet<i64>>>) {
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
            pass: "prefill",
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

/// Runs `verify model` from files.
pub fn verify_model(
    config: &Path,
    weights: &Path,
    vectors: &Path,
    rel_tol: f64,
) -> Result<ModelVerifyReport, Error> {
    let cfg = ModelConfig::from_file(config).map_err(Error::ModelConfig)?;
    let wfile = TensorFile::open(weights)?;
    let model = Model::load(&cfg, &wfile)?;
    let naming = crate::checkpoint::Naming::detect(&wfile)?;
    let vfile = TensorFile::open(vectors)?;
    verify_loaded(&model, naming, &vfile, rel_tol)
}

/// [`verify_model`] with the model and the dump loaded.
pub fn verify_loaded(
    model: &Model,
    naming: Naming,
    file: &TensorFile,
    rel_tol: f64,
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
        tol: rel_tol,
        out: Vec::new(),
        skipped: Vec::new(),
    };
    let mut store = model.new_store(None);
    let mut trace = ModelTrace::default();
    let logits = model.step(&mut store, &tokens, Logits::All, Some(&mut trace))?;
    sink.values("prefill", "logits", &logits, v)?;
    sink.values("prefill", "final_hidden", &trace.final_hidden, h)?;
    let n = model.dims().hc_mult;
    for (l, b) in trace.blocks.iter().enumerate() {
        let p = |s: &str| format!("layers.{l}.{s}");
        sink.values("prefill", &p("streams_in"), &b.streams_in, h)?;
        sink.values("prefill", &p("attn_input"), &b.attn_input, h)?;
        sink.values("prefill", &p("attn_output"), &b.attn_output, h)?;
        sink.values("prefill", &p("ffn_input"), &b.ffn_input, h)?;
        sink.values("prefill", &p("ffn_output"), &b.ffn_output, h)?;
        for (site, mix) in [("attn_hc", &b.attn_hc), ("ffn_hc", &b.ffn_hc)] {
            sink.values(
                "prefill",
                &p(&format!("{site}.pre")),
                &flat(mix, |m| &m.pre),
                n,
            )?;
            sink.values(
                "prefill",
                &p(&format!("{site}.post")),
                &flat(mix, |m| &m.post),
                n,
            )?;
            sink.values(
                "prefill",
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
            sink.sets(&p("router.indices"), &ours, Some(theirs));
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
            sink.values("prefill", &p("router.weights"), &w, k)?;
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
            sink.sets(&p("topk_indices"), &ours, theirs);
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
            sink.sets(&name, &ours, theirs);
        }
    }
    let greedy_agreement = match file.shape("logits").map(<[usize]>::to_vec) {
        Some(shape) => {
            let theirs = file.f32("logits", &shape)?;
            logits
                .chunks(v)
                .zip(theirs.chunks(v))
                .filter(|(a, b)| {
                    kvstack_kernels::model::argmax(a) == kvstack_kernels::model::argmax(b)
                })
                .count()
        }
        None => 0,
    };
    // Decode pass: one token per step.
    let mut store = model.new_store(None);
    let mut all = Vec::with_capacity(t * v);
    for &tok in &tokens {
        all.extend(model.decode(&mut store, tok)?);
    }
    sink.values("decode", "logits", &all, v)?;
    Ok(ModelVerifyReport {
        tokens: t,
        layers: model.dims().layers,
        naming: format!("{naming:?}"),
        rel_tol,
        tensors: sink.out,
        skipped: sink.skipped,
        greedy_agreement,
    })
}
