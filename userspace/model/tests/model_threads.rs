//! `--threads` changes how a step is split, never what it computes: on the built-in tiny model
//! (the real V4.1-Flash cache geometry, hidden 256), a prefill chunk large enough for every
//! phase to split (HC, norms, router, attention projections, LM head), batched decode steps
//! (sequence groups, with threads of their own at 4 threads) and a lone decode step (split
//! phase by phase on a team) give bit-identical logits and cache rows on 1 to 4 threads.

// Test code: a failed unwrap is a failed test, with its message.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_kernels::model::argmax;
use kvstack_model::attention::{ContiguousStore, KvStore};
use kvstack_model::init::random_model;
use kvstack_model::{BatchItem, Logits, Model, PrefillMode};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// One decode token per store, last logits each.
fn items<'a>(stores: &'a mut [ContiguousStore], toks: &'a [[u32; 1]]) -> Vec<BatchItem<'a>> {
    stores
        .iter_mut()
        .zip(toks)
        .map(|(s, t)| BatchItem {
            store: s,
            tokens: t,
            logits: Logits::Last,
            decoder_window_start: 0,
        })
        .collect()
}

/// Prefill of 160 tokens in one exact chunk (all logits), then 3 batched decode steps of two
/// sequences and one step of the first alone; returns every logit computed.
fn run(model: &Model) -> (Vec<u32>, Vec<ContiguousStore>) {
    let vocab = model.dims().vocab as u32;
    let mut out = Vec::new();
    let mut stores = Vec::new();
    let mut next = Vec::new();
    for salt in 0..2u32 {
        let prompt: Vec<u32> = (0..160u32)
            .map(|i| (i * 131 + salt * 7 + 3) % vocab)
            .collect();
        let mut s = model.new_store(None);
        let logits = model.step(&mut s, &prompt, Logits::All, None).unwrap();
        out.extend(bits(&logits));
        let last = &logits[logits.len() - vocab as usize..];
        next.push(argmax(last).unwrap() as u32);
        stores.push(s);
    }
    for _ in 0..3 {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let logits = model.step_batch(&mut items(&mut stores, &toks)).unwrap();
        next = logits.iter().map(|l| argmax(l).unwrap() as u32).collect();
        for l in &logits {
            out.extend(bits(l));
        }
    }
    out.extend(bits(&model.decode(&mut stores[0], next[0]).unwrap()));
    (out, stores)
}

#[test]
fn every_thread_count_computes_the_same_bits() {
    let cfg = kvstack_spec::builtin::tiny_config().unwrap();
    let mut model = random_model(&cfg, 7).unwrap();
    model.set_threads(1);
    let (want, want_stores) = run(&model);
    // A CED prefill too: encoder-only chunks take another path through the layers.
    let ced = |m: &Model| {
        let prompt: Vec<u32> = (0..200u32).map(|i| (i * 17 + 5) % 1024).collect();
        let mut s = m.new_store(None);
        bits(&m.prefill(&mut s, &prompt, PrefillMode::Ced, 128).unwrap())
    };
    let want_ced = ced(&model);
    for threads in [2, 3, 4] {
        model.set_threads(threads);
        let (got, stores) = run(&model);
        assert!(got == want, "{threads} threads: logits differ");
        for (a, b) in stores.iter().zip(&want_stores) {
            for l in 0..model.dims().layers {
                assert_eq!(
                    a.window_row(l, a.len() - 1).unwrap(),
                    b.window_row(l, b.len() - 1).unwrap(),
                    "{threads} threads: layer {l} window row"
                );
            }
        }
        assert!(
            ced(&model) == want_ced,
            "{threads} threads: CED prefill logits differ"
        );
    }
}

/// A decode step run in sequence groups (2 threads, 4 members) with a token outside the
/// vocabulary in the last group is refused before any group touches its stores: every store
/// keeps its length.
#[test]
fn a_bad_token_fails_a_grouped_step_before_any_store_moves() {
    let cfg = kvstack_spec::builtin::tiny_config().unwrap();
    let mut model = random_model(&cfg, 9).unwrap();
    model.set_threads(2);
    let vocab = model.dims().vocab as u32;
    let mut stores: Vec<ContiguousStore> = (0..4u32)
        .map(|salt| {
            let prompt: Vec<u32> = (0..20u32).map(|i| (i * 31 + salt) % vocab).collect();
            let mut s = model.new_store(None);
            model.step(&mut s, &prompt, Logits::Last, None).unwrap();
            s
        })
        .collect();
    let toks = [[1u32], [2], [3], [vocab]];
    let err = model
        .step_batch(&mut items(&mut stores, &toks))
        .unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    for (k, s) in stores.iter().enumerate() {
        assert_eq!(s.len(), 20, "member {k} moved");
    }
}
