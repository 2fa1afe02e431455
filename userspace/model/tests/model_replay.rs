//! Continuous batching and bounded replay (spec §7) on the reference tiny model of
//! `shared/vectors/csa2` (window 16).

// Test code: a failed unwrap is a failed test, with its message.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;

use kvstack_kernels::model::argmax;
use kvstack_model::attention::{ContiguousStore, KvStore};
use kvstack_model::verify::row_errors;
use kvstack_model::weights::TensorFile;
use kvstack_model::{BatchItem, Logits, Model, PrefillMode};
use kvstack_spec::config::ModelConfig;
use kvstack_spec::plan::LayerMode;

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../testdata/vectors/csa2");

fn model() -> Model {
    let dir = PathBuf::from(DIR);
    let cfg = ModelConfig::from_file(dir.join("model_config.json")).unwrap();
    let file = TensorFile::open(dir.join("model_weights.released.safetensors")).unwrap();
    Model::load(&cfg, &file).unwrap()
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 97 + 13 + salt * 31) % 256)
        .collect()
}

fn sources(model: &Model) -> Vec<usize> {
    model
        .attention()
        .plan()
        .layers
        .iter()
        .filter(|s| s.mode == LayerMode::Full)
        .map(|s| s.index)
        .collect()
}

/// Decoding three sequences in one batched step per token gives exactly the logits and cache
/// rows of decoding each alone, with the batch's attentions on one thread or spread over two.
#[test]
fn batched_decode_equals_decoding_each_alone() {
    batched_equals_alone(1);
    batched_equals_alone(2);
}

fn batched_equals_alone(threads: usize) {
    let model = model();
    let mut batch_model = self::model();
    batch_model.set_threads(threads);
    let lens = [37usize, 20, 51];
    let mut alone: Vec<ContiguousStore> = Vec::new();
    let mut batched: Vec<ContiguousStore> = Vec::new();
    let mut next = Vec::new();
    for (k, &n) in lens.iter().enumerate() {
        let mut s = model.new_store(None);
        let l = model
            .prefill(&mut s, &prompt(n, k as u32), PrefillMode::Exact, 16)
            .unwrap();
        next.push(argmax(&l).unwrap() as u32);
        batched.push(s.clone());
        alone.push(s);
    }
    let mut tok_a = next.clone();
    let mut tok_b = next;
    for _ in 0..6 {
        for (s, t) in alone.iter_mut().zip(tok_a.iter_mut()) {
            let l = model.decode(s, *t).unwrap();
            *t = argmax(&l).unwrap() as u32;
        }
        let toks: Vec<[u32; 1]> = tok_b.iter().map(|&t| [t]).collect();
        let mut items: Vec<BatchItem<'_>> = batched
            .iter_mut()
            .zip(&toks)
            .map(|(s, t)| BatchItem {
                store: s,
                tokens: t,
                logits: Logits::Last,
                decoder_window_start: 0,
            })
            .collect();
        let outs = batch_model.step_batch(&mut items).unwrap();
        for (t, l) in tok_b.iter_mut().zip(&outs) {
            *t = argmax(l).unwrap() as u32;
        }
        assert_eq!(tok_a, tok_b);
    }
    // A prefill chunk batched beside decode tokens: the same again.
    let extra = prompt(9, 7);
    let mut a0 = alone[0].clone();
    let mut a1 = alone[1].clone();
    let la = model.step(&mut a0, &extra, Logits::Last, None).unwrap();
    let lb = model.decode(&mut a1, tok_a[1]).unwrap();
    let t1 = [tok_b[1]];
    let (b0, rest) = batched.split_at_mut(1);
    let mut items = [
        BatchItem {
            store: &mut b0[0],
            tokens: &extra,
            logits: Logits::Last,
            decoder_window_start: 0,
        },
        BatchItem {
            store: &mut rest[0],
            tokens: &t1,
            logits: Logits::Last,
            decoder_window_start: 0,
        },
    ];
    let outs = model.step_batch(&mut items).unwrap();
    assert_eq!(outs[0], la, "batched prefill chunk differs");
    assert_eq!(outs[1], lb, "batched decode beside a prefill chunk differs");
    for (x, y) in [(&a0, &batched[0]), (&a1, &batched[1])] {
        for src in sources(&model) {
            assert_eq!(x.compressed_rows(src), y.compressed_rows(src));
        }
        let last = x.len() - 1;
        for l in 0..model.dims().layers {
            assert_eq!(x.window_row(l, last), y.window_row(l, last));
        }
    }
}

/// A replay from position 0 (the prefix is shorter than the window) recomputes everything the
/// uncached run computes: bit-identical logits, and the global entries are those of the prefix.
#[test]
fn replay_of_a_whole_short_prefix_is_exact() {
    let model = model();
    let p = prompt(60, 3);
    let (prefix, suffix) = p.split_at(12);
    let mut uncached = model.new_store(None);
    model
        .prefill(&mut uncached, prefix, PrefillMode::Exact, 64)
        .unwrap();
    let want = model
        .prefill(&mut uncached, suffix, PrefillMode::Exact, 64)
        .unwrap();
    let mut restored = model.new_store(None);
    model
        .prefill(&mut restored, prefix, PrefillMode::Exact, 64)
        .unwrap();
    restored.drop_window();
    let got = model
        .prefill_replay(&mut restored, prefix, suffix, PrefillMode::Exact, 64)
        .unwrap();
    assert_eq!(got, want);
    assert_eq!(restored.len(), uncached.len());
    for src in sources(&model) {
        assert_eq!(restored.compressed_rows(src), uncached.compressed_rows(src));
    }
}

/// A bounded replay of the last `window` tokens of a long prefix: the cached global entries
/// are never rewritten, the window is rebuilt, and the next logits are close to (not equal to)
/// an uncached run; without any replay (an empty window) they are further off.
#[test]
fn bounded_replay_rebuilds_the_window_and_keeps_global_kv() {
    let model = model();
    let w = model.window();
    let p = prompt(170, 5);
    let (prefix, suffix) = p.split_at(120);
    let mut uncached = model.new_store(None);
    model
        .prefill(&mut uncached, prefix, PrefillMode::Exact, 64)
        .unwrap();
    let base = uncached.clone();
    let want = model
        .prefill(&mut uncached, suffix, PrefillMode::Exact, 64)
        .unwrap();

    let mut replayed = base.clone();
    replayed.drop_window();
    let before: Vec<Vec<u8>> = sources(&model)
        .iter()
        .map(|&s| replayed.compressed_rows(s).to_vec())
        .collect();
    let got = model
        .prefill_replay(
            &mut replayed,
            &prefix[prefix.len() - w..],
            suffix,
            PrefillMode::Exact,
            64,
        )
        .unwrap();
    for (s, old) in sources(&model).iter().zip(&before) {
        assert_eq!(
            &replayed.compressed_rows(*s)[..old.len()],
            &old[..],
            "replay rewrote cached global KV of layer {s}"
        );
        assert_eq!(
            replayed.compressed_rows(*s).len(),
            uncached.compressed_rows(*s).len()
        );
    }
    // The last window rows of every layer exist again.
    let end = replayed.len();
    for l in 0..model.dims().layers {
        assert!(replayed.window_row(l, end - 1).is_some(), "layer {l}");
        assert!(
            replayed.window_row(l, end - w as u64).is_some(),
            "layer {l}"
        );
    }

    // No replay at all: the window starts empty at the prefix end.
    let mut blind = base.clone();
    blind.drop_window();
    let none = model
        .prefill(&mut blind, suffix, PrefillMode::Exact, 64)
        .unwrap();
    let (e_replay, _) = row_errors(&got, &want, want.len(), f64::INFINITY);
    let (e_none, _) = row_errors(&none, &want, want.len(), f64::INFINITY);
    eprintln!(
        "reference tiny model, window {w}, prefix 120 + suffix 50: next-logit error vs uncached: bounded replay {e_replay:e}, no replay {e_none:e}; top-1 {} / {} / {}",
        argmax(&want).unwrap(),
        argmax(&got).unwrap(),
        argmax(&none).unwrap()
    );
    assert!(
        e_replay > 0.0,
        "replay is approximate; bit-equality is suspicious"
    );
    assert!(e_replay.is_finite());
    assert!(
        e_replay < e_none,
        "bounded replay ({e_replay:e}) should be closer to the uncached run than no replay ({e_none:e})"
    );
}

/// Replay arguments out of range are errors, not panics.
#[test]
fn replay_longer_than_the_store_is_an_error() {
    let model = model();
    let mut s = model.new_store(None);
    model
        .prefill(&mut s, &prompt(8, 1), PrefillMode::Exact, 8)
        .unwrap();
    let err = model
        .prefill_replay(&mut s, &prompt(10, 1), &[1], PrefillMode::Exact, 8)
        .unwrap_err();
    assert!(err.to_string().contains("longer"), "{err}");
    // A replay that does not start a compress group of 2.
    let err = model
        .prefill_replay(&mut s, &prompt(3, 1), &[1], PrefillMode::Exact, 8)
        .unwrap_err();
    assert!(err.to_string().contains("compress group"), "{err}");
}
