//! kvstackd, the appliance: the engine's [`kvstack_engine::Service`] behind an HTTP API on a
//! Unix socket (and optionally loopback TCP), run by systemd (`docs/appliance.md`).
//!
//! - [`config`]: `kvstackd.toml`, every key checked at start;
//! - [`worker`]: the engine thread that owns the service, fed by a bounded channel;
//! - [`http`]: completions (JSON and server-sent events), models, the KV-cache API, metrics,
//!   health and readiness;
//! - [`metrics`]: the Prometheus registry;
//! - [`frame`]: the binary framing of the KV-cache API's units (`docs/kv-protocol.md`);
//! - [`peer`]: fetching a prompt's unit from the node the shared prefix index names
//!   (`docs/cluster.md`);
//! - `conn`: accept loops bounded by `limits.max_connections` and `limits.max_header_bytes`;
//! - [`serve`]: sockets (bound, or passed by systemd socket activation), `sd_notify`
//!   (READY after recovery, STATUS, EXTEND_TIMEOUT_USEC during recovery, WATCHDOG from the
//!   engine loop), SIGTERM drain and SIGHUP reload.

pub mod config;
mod conn;
mod error;
pub mod frame;
pub mod http;
pub mod metrics;
pub mod peer;
pub mod worker;

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use kvstack_cache::CacheOptions;
use kvstack_engine::{EngineOptions, ModelSource, Service, ServiceOptions};
use kvstack_model::tokenizer::ByteLevel;
use kvstack_tiers::{PoolOptions, StoreLocation, StoreOptions, TierOptions};
use sd_notify::NotifyState;

pub use config::Config;
pub use error::{Error, Result};

use crate::http::AppState;
use crate::metrics::Metrics;
use crate::worker::{Command, Shared};

/// A socket the daemon serves on.
enum Socket {
    Unix(tokio::net::UnixListener, Option<PathBuf>),
    Tcp(tokio::net::TcpListener),
}

fn notify(states: &[NotifyState<'_>]) {
    // Outside systemd there is no NOTIFY_SOCKET and this is a no-op.
    if let Err(e) = sd_notify::notify(false, states) {
        log::debug!("sd_notify: {e}");
    }
}

/// Half of systemd's `WATCHDOG_USEC`, when the watchdog is on for this process. As
/// libsystemd's `sd_watchdog_enabled(3)`: a `WATCHDOG_PID` naming another process turns it off,
/// none at all leaves it on (the `sd-notify` crate insists on the pid, which a supervisor such
/// as `systemd-socket-activate` cannot know before it execs us).
fn watchdog_interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID")
        && pid.parse::<u32>().ok() != Some(std::process::id())
    {
        return None;
    }
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}

/// Sockets passed by systemd (`LISTEN_FDS`), else the configured addresses, bound.
fn sockets(cfg: &Config) -> Result<Vec<Socket>> {
    let mut fds = listenfd::ListenFd::from_env();
    let mut out = Vec::new();
    let names = std::env::var("LISTEN_FDNAMES").unwrap_or_default();
    for i in 0..fds.len() {
        let what = format!(
            "LISTEN_FDS #{i} ({})",
            names.split(':').nth(i).unwrap_or("unnamed")
        );
        let le = |e| Error::Listen {
            addr: what.clone(),
            source: e,
        };
        if let Ok(Some(l)) = fds.take_unix_listener(i) {
            l.set_nonblocking(true).map_err(le)?;
            out.push(Socket::Unix(
                tokio::net::UnixListener::from_std(l).map_err(le)?,
                None,
            ));
        } else if let Ok(Some(l)) = fds.take_tcp_listener(i) {
            l.set_nonblocking(true).map_err(le)?;
            out.push(Socket::Tcp(
                tokio::net::TcpListener::from_std(l).map_err(le)?,
            ));
        } else {
            return Err(le(std::io::Error::other("not a listening stream socket")));
        }
        log::info!("adopted {what} from systemd");
    }
    if !out.is_empty() {
        return Ok(out);
    }
    for l in &cfg.listen {
        let le = |e| Error::Listen {
            addr: l.to_string(),
            source: e,
        };
        match l {
            config::Listen::Unix(p) => {
                if let Some(dir) = p.parent()
                    && !dir.as_os_str().is_empty()
                {
                    std::fs::create_dir_all(dir).map_err(le)?;
                }
                if p.exists() {
                    // A live daemon answers on it: refuse; a stale file from a killed one goes.
                    if std::os::unix::net::UnixStream::connect(p).is_ok() {
                        return Err(le(std::io::Error::new(
                            std::io::ErrorKind::AddrInUse,
                            "another process is serving on this socket",
                        )));
                    }
                    std::fs::remove_file(p).map_err(le)?;
                }
                out.push(Socket::Unix(
                    tokio::net::UnixListener::bind(p).map_err(le)?,
                    Some(p.clone()),
                ));
            }
            config::Listen::Tcp(a) => {
                let std = std::net::TcpListener::bind(a).map_err(le)?;
                std.set_nonblocking(true).map_err(le)?;
                out.push(Socket::Tcp(
                    tokio::net::TcpListener::from_std(std).map_err(le)?,
                ));
            }
        }
        log::info!("listening on {l}");
    }
    Ok(out)
}

/// The engine's options for `cfg`: what the daemon opens, and what an in-process comparison
/// (`kvstack bench serve`) opens to run the same engine.
pub fn service_options(cfg: &Config) -> ServiceOptions {
    let model = match &cfg.model {
        config::ModelChoice::Builtin { seed } => ModelSource::BuiltinTiny { seed: *seed },
        config::ModelChoice::Checkpoint { config, weights } => ModelSource::Checkpoint {
            config: config.clone(),
            weights: weights.clone(),
        },
    };
    let mut opts = ServiceOptions::new(model);
    let mut store = StoreOptions::new(StoreLocation::Directory(cfg.data_dir.clone()));
    if let Some(b) = cfg.ssd_capacity_bytes {
        store.capacity_bytes = b;
    }
    if let Some(e) = &cfg.ssd_io_engine
        && let Err(err) = store.set_io_engine(e)
    {
        // Checked when the configuration was read: unreachable with a loaded Config.
        log::error!("ssd.io_engine {e}: {err}");
    }
    store.retention_ms = cfg.ssd_retention_hours * kvstack_tiers::HOUR_MS;
    let mut tiers = TierOptions::new(store);
    tiers.pool = PoolOptions {
        capacity_bytes: cfg.pool_capacity_bytes,
        ttl_ms: cfg.pool_ttl_ms,
        ..PoolOptions::new(1)
    };
    tiers.remote = cfg.pool_remote.clone();
    opts.tiers = Some(tiers);
    opts.threads = if cfg.engine.threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        cfg.engine.threads
    };
    opts.engine = EngineOptions {
        chunk: cfg.engine.chunk,
        max_decode_batch: cfg.engine.max_decode_batch,
        cache: CacheOptions {
            context_limit: cfg.engine.context_limit,
            max_sequences: cfg.engine.max_sequences,
            ..CacheOptions::default()
        },
        // Sessions without a name release their cache after each request; named ones are
        // kept live between turns.
        keep_live: true,
        ..EngineOptions::default()
    };
    opts
}

/// Runs the daemon until SIGTERM/SIGINT (drained) or a fatal engine error.
/// `config_path`: re-read on SIGHUP (tenants and limits).
///
/// # Errors
/// Start-up errors (sockets, the data directory, the model, recovery) and engine failures.
pub fn serve(cfg: Config, config_path: Option<PathBuf>) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::Io {
            what: "starting the runtime".into(),
            source: e,
        })?;
    rt.block_on(serve_async(cfg, config_path))
}

async fn serve_async(cfg: Config, config_path: Option<PathBuf>) -> Result<()> {
    std::fs::create_dir_all(&cfg.data_dir).map_err(|e| Error::Io {
        what: format!("creating the data directory {}", cfg.data_dir.display()),
        source: e,
    })?;
    let socks = sockets(&cfg)?;
    let shared = Arc::new(Shared::default());
    shared.set_quotas(Some(&cfg.tenants));
    let metrics = Arc::new(Metrics::new());
    let (tx, rx) = std::sync::mpsc::sync_channel::<Command>(cfg.engine.queue_depth);
    let opts = service_options(&cfg);
    let vocab_guess = kvstack_spec::builtin::tiny_config()
        .ok()
        .and_then(|c| c.vocab_size);
    let tokenizer = match (&cfg.model, vocab_guess) {
        (config::ModelChoice::Builtin { .. }, Some(v)) => ByteLevel::new(v as u32).ok(),
        _ => None,
    };
    let idle = Duration::from_millis(cfg.engine.session_idle_ms);
    let max_sessions = cfg.engine.max_sessions;
    let watchdog = watchdog_interval();
    notify(&[NotifyState::Status(&format!(
        "recovering the SSD store in {}",
        cfg.data_dir.display()
    ))]);
    // The engine thread opens the service (recovery) and then serves.
    let (opened_tx, opened_rx) = tokio::sync::oneshot::channel::<u32>();
    let wshared = Arc::clone(&shared);
    let wmetrics = Arc::clone(&metrics);
    let engine_thread = std::thread::Builder::new()
        .name("kvstack-engine".into())
        .spawn(move || -> Result<()> {
            let t0 = Instant::now();
            // On failure the sender drops and the error is this thread's result.
            let svc = Service::open(opts)?;
            let vocab = svc.engine().model().dims().vocab as u32;
            if let Ok(mut slot) = wshared.tiers.write() {
                *slot = svc.shared_tiers();
            }
            // The quotas of the config now in force (set before the engine thread started,
            // replaced by any SIGHUP since).
            wshared.set_quotas(None);
            log::info!(
                "model {} ready in {:.2} s (SSD recovery {:.2} s)",
                svc.model_name(),
                t0.elapsed().as_secs_f64(),
                svc.recovery_seconds()
            );
            wshared.ready.store(true, Ordering::Release);
            let _ = opened_tx.send(vocab);
            worker::run(svc, rx, wshared, wmetrics, idle, max_sessions, watchdog)
                .map_err(Error::from)
        })
        .map_err(|e| Error::Io {
            what: "starting the engine thread".into(),
            source: e,
        })?;
    // While recovery runs, ask systemd for more start time.
    let opening = tokio::spawn(async move {
        loop {
            notify(&[NotifyState::ExtendTimeoutUsec(30_000_000)]);
            tokio::time::sleep(Duration::from_secs(10)).await;
        }
    });
    let vocab = match opened_rx.await {
        Ok(v) => v,
        Err(_) => {
            opening.abort();
            return match engine_thread.join() {
                Ok(Err(e)) => Err(e),
                _ => Err(Error::EngineGone),
            };
        }
    };
    opening.abort();
    let state = Arc::new(AppState {
        config: RwLock::new(Arc::new(cfg.clone())),
        jobs: tx.clone(),
        shared: Arc::clone(&shared),
        metrics,
        draining: false.into(),
        vocab,
        tokenizer,
        tenant_running: Default::default(),
    });
    let app = http::router(Arc::clone(&state));
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let limits = conn::ConnLimits {
        slots: Arc::new(tokio::sync::Semaphore::new(cfg.limits.max_connections)),
        max_header_bytes: cfg.limits.max_header_bytes,
    };
    let mut servers = Vec::new();
    let mut socket_files = Vec::new();
    for s in socks {
        let listener = match s {
            Socket::Unix(l, path) => {
                socket_files.extend(path);
                conn::Listener::Unix(l)
            }
            Socket::Tcp(l) => conn::Listener::Tcp(l),
        };
        servers.push(tokio::spawn(conn::serve(
            listener,
            app.clone(),
            limits.clone(),
            stop_rx.clone(),
        )));
    }
    notify(&[NotifyState::Ready, NotifyState::Status("serving")]);
    log::info!("ready");
    // Signals: SIGTERM/SIGINT drain, SIGHUP reload.
    let sig = |k| {
        tokio::signal::unix::signal(k).map_err(|e| Error::Io {
            what: "installing signal handlers".into(),
            source: e,
        })
    };
    let mut term = sig(tokio::signal::unix::SignalKind::terminate())?;
    let mut int = sig(tokio::signal::unix::SignalKind::interrupt())?;
    let mut hup = sig(tokio::signal::unix::SignalKind::hangup())?;
    loop {
        tokio::select! {
            _ = term.recv() => break,
            _ = int.recv() => break,
            _ = hup.recv() => reload(&state, config_path.as_deref()),
            _ = tokio::time::sleep(Duration::from_millis(500)) => {
                if engine_thread.is_finished() {
                    log::error!("the engine thread stopped");
                    break;
                }
            }
        }
    }
    notify(&[NotifyState::Stopping, NotifyState::Status("draining")]);
    log::info!(
        "draining: no new requests, waiting up to {} ms for running ones",
        cfg.drain_timeout_ms
    );
    state.draining.store(true, Ordering::Release);
    let deadline = Instant::now() + Duration::from_millis(cfg.drain_timeout_ms);
    while shared.in_flight.load(Ordering::Acquire) > 0
        && Instant::now() < deadline
        && !engine_thread.is_finished()
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop_tx.send(true);
    let _ = tx.send(Command::Shutdown);
    drop(tx);
    drop(state);
    for s in servers {
        let _ = tokio::time::timeout(Duration::from_secs(3), s).await;
    }
    for p in socket_files {
        let _ = std::fs::remove_file(p);
    }
    let r = tokio::task::spawn_blocking(move || engine_thread.join())
        .await
        .map_err(|_| Error::EngineGone)?;
    match r {
        Ok(r) => {
            r?;
            log::info!("stopped: units flushed, store closed");
            Ok(())
        }
        Err(_) => Err(Error::EngineGone),
    }
}

/// SIGHUP: tenants and limits from the file again; other keys need a restart.
fn reload(state: &AppState, path: Option<&std::path::Path>) {
    let Some(path) = path else {
        log::warn!("SIGHUP: started without --config, nothing to reload");
        return;
    };
    match Config::from_file(path) {
        Ok(new) => {
            if let Ok(mut c) = state.config.write() {
                let mut next = (**c).clone();
                state.shared.set_quotas(Some(&new.tenants));
                next.tenants = new.tenants;
                next.limits = new.limits;
                *c = Arc::new(next);
                log::info!(
                    "SIGHUP: reloaded tenants and limits from {}",
                    path.display()
                );
            }
        }
        Err(e) => log::error!("SIGHUP: keeping the running config: {e}"),
    }
}
