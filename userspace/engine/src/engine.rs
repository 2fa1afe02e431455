//! The serving engine: sessions, requests, chunked prefill, continuous batching of decode
//! steps, the paged cache for live sequences, and prefix reuse through the tiers (spec §7).
//!
//! One [`Engine`] owns a [`Model`], a [`KvCache`] and optionally the [`Tiers`]. Callers (the
//! `kvstack run` workload, the appliance daemon, the C ABI) open sessions, submit one request
//! per turn and drive [`Engine::step`], which returns [`Event`]s. Nothing here blocks on I/O
//! except a restore (SSD reads of a prefix) and the store's own back-pressure.
//!
//! **Admission** of a request (its session's history plus the new tokens `all`):
//! 1. the session's live sequence, when the engine kept it ([`EngineOptions::keep_live`]):
//!    only the new tokens are computed;
//! 2. otherwise the tiers: the longest unit of this tenant that `all[..len - 1]` starts with
//!    ([`Tiers::lookup`]), rebuilt by [`Tiers::restore`] (blocks still in the paged cache's
//!    prefix index are mapped without I/O, the rest read from SSD, the window from the DRAM
//!    pool); without a window snapshot the last `sliding_window` tokens of the prefix are
//!    replayed with the new tokens ([`Model::prefill_replay`] semantics: window KV only);
//! 3. otherwise a fresh sequence. The paged cache's prefix index is keyed by tokens alone, so
//!    it is reached only through a tier hit of the same tenant (no cross-tenant timing
//!    channel); without tiers there is no cross-session reuse.
//!
//! At least the last token of a request is always computed (the lookup stops one short),
//! which gives the first token's logits.
//!
//! **Scheduling** ([`Engine::step`]): each step runs at most one prefill step of the oldest
//! prefilling request (a chunk of [`EngineOptions::chunk`] tokens) together with one decode
//! token of every decoding request, as one batch through the layers
//! ([`Model::step_batch`]); CED encoder-only chunks run alone just before. A request whose
//! prefill ends samples its first token in that step; decoding requests sample one more each.
//!
//! **Persistence**: units are persisted ([`Tiers::persist`], write-behind) where
//! [`Tiers::unit_points`] says: every `unit_interval_tokens` of a long prefill, at the end of
//! each prompt and of each output (with a window snapshot in the DRAM pool at those ends).
//! Persist failures (a full store, a full queue) are counted and logged, never fatal: the
//! tiers are a cache.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvstack_kernels::model::{Sampling, sample};

use kvstack_cache::{CacheOptions, KvCache, SequenceId};
use kvstack_model::attention::{KvStore, PagedStage};
use kvstack_model::{BatchItem, Logits, Model, PrefillMode, PrefillStep};
use kvstack_spec::ModelConfig;
use kvstack_tiers::store::UnitTicket;
use kvstack_tiers::{Tenant, Tiers};

use crate::error::{Error, Result};
use crate::stats::{EngineStats, Reuse, ReuseKind, TtftSample};

/// Options of an [`Engine`].
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Prefill mode (spec §3).
    pub prefill: PrefillMode,
    /// Most tokens of one prefill step.
    pub chunk: usize,
    /// Most decoding requests in one batched step (the rest wait for the next).
    pub max_decode_batch: usize,
    /// The paged cache.
    pub cache: CacheOptions,
    /// Keep a session's sequence in the cache between turns (its next turn computes only its
    /// new tokens); `false` releases it once its units are persisted, and the next turn finds
    /// them through the tiers (agents waiting on tools hold no cache).
    pub keep_live: bool,
    /// Keep each request's first-token logits in its [`Completion`] (benchmarks compare
    /// them across kinds of reuse).
    pub keep_first_logits: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            prefill: PrefillMode::Ced,
            chunk: 256,
            max_decode_batch: 32,
            cache: CacheOptions::default(),
            keep_live: true,
            keep_first_logits: false,
        }
    }
}

/// A session: one conversation of one tenant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub u64);

/// A request: one turn of a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// What a request asks for.
#[derive(Clone, Debug)]
pub struct RequestSpec {
    /// New input tokens, appended to the session's history (at least one).
    pub tokens: Vec<u32>,
    /// Tokens to generate (at least one: the first token ends the prefill).
    pub max_new_tokens: usize,
    /// How tokens are sampled.
    pub sampling: Sampling,
    /// Seed of the sampler's random numbers.
    pub seed: u64,
}

/// A finished request.
#[derive(Clone, Debug)]
pub struct Completion {
    /// The request.
    pub request: RequestId,
    /// Its session.
    pub session: SessionId,
    /// The generated tokens.
    pub tokens: Vec<u32>,
    /// Tokens of the context (history plus new input).
    pub context_tokens: u64,
    /// Where the context came from.
    pub reuse: Reuse,
    /// Submission to first token.
    pub ttft: Duration,
    /// Of `ttft`, the time spent queued: before admission, and between its sequence being
    /// ready and its first prefill step (the rest is service: lookup, restore, prefill).
    pub ttft_queued: Duration,
    /// Submission to the last token.
    pub total: Duration,
    /// The logits the first token was sampled from, with
    /// [`EngineOptions::keep_first_logits`].
    pub first_logits: Option<Vec<f32>>,
}

/// What a step produced.
#[derive(Clone, Debug)]
pub enum Event {
    /// A request's first token (its prefill is done).
    FirstToken {
        /// The request.
        request: RequestId,
        /// The token.
        token: u32,
        /// Submission to now.
        ttft: Duration,
    },
    /// A further token.
    Token {
        /// The request.
        request: RequestId,
        /// The token.
        token: u32,
    },
    /// A request finished.
    Finished(Completion),
    /// A request failed; its session is usable again (its sequence was dropped).
    Failed {
        /// The request.
        request: RequestId,
        /// The error, with its chain.
        error: String,
    },
}

#[derive(Debug)]
struct Session {
    tenant: Tenant,
    /// Every token of the conversation, including the last sampled one.
    history: Vec<u32>,
    /// The live sequence (holding `history[..len]`), when kept.
    seq: Option<SequenceId>,
    busy: Option<RequestId>,
    /// Units of its last turns still being written: its next turn waits for them before the
    /// lookup, so a released session finds its own latest unit.
    pending_units: Vec<UnitTicket>,
}

#[derive(Debug, PartialEq, Eq)]
enum Phase {
    Queued,
    Prefill,
    Decode,
}

#[derive(Debug)]
struct Request {
    session: SessionId,
    spec: RequestSpec,
    phase: Phase,
    /// History plus new tokens.
    all: Vec<u32>,
    seq: Option<SequenceId>,
    stage: Option<PagedStage>,
    /// Tokens the prefill runs (a replay, then the uncached suffix) and its steps.
    prefill: Vec<u32>,
    plan: Vec<PrefillStep>,
    next_step: usize,
    generated: Vec<u32>,
    rng: u64,
    reuse: Reuse,
    submitted: Instant,
    /// Waiting before admission (arrival to the start of its lookup).
    queued_admission: Duration,
    /// When its sequence was ready (after admission), and when its first prefill step ran:
    /// the wait between them is queueing too.
    ready: Option<Instant>,
    first_step: Option<Instant>,
    first_token: Option<Duration>,
    /// Of the time to the first token, the time queued (see [`Completion::ttft_queued`]).
    first_token_queued: Duration,
    first_logits: Option<Vec<f32>>,
    /// Units are persisted up to here.
    persisted: u64,
}

impl Request {
    fn uniform(&mut self) -> f32 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// The serving engine. See the module docs.
#[derive(Debug)]
pub struct Engine {
    model: Model,
    cache: KvCache,
    /// Shared: the appliance's KV-cache API reads and writes units beside the engine (the
    /// tiers synchronize internally).
    tiers: Option<Arc<Tiers>>,
    opts: EngineOptions,
    sessions: HashMap<SessionId, Session>,
    /// In arrival order.
    requests: BTreeMap<RequestId, Request>,
    next_session: u64,
    next_request: u64,
    stats: EngineStats,
}

impl Engine {
    /// An engine serving `model` (built from `cfg`), with the tiers when given.
    ///
    /// # Errors
    /// Cache construction errors (geometry, memory).
    pub fn new(
        cfg: &ModelConfig,
        model: Model,
        tiers: Option<Tiers>,
        opts: EngineOptions,
    ) -> Result<Engine> {
        let cache = KvCache::new(cfg, model.attention().plan(), opts.cache)?;
        Ok(Engine {
            model,
            cache,
            tiers: tiers.map(Arc::new),
            opts,
            sessions: HashMap::new(),
            requests: BTreeMap::new(),
            next_session: 0,
            next_request: 0,
            stats: EngineStats::default(),
        })
    }

    /// The model.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The paged cache.
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// The tiers, if any.
    pub fn tiers(&self) -> Option<&Tiers> {
        self.tiers.as_deref()
    }

    /// The tiers, shared: for callers that read and write units beside the engine from other
    /// threads (the appliance's KV-cache API). Hold the handle only while using it:
    /// [`Engine::close`] and [`Engine::into_tiers`] need the engine's to be the last one.
    pub fn shared_tiers(&self) -> Option<Arc<Tiers>> {
        self.tiers.clone()
    }

    /// Counters so far.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Sets the threads of the routed experts.
    pub fn set_threads(&mut self, threads: usize) {
        self.model.set_threads(threads);
    }

    /// Opens a session of `tenant`.
    pub fn open_session(&mut self, tenant: &str) -> SessionId {
        let id = SessionId(self.next_session);
        self.next_session += 1;
        self.sessions.insert(
            id,
            Session {
                tenant: Tenant::new(tenant),
                history: Vec::new(),
                seq: None,
                busy: None,
                pending_units: Vec::new(),
            },
        );
        id
    }

    /// Closes a session, dropping its live sequence (its persisted units stay in the tiers).
    ///
    /// # Errors
    /// [`Error::Request`] when the session is unknown or has a request in flight.
    pub fn close_session(&mut self, session: SessionId) -> Result<()> {
        let s = self.session(session)?;
        if let Some(r) = s.busy {
            return Err(request_error(
                session,
                format!("request {} is still in flight", r.0),
            ));
        }
        if let Some(s) = self.sessions.remove(&session)
            && let Some(seq) = s.seq
        {
            self.cache.drop_sequence(seq)?;
        }
        Ok(())
    }

    /// The conversation of a session so far (inputs and outputs).
    ///
    /// # Errors
    /// [`Error::Request`] for an unknown session.
    pub fn history(&self, session: SessionId) -> Result<&[u32]> {
        Ok(&self.session(session)?.history)
    }

    fn session(&self, session: SessionId) -> Result<&Session> {
        self.sessions
            .get(&session)
            .ok_or_else(|| request_error(session, "no such session".into()))
    }

    /// Queues one turn of `session`.
    ///
    /// # Errors
    /// [`Error::Request`]: unknown or busy session, no input tokens, `max_new_tokens` 0, a
    /// token outside the vocabulary (named with its position).
    pub fn submit(&mut self, session: SessionId, spec: RequestSpec) -> Result<RequestId> {
        let vocab = self.model.dims().vocab;
        let s = self.session(session)?;
        if let Some(r) = s.busy {
            return Err(request_error(
                session,
                format!("request {} is still in flight", r.0),
            ));
        }
        if spec.tokens.is_empty() {
            return Err(request_error(
                session,
                "a request needs input tokens".into(),
            ));
        }
        if spec.max_new_tokens == 0 {
            return Err(request_error(
                session,
                "max_new_tokens must be at least 1".into(),
            ));
        }
        if let Some((i, t)) = spec
            .tokens
            .iter()
            .enumerate()
            .find(|(_, t)| **t as usize >= vocab)
        {
            return Err(request_error(
                session,
                format!("token {t} at input position {i} is outside the vocabulary of {vocab}"),
            ));
        }
        let mut all = s.history.clone();
        all.extend_from_slice(&spec.tokens);
        let limit = self.opts.cache.context_limit;
        if all.len() as u64 + spec.max_new_tokens as u64 > limit {
            return Err(request_error(
                session,
                format!(
                    "{} context tokens plus {} new exceed the context limit of {limit}",
                    all.len(),
                    spec.max_new_tokens
                ),
            ));
        }
        let id = RequestId(self.next_request);
        self.next_request += 1;
        let rng = spec.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        self.requests.insert(
            id,
            Request {
                session,
                spec,
                phase: Phase::Queued,
                all,
                seq: None,
                stage: None,
                prefill: Vec::new(),
                plan: Vec::new(),
                next_step: 0,
                generated: Vec::new(),
                rng,
                reuse: Reuse::default(),
                submitted: Instant::now(),
                queued_admission: Duration::ZERO,
                ready: None,
                first_step: None,
                first_token: None,
                first_token_queued: Duration::ZERO,
                first_logits: None,
                persisted: 0,
            },
        );
        if let Some(s) = self.sessions.get_mut(&session) {
            s.busy = Some(id);
        }
        Ok(id)
    }

    /// Cancels a queued or running request (a client went away): its sequence and pages are
    /// freed, its session is usable again with its history as before the request, and no
    /// further event names it. Units it already persisted stay (they are valid prefixes).
    /// Returns whether the request was still there.
    pub fn cancel(&mut self, request: RequestId) -> bool {
        let Some(mut r) = self.requests.remove(&request) else {
            return false;
        };
        if let Some(stage) = r.stage.as_mut() {
            stage.discard();
        }
        if let Some(seq) = r.seq {
            let _ = self.cache.drop_sequence(seq);
        }
        if let Some(s) = self.sessions.get_mut(&r.session) {
            // A started request took the session's live sequence (dropped above); a queued
            // one leaves it to the session.
            s.busy = None;
        }
        self.stats.cancelled += 1;
        true
    }

    /// Ends a decoding request now, as if it had reached its `max_new_tokens` (a client's stop
    /// sequence matched): its units are persisted and its session keeps the history so far,
    /// exactly as for a request that ran to its end. Returns its completion (no
    /// [`Event::Finished`] follows); `None` when the request is not decoding (queued, in
    /// prefill, or gone).
    pub fn stop(&mut self, request: RequestId) -> Option<Completion> {
        if self.requests.get(&request)?.phase != Phase::Decode {
            return None;
        }
        let mut events = Vec::new();
        self.finish(request, &mut events);
        match events.pop() {
            Some(Event::Finished(c)) => Some(c),
            _ => None,
        }
    }

    /// Whether no request is queued or running.
    pub fn is_idle(&self) -> bool {
        self.requests.is_empty()
    }

    /// Runs steps until every request finished, handing each event to `on_event`.
    ///
    /// # Errors
    /// As [`Engine::step`].
    pub fn run_until_idle(&mut self, mut on_event: impl FnMut(&Event)) -> Result<()> {
        while !self.is_idle() {
            for e in self.step()? {
                on_event(&e);
            }
        }
        Ok(())
    }

    /// One scheduling step (module docs). A request that fails (a cache or model error) is
    /// reported as [`Event::Failed`] and its sequence dropped; the engine goes on.
    ///
    /// # Errors
    /// Only errors that leave the engine unusable (none today; reserved).
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        self.admit(&mut events);
        // The prefill step of the oldest prefilling request.
        let prefill = self
            .requests
            .iter_mut()
            .find(|(_, r)| r.phase == Phase::Prefill)
            .map(|(&id, r)| {
                r.first_step.get_or_insert_with(Instant::now);
                id
            });
        let mut joined = None;
        if let Some(id) = prefill {
            let encoder_only = self
                .requests
                .get(&id)
                .and_then(|r| r.plan.get(r.next_step))
                .is_some_and(|s| s.encoder_only);
            if encoder_only {
                let t = Instant::now();
                let r = self.encoder_step(id);
                let n = self.requests.get(&id).map_or(0, |r| {
                    r.plan
                        .get(r.next_step.saturating_sub(1))
                        .map_or(0, |s| s.tokens.len())
                });
                self.stats.prefill_time += t.elapsed();
                self.stats.prefill_steps += 1;
                if let Err(e) = r {
                    self.fail(id, &e, &mut events);
                } else {
                    self.stats.prefill_rows += n as u64;
                    self.persist_progress(id, false);
                }
            } else {
                joined = Some(id);
            }
        }
        let decoders: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, r)| r.phase == Phase::Decode)
            .map(|(&id, _)| id)
            .take(self.opts.max_decode_batch.max(1))
            .collect();
        if joined.is_some() || !decoders.is_empty() {
            self.batch_step(joined, &decoders, &mut events);
        }
        Ok(events)
    }

    /// Admits queued requests while the cache has room.
    fn admit(&mut self, events: &mut Vec<Event>) {
        let queued: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, r)| r.phase == Phase::Queued)
            .map(|(&id, _)| id)
            .collect();
        for id in queued {
            match self.start(id) {
                Ok(()) => {}
                Err(Error::Cache(
                    kvstack_cache::Error::TooManySequences { .. }
                    | kvstack_cache::Error::PoolExhausted { .. },
                )) if self.requests.values().any(|r| r.phase != Phase::Queued) => {
                    // Wait until a running request frees its sequence.
                    break;
                }
                Err(e) => self.fail(id, &e, events),
            }
        }
    }

    /// Sets up a request's sequence (module docs, admission) and its prefill plan.
    fn start(&mut self, id: RequestId) -> Result<()> {
        let Some(r) = self.requests.get_mut(&id) else {
            return Ok(());
        };
        // A request that waits for room is started again later: its waiting is the time up
        // to the attempt that succeeds.
        r.queued_admission = r.submitted.elapsed();
        let session = r.session;
        let all = r.all.clone();
        let s = self.session(session)?;
        let tenant = s.tenant.clone();
        let live = s.seq;
        let mut reuse = Reuse::default();
        let (seq, replay) = if let Some(seq) = live {
            let len = self.cache.len(seq)?;
            reuse.kind = ReuseKind::Live;
            reuse.live_tokens = len;
            (seq, None)
        } else if let Some(tiers) = &self.tiers {
            let t = Instant::now();
            let waits = self
                .sessions
                .get_mut(&session)
                .map(|s| std::mem::take(&mut s.pending_units))
                .unwrap_or_default();
            for w in waits {
                if let Err(e) = w.wait() {
                    // The unit is lost; the lookup finds an earlier one.
                    log::warn!("a unit of session {} failed: {e}", session.0);
                    self.stats.persist_failures += 1;
                }
            }
            let cut = &all[..all.len() - 1];
            let hit = tiers.lookup(cut, &tenant);
            let restored = tiers.restore(&mut self.cache, cut, &hit)?;
            reuse.restore_time = t.elapsed();
            reuse.mapped_tokens = restored.mapped_tokens;
            reuse.ssd_tokens = restored.read_tokens;
            reuse.ssd_bytes = restored.read_bytes;
            reuse.window_from_pool = restored.window;
            reuse.window_from_remote = restored.window_remote;
            reuse.kind = if restored.tokens == 0 {
                ReuseKind::None
            } else if restored.window {
                ReuseKind::TiersWithWindow
            } else {
                ReuseKind::TiersReplay
            };
            if restored.damaged {
                self.stats.damaged_restores += 1;
            }
            (restored.seq, restored.replay)
        } else {
            (self.cache.create_sequence()?, None)
        };
        let len = self.cache.len(seq)?;
        let mut stage = match PagedStage::new(&self.cache, seq) {
            Ok(s) => s,
            Err(e) => {
                let _ = self.cache.drop_sequence(seq);
                return Err(e.into());
            }
        };
        let (prefill, replayed) = match replay {
            Some(p) if p.end == len && p.start < p.end => {
                let from = p.start;
                if let Err(e) = stage.view(&self.cache).begin_replay(from) {
                    let _ = self.cache.drop_sequence(seq);
                    return Err(e.into());
                }
                reuse.replayed_tokens = len - from;
                (all[from as usize..].to_vec(), (len - from) as usize)
            }
            _ => (all[len as usize..].to_vec(), 0),
        };
        let start = len - replayed as u64;
        let plan = self.model.prefill_plan(
            start,
            prefill.len(),
            replayed,
            self.opts.prefill,
            self.opts.chunk,
        );
        reuse.computed_tokens = (prefill.len() - replayed) as u64;
        self.stats.add_reuse(&reuse, all.len() as u64);
        if let Some(s) = self.sessions.get_mut(&session) {
            // The sequence now belongs to the request until it finishes.
            s.seq = None;
        }
        if let Some(r) = self.requests.get_mut(&id) {
            r.seq = Some(seq);
            r.stage = Some(stage);
            r.prefill = prefill;
            r.plan = plan;
            r.next_step = 0;
            r.phase = Phase::Prefill;
            r.persisted = len;
            r.reuse = reuse;
            r.ready = Some(Instant::now());
        }
        Ok(())
    }

    /// Runs the next (encoder-only) prefill step of `id` alone.
    fn encoder_step(&mut self, id: RequestId) -> Result<()> {
        let Engine {
            model,
            cache,
            requests,
            ..
        } = self;
        let r = requests.get_mut(&id).ok_or_else(|| {
            request_error(SessionId(u64::MAX), format!("request {} vanished", id.0))
        })?;
        let st = r
            .plan
            .get(r.next_step)
            .cloned()
            .ok_or_else(|| request_error(r.session, "prefill plan overrun".into()))?;
        let stage = r
            .stage
            .as_mut()
            .ok_or_else(|| request_error(r.session, "request has no sequence".into()))?;
        let tokens = &r.prefill[st.tokens.clone()];
        let res = {
            let mut view = stage.view(cache);
            model.step_encoder(&mut view, tokens, st.decoder_window_start)
        };
        match res {
            Ok(()) => stage.apply(cache)?,
            Err(e) => {
                stage.discard();
                return Err(e.into());
            }
        }
        r.next_step += 1;
        Ok(())
    }

    /// One batched step: the joined prefill step (if any) and a decode token of each decoder.
    fn batch_step(
        &mut self,
        joined: Option<RequestId>,
        decoders: &[RequestId],
        events: &mut Vec<Event>,
    ) {
        let t = Instant::now();
        let mut members: Vec<RequestId> = Vec::with_capacity(decoders.len() + 1);
        members.extend(joined);
        members.extend_from_slice(decoders);
        let result = {
            let Engine {
                model,
                cache,
                requests,
                ..
            } = &mut *self;
            // Each member's tokens and which logits it wants.
            let mut plan: Vec<(Vec<u32>, Logits, u64)> = Vec::with_capacity(members.len());
            for id in &members {
                let Some(r) = requests.get(id) else { continue };
                if r.phase == Phase::Prefill {
                    let Some(st) = r.plan.get(r.next_step) else {
                        continue;
                    };
                    let last = r.next_step + 1 == r.plan.len();
                    plan.push((
                        r.prefill[st.tokens.clone()].to_vec(),
                        if last { Logits::Last } else { Logits::None },
                        st.decoder_window_start,
                    ));
                } else {
                    let tok = r.generated.last().copied().unwrap_or(0);
                    plan.push((vec![tok], Logits::Last, 0));
                }
            }
            let shared: &KvCache = cache;
            let mut stages: Vec<&mut PagedStage> = Vec::with_capacity(members.len());
            for (id, r) in requests.iter_mut() {
                if members.contains(id)
                    && let Some(s) = r.stage.as_mut()
                {
                    stages.push(s);
                }
            }
            // `requests` iterates in id order; `members` may not be: order the plan alike.
            let mut order: Vec<usize> = (0..members.len()).collect();
            order.sort_by_key(|&i| members[i]);
            let mut views: Vec<_> = stages.into_iter().map(|s| s.view(shared)).collect();
            if views.len() != plan.len() {
                Err(request_error(
                    SessionId(u64::MAX),
                    "batch members without a sequence".into(),
                ))
            } else {
                let mut items: Vec<BatchItem<'_>> = views
                    .iter_mut()
                    .zip(&order)
                    .map(|(v, &i)| BatchItem {
                        store: v,
                        tokens: &plan[i].0,
                        logits: plan[i].1,
                        decoder_window_start: plan[i].2,
                    })
                    .collect();
                model
                    .step_batch(&mut items)
                    .map(|outs| {
                        // Back to `members` order.
                        let mut by_member = vec![Vec::new(); outs.len()];
                        for (o, &i) in outs.into_iter().zip(&order) {
                            by_member[i] = o;
                        }
                        by_member
                    })
                    .map_err(Error::from)
            }
        };
        let elapsed = t.elapsed();
        let outs = match result {
            Ok(o) => o,
            Err(e) => {
                for id in &members {
                    if let Some(s) = self.requests.get_mut(id).and_then(|r| r.stage.as_mut()) {
                        s.discard();
                    }
                    self.fail(*id, &e, events);
                }
                return;
            }
        };
        // Apply every stage, then sample.
        let mut rows_prefill = 0u64;
        for id in &members {
            let applied = match self.requests.get_mut(id) {
                Some(r) => {
                    if r.phase == Phase::Prefill {
                        rows_prefill +=
                            r.plan.get(r.next_step).map_or(0, |s| s.tokens.len() as u64);
                    }
                    match r.stage.as_mut() {
                        Some(s) => s.apply(&mut self.cache),
                        None => Ok(()),
                    }
                }
                None => Ok(()),
            };
            if let Err(e) = applied {
                self.fail(*id, &e, events);
            }
        }
        let rows_decode = decoders.len() as u64;
        let rows = (rows_prefill + rows_decode).max(1) as f64;
        // A mixed step's time is split between prefill and decode by rows.
        let pre = elapsed.mul_f64(rows_prefill as f64 / rows);
        self.stats.prefill_time += pre;
        self.stats.decode_time += elapsed.saturating_sub(pre);
        self.stats.prefill_rows += rows_prefill;
        self.stats.decode_tokens += rows_decode;
        if rows_prefill > 0 {
            self.stats.prefill_steps += 1;
        }
        if rows_decode > 0 {
            self.stats.decode_steps += 1;
            self.stats.decode_batch_rows += rows_decode;
        }
        for (id, logits) in members.iter().zip(outs) {
            let Some(r) = self.requests.get_mut(id) else {
                continue;
            };
            match r.phase {
                Phase::Prefill => {
                    r.next_step += 1;
                    if r.next_step < r.plan.len() {
                        self.persist_progress(*id, false);
                        continue;
                    }
                    let u = r.uniform();
                    let token = sample(&logits, r.spec.sampling, u).unwrap_or(0) as u32;
                    let ttft = r.submitted.elapsed();
                    r.first_token = Some(ttft);
                    r.generated.push(token);
                    if self.opts.keep_first_logits {
                        r.first_logits = Some(logits);
                    }
                    r.phase = Phase::Decode;
                    let waited = match (r.ready, r.first_step) {
                        (Some(a), Some(b)) => b.saturating_duration_since(a),
                        _ => Duration::ZERO,
                    };
                    let queued = (r.queued_admission + waited).min(ttft);
                    r.first_token_queued = queued;
                    self.stats.record_ttft(TtftSample {
                        kind: r.reuse.kind,
                        total: ttft,
                        queued,
                    });
                    events.push(Event::FirstToken {
                        request: *id,
                        token,
                        ttft,
                    });
                    self.persist_progress(*id, true);
                }
                Phase::Decode => {
                    let u = r.uniform();
                    let token = sample(&logits, r.spec.sampling, u).unwrap_or(0) as u32;
                    r.generated.push(token);
                    events.push(Event::Token {
                        request: *id,
                        token,
                    });
                }
                Phase::Queued => {}
            }
            if self.requests.get(id).is_some_and(|r| {
                r.phase == Phase::Decode && r.generated.len() >= r.spec.max_new_tokens
            }) {
                self.finish(*id, events);
            }
        }
    }

    /// Persists the units a request's sequence has reached (`end_of_turn`: including its end).
    fn persist_progress(&mut self, id: RequestId, end_of_turn: bool) {
        let Some(tiers) = &self.tiers else { return };
        let Some(r) = self.requests.get_mut(&id) else {
            return;
        };
        let Some(seq) = r.seq else { return };
        let Ok(len) = self.cache.len(seq) else { return };
        let Some(s) = self.sessions.get_mut(&r.session) else {
            return;
        };
        for p in tiers.unit_points(r.persisted, len, end_of_turn) {
            match tiers.persist(&self.cache, seq, &s.tenant, p) {
                Ok(ticket) => {
                    self.stats.units_persisted += 1;
                    r.persisted = p;
                    s.pending_units.push(ticket);
                }
                Err(e) => {
                    self.stats.persist_failures += 1;
                    log::warn!("persisting {p} tokens of session {}: {e}", r.session.0);
                }
            }
        }
    }

    fn finish(&mut self, id: RequestId, events: &mut Vec<Event>) {
        self.persist_progress(id, true);
        let Some(r) = self.requests.remove(&id) else {
            return;
        };
        let total = r.submitted.elapsed();
        let keep = self.opts.keep_live;
        if let Some(u) = r.seq.and_then(|q| self.cache.sequence_usage(q).ok()) {
            self.stats.finished_tokens += u.tokens;
            self.stats.finished_entry_bytes += u.global_entry_bytes + u.index_entry_bytes;
        }
        if let Some(s) = self.sessions.get_mut(&r.session) {
            s.history.clone_from(&r.all);
            s.history.extend_from_slice(&r.generated);
            s.busy = None;
            s.seq = if keep { r.seq } else { None };
            if keep {
                // A live session never looks its units up; dropping a ticket does not cancel
                // the write.
                s.pending_units.clear();
            }
        }
        if !keep && let Some(seq) = r.seq {
            // Its blocks stay in the prefix index (cached, evictable) for the tiers to map.
            let _ = self.cache.drop_sequence(seq);
        }
        self.stats.requests += 1;
        events.push(Event::Finished(Completion {
            request: id,
            session: r.session,
            tokens: r.generated,
            context_tokens: r.all.len() as u64,
            reuse: r.reuse,
            ttft: r.first_token.unwrap_or(total),
            ttft_queued: r.first_token_queued,
            total,
            first_logits: r.first_logits,
        }));
    }

    fn fail(
        &mut self,
        id: RequestId,
        e: &(dyn std::error::Error + 'static),
        events: &mut Vec<Event>,
    ) {
        let Some(r) = self.requests.remove(&id) else {
            return;
        };
        if let Some(seq) = r.seq {
            let _ = self.cache.drop_sequence(seq);
        }
        if let Some(s) = self.sessions.get_mut(&r.session) {
            s.busy = None;
            s.seq = None;
        }
        self.stats.failed += 1;
        let mut msg = e.to_string();
        let mut src = e.source();
        while let Some(s) = src {
            msg.push_str(": ");
            msg.push_str(&s.to_string());
            src = s.source();
        }
        log::warn!("request {} failed: {msg}", id.0);
        events.push(Event::Failed {
            request: id,
            error: msg,
        });
    }

    /// Waits until every persisted unit is durable.
    ///
    /// # Errors
    /// The store's flush errors.
    pub fn flush(&self) -> Result<()> {
        if let Some(t) = &self.tiers {
            t.flush()?;
        }
        Ok(())
    }

    /// Hands the tiers back (flushed), dropping the engine's cache: a new engine over the same
    /// tiers starts with an empty paged cache (benchmarks use it to force SSD reads).
    ///
    /// # Errors
    /// The store's flush errors.
    pub fn into_tiers(self) -> Result<Option<Tiers>> {
        self.flush()?;
        self.tiers.map(unshare).transpose()
    }

    /// Flushes and closes the tiers.
    ///
    /// # Errors
    /// The store's close errors.
    pub fn close(self) -> Result<()> {
        if let Some(t) = self.tiers {
            unshare(t)?.close()?;
        }
        Ok(())
    }
}

/// The tiers out of their `Arc`, once no [`Engine::shared_tiers`] handle is left. A handle
/// still held elsewhere is an error, not a wait: the tiers would be closed under its user.
fn unshare(t: Arc<Tiers>) -> Result<Tiers> {
    let others = Arc::strong_count(&t) - 1;
    Arc::try_unwrap(t).map_err(|_| Error::TiersShared { others })
}

fn request_error(session: SessionId, reason: String) -> Error {
    Error::Request {
        session: session.0,
        reason,
    }
}
