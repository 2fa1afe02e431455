//! [`Service`]: one serving instance (a model, its paged cache, the tiers in a data directory,
//! the engine over them), opened from [`ServiceOptions`].
//!
//! This is the API the faces of kvstack drive: `kvstack run` (a simulated agent workload),
//! and the appliance daemon and the C ABI to come. Each face turns its own input (flags, a
//! TOML file, C structs) into [`ServiceOptions`], then opens sessions, submits requests and
//! steps the engine; none of them builds a model, a cache or the tiers itself, so the faces
//! cannot diverge in how a model's KV is keyed, stored or reused.
//!
//! A `Service` is driven from one thread (`&mut self`); a server runs its step loop on a
//! thread of its own and feeds it through channels.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvstack_model::Checkpoint;
use kvstack_model::Model;
use kvstack_model::WeightPrecision;
use kvstack_model::init::random_model_with;
use kvstack_spec::ModelConfig;
use kvstack_tiers::{Clock, StoreLocation, StoreOptions, SystemClock, TierOptions, Tiers};
use serde::Serialize;

use crate::engine::{Engine, EngineOptions, Event, RequestId, RequestSpec, SessionId};
use crate::error::{Error, Result};
use crate::stats::ReuseKind;

/// Where a service's model comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// The embedded tiny V4.1 model (`kvstack_spec::builtin::tiny_config`: the real
    /// V4.1-Flash cache geometry, a small hidden size), its weights generated from `seed`.
    BuiltinTiny {
        /// Seed of the weights.
        seed: u64,
    },
    /// A checkpoint: a Hugging Face `config.json` and a safetensors file of its weights.
    Checkpoint {
        /// The config file.
        config: PathBuf,
        /// The weights file.
        weights: PathBuf,
    },
}

impl ModelSource {
    /// A name for reports.
    pub fn name(&self) -> String {
        match self {
            ModelSource::BuiltinTiny { seed } => {
                format!("{} seed {seed}", kvstack_spec::builtin::TINY_CONFIG_NAME)
            }
            ModelSource::Checkpoint { weights, .. } => weights.display().to_string(),
        }
    }
}

/// How to open a [`Service`].
#[derive(Clone)]
pub struct ServiceOptions {
    /// The model.
    pub model: ModelSource,
    /// The tiers (SSD store and DRAM window pool); `None` serves without them (nothing
    /// persisted, no reuse across sessions or restarts). [`TierOptions::weights_id`] is set
    /// by [`Service::open`] from the model source when left empty.
    pub tiers: Option<TierOptions>,
    /// The engine (prefill mode, chunk, batch, the paged cache's options).
    pub engine: EngineOptions,
    /// Threads of the forward pass (at least 1).
    pub threads: usize,
    /// Time for the tiers' retention and TTL rules.
    pub clock: Arc<dyn Clock>,
    /// How the model holds its linear weights: as stored (the default) or as f32 (the
    /// verification path; the same results, 4 bytes per weight).
    pub weight_precision: WeightPrecision,
}

impl std::fmt::Debug for ServiceOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceOptions")
            .field("model", &self.model)
            .field("tiers", &self.tiers.as_ref().map(|t| &t.store.location))
            .field("engine", &self.engine)
            .field("threads", &self.threads)
            .finish_non_exhaustive()
    }
}

impl ServiceOptions {
    /// `model` with default engine options, one thread, no tiers.
    pub fn new(model: ModelSource) -> ServiceOptions {
        ServiceOptions {
            model,
            tiers: None,
            engine: EngineOptions::default(),
            threads: 1,
            clock: Arc::new(SystemClock),
            weight_precision: WeightPrecision::Stored,
        }
    }

    /// The tiers with default options in the data directory `dir` (segment files of the SSD
    /// store; created if absent).
    pub fn with_data_dir(mut self, dir: impl Into<PathBuf>) -> ServiceOptions {
        let store = StoreOptions::new(StoreLocation::Directory(dir.into()));
        self.tiers = Some(TierOptions::new(store));
        self
    }
}

/// A serving instance: the model, the paged cache, the tiers and the engine over them.
pub struct Service {
    config: ModelConfig,
    model_name: String,
    engine: Engine,
    load_time: Duration,
    units_at_start: u64,
    recovery_seconds: f64,
}

impl Service {
    /// Loads (or generates) the model, opens the tiers (recovering the store) and builds the
    /// engine.
    ///
    /// # Errors
    /// [`Error::InvalidOption`] for zero threads or chunk; the config's, the model's, the
    /// cache's and the tiers' errors (a checkpoint that does not load, a data directory that
    /// cannot hold a store).
    pub fn open(opts: ServiceOptions) -> Result<Service> {
        if opts.threads == 0 {
            return Err(Error::InvalidOption {
                field: "threads",
                reason: "must be at least 1".into(),
            });
        }
        if opts.engine.chunk == 0 {
            return Err(Error::InvalidOption {
                field: "chunk",
                reason: "must be at least 1".into(),
            });
        }
        let t0 = Instant::now();
        let (config, opened) = Opened::open(&opts.model)?;
        // The tiers open before the model is built: a data directory in use by another
        // process is refused at once, not after minutes of loading.
        let tiers = match opts.tiers {
            Some(mut t) => {
                if t.weights_id.is_empty() {
                    t.weights_id = opened.weights_id()?;
                }
                Some(Tiers::open(
                    &config,
                    opts.engine.cache.page_tokens,
                    t,
                    Arc::clone(&opts.clock),
                )?)
            }
            None => None,
        };
        let model = opened.build(&config, opts.weight_precision)?;
        let load_time = t0.elapsed();
        let units_at_start = tiers.as_ref().map_or(0, |t| t.store().stats().units);
        let recovery_seconds = tiers.as_ref().map_or(0.0, |t| t.store().recovery().seconds);
        let mut engine = Engine::new(&config, model, tiers, opts.engine)?;
        engine.set_threads(opts.threads);
        Ok(Service {
            config,
            model_name: opts.model.name(),
            engine,
            load_time,
            units_at_start,
            recovery_seconds,
        })
    }

    /// The model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The model's name for reports ([`ModelSource::name`]).
    pub fn model_name(&self) -> &str {
        &self.model_name
    }

    /// How long loading (or generating) the model took.
    pub fn load_time(&self) -> Duration {
        self.load_time
    }

    /// Seconds the store's recovery took at open (0 without tiers).
    pub fn recovery_seconds(&self) -> f64 {
        self.recovery_seconds
    }

    /// The engine, for inspection (its cache, tiers and stats).
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The tiers, shared with other threads ([`Engine::shared_tiers`]); `None` without tiers.
    pub fn shared_tiers(&self) -> Option<Arc<Tiers>> {
        self.engine.shared_tiers()
    }

    /// Opens a session of `tenant` (tenants never share cached prefixes).
    pub fn open_session(&mut self, tenant: &str) -> SessionId {
        self.engine.open_session(tenant)
    }

    /// Closes a session.
    ///
    /// # Errors
    /// [`Error::Request`] when the session is unknown or has a request in flight.
    pub fn close_session(&mut self, session: SessionId) -> Result<()> {
        self.engine.close_session(session)
    }

    /// Queues a request (one turn) of `session`.
    ///
    /// # Errors
    /// [`Error::Request`] for an unknown or busy session or an unusable request.
    pub fn submit(&mut self, session: SessionId, spec: RequestSpec) -> Result<RequestId> {
        self.engine.submit(session, spec)
    }

    /// Cancels a queued or running request ([`Engine::cancel`]); whether it was still there.
    pub fn cancel(&mut self, request: RequestId) -> bool {
        self.engine.cancel(request)
    }

    /// Ends a decoding request now ([`Engine::stop`]).
    pub fn stop(&mut self, request: RequestId) -> Option<crate::Completion> {
        self.engine.stop(request)
    }

    /// Whether no request is queued or running.
    pub fn is_idle(&self) -> bool {
        self.engine.is_idle()
    }

    /// Runs one engine step and returns its events.
    ///
    /// # Errors
    /// Errors that stop the engine (a failing request is an [`Event::Failed`] instead).
    pub fn step(&mut self) -> Result<Vec<Event>> {
        self.engine.step()
    }

    /// Waits until every persisted unit is durable.
    ///
    /// # Errors
    /// The store's flush errors.
    pub fn flush(&self) -> Result<()> {
        self.engine.flush()
    }

    /// Counters of the service so far.
    pub fn report(&self) -> ServiceReport {
        ServiceReport::of(&self.engine, self.units_at_start)
    }

    /// Flushes and closes the tiers.
    ///
    /// # Errors
    /// The store's close errors.
    pub fn close(self) -> Result<()> {
        self.engine.close()
    }
}

/// A model source whose files are open: the config read, the weights memory-mapped (not yet
/// decoded).
enum Opened {
    /// The built-in tiny model, generated from `seed`.
    Builtin(u64),
    /// A checkpoint's weights: one file or a sharded directory.
    Checkpoint(Checkpoint),
}

impl Opened {
    /// Opens `src`'s files and reads its config.
    fn open(src: &ModelSource) -> Result<(ModelConfig, Opened)> {
        match src {
            ModelSource::BuiltinTiny { seed } => Ok((
                kvstack_spec::builtin::tiny_config()?,
                Opened::Builtin(*seed),
            )),
            ModelSource::Checkpoint { config, weights } => Ok((
                ModelConfig::from_file(config)?,
                Opened::Checkpoint(Checkpoint::open(weights)?),
            )),
        }
    }

    /// The identity of the weights, mixed into every stored key so that KV computed with
    /// other weights never matches.
    fn weights_id(&self) -> Result<Vec<u8>> {
        match self {
            // Generated from the seed: KV of other seeds must never match. (This id is what
            // earlier versions wrote, so their data directories still match.)
            Opened::Builtin(seed) => {
                Ok(format!("builtin kvstack-tiny-v4.1 seed {seed}").into_bytes())
            }
            Opened::Checkpoint(ck) => Ok(ck.content_id()?),
        }
    }

    /// The model: generated, or decoded from the weights file.
    fn build(&self, config: &ModelConfig, precision: WeightPrecision) -> Result<Model> {
        match self {
            Opened::Builtin(seed) => Ok(random_model_with(config, *seed, precision)?),
            Opened::Checkpoint(ck) => Ok(Model::load_with(config, ck.source(), precision)?),
        }
    }
}

/// Counters of a [`Service`] (the JSON of `kvstack run --json`, less the workload's own
/// fields).
#[derive(Clone, Debug, Serialize)]
pub struct ServiceReport {
    /// Requests submitted.
    pub requests: u64,
    /// Requests that failed.
    pub failed: u64,
    /// Prefill tokens per second of prefill time.
    pub prefill_tokens_per_s: f64,
    /// Decoded tokens per second of decode time.
    pub decode_tokens_per_s: f64,
    /// Mean sequences per decode step.
    pub mean_decode_batch: f64,
    /// Context tokens of all admitted requests.
    pub context_tokens: u64,
    /// Of them, held by live sessions.
    pub live_tokens: u64,
    /// Mapped from the paged cache's prefix index (no I/O).
    pub dram_cache_tokens: u64,
    /// Read from SSD.
    pub ssd_tokens: u64,
    /// Bytes read from SSD.
    pub ssd_read_bytes: u64,
    /// Windows restored from the DRAM pool.
    pub pool_windows: u64,
    /// Tokens replayed to rebuild a window.
    pub replayed_tokens: u64,
    /// Tokens computed.
    pub computed_tokens: u64,
    /// Tokens decoded.
    pub decode_tokens: u64,
    /// Global KV and index bytes per token, measured over finished sequences.
    pub measured_bytes_per_token: f64,
    /// Bytes the paged cache has allocated.
    pub dram_cache_bytes: u64,
    /// Bytes the DRAM window pool has committed.
    pub dram_pool_bytes: u64,
    /// Live bytes on SSD.
    pub ssd_live_bytes: u64,
    /// Units on SSD.
    pub ssd_units: u64,
    /// Units on SSD when the service opened.
    pub ssd_units_at_start: u64,
    /// Units persisted.
    pub units_persisted: u64,
    /// Units whose persisting was refused (full store or queue).
    pub persist_failures: u64,
    /// Mean time to first token by kind of reuse.
    pub ttft_ms: Vec<TtftLine>,
    /// Bytes the model's weights hold in memory (linear weights in their stored formats).
    pub weight_bytes_resident: u64,
    /// Bytes the same weights would hold as f32.
    pub weight_bytes_f32: u64,
}

/// Mean time to first token of one kind of reuse.
#[derive(Clone, Debug, Serialize)]
pub struct TtftLine {
    /// The kind of reuse.
    pub reuse: ReuseKind,
    /// Requests of that kind.
    pub requests: usize,
    /// Their mean time to first token, from arrival, in milliseconds.
    pub mean_ms: f64,
    /// Of that, waiting for admission and for the prefill slot (other requests' work).
    pub queue_ms: f64,
    /// Of that, the request's own work: lookup, restore, prefill, first token.
    pub service_ms: f64,
}

impl ServiceReport {
    fn of(engine: &Engine, units_at_start: u64) -> ServiceReport {
        let st = engine.stats();
        let usage = engine.cache().usage();
        let tiers = engine.tiers();
        let store = tiers.map(|t| t.store().stats());
        let wb = engine.model().weight_bytes();
        ServiceReport {
            requests: st.requests,
            failed: st.failed,
            prefill_tokens_per_s: st.prefill_rate(),
            decode_tokens_per_s: st.decode_rate(),
            mean_decode_batch: st.decode_batch_rows as f64 / st.decode_steps.max(1) as f64,
            context_tokens: st.context_tokens,
            live_tokens: st.live_tokens,
            dram_cache_tokens: st.mapped_tokens,
            ssd_tokens: st.ssd_tokens,
            ssd_read_bytes: st.ssd_bytes,
            pool_windows: st.pool_windows,
            replayed_tokens: st.replayed_tokens,
            computed_tokens: st.computed_tokens,
            decode_tokens: st.decode_tokens,
            measured_bytes_per_token: st.finished_entry_bytes as f64
                / st.finished_tokens.max(1) as f64,
            dram_cache_bytes: usage.total_allocated_bytes(),
            dram_pool_bytes: tiers.map_or(0, |t| t.pool().stats().committed_bytes),
            ssd_live_bytes: store.as_ref().map_or(0, |s| s.live_bytes),
            ssd_units: store.as_ref().map_or(0, |s| s.units),
            ssd_units_at_start: units_at_start,
            units_persisted: st.units_persisted,
            persist_failures: st.persist_failures,
            ttft_ms: ReuseKind::ALL
                .iter()
                .filter_map(|&k| {
                    st.mean_ttft(k).map(|m| TtftLine {
                        reuse: k,
                        requests: m.requests,
                        mean_ms: m.total.as_secs_f64() * 1e3,
                        queue_ms: m.queued.as_secs_f64() * 1e3,
                        service_ms: m.service.as_secs_f64() * 1e3,
                    })
                })
                .collect(),
            weight_bytes_resident: wb.resident,
            weight_bytes_f32: wb.f32,
        }
    }
}
