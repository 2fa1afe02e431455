//! A batched step computes each attention projection once over every member's rows (one read
//! of each weight per step) and still gives each member exactly what its step alone gives: on
//! the built-in tiny model (the real V4.1-Flash plan: compressors at ratios 4 and 128, index
//! sources, candidate pools, Reuse layers), four sequences at different lengths, some
//! completing compressor groups during the steps, decode together and alone with bit-identical
//! logits and cache rows, on 1 and 2 threads; a step with a prefill chunk beside decode tokens
//! too. The one test of this file also holds the step's weight bytes (the linear work
//! counters, process-wide: no other test runs beside it) against one member's step.

// Test code: a failed unwrap is a failed test, with its message.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_kernels::model::argmax;
use kvstack_kernels::work::Work;
use kvstack_model::attention::{ContiguousStore, KvStore};
use kvstack_model::init::random_model;
use kvstack_model::{BatchItem, Logits, Model};
use kvstack_spec::plan::LayerMode;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every cache row of `a` and `b`: window rows of every layer and position, compressed
/// entries, index keys and pending compressor state of every KV source.
fn assert_same_cache(model: &Model, a: &ContiguousStore, b: &ContiguousStore, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for l in 0..model.dims().layers {
        for p in 0..a.len() {
            assert_eq!(
                a.window_row(l, p),
                b.window_row(l, p),
                "{what}: layer {l} window row {p}"
            );
        }
    }
    for s in model.attention().plan().layers.iter() {
        if s.mode == LayerMode::Full {
            let l = s.index;
            assert_eq!(
                a.compressed_len(l),
                b.compressed_len(l),
                "{what}: layer {l}"
            );
            assert!(
                a.compressed_rows(l) == b.compressed_rows(l),
                "{what}: layer {l} entries"
            );
            assert!(
                a.index_key_rows(l) == b.index_key_rows(l),
                "{what}: layer {l} index keys"
            );
            assert_eq!(
                bits(a.pending(l)),
                bits(b.pending(l)),
                "{what}: layer {l} pending"
            );
        }
    }
}

/// One batched decode step of `stores` with `tokens`; the logits per member.
fn batch_step(model: &Model, stores: &mut [ContiguousStore], tokens: &[u32]) -> Vec<Vec<f32>> {
    let toks: Vec<[u32; 1]> = tokens.iter().map(|&t| [t]).collect();
    let mut items: Vec<BatchItem<'_>> = stores
        .iter_mut()
        .zip(&toks)
        .map(|(s, t)| BatchItem {
            store: s,
            tokens: t,
            logits: Logits::Last,
            decoder_window_start: 0,
        })
        .collect();
    model.step_batch(&mut items).unwrap()
}

#[test]
fn batched_steps_equal_separate_steps_bit_for_bit() {
    let cfg = kvstack_spec::builtin::tiny_config().unwrap();
    let mut model = random_model(&cfg, 11).unwrap();
    model.set_threads(1);
    let vocab = model.dims().vocab as u32;
    // 126 reaches a 128-token group during the steps; the others complete 4-token groups at
    // different steps.
    let lens = [126u32, 37, 62, 3];
    let mut start = Vec::new();
    let mut first = Vec::new();
    for (k, &n) in lens.iter().enumerate() {
        let prompt: Vec<u32> = (0..n)
            .map(|i| (i * 89 + 7 * k as u32 + 1) % vocab)
            .collect();
        let mut s = model.new_store(None);
        let l = model.step(&mut s, &prompt, Logits::Last, None).unwrap();
        first.push(argmax(&l).unwrap() as u32);
        start.push(s);
    }

    // The weight bytes of a step: four members read each attention weight once, as one does
    // (only the routed experts of more tokens add to it). Reading them per member, as before,
    // costs about 3.6 times one member's step on this model.
    let w0 = Work::now();
    model.decode(&mut start[0].clone(), first[0]).unwrap();
    let w1 = Work::now();
    batch_step(&model, &mut start.clone(), &first);
    let w2 = Work::now();
    let (one, four) = (w1.since(&w0).weight_bytes, w2.since(&w1).weight_bytes);
    assert!(
        four < one * 3 / 2,
        "a batch of 4 read {four} weight bytes, one member's step {one}"
    );

    for threads in [1, 2] {
        model.set_threads(threads);
        let mut alone = start.clone();
        let mut batched = start.clone();
        let mut tokens = first.clone();
        for step in 0..6 {
            let want: Vec<Vec<f32>> = alone
                .iter_mut()
                .zip(&tokens)
                .map(|(s, &t)| model.decode(s, t).unwrap())
                .collect();
            let got = batch_step(&model, &mut batched, &tokens);
            for (k, (w, g)) in want.iter().zip(&got).enumerate() {
                assert!(
                    bits(w) == bits(g),
                    "{threads} threads, step {step}, member {k}: logits differ"
                );
            }
            tokens = want.iter().map(|l| argmax(l).unwrap() as u32).collect();
        }
        for (k, (a, b)) in alone.iter().zip(&batched).enumerate() {
            assert_same_cache(&model, a, b, &format!("{threads} threads, member {k}"));
        }

        // A 9-token chunk of member 0 beside decode tokens of the others.
        let chunk: Vec<u32> = (0..9u32).map(|i| (i * 31 + 5) % vocab).collect();
        let mut want = vec![
            model
                .step(&mut alone[0], &chunk, Logits::All, None)
                .unwrap(),
        ];
        for (s, &t) in alone.iter_mut().zip(&tokens).skip(1) {
            want.push(model.decode(s, t).unwrap());
        }
        let toks: Vec<[u32; 1]> = tokens.iter().map(|&t| [t]).collect();
        let mut items: Vec<BatchItem<'_>> = batched
            .iter_mut()
            .enumerate()
            .map(|(k, s)| BatchItem {
                store: s,
                tokens: if k == 0 { &chunk[..] } else { &toks[k][..] },
                logits: if k == 0 { Logits::All } else { Logits::Last },
                decoder_window_start: 0,
            })
            .collect();
        let got = model.step_batch(&mut items).unwrap();
        for (k, (w, g)) in want.iter().zip(&got).enumerate() {
            assert!(
                bits(w) == bits(g),
                "{threads} threads, mixed step, member {k}: logits differ"
            );
        }
        for (k, (a, b)) in alone.iter().zip(&batched).enumerate() {
            assert_same_cache(
                &model,
                a,
                b,
                &format!("{threads} threads, mixed, member {k}"),
            );
        }
    }
}
