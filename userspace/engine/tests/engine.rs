//! The serving engine on the built-in tiny model (the real V4.1-Flash cache geometry): the
//! same tokens as the model run alone, continuous batching, prefix reuse through the tiers
//! (window from the DRAM pool; bounded replay after a restart), tenant isolation, errors.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use kvstack_cache::CacheOptions;
use kvstack_driver::pinned::{HugePages, Locking, PinnedOptions};
use kvstack_engine::{Completion, Engine, EngineOptions, Event, RequestSpec, ReuseKind, SessionId};
use kvstack_kernels::model::{Sampling, argmax};
use kvstack_model::init::random_model;
use kvstack_model::{Model, PrefillMode};
use kvstack_spec::ModelConfig;
use kvstack_spec::builtin::tiny_config;
use kvstack_tiers::{PoolOptions, StoreLocation, StoreOptions, SystemClock, TierOptions, Tiers};

/// Plain memory: tests must not depend on the machine's huge pages or memlock limit.
const MEM: PinnedOptions = PinnedOptions {
    huge_pages: HugePages::Never,
    locking: Locking::Never,
};

const SEED: u64 = 11;

fn setup() -> (ModelConfig, Model) {
    let cfg = tiny_config().unwrap();
    let model = random_model(&cfg, SEED).unwrap();
    (cfg, model)
}

fn tiers(cfg: &ModelConfig, dir: &std::path::Path) -> Tiers {
    let mut store = StoreOptions::new(StoreLocation::Directory(dir.to_path_buf()));
    store.segment_bytes = 8 << 20;
    store.capacity_bytes = 16 * store.segment_bytes;
    store.memory = MEM;
    let mut pool = PoolOptions::new(1);
    pool.capacity_bytes = Some(64 << 20);
    pool.memory = MEM;
    let opts = TierOptions {
        pool,
        weights_id: format!("builtin seed {SEED}").into_bytes(),
        ..TierOptions::new(store)
    };
    Tiers::open(cfg, 256, opts, Arc::new(SystemClock)).unwrap()
}

fn engine(cfg: &ModelConfig, model: Model, tiers: Option<Tiers>, keep_live: bool) -> Engine {
    let opts = EngineOptions {
        chunk: 128,
        keep_live,
        cache: CacheOptions {
            context_limit: 8192,
            max_sequences: 8,
            memory: MEM,
            ..CacheOptions::default()
        },
        ..EngineOptions::default()
    };
    Engine::new(cfg, model, tiers, opts).unwrap()
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 131 + 7 + salt * 977) % 1024)
        .collect()
}

fn spec(tokens: Vec<u32>, new: usize) -> RequestSpec {
    RequestSpec {
        tokens,
        max_new_tokens: new,
        sampling: Sampling::Greedy,
        seed: 1,
    }
}

/// Runs until idle; returns the completions in finishing order (failures panic).
fn drain(e: &mut Engine) -> Vec<Completion> {
    let mut done = Vec::new();
    e.run_until_idle(|ev| match ev {
        Event::Finished(c) => done.push(c.clone()),
        Event::Failed { request, error } => panic!("request {request:?} failed: {error}"),
        _ => {}
    })
    .unwrap();
    done
}

fn turn(e: &mut Engine, s: SessionId, input: Vec<u32>, new: usize) -> Completion {
    e.submit(s, spec(input, new)).unwrap();
    drain(e).pop().unwrap()
}

/// Greedy generation by the model alone (in-memory store, the same prefill plan), continuing
/// `store`; the last generated token is not fed (as in the engine).
fn generate(
    model: &Model,
    store: &mut kvstack_model::attention::ContiguousStore,
    input: &[u32],
    new: usize,
) -> Vec<u32> {
    let mut l = model.prefill(store, input, PrefillMode::Ced, 128).unwrap();
    let mut out = Vec::new();
    for _ in 0..new {
        let t = argmax(&l).unwrap() as u32;
        out.push(t);
        if out.len() == new {
            break;
        }
        l = model.decode(store, t).unwrap();
    }
    out
}

/// Three sessions submitted together: chunked prefill beside batched decodes gives exactly
/// the tokens of running each alone; a second turn reuses the live sequence.
#[test]
fn engine_matches_the_model_alone_and_batches_decodes() {
    let (cfg, model) = setup();
    let prompts: Vec<Vec<u32>> = (0..3).map(|k| tokens(150 + 40 * k, k as u32)).collect();
    let mut stores: Vec<_> = (0..3)
        .map(|_| model.new_store(Some(model.window())))
        .collect();
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&mut stores)
        .map(|(p, s)| generate(&model, s, p, 6))
        .collect();
    let mut e = engine(&cfg, model, None, true);
    let sessions: Vec<SessionId> = (0..3).map(|_| e.open_session("t")).collect();
    let ids: Vec<_> = sessions
        .iter()
        .zip(&prompts)
        .map(|(&s, p)| e.submit(s, spec(p.clone(), 6)).unwrap())
        .collect();
    let mut done = drain(&mut e);
    done.sort_by_key(|c| c.request);
    for ((c, w), id) in done.iter().zip(&want).zip(&ids) {
        assert_eq!(c.request, *id);
        assert_eq!(&c.tokens, w, "request {id:?}");
        assert_eq!(c.reuse.kind, ReuseKind::None);
    }
    let st = e.stats();
    assert!(
        st.decode_batch_rows > st.decode_steps,
        "decodes were never batched: {} rows in {} steps",
        st.decode_batch_rows,
        st.decode_steps
    );
    // Turn two of session 0 continues its live sequence.
    let c = turn(&mut e, sessions[0], tokens(20, 9), 3);
    assert_eq!(c.reuse.kind, ReuseKind::Live);
    assert_eq!(c.reuse.live_tokens, prompts[0].len() as u64 + 5);
    let mut input = vec![want[0][5]];
    input.extend(tokens(20, 9));
    assert_eq!(c.tokens, generate(e.model(), &mut stores[0], &input, 3));
}

/// Released between turns, a session's next turn is restored from the tiers: with its window
/// from the DRAM pool it continues bit for bit like a live session; after a restart (empty
/// pool) the window is replayed and the global KV read from SSD. Another tenant gets nothing.
#[test]
fn tiers_restore_released_sessions_and_survive_a_restart() {
    let dir = tempfile::Builder::new()
        .prefix("kvstack-test-engine-tiers")
        .tempdir()
        .unwrap();
    let (cfg, model) = setup();
    // 300 + 5 generated - 1 fed = 304 tokens in the cache: an even length, so the unit at the
    // end of the output carries a window snapshot.
    let p1 = tokens(300, 1);
    let p2 = tokens(30, 2);

    let mut live = engine(&cfg, model.clone(), None, true);
    let s = live.open_session("alice");
    let a1 = turn(&mut live, s, p1.clone(), 5);
    let a2 = turn(&mut live, s, p2.clone(), 4);

    let mut e = engine(&cfg, model.clone(), Some(tiers(&cfg, dir.path())), false);
    let s = e.open_session("alice");
    let b1 = turn(&mut e, s, p1.clone(), 5);
    assert_eq!(b1.tokens, a1.tokens);
    let b2 = turn(&mut e, s, p2.clone(), 4);
    assert_eq!(b2.reuse.kind, ReuseKind::TiersWithWindow, "{:?}", b2.reuse);
    assert!(b2.reuse.window_from_pool);
    assert_eq!(b2.reuse.mapped_tokens + b2.reuse.ssd_tokens, 304);
    assert_eq!(
        b2.tokens, a2.tokens,
        "restore with the window must be exact"
    );
    let history = e.history(s).unwrap().to_vec();
    e.close().unwrap();

    // Restart: the SSD units survive, the DRAM pool does not.
    let mut e = engine(&cfg, model.clone(), Some(tiers(&cfg, dir.path())), false);
    let s = e.open_session("alice");
    let mut input = history.clone();
    input.extend(tokens(10, 3));
    let c = turn(&mut e, s, input.clone(), 2);
    assert_eq!(c.reuse.kind, ReuseKind::TiersReplay, "{:?}", c.reuse);
    assert!(c.reuse.ssd_tokens >= 256, "{:?}", c.reuse);
    assert_eq!(c.reuse.replayed_tokens, 128);
    assert_eq!(
        c.reuse.computed_tokens + c.reuse.ssd_tokens,
        input.len() as u64
    );
    assert!(e.stats().ssd_bytes > 0);

    // Another tenant with the same tokens computes everything.
    let m = e.open_session("mallory");
    let c = turn(&mut e, m, input, 2);
    assert_eq!(c.reuse.kind, ReuseKind::None, "{:?}", c.reuse);
    assert_eq!(c.reuse.ssd_tokens + c.reuse.mapped_tokens, 0);
    e.close().unwrap();
}

/// Bad requests are errors naming what is wrong; the engine keeps serving.
#[test]
fn bad_requests_are_clear_errors() {
    let (cfg, model) = setup();
    let mut e = engine(&cfg, model, None, true);
    let s = e.open_session("t");
    let err = e.submit(s, spec(vec![1, 2, 5000], 2)).unwrap_err();
    assert!(
        err.to_string().contains("token 5000 at input position 2"),
        "{err}"
    );
    let err = e.submit(s, spec(vec![], 2)).unwrap_err();
    assert!(err.to_string().contains("input tokens"), "{err}");
    let err = e.submit(SessionId(99), spec(vec![1], 2)).unwrap_err();
    assert!(err.to_string().contains("no such session"), "{err}");
    e.submit(s, spec(vec![1, 2, 3], 2)).unwrap();
    let err = e.submit(s, spec(vec![4], 2)).unwrap_err();
    assert!(err.to_string().contains("in flight"), "{err}");
    let done = drain(&mut e);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].tokens.len(), 2);
}

#[test]
fn a_cancelled_request_frees_its_pages_and_its_session_goes_on() {
    let (cfg, model) = setup();
    let mut e = engine(&cfg, model.clone(), None, true);
    let s = e.open_session("t");
    let first = turn(&mut e, s, tokens(200, 1), 3);
    assert_eq!(
        e.cache().usage().sequences,
        1,
        "the live session holds its sequence"
    );

    // Cancel mid-prefill (after one 128-token chunk of a 300-token turn).
    let id = e.submit(s, spec(tokens(300, 2), 4)).unwrap();
    let mut events = e.step().unwrap();
    assert!(e.cancel(id));
    assert!(!e.cancel(id), "cancelled once");
    while !e.is_idle() {
        events.extend(e.step().unwrap());
    }
    assert!(
        events.iter().all(|ev| !matches!(ev, Event::Finished(_))),
        "no completion after a cancel"
    );
    assert_eq!(e.stats().cancelled, 1);
    // The turn's sequence (which had taken the session's) is gone: nothing is held.
    assert_eq!(e.cache().usage().sequences, 0);
    assert_eq!(
        e.history(s).unwrap().len(),
        first.context_tokens as usize + 3
    );

    // The session takes its next turn, equal to a fresh engine given the same history.
    let history = e.history(s).unwrap().to_vec();
    let next = turn(&mut e, s, tokens(20, 3), 3);
    let mut fresh = engine(&cfg, model, None, true);
    let f = fresh.open_session("t");
    let mut all = history;
    all.extend(tokens(20, 3));
    let want = turn(&mut fresh, f, all, 3);
    assert_eq!(next.tokens, want.tokens);

    // A queued request (not started) is cancelled without touching the live sequence.
    let a = e.open_session("t");
    let before = e.cache().usage();
    assert_eq!(before.sequences, 1, "session s is live again");
    let q = e.submit(a, spec(tokens(50, 4), 2)).unwrap();
    assert!(e.cancel(q));
    assert_eq!(e.cache().usage(), before);
    assert!(e.is_idle());
}
