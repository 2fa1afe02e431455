//! Decoding token by token (and prefilling in odd-sized chunks) reproduces a one-shot prefill
//! of the same tokens: the same top-k sets and candidate pools at every layer, the same
//! compressed entries and index keys byte for byte, and outputs within f32 rounding.

// Test code: a failed unwrap is a failed test (the workspace denies these in library code).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::PathBuf;

use kvstack_model::attention::{ContiguousStore, Csa2Attention, KvStore, StepState};
use kvstack_model::weights::TensorFile;

fn vectors() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../testdata/vectors/csa2"
    ))
}

/// Outputs `[layer][token][hidden]`, top-k sets `[layer][token]` and candidate pools.
struct Run {
    outputs: Vec<Vec<f32>>,
    topk: Vec<Vec<BTreeSet<i32>>>,
    candidates: Vec<Vec<Vec<u32>>>,
    store: ContiguousStore,
}

/// Runs the first `tokens` tokens of every layer's recorded input in steps of `chunk`.
fn run(
    attn: &Csa2Attention,
    inputs: &[Vec<f32>],
    tokens: usize,
    chunk: usize,
    keep_window: Option<usize>,
) -> Run {
    let d = attn.dims();
    let layers = attn.plan().layers.len();
    let mut store = attn.new_store(keep_window);
    let mut r = Run {
        outputs: vec![Vec::new(); layers],
        topk: vec![Vec::new(); layers],
        candidates: vec![Vec::new(); layers],
        store: attn.new_store(None),
    };
    let mut start = 0;
    while start < tokens {
        let n = chunk.min(tokens - start);
        let mut step = StepState::new(n);
        for (l, input) in inputs.iter().enumerate().take(layers) {
            let x = &input[start * d.hidden..(start + n) * d.hidden];
            let out = attn.forward(l, &mut store, &mut step, x, None).unwrap();
            r.outputs[l].extend_from_slice(&out);
            if attn.plan().layers[l].compress_ratio > 0 {
                let tk = step.topk().unwrap();
                for i in 0..n {
                    r.topk[l].push(
                        tk.row(i)
                            .unwrap()
                            .iter()
                            .copied()
                            .filter(|&j| j >= 0)
                            .collect(),
                    );
                }
            }
            if let Some(c) = step.candidates() {
                r.candidates[l].extend(c.rows.iter().cloned());
            }
        }
        store.commit(n as u64).unwrap();
        start += n;
    }
    r.store = store;
    r
}

fn load() -> (Csa2Attention, Vec<Vec<f32>>, usize) {
    let dir = vectors();
    let attn = Csa2Attention::from_files(
        &dir.join("config.json"),
        &dir.join("attn_weights.safetensors"),
    )
    .unwrap();
    let file = TensorFile::open(dir.join("attn_vectors.safetensors")).unwrap();
    let t = file.shape("layers.0.input").unwrap()[1];
    let hidden = attn.dims().hidden;
    let inputs = (0..attn.plan().layers.len())
        .map(|l| {
            file.f32(&format!("layers.{l}.input"), &[1, t, hidden])
                .unwrap()
        })
        .collect();
    (attn, inputs, t)
}

/// Largest |a - b| relative to max |b| of the row, over all rows.
fn worst_rel(a: &[f32], b: &[f32], row: usize) -> f64 {
    a.chunks(row)
        .zip(b.chunks(row))
        .map(|(x, y)| {
            let num = x
                .iter()
                .zip(y)
                .map(|(p, q)| (p - q).abs())
                .fold(0f32, f32::max);
            let den = y.iter().map(|q| q.abs()).fold(0f32, f32::max);
            f64::from(num) / f64::from(den.max(f32::MIN_POSITIVE))
        })
        .fold(0.0, f64::max)
}

fn assert_same(attn: &Csa2Attention, prefill: &Run, other: &Run, what: &str) {
    let d = attn.dims();
    for l in 0..attn.plan().layers.len() {
        assert_eq!(
            prefill.topk[l], other.topk[l],
            "{what}: top-k sets differ at layer {l}"
        );
        assert_eq!(
            prefill.candidates[l], other.candidates[l],
            "{what}: candidates differ at layer {l}"
        );
        let rel = worst_rel(&other.outputs[l], &prefill.outputs[l], d.hidden);
        // The decode == prefill bound: a few f32 ulps of the row's largest output (observed: 0).
        assert!(
            rel <= 4.0 * f64::from(f32::EPSILON),
            "{what}: layer {l} outputs differ by {rel:e}"
        );
        if let Some(s) = attn.plan().layers[l].kv_source.filter(|&s| s == l) {
            assert_eq!(
                prefill.store.compressed_rows(s),
                other.store.compressed_rows(s),
                "{what}: entries of layer {s}"
            );
            assert_eq!(
                prefill.store.index_key_rows(s),
                other.store.index_key_rows(s),
                "{what}: keys of layer {s}"
            );
            assert_eq!(
                prefill.store.pending(s),
                other.store.pending(s),
                "{what}: pending of layer {s}"
            );
        }
    }
}

#[test]
fn decode_token_by_token_equals_prefill() {
    let (attn, inputs, t) = load();
    // 101 tokens: an odd count leaves one pending token in the ratio-2 compressor, and
    // reaches past the window (16), the top-k (16 entries) and several candidate blocks.
    let tokens = t.min(101);
    let prefill = run(&attn, &inputs, tokens, tokens, None);
    // Decode keeps only the last `window` rows of each layer, as a serving cache would.
    let window = attn.dims().window;
    let decode = run(&attn, &inputs, tokens, 1, Some(window));
    assert_same(&attn, &prefill, &decode, "decode");
    // Stronger than the rounding bound: every stage works per token, and the projections'
    // GEMM (matrixmultiply) sums along k in the same blocks for any number of rows, so one
    // token at a time gives the same bits as all tokens at once.
    for l in 0..prefill.outputs.len() {
        assert!(
            prefill.outputs[l] == decode.outputs[l],
            "layer {l}: decode is not bit-identical to prefill"
        );
    }
}

/// A prefill step whose queries read the selected entries as stored (each dequantizing its
/// own, as a long context's steps do past `set_entry_decode_limit`) gives the bits of one that
/// decodes each entry once for all its queries, and of decoding token by token.
#[test]
fn prefill_reading_stored_entries_equals_decoded_sharing() {
    let (mut attn, inputs, t) = load();
    let tokens = t.min(101);
    let shared = run(&attn, &inputs, tokens, tokens, None);
    attn.set_entry_decode_limit(0);
    let stored = run(&attn, &inputs, tokens, tokens, None);
    assert_same(&attn, &shared, &stored, "entries as stored");
    let window = attn.dims().window;
    let decode = run(&attn, &inputs, tokens, 1, Some(window));
    for l in 0..shared.outputs.len() {
        assert!(
            stored.outputs[l] == shared.outputs[l] && stored.outputs[l] == decode.outputs[l],
            "layer {l}: entries read as stored change the bits"
        );
    }
}

#[test]
fn chunked_prefill_equals_one_shot_prefill() {
    let (attn, inputs, t) = load();
    let tokens = t.min(101);
    let prefill = run(&attn, &inputs, tokens, tokens, None);
    for chunk in [7, 16, 33] {
        let chunked = run(&attn, &inputs, tokens, chunk, Some(attn.dims().window));
        assert_same(&attn, &prefill, &chunked, &format!("chunks of {chunk}"));
    }
}

#[test]
fn reuse_layer_without_its_index_source_is_an_error() {
    let (attn, inputs, _) = load();
    let hidden = attn.dims().hidden;
    let mut store = attn.new_store(None);
    let mut step = StepState::new(1);
    // Layer 3 (Reuse) needs the top-k layer 2 publishes in the same step.
    let err = attn
        .forward(3, &mut store, &mut step, &inputs[3][..hidden], None)
        .unwrap_err();
    assert!(err.to_string().contains("top-k"), "{err}");
}
