//! The engine thread: it owns the [`Service`] (which is driven from one thread), takes jobs
//! from a bounded channel, steps the engine and sends each job's tokens back on the job's own
//! channel. A job whose channel is closed (the client went away) is cancelled, which frees its
//! pages; a job past its deadline is cancelled and answered with a timeout.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use kvstack_engine::{Event, RequestId, RequestSpec, Reuse, Service, SessionId};
use kvstack_model::tokenizer::ByteLevel;
use kvstack_tiers::Tiers;
use tokio::sync::mpsc::UnboundedSender;

use crate::metrics::Metrics;

/// One completion request for the engine.
pub struct Job {
    /// The tenant (decided by the server from the API key).
    pub tenant: String,
    /// A named session kept live between turns; `None`: a session for this request only.
    pub session: Option<String>,
    /// The engine request.
    pub spec: RequestSpec,
    /// Stop sequences (bytes of the generated text).
    pub stop: Vec<Vec<u8>>,
    /// The model's tokenizer, if it has one: its end-of-sequence token and the bytes of
    /// tokens (for stop sequences).
    pub tokenizer: Option<ByteLevel>,
    /// When the job must be done.
    pub deadline: Instant,
    /// When the request arrived (its time in the engine thread's channel counts as queued).
    pub arrived: Instant,
    /// Where its events go.
    pub events: UnboundedSender<JobEvent>,
}

/// What a job produced.
#[derive(Debug)]
pub enum JobEvent {
    /// A generated token.
    Token(u32),
    /// The job ended normally.
    Done(Box<JobDone>),
    /// The job failed: an HTTP status and a message.
    Failed {
        /// Status to answer with (or to report in the stream).
        status: u16,
        /// What went wrong.
        message: String,
    },
}

/// A finished job.
#[derive(Debug)]
pub struct JobDone {
    /// Generated tokens, all of them (a matched stop sequence included).
    pub tokens: Vec<u32>,
    /// `length` or `stop`.
    pub finish_reason: &'static str,
    /// Context tokens (session history plus the prompt).
    pub context_tokens: u64,
    /// Where the context came from.
    pub reuse: Reuse,
    /// Arrival to first token.
    pub ttft: Duration,
    /// Of `ttft`, the time queued (in the engine thread's channel, then in the engine).
    pub ttft_queued: Duration,
    /// Arrival to the end.
    pub total: Duration,
}

/// Commands of the engine thread.
pub enum Command {
    /// Run a job.
    Job(Box<Job>),
    /// Stop: fail what is left, flush and close the service.
    Shutdown,
}

/// State shared between the engine thread and the HTTP side.
#[derive(Default)]
pub struct Shared {
    /// Recovery done, the engine is serving.
    pub ready: AtomicBool,
    /// The tiers, for the KV-cache API (`None` until ready and after shutdown).
    pub tiers: RwLock<Option<Arc<Tiers>>>,
    /// Jobs queued or running in the engine.
    pub in_flight: AtomicU64,
    /// Jobs that have not produced their first token.
    pub waiting: AtomicU64,
    /// The tenants of the current config, for their DRAM pool and SSD quotas. Applied
    /// to the tiers under this lock, by the engine thread once they open and by each `SIGHUP`,
    /// so a reload during recovery is never overwritten by the config the daemon started with.
    pub quotas: std::sync::Mutex<Vec<crate::config::Tenant>>,
}

impl Shared {
    /// Sets the quotas of `tenants` (the current config's) and applies them to the tiers if
    /// they are open.
    pub fn set_quotas(&self, tenants: Option<&[crate::config::Tenant]>) {
        let mut q = self.quotas.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tenants) = tenants {
            *q = tenants.to_vec();
        }
        let tiers = self.tiers.read().ok().and_then(|t| t.clone());
        if let Some(tiers) = tiers {
            let named: Vec<_> = q
                .iter()
                .map(|t| {
                    let id = kvstack_tiers::Tenant::new(&t.name);
                    (id, t.dram_pool_bytes, t.ssd_bytes)
                })
                .collect();
            tiers.set_dram_quotas(named.iter().filter_map(|(t, d, _)| Some((t, (*d)?))));
            tiers.set_ssd_quotas(named.iter().filter_map(|(t, _, s)| Some((t, (*s)?))));
        }
    }
}

struct Active {
    events: UnboundedSender<JobEvent>,
    deadline: Instant,
    stop: Vec<Vec<u8>>,
    tokenizer: Option<ByteLevel>,
    text: Vec<u8>,
    session: SessionId,
    /// Named session key, or `None` for a session to close after the job.
    named: Option<(String, String)>,
    got_first: bool,
    last_token: Instant,
    tenant: String,
    /// Arrival to its submission to the engine (queued in the channel).
    channel_wait: Duration,
}

struct Named {
    id: SessionId,
    last_used: Instant,
    busy: bool,
}

/// Runs the engine loop until [`Command::Shutdown`] or until every sender is gone.
/// `watchdog`: send `WATCHDOG=1` this often (half of systemd's `WATCHDOG_USEC`).
pub fn run(
    mut svc: Service,
    rx: Receiver<Command>,
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
    session_idle: Duration,
    max_sessions: usize,
    watchdog: Option<Duration>,
) -> kvstack_engine::Result<()> {
    let mut active: HashMap<RequestId, Active> = HashMap::new();
    let mut named: HashMap<(String, String), Named> = HashMap::new();
    let mut last_ping = Instant::now();
    let mut last_status = Instant::now();
    let mut last_gauges = Instant::now();
    let mut shutdown = false;
    loop {
        // Commands: block only while idle, and never past the next watchdog ping.
        let mut first = if svc.is_idle() && !shutdown {
            let wait = watchdog
                .unwrap_or(Duration::from_secs(1))
                .min(Duration::from_secs(1));
            match rx.recv_timeout(wait) {
                Ok(c) => Some(c),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => Some(Command::Shutdown),
            }
        } else {
            None
        };
        loop {
            let cmd = match first.take() {
                Some(c) => c,
                None => match rx.try_recv() {
                    Ok(c) => c,
                    Err(_) => break,
                },
            };
            match cmd {
                Command::Shutdown => shutdown = true,
                Command::Job(job) => admit(
                    &mut svc,
                    *job,
                    &mut active,
                    &mut named,
                    max_sessions,
                    &shared,
                ),
            }
        }
        if shutdown {
            for (id, a) in active.drain() {
                svc.cancel(id);
                let _ = a.events.send(JobEvent::Failed {
                    status: 503,
                    message: "the daemon is shutting down".into(),
                });
            }
            shared.in_flight.store(0, Ordering::Release);
            break;
        }
        if !svc.is_idle() {
            let events = svc.step()?;
            for e in events {
                route(&mut svc, e, &mut active, &mut named, &shared, &metrics);
            }
        }
        // Clients gone or past their deadline.
        let now = Instant::now();
        let dead: Vec<RequestId> = active
            .iter()
            .filter(|(_, a)| a.events.is_closed() || now >= a.deadline)
            .map(|(id, _)| *id)
            .collect();
        for id in dead {
            svc.cancel(id);
            if let Some(a) = active.remove(&id) {
                let timed_out = now >= a.deadline;
                if timed_out {
                    metrics.request_done(&a.tenant, "timeout");
                } else {
                    metrics.request_done(&a.tenant, "cancelled");
                }
                let _ = a.events.send(JobEvent::Failed {
                    status: 408,
                    message: "request timed out".into(),
                });
                end_job(&mut svc, &a, !a.got_first, &mut named, &shared);
            }
        }
        // Idle named sessions are closed (their units stay in the tiers).
        named.retain(|_, n| {
            let keep = n.busy || n.last_used.elapsed() < session_idle;
            if !keep {
                let _ = svc.close_session(n.id);
            }
            keep
        });
        // Cache usage walks every pool: once a second, not on every step.
        if last_gauges.elapsed() >= Duration::from_secs(1) {
            metrics.engine_gauges(&svc, named.len());
            last_gauges = Instant::now();
        }
        if let Some(w) = watchdog
            && last_ping.elapsed() >= w
        {
            let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Watchdog]);
            last_ping = Instant::now();
        }
        if last_status.elapsed() >= Duration::from_secs(10) {
            let status = format!(
                "serving: {} requests in flight, {} named sessions",
                shared.in_flight.load(Ordering::Acquire),
                named.len()
            );
            let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Status(&status)]);
            last_status = Instant::now();
        }
    }
    named.clear();
    // The KV-cache API's handles: none may outlive the close; wait briefly for running ones.
    let t0 = Instant::now();
    if let Ok(mut slot) = shared.tiers.write() {
        *slot = None;
    }
    while let Some(t) = svc.shared_tiers() {
        if Arc::strong_count(&t) <= 2 || t0.elapsed() > Duration::from_secs(10) {
            break;
        }
        drop(t);
        std::thread::sleep(Duration::from_millis(20));
    }
    svc.flush()?;
    svc.close()
}

fn admit(
    svc: &mut Service,
    job: Job,
    active: &mut HashMap<RequestId, Active>,
    named: &mut HashMap<(String, String), Named>,
    max_sessions: usize,
    shared: &Shared,
) {
    let fail = |job: &Job, status: u16, message: String| {
        let _ = job.events.send(JobEvent::Failed { status, message });
    };
    if job.events.is_closed() {
        return;
    }
    let key = job.session.clone().map(|s| (job.tenant.clone(), s));
    let session = match &key {
        Some(k) => match named.get_mut(k) {
            Some(n) if n.busy => {
                return fail(
                    &job,
                    409,
                    format!("session `{}` has a request running", k.1),
                );
            }
            Some(n) => {
                n.busy = true;
                n.last_used = Instant::now();
                n.id
            }
            None => {
                // At `engine.max_sessions`, the least recently used idle session makes room
                // (its units stay in the tiers, so its next turn still finds its prefix);
                // with every session busy, the request waits for a later try.
                if named.len() >= max_sessions {
                    let lru = named
                        .iter()
                        .filter(|(_, n)| !n.busy)
                        .min_by_key(|(_, n)| n.last_used)
                        .map(|(k, n)| (k.clone(), n.id));
                    match lru {
                        Some((k, id)) => {
                            named.remove(&k);
                            let _ = svc.close_session(id);
                        }
                        None => {
                            return fail(
                                &job,
                                429,
                                format!(
                                    "{} named sessions are busy (engine.max_sessions)",
                                    named.len()
                                ),
                            );
                        }
                    }
                }
                let id = svc.open_session(&job.tenant);
                named.insert(
                    k.clone(),
                    Named {
                        id,
                        last_used: Instant::now(),
                        busy: true,
                    },
                );
                id
            }
        },
        None => svc.open_session(&job.tenant),
    };
    match svc.submit(session, job.spec.clone()) {
        Ok(id) => {
            shared.in_flight.fetch_add(1, Ordering::AcqRel);
            shared.waiting.fetch_add(1, Ordering::AcqRel);
            active.insert(
                id,
                Active {
                    events: job.events,
                    deadline: job.deadline,
                    stop: job.stop,
                    tokenizer: job.tokenizer,
                    text: Vec::new(),
                    session,
                    named: key,
                    got_first: false,
                    last_token: Instant::now(),
                    tenant: job.tenant,
                    channel_wait: job.arrived.elapsed(),
                },
            );
        }
        Err(e) => {
            fail(&job, 400, e.to_string());
            match &key {
                Some(k) => {
                    if let Some(n) = named.get_mut(k) {
                        n.busy = false;
                    }
                }
                None => {
                    let _ = svc.close_session(session);
                }
            }
        }
    }
}

fn end_job(
    svc: &mut Service,
    a: &Active,
    waiting: bool,
    named: &mut HashMap<(String, String), Named>,
    shared: &Shared,
) {
    shared.in_flight.fetch_sub(1, Ordering::AcqRel);
    if waiting {
        shared.waiting.fetch_sub(1, Ordering::AcqRel);
    }
    match &a.named {
        Some(k) => {
            if let Some(n) = named.get_mut(k) {
                n.busy = false;
                n.last_used = Instant::now();
            }
        }
        None => {
            let _ = svc.close_session(a.session);
        }
    }
}

fn route(
    svc: &mut Service,
    e: Event,
    active: &mut HashMap<RequestId, Active>,
    named: &mut HashMap<(String, String), Named>,
    shared: &Shared,
    metrics: &Metrics,
) {
    let (id, token) = match &e {
        Event::FirstToken {
            request,
            token,
            ttft,
        } => {
            if let Some(a) = active.get_mut(request) {
                a.got_first = true;
                shared.waiting.fetch_sub(1, Ordering::AcqRel);
                metrics.ttft.observe((*ttft + a.channel_wait).as_secs_f64());
            }
            (*request, Some(*token))
        }
        Event::Token { request, token } => (*request, Some(*token)),
        Event::Finished(c) => {
            if let Some(a) = active.remove(&c.request) {
                metrics.completed(&a.tenant, &c.reuse, c.tokens.len() as u64);
                let _ = a.events.send(JobEvent::Done(Box::new(JobDone {
                    tokens: c.tokens.clone(),
                    finish_reason: "length",
                    context_tokens: c.context_tokens,
                    reuse: c.reuse,
                    ttft: c.ttft + a.channel_wait,
                    ttft_queued: c.ttft_queued + a.channel_wait,
                    total: c.total + a.channel_wait,
                })));
                end_job(svc, &a, false, named, shared);
            }
            return;
        }
        Event::Failed { request, error } => {
            if let Some(a) = active.remove(request) {
                metrics.request_done(&a.tenant, "failed");
                let _ = a.events.send(JobEvent::Failed {
                    status: 500,
                    message: error.clone(),
                });
                end_job(svc, &a, !a.got_first, named, shared);
            }
            return;
        }
    };
    let Some(token) = token else { return };
    let Some(a) = active.get_mut(&id) else { return };
    let now = Instant::now();
    metrics
        .inter_token
        .observe((now - a.last_token).as_secs_f64());
    a.last_token = now;
    let _ = a.events.send(JobEvent::Token(token));
    // Stop sequences and the end-of-sequence token end a decoding request early.
    let mut stop = a.tokenizer.is_some() && token == ByteLevel::EOS;
    if let Some(b) = a.tokenizer.and_then(|t| t.token_bytes(token)) {
        a.text.push(b);
        stop |= a.stop.iter().any(|s| !s.is_empty() && a.text.ends_with(s));
    }
    if stop
        && let Some(c) = svc.stop(id)
        && let Some(a) = active.remove(&id)
    {
        metrics.completed(&a.tenant, &c.reuse, c.tokens.len() as u64);
        let _ = a.events.send(JobEvent::Done(Box::new(JobDone {
            tokens: c.tokens,
            finish_reason: "stop",
            context_tokens: c.context_tokens,
            reuse: c.reuse,
            ttft: c.ttft + a.channel_wait,
            ttft_queued: c.ttft_queued + a.channel_wait,
            total: c.total + a.channel_wait,
        })));
        end_job(svc, &a, false, named, shared);
    }
}
