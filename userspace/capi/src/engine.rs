//! `kvstack_engine` and `kvstack_session`: the serving engine (`kvstack_engine::Service`:
//! a model, its paged cache, optionally the tiers in a data directory) and its sessions.
//!
//! The engine batches every session's requests into one step loop. Whichever session calls
//! `kvstack_session_step` runs the next step for all of them; the tokens a step produces are
//! kept per session until that session polls them. All state sits behind one lock, so the
//! engine and its sessions may be used from any threads.

use std::collections::{HashMap, VecDeque};
use std::ffi::c_char;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use ::kvstack_engine::{
    EngineOptions, Event, ModelSource, RequestId, RequestSpec, Service, ServiceOptions, SessionId,
};
use kvstack_cache::CacheOptions;
use kvstack_kernels::model::Sampling;
use kvstack_model::PrefillMode;
use kvstack_tiers::{StoreLocation, StoreOptions, TierOptions};

use crate::KVSTACK_MAX_TOKENS;
use crate::error::{Error, Result, kvstack_result};
use crate::ffi::{self, Out, SizedStruct, boundary};
use crate::store::memory_policy;

/// Prefill mode: encoder over every prompt token, decoder over the last 128 (the default).
pub const KVSTACK_PREFILL_CED: u32 = 0;
/// Prefill mode: every layer over every token.
pub const KVSTACK_PREFILL_EXACT: u32 = 1;
/// Sampling: the most likely token (the lowest id on ties).
pub const KVSTACK_SAMPLING_GREEDY: u32 = 0;
/// Sampling: nucleus sampling with `temperature` and `top_p`.
pub const KVSTACK_SAMPLING_TOP_P: u32 = 1;

/// Default seed of the built-in model's weights (that of `kvstack run`).
const DEFAULT_SEED: u64 = 4101;
/// Most threads, decode batch, chunk or sequences an option may ask for.
const MAX_COUNT: u32 = 1 << 16;

/// An engine. Created by `kvstack_engine_new`, freed by `kvstack_engine_free`.
pub struct kvstack_engine {
    shared: Arc<Shared>,
}

/// A session of one tenant on an engine. Created by `kvstack_session_new`, freed by
/// `kvstack_session_free`.
pub struct kvstack_session {
    shared: Arc<Shared>,
    id: SessionId,
}

/// What an engine and its sessions share.
struct Shared {
    state: Mutex<State>,
}

struct State {
    /// `None` once the engine is freed.
    service: Option<Service>,
    sessions: HashMap<SessionId, Slot>,
    /// The session of each request in flight.
    owners: HashMap<RequestId, SessionId>,
}

/// A session's view of its request.
#[derive(Default)]
struct Slot {
    /// The request in flight.
    request: Option<RequestId>,
    /// Tokens produced and not yet polled.
    tokens: VecDeque<u32>,
    /// The failure of its last request, until polled.
    failed: Option<String>,
}

impl Shared {
    /// The state under the lock; a panic that held it left it untrusted.
    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.state
            .lock()
            .map_err(|_| Error::Poisoned { what: "engine" })
    }
}

impl State {
    fn service(&mut self) -> Result<&mut Service> {
        self.service
            .as_mut()
            .ok_or(Error::Closed { what: "engine" })
    }

    fn slot(&mut self, id: SessionId) -> Result<&mut Slot> {
        self.sessions
            .get_mut(&id)
            .ok_or(Error::Closed { what: "session" })
    }

    /// Runs one engine step (when any request is queued or running) and files its events
    /// under their sessions.
    fn step(&mut self) -> Result<()> {
        let service = self.service()?;
        if service.is_idle() {
            return Ok(());
        }
        let events = service.step()?;
        for e in events {
            match e {
                Event::FirstToken { request, token, .. } | Event::Token { request, token } => {
                    if let Some(slot) = self.owned(request) {
                        slot.tokens.push_back(token);
                    }
                }
                Event::Finished(c) => {
                    if let Some(slot) = self.owned(c.request) {
                        slot.request = None;
                    }
                    self.owners.remove(&c.request);
                }
                Event::Failed { request, error } => {
                    if let Some(slot) = self.owned(request) {
                        slot.request = None;
                        slot.tokens.clear();
                        slot.failed = Some(error);
                    }
                    self.owners.remove(&request);
                }
            }
        }
        Ok(())
    }

    fn owned(&mut self, request: RequestId) -> Option<&mut Slot> {
        let s = self.owners.get(&request)?;
        self.sessions.get_mut(s)
    }

    /// Cancels the session's request in flight; whether there was one.
    fn cancel(&mut self, id: SessionId) -> Result<bool> {
        let Some(request) = self.slot(id)?.request else {
            return Ok(false);
        };
        self.service()?.cancel(request);
        self.owners.remove(&request);
        let slot = self.slot(id)?;
        slot.request = None;
        slot.tokens.clear();
        Ok(true)
    }
}

/// How to create an engine. Set `size` to `sizeof(kvstack_engine_options)`, fill it with
/// `kvstack_engine_options_default`, then change fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvstack_engine_options {
    /// `sizeof(kvstack_engine_options)`, set by the caller.
    pub size: usize,
    /// With a `config_path`: the checkpoint's weights (safetensors). NULL with the built-in
    /// model.
    pub weights_path: *const c_char,
    /// Data directory of the engine's tiers (SSD store and DRAM window pool: prefixes reused
    /// across sessions and restarts); NULL serves without them.
    pub data_dir: *const c_char,
    /// Seed of the built-in model's weights (default 4101, as `kvstack run`).
    pub seed: u64,
    /// The longest a session's context may grow, in tokens (default 1,048,576).
    pub context_limit: u64,
    /// With `data_dir`: most bytes of segment files (default 64 GiB).
    pub store_capacity_bytes: u64,
    /// With `data_dir`: bytes per segment file, a multiple of 4096 (default 64 MiB).
    pub store_segment_bytes: u64,
    /// With `data_dir`: bytes of the DRAM window pool; 0 for 10% of the machine's memory.
    pub pool_capacity_bytes: u64,
    /// Threads of the forward pass (default 1).
    pub threads: u32,
    /// Most tokens of one prefill step (default 256).
    pub chunk: u32,
    /// Most decoding requests in one batched step (default 32).
    pub max_decode_batch: u32,
    /// Live sequences at most, i.e. requests running at once (default 8).
    pub max_sequences: u32,
    /// `KVSTACK_PREFILL_CED` (default) or `KVSTACK_PREFILL_EXACT`.
    pub prefill: u32,
    /// Non-zero: keep a session's KV in the paged cache between its turns (default 1); zero
    /// releases it and the next turn finds it through the tiers.
    pub keep_live: u8,
    /// Non-zero: try to lock the cache and the tiers' memory (default 1).
    pub lock_memory: u8,
    /// Non-zero: use huge pages when the system has them (default 1).
    pub huge_pages: u8,
}

// SAFETY: `#[repr(C)]`, `size: usize` first; the other fields are integers and raw pointers,
// valid for any bits.
unsafe impl SizedStruct for kvstack_engine_options {
    const NAME: &'static str = "kvstack_engine_options";
    const MIN_SIZE: usize = size_of::<kvstack_engine_options>();
}

impl Default for kvstack_engine_options {
    fn default() -> Self {
        let e = EngineOptions::default();
        let s = StoreOptions::new(StoreLocation::Directory(PathBuf::new()));
        kvstack_engine_options {
            size: size_of::<kvstack_engine_options>(),
            weights_path: std::ptr::null(),
            data_dir: std::ptr::null(),
            seed: DEFAULT_SEED,
            context_limit: e.cache.context_limit,
            store_capacity_bytes: s.capacity_bytes,
            store_segment_bytes: s.segment_bytes,
            pool_capacity_bytes: 0,
            threads: 1,
            chunk: clamp_u32(e.chunk),
            max_decode_batch: clamp_u32(e.max_decode_batch),
            max_sequences: clamp_u32(e.cache.max_sequences),
            prefill: KVSTACK_PREFILL_CED,
            keep_live: u8::from(e.keep_live),
            lock_memory: 1,
            huge_pages: 1,
        }
    }
}

fn clamp_u32(v: usize) -> u32 {
    u32::try_from(v).unwrap_or(u32::MAX)
}

/// A count option in `1..=MAX_COUNT`.
fn count(v: u32, field: &'static str) -> Result<usize> {
    if v == 0 || v > MAX_COUNT {
        return Err(Error::option(
            field,
            format!("{v} is not in 1..={MAX_COUNT}"),
        ));
    }
    Ok(v as usize)
}

/// How to run one request. Set `size` to `sizeof(kvstack_request_params)`, fill it with
/// `kvstack_request_params_default`, then change fields.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvstack_request_params {
    /// `sizeof(kvstack_request_params)`, set by the caller.
    pub size: usize,
    /// Seed of the sampler (default 0).
    pub seed: u64,
    /// Tokens to generate, at least 1 (default 16).
    pub max_new_tokens: u32,
    /// `KVSTACK_SAMPLING_GREEDY` (default) or `KVSTACK_SAMPLING_TOP_P`.
    pub sampling: u32,
    /// With `KVSTACK_SAMPLING_TOP_P`: temperature, > 0 (default 1).
    pub temperature: f32,
    /// With `KVSTACK_SAMPLING_TOP_P`: nucleus mass in (0, 1] (default 1).
    pub top_p: f32,
}

// SAFETY: `#[repr(C)]`, `size: usize` first; the other fields are integers and floats.
unsafe impl SizedStruct for kvstack_request_params {
    const NAME: &'static str = "kvstack_request_params";
    const MIN_SIZE: usize = size_of::<kvstack_request_params>();
}

impl Default for kvstack_request_params {
    fn default() -> Self {
        kvstack_request_params {
            size: size_of::<kvstack_request_params>(),
            seed: 0,
            max_new_tokens: 16,
            sampling: KVSTACK_SAMPLING_GREEDY,
            temperature: 1.0,
            top_p: 1.0,
        }
    }
}

impl kvstack_request_params {
    fn sampling(&self) -> Result<Sampling> {
        match self.sampling {
            KVSTACK_SAMPLING_GREEDY => Ok(Sampling::Greedy),
            KVSTACK_SAMPLING_TOP_P => {
                if !(self.temperature.is_finite() && self.temperature > 0.0) {
                    return Err(Error::option(
                        "kvstack_request_params.temperature",
                        format!("{} is not a positive number", self.temperature),
                    ));
                }
                if !(self.top_p > 0.0 && self.top_p <= 1.0) {
                    return Err(Error::option(
                        "kvstack_request_params.top_p",
                        format!("{} is not in (0, 1]", self.top_p),
                    ));
                }
                Ok(Sampling::TopP {
                    temperature: self.temperature,
                    top_p: self.top_p,
                })
            }
            other => Err(Error::option(
                "kvstack_request_params.sampling",
                format!("{other} is not a KVSTACK_SAMPLING_ value"),
            )),
        }
    }
}

/// Fills `*options` with the defaults (the fields its `size` covers).
///
/// Thread safety: callable from any thread.
///
/// # Safety
/// `options` points to a writable `kvstack_engine_options` whose `size` the caller set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_engine_options_default(
    options: *mut kvstack_engine_options,
) -> kvstack_result {
    boundary::call("kvstack_engine_options_default", || {
        // SAFETY: the caller's contract above is `OutSized::new`'s.
        let out = unsafe { ffi::OutSized::new(options) }?;
        out.write(&kvstack_engine_options::default());
        Ok(())
    })
}

/// Fills `*params` with the defaults (the fields its `size` covers).
///
/// Thread safety: callable from any thread.
///
/// # Safety
/// `params` points to a writable `kvstack_request_params` whose `size` the caller set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_request_params_default(
    params: *mut kvstack_request_params,
) -> kvstack_result {
    boundary::call("kvstack_request_params_default", || {
        // SAFETY: the caller's contract above is `OutSized::new`'s.
        let out = unsafe { ffi::OutSized::new(params) }?;
        out.write(&kvstack_request_params::default());
        Ok(())
    })
}

/// Creates an engine and writes its handle to `*out` (NULL on failure): the model of
/// `config_path` (a Hugging Face `config.json`) with the weights of
/// `options->weights_path`, or with `config_path = NULL` the built-in tiny V4.1 model (the
/// real V4.1-Flash cache geometry) with weights generated from `options->seed`; the paged
/// cache; and, with `options->data_dir`, the tiers in that directory (recovered here; a
/// directory in use gives `KVSTACK_STORE_IN_USE`). `options` may be NULL for the defaults.
///
/// Thread safety: callable from any thread. The handle may be shared by any number of
/// threads: calls on it and on its sessions serialize on one lock.
///
/// # Safety
/// `config_path` is NULL or a NUL-terminated string; `options` is NULL or a readable
/// `kvstack_engine_options` with its `size` set, whose pointers follow its field docs;
/// `out` points to a writable `kvstack_engine *`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_engine_new(
    config_path: *const c_char,
    options: *const kvstack_engine_options,
    out: *mut *mut kvstack_engine,
) -> kvstack_result {
    boundary::call("kvstack_engine_new", || {
        // SAFETY: the caller's contract for `out`.
        let out = unsafe { Out::new(out, "out") }?;
        out.write(std::ptr::null_mut());
        // SAFETY: the caller's contract for `config_path`.
        let config = unsafe { ffi::opt_c_str(config_path, "config_path") }?;
        // SAFETY: the caller's contract for `options`.
        let o = unsafe { ffi::read_sized(options, kvstack_engine_options::default()) }?;
        // SAFETY: the caller's contract for the options' pointer fields.
        let (weights, data_dir) = unsafe {
            (
                ffi::opt_c_str(o.weights_path, "options.weights_path")?,
                ffi::opt_c_str(o.data_dir, "options.data_dir")?,
            )
        };
        let service = Service::open(service_options(config, weights, data_dir, &o)?)?;
        let handle = Box::new(kvstack_engine {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    service: Some(service),
                    sessions: HashMap::new(),
                    owners: HashMap::new(),
                }),
            }),
        });
        out.write(Box::into_raw(handle));
        Ok(())
    })
}

/// The service options of the C options.
fn service_options(
    config: Option<&str>,
    weights: Option<&str>,
    data_dir: Option<&str>,
    o: &kvstack_engine_options,
) -> Result<ServiceOptions> {
    let model = match (config, weights) {
        (None, None) => ModelSource::BuiltinTiny { seed: o.seed },
        (Some(c), Some(w)) => ModelSource::Checkpoint {
            config: c.into(),
            weights: w.into(),
        },
        (Some(_), None) => {
            return Err(Error::option(
                "kvstack_engine_options.weights_path",
                "a config_path needs its weights",
            ));
        }
        (None, Some(_)) => {
            return Err(Error::option(
                "kvstack_engine_options.weights_path",
                "weights need their config_path (NULL is the built-in model)",
            ));
        }
    };
    let prefill = match o.prefill {
        KVSTACK_PREFILL_CED => PrefillMode::Ced,
        KVSTACK_PREFILL_EXACT => PrefillMode::Exact,
        other => {
            return Err(Error::option(
                "kvstack_engine_options.prefill",
                format!("{other} is not a KVSTACK_PREFILL_ value"),
            ));
        }
    };
    if o.context_limit == 0 || o.context_limit > KVSTACK_MAX_TOKENS as u64 {
        return Err(Error::option(
            "kvstack_engine_options.context_limit",
            format!("{} is not in 1..={KVSTACK_MAX_TOKENS}", o.context_limit),
        ));
    }
    let memory = memory_policy(o.lock_memory, o.huge_pages);
    let mut opts = ServiceOptions::new(model);
    opts.threads = count(o.threads, "kvstack_engine_options.threads")?;
    opts.engine = EngineOptions {
        prefill,
        chunk: count(o.chunk, "kvstack_engine_options.chunk")?,
        max_decode_batch: count(
            o.max_decode_batch,
            "kvstack_engine_options.max_decode_batch",
        )?,
        keep_live: o.keep_live != 0,
        cache: CacheOptions {
            context_limit: o.context_limit,
            max_sequences: count(o.max_sequences, "kvstack_engine_options.max_sequences")?,
            memory,
            ..CacheOptions::default()
        },
        ..EngineOptions::default()
    };
    if let Some(dir) = data_dir {
        if dir.is_empty() {
            return Err(Error::option(
                "kvstack_engine_options.data_dir",
                "must not be empty (NULL serves without tiers)",
            ));
        }
        let mut store = StoreOptions::new(StoreLocation::Directory(PathBuf::from(dir)));
        store.capacity_bytes = o.store_capacity_bytes;
        store.segment_bytes = o.store_segment_bytes;
        store.memory = memory;
        let mut tiers = TierOptions::new(store);
        tiers.pool.capacity_bytes = (o.pool_capacity_bytes > 0).then_some(o.pool_capacity_bytes);
        tiers.pool.memory = memory;
        opts.tiers = Some(tiers);
    }
    Ok(opts)
}

/// Frees the engine: its tiers are flushed and closed, its model and cache dropped. Sessions
/// not yet freed stay valid handles whose calls give `KVSTACK_CLOSED`; free them too. NULL
/// is a no-op.
///
/// Thread safety: no other call on this engine handle may run or follow; its sessions may
/// still be used (and must be freed) from any thread.
///
/// # Safety
/// `engine` is NULL or a handle from `kvstack_engine_new` not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_engine_free(engine: *mut kvstack_engine) {
    boundary::value("kvstack_engine_free", (), || {
        if engine.is_null() {
            return;
        }
        // SAFETY: the caller's contract: the pointer came from `Box::into_raw` in
        // `kvstack_engine_new` and is freed once.
        let engine = unsafe { Box::from_raw(engine) };
        // After a panic the state is dropped all the same: freeing must not fail.
        let mut state = engine
            .shared
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        state.owners.clear();
        state
            .sessions
            .values_mut()
            .for_each(|s| *s = Slot::default());
        if let Some(service) = state.service.take() {
            // Close errors have nowhere to go from a `void` function; the units written
            // before stay recoverable.
            let _ = service.close();
        }
    })
}

/// The engine behind a handle.
///
/// # Safety
/// `p` is NULL or an engine from `kvstack_engine_new` not freed before the call ends.
unsafe fn engine_ref<'a>(p: *const kvstack_engine) -> Result<&'a kvstack_engine> {
    if p.is_null() {
        return Err(Error::Null { name: "engine" });
    }
    // SAFETY: the caller's contract: a live engine made by `kvstack_engine_new` (a `Box`
    // that `kvstack_engine_free` alone releases). Only shared references are made of it.
    Ok(unsafe { &*p })
}

/// The session behind a handle.
///
/// # Safety
/// `p` is NULL or a session from `kvstack_session_new` not freed before the call ends.
unsafe fn session_ref<'a>(p: *const kvstack_session) -> Result<&'a kvstack_session> {
    if p.is_null() {
        return Err(Error::Null { name: "session" });
    }
    // SAFETY: the caller's contract: a live session made by `kvstack_session_new` (a `Box`
    // that `kvstack_session_free` alone releases). Only shared references are made of it.
    Ok(unsafe { &*p })
}

/// Waits until every unit the engine persisted is durable (no-op without tiers).
///
/// Thread safety: the engine handle may be shared; calls serialize on its lock.
///
/// # Safety
/// `engine` is a live handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_engine_flush(engine: *const kvstack_engine) -> kvstack_result {
    boundary::call("kvstack_engine_flush", || {
        // SAFETY: the caller's contract above.
        let engine = unsafe { engine_ref(engine) }?;
        let mut state = engine.shared.lock()?;
        Ok(state.service()?.flush()?)
    })
}

/// Opens a session of `tenant` (non-empty UTF-8; tenants never share cached prefixes) and
/// writes its handle to `*out` (NULL on failure).
///
/// Thread safety: the engine handle may be shared; calls serialize on its lock. The session
/// may be used from any thread.
///
/// # Safety
/// `engine` is a live handle; `tenant` a NUL-terminated string; `out` points to a writable
/// `kvstack_session *`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_session_new(
    engine: *const kvstack_engine,
    tenant: *const c_char,
    out: *mut *mut kvstack_session,
) -> kvstack_result {
    boundary::call("kvstack_session_new", || {
        // SAFETY: the caller's contract for each argument, as documented above.
        let (engine, tenant, out) = unsafe {
            (
                engine_ref(engine)?,
                ffi::c_str(tenant, "tenant")?,
                Out::new(out, "out")?,
            )
        };
        out.write(std::ptr::null_mut());
        if tenant.is_empty() {
            return Err(Error::invalid("tenant", "must not be empty"));
        }
        let mut state = engine.shared.lock()?;
        let id = state.service()?.open_session(tenant);
        state.sessions.insert(id, Slot::default());
        out.write(Box::into_raw(Box::new(kvstack_session {
            shared: Arc::clone(&engine.shared),
            id,
        })));
        Ok(())
    })
}

/// Frees the session, cancelling its request in flight. NULL is a no-op. A session may
/// outlive its engine (it is then closed) and must still be freed.
///
/// Thread safety: no other call on this session handle may run or follow; other sessions and
/// the engine may be used meanwhile.
///
/// # Safety
/// `session` is NULL or a handle from `kvstack_session_new` not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_session_free(session: *mut kvstack_session) {
    boundary::value("kvstack_session_free", (), || {
        if session.is_null() {
            return;
        }
        // SAFETY: the caller's contract: the pointer came from `Box::into_raw` in
        // `kvstack_session_new` and is freed once.
        let session = unsafe { Box::from_raw(session) };
        let mut state = session
            .shared
            .state
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if state.service.is_some() && state.sessions.contains_key(&session.id) {
            let _ = state.cancel(session.id);
            if let Ok(service) = state.service() {
                // Fails only for an unknown or busy session; it is neither after the cancel.
                let _ = service.close_session(session.id);
            }
        }
        state.sessions.remove(&session.id);
    })
}

/// Queues one turn of the session: `tokens[0..n_tokens]` (at least one, each in the model's
/// vocabulary) appended to the session's history, then `params->max_new_tokens` generated.
/// `params` may be NULL for the defaults. Drive it with `kvstack_session_step` and collect
/// its tokens with `kvstack_session_step` or `kvstack_session_poll`.
///
/// `KVSTACK_SESSION_BUSY` while the session's previous request runs or has tokens (or a
/// failure) not yet polled.
///
/// Thread safety: the session handle may be used from any thread; calls serialize on the
/// engine's lock.
///
/// # Safety
/// `session` is a live handle; `tokens` points to `n_tokens` readable `uint32_t`; `params`
/// is NULL or a readable `kvstack_request_params` with its `size` set.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_session_submit(
    session: *const kvstack_session,
    tokens: *const u32,
    n_tokens: usize,
    params: *const kvstack_request_params,
) -> kvstack_result {
    boundary::call("kvstack_session_submit", || {
        if n_tokens == 0 {
            return Err(Error::invalid("n_tokens", "a request needs input tokens"));
        }
        // SAFETY: the caller's contract for each argument, as documented above.
        let (session, tokens, p) = unsafe {
            (
                session_ref(session)?,
                ffi::slice(tokens, n_tokens, KVSTACK_MAX_TOKENS, "tokens")?,
                ffi::read_sized(params, kvstack_request_params::default())?,
            )
        };
        let spec = RequestSpec {
            tokens: tokens.to_vec(),
            max_new_tokens: p.max_new_tokens as usize,
            sampling: p.sampling()?,
            seed: p.seed,
        };
        let mut state = session.shared.lock()?;
        state.service()?;
        let slot = state.slot(session.id)?;
        if slot.request.is_some() {
            return Err(Error::Busy {
                reason: "a request is in flight".into(),
            });
        }
        if !slot.tokens.is_empty() || slot.failed.is_some() {
            return Err(Error::Busy {
                reason: "the last request's outcome has not been polled".into(),
            });
        }
        let request = state.service()?.submit(session.id, spec)?;
        state.owners.insert(request, session.id);
        state.slot(session.id)?.request = Some(request);
        Ok(())
    })
}

/// Runs one engine step (for every session's requests, batched) if any request is queued or
/// running, then does what `kvstack_session_poll` does.
///
/// Thread safety: the session handle may be used from any thread; calls serialize on the
/// engine's lock, which a step holds while it runs.
///
/// # Safety
/// As `kvstack_session_poll`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_session_step(
    session: *const kvstack_session,
    tokens_out: *mut u32,
    cap: usize,
    n_out: *mut usize,
    done: *mut bool,
) -> kvstack_result {
    boundary::call("kvstack_session_step", || {
        // SAFETY: the caller's contract, as `kvstack_session_poll` documents it.
        unsafe { poll(session, tokens_out, cap, n_out, done, true) }
    })
}

/// Moves up to `cap` of the session's generated tokens not yet delivered into
/// `tokens_out` (`*n_out` of them, oldest first), without running the engine. `*done` is
/// true when the session's request has finished (or there is none) and every token was
/// delivered: the session can take its next request.
///
/// A request that failed inside the engine gives `KVSTACK_REQUEST_FAILED` once (its message
/// in the last error, `*n_out = 0`, `*done = true`; its undelivered tokens are dropped and the
/// session's history is as before it).
///
/// `tokens_out` may be NULL when `cap` is 0.
///
/// Thread safety: the session handle may be used from any thread; calls serialize on the
/// engine's lock.
///
/// # Safety
/// `session` is a live handle; `tokens_out` is NULL with 0 or has `cap` writable
/// `uint32_t`; `n_out` points to a writable `size_t`, `done` to a writable `bool`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_session_poll(
    session: *const kvstack_session,
    tokens_out: *mut u32,
    cap: usize,
    n_out: *mut usize,
    done: *mut bool,
) -> kvstack_result {
    boundary::call("kvstack_session_poll", || {
        // SAFETY: the caller's contract above.
        unsafe { poll(session, tokens_out, cap, n_out, done, false) }
    })
}

/// `kvstack_session_poll`, after a step when `step`.
///
/// # Safety
/// As `kvstack_session_poll`.
unsafe fn poll(
    session: *const kvstack_session,
    tokens_out: *mut u32,
    cap: usize,
    n_out: *mut usize,
    done: *mut bool,
    step: bool,
) -> Result<()> {
    // SAFETY: the caller's contract for each argument, as `kvstack_session_poll` documents.
    let (session, n_out, done) = unsafe {
        (
            session_ref(session)?,
            Out::new(n_out, "n_out")?,
            Out::new(done, "done")?,
        )
    };
    if tokens_out.is_null() && cap > 0 {
        return Err(Error::Null { name: "tokens_out" });
    }
    if !tokens_out.is_aligned() {
        return Err(Error::invalid("tokens_out", "not aligned to 4 bytes"));
    }
    if cap > KVSTACK_MAX_TOKENS {
        return Err(Error::invalid(
            "cap",
            format!("{cap} is over the limit of {KVSTACK_MAX_TOKENS}"),
        ));
    }
    n_out.write(0);
    done.write(false);
    let mut state = session.shared.lock()?;
    if step {
        state.step()?;
    }
    let slot = state.slot(session.id)?;
    if let Some(error) = slot.failed.take() {
        done.write(true);
        return Err(Error::RequestFailed { reason: error });
    }
    let n = cap.min(slot.tokens.len());
    for (i, t) in slot.tokens.drain(..n).enumerate() {
        // SAFETY: the caller promised `cap` writable `uint32_t` at `tokens_out` (non-NULL and
        // aligned, checked above); `i < n <= cap`.
        unsafe { tokens_out.add(i).write(t) };
    }
    n_out.write(n);
    done.write(slot.request.is_none() && slot.tokens.is_empty());
    Ok(())
}

/// Cancels the session's request in flight (a client went away): its cache pages are freed,
/// its undelivered tokens dropped, and the session's history is as before the request.
/// `*cancelled` (when `cancelled` is not NULL) says whether a request was in flight.
///
/// Thread safety: the session handle may be used from any thread; calls serialize on the
/// engine's lock.
///
/// # Safety
/// `session` is a live handle; `cancelled` is NULL or points to a writable `bool`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn kvstack_session_cancel(
    session: *const kvstack_session,
    cancelled: *mut bool,
) -> kvstack_result {
    boundary::call("kvstack_session_cancel", || {
        // SAFETY: the caller's contract for each argument, as documented above.
        let (session, out) = unsafe {
            (
                session_ref(session)?,
                Out::optional(cancelled, "cancelled")?,
            )
        };
        let mut state = session.shared.lock()?;
        state.service()?;
        let was = state.cancel(session.id)?;
        if let Some(out) = out {
            out.write(was);
        }
        Ok(())
    })
}
