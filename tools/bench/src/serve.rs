//! `kvstack bench serve`: the appliance under N concurrent streaming clients, against the
//! same workload through the engine in-process, in the same run.
//!
//! The daemon is the real `kvstackd` binary on a Unix socket in the bench directory, started
//! from a config this harness writes; the clients are tasks of one thread here, each sending
//! `POST /v1/completions` with `stream: true` and reading its server-sent events as they come.
//! The in-process run opens the [`kvstack_engine::Service`] with exactly the options the daemon
//! derives from that config ([`kvstack_appliance::service_options`]) and keeps the same number
//! of requests in flight. Both start from an empty data directory, so neither reuses the
//! other's cache; the prompts are distinct, so every request computes its prefill. Each run
//! first sends one untimed round of warm-up requests (other prompts) through its process.
//!
//! The ratio printed is the daemon's generated tokens/s over in-process tokens/s: what the
//! HTTP, JSON and socket layers cost. The client's time to first token is split with the
//! server's own account (`usage.kvstack.ttft_queued_ms`) into queueing (in the engine
//! channel, before admission, waiting for a sequence) and service. Peak RSS is the daemon's
//! `VmHWM`; the DRAM pool's bytes are sampled from `/metrics` during the run.

use std::fmt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use kvstack_engine::{Event, RequestSpec, Service};
use kvstack_kernels::model::Sampling;
use serde::Serialize;

use crate::{Error, Result};

/// What `kvstack bench serve` runs.
#[derive(Clone, Debug)]
pub struct ServeBenchOptions {
    /// Bench directory (a subdirectory is created and removed).
    pub dir: PathBuf,
    /// The `kvstackd` binary.
    pub kvstackd: PathBuf,
    /// Concurrent streaming clients.
    pub clients: usize,
    /// Requests in all.
    pub requests: usize,
    /// Prompt tokens of each request.
    pub prompt_tokens: usize,
    /// Tokens each request generates.
    pub max_tokens: usize,
    /// Engine threads (both runs).
    pub threads: usize,
    /// The DRAM window pool's capacity (both runs).
    pub pool_bytes: u64,
    /// The daemon's tokens/s must be at least this fraction of in-process.
    pub min_ratio: f64,
}

impl ServeBenchOptions {
    /// Defaults: 64 clients, 128 requests of 32 prompt tokens and 16 generated, 2 threads,
    /// a 256 MiB pool, ratio target 0.9 (about a minute a run on 2 cores).
    pub fn new(dir: PathBuf, kvstackd: PathBuf) -> ServeBenchOptions {
        ServeBenchOptions {
            dir,
            kvstackd,
            clients: 64,
            requests: 128,
            prompt_tokens: 32,
            max_tokens: 16,
            threads: 2,
            pool_bytes: 256 << 20,
            min_ratio: 0.9,
        }
    }
}

/// One run's throughput.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SideReport {
    /// First request sent to last request done, seconds.
    pub seconds: f64,
    /// Requests that completed.
    pub requests: usize,
    /// Requests that failed (target 0).
    pub errors: usize,
    /// Tokens generated.
    pub tokens: u64,
    /// Requests per second.
    pub requests_per_s: f64,
    /// Generated tokens per second.
    pub tokens_per_s: f64,
}

/// p50 and p99 of a sample, milliseconds.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Percentiles {
    fn of(mut v: Vec<f64>) -> Percentiles {
        if v.is_empty() {
            return Percentiles::default();
        }
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        Percentiles {
            p50: at(0.5),
            p99: at(0.99),
        }
    }
}

/// The report of `kvstack bench serve`.
#[derive(Clone, Debug, Serialize)]
pub struct ServeReport {
    /// Concurrent clients.
    pub clients: usize,
    /// Requests per run.
    pub requests: usize,
    /// Prompt tokens per request.
    pub prompt_tokens: usize,
    /// Generated tokens per request (at most: the end-of-sequence token ends one early).
    pub max_tokens: usize,
    /// Engine threads.
    pub threads: usize,
    /// Through kvstackd over the Unix socket.
    pub daemon: SideReport,
    /// Through the engine in-process.
    pub in_process: SideReport,
    /// `daemon.tokens_per_s / in_process.tokens_per_s`.
    pub ratio: f64,
    /// Its target.
    pub min_ratio: f64,
    /// Time to first token seen by the clients (send to first token event), ms.
    pub ttft_ms: Percentiles,
    /// Of it, queued (the server's `ttft_queued_ms`), ms.
    pub ttft_queued_ms: Percentiles,
    /// Of it, the rest: service (the client's TTFT less the server's queued time), ms.
    pub ttft_service_ms: Percentiles,
    /// The daemon's peak resident set (`VmHWM`), bytes.
    pub peak_rss_bytes: u64,
    /// The DRAM window pool's largest sampled size, bytes.
    pub pool_peak_bytes: u64,
    /// Its capacity, bytes.
    pub pool_cap_bytes: u64,
}

impl ServeReport {
    /// What missed its target, if anything.
    pub fn failures(&self) -> Vec<String> {
        let mut f = Vec::new();
        if self.daemon.errors + self.in_process.errors > 0 {
            f.push(format!(
                "{} daemon and {} in-process requests failed (target 0)",
                self.daemon.errors, self.in_process.errors
            ));
        }
        if self.ratio < self.min_ratio {
            f.push(format!(
                "daemon tokens/s is {:.3} of in-process (target >= {})",
                self.ratio, self.min_ratio
            ));
        }
        if self.pool_peak_bytes > self.pool_cap_bytes {
            f.push(format!(
                "the DRAM pool reached {} bytes, above its cap of {}",
                self.pool_peak_bytes, self.pool_cap_bytes
            ));
        }
        f
    }
}

impl fmt::Display for ServeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "kvstack bench serve: {} streaming clients, {} requests of {} prompt tokens, up to {} generated, {} engine threads",
            self.clients, self.requests, self.prompt_tokens, self.max_tokens, self.threads
        )?;
        writeln!(
            f,
            "  {:<22} {:>9} {:>8} {:>7} {:>10} {:>10}",
            "run", "seconds", "req/s", "errors", "tokens", "tokens/s"
        )?;
        for (name, s) in [
            ("kvstackd (Unix socket)", &self.daemon),
            ("engine in-process", &self.in_process),
        ] {
            writeln!(
                f,
                "  {:<22} {:>9.2} {:>8.1} {:>7} {:>10} {:>10.1}",
                name, s.seconds, s.requests_per_s, s.errors, s.tokens, s.tokens_per_s
            )?;
        }
        writeln!(
            f,
            "  daemon / in-process tokens/s: {:.3} (target >= {})",
            self.ratio, self.min_ratio
        )?;
        writeln!(
            f,
            "  TTFT ms p50 / p99: client {:.1} / {:.1}; queued {:.1} / {:.1}; service {:.1} / {:.1}",
            self.ttft_ms.p50,
            self.ttft_ms.p99,
            self.ttft_queued_ms.p50,
            self.ttft_queued_ms.p99,
            self.ttft_service_ms.p50,
            self.ttft_service_ms.p99
        )?;
        writeln!(
            f,
            "  daemon peak RSS {:.1} MiB; DRAM pool peak {:.1} MiB of its {:.1} MiB cap",
            self.peak_rss_bytes as f64 / (1u64 << 20) as f64,
            self.pool_peak_bytes as f64 / (1u64 << 20) as f64,
            self.pool_cap_bytes as f64 / (1u64 << 20) as f64
        )
    }
}

/// The prompt of request `i`: distinct per request, ids below the built-in model's 258.
fn prompt(i: usize, n: usize) -> Vec<u32> {
    let mut x = (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 250) as u32
        })
        .collect()
}

fn config_text(o: &ServeBenchOptions, data: &Path, sock: &Path) -> String {
    format!(
        "data_dir = \"{}\"\nlisten = [\"unix:{}\"]\n[engine]\nthreads = {}\nqueue_depth = {}\n[window_pool]\ncapacity_bytes = {}\n[ssd]\ncapacity_bytes = {}\n",
        data.display(),
        sock.display(),
        o.threads,
        o.clients + 16,
        o.pool_bytes,
        8u64 << 30
    )
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        what,
        path: path.to_path_buf(),
        source,
    }
}

/// Runs the bench; `progress` hears each stage.
///
/// # Errors
/// The bench directory, the daemon (missing binary, not ready in 120 s), the engine.
pub fn run_serve_bench(
    o: &ServeBenchOptions,
    mut progress: impl FnMut(&str),
) -> Result<ServeReport> {
    if o.clients == 0 || o.requests == 0 || o.prompt_tokens == 0 || o.max_tokens == 0 {
        return Err(Error::Run(
            "clients, requests, prompt tokens and max tokens must all be at least 1".into(),
        ));
    }
    if !o.kvstackd.is_file() {
        return Err(Error::Tool {
            tool: "kvstackd",
            reason: format!(
                "{} not found: build it with `cargo build --release -p kvstack-appliance` (or pass --kvstackd PATH)",
                o.kvstackd.display()
            ),
        });
    }
    let root = o
        .dir
        .join(format!("kvstack-bench-serve-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).map_err(io("creating", &root))?;
    let result = run_in(o, &root, &mut progress);
    let _ = std::fs::remove_dir_all(&root);
    result
}

fn run_in(
    o: &ServeBenchOptions,
    root: &Path,
    progress: &mut impl FnMut(&str),
) -> Result<ServeReport> {
    progress("engine in-process");
    let in_process = in_process(o, root)?;
    progress("kvstackd over its Unix socket");
    let d = daemon(o, root)?;
    Ok(ServeReport {
        clients: o.clients,
        requests: o.requests,
        prompt_tokens: o.prompt_tokens,
        max_tokens: o.max_tokens,
        threads: o.threads,
        ratio: if in_process.tokens_per_s > 0.0 {
            d.side.tokens_per_s / in_process.tokens_per_s
        } else {
            0.0
        },
        daemon: d.side,
        in_process,
        min_ratio: o.min_ratio,
        ttft_ms: Percentiles::of(d.ttft.clone()),
        ttft_queued_ms: Percentiles::of(d.queued.clone()),
        ttft_service_ms: Percentiles::of(
            d.ttft
                .iter()
                .zip(&d.queued)
                .map(|(t, q)| (t - q).max(0.0))
                .collect(),
        ),
        peak_rss_bytes: d.peak_rss,
        pool_peak_bytes: d.pool_peak,
        pool_cap_bytes: o.pool_bytes,
    })
}

fn spec(o: &ServeBenchOptions, i: usize) -> RequestSpec {
    RequestSpec {
        tokens: prompt(i, o.prompt_tokens),
        max_new_tokens: o.max_tokens,
        sampling: Sampling::Greedy,
        seed: 0,
    }
}

fn in_process(o: &ServeBenchOptions, root: &Path) -> Result<SideReport> {
    let data = root.join("in-process");
    let cfg = kvstack_appliance::Config::from_toml_str(
        &config_text(o, &data, &root.join("unused.sock")),
        "kvstack bench serve",
    )
    .map_err(|e| Error::Run(format!("the bench's config: {e}")))?;
    let mut svc = Service::open(kvstack_appliance::service_options(&cfg))?;
    drive(&mut svc, o, WARMUP_BASE, warmup(o))?;
    let side = drive(&mut svc, o, 0, o.requests)?;
    svc.flush()?;
    svc.close()?;
    Ok(side)
}

/// Requests `base..base + count` through `svc`, `o.clients` in flight.
fn drive(
    svc: &mut Service,
    o: &ServeBenchOptions,
    base: usize,
    count: usize,
) -> Result<SideReport> {
    let (mut next, mut running, mut done, mut errors, mut tokens) = (0usize, 0usize, 0, 0, 0u64);
    let t0 = Instant::now();
    while done + errors < count {
        while running < o.clients && next < count {
            let s = svc.open_session("default");
            svc.submit(s, spec(o, base + next))?;
            next += 1;
            running += 1;
        }
        for e in svc.step()? {
            match e {
                Event::FirstToken { .. } | Event::Token { .. } => tokens += 1,
                Event::Finished(c) => {
                    running -= 1;
                    done += 1;
                    svc.close_session(c.session)?;
                }
                Event::Failed { error, .. } => {
                    log::warn!("in-process request failed: {error}");
                    running -= 1;
                    errors += 1;
                }
            }
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    Ok(SideReport {
        seconds,
        requests: done,
        errors,
        tokens,
        requests_per_s: done as f64 / seconds,
        tokens_per_s: tokens as f64 / seconds,
    })
}

/// Prompt indices of the warm-up requests (never those of the measured ones).
const WARMUP_BASE: usize = 1 << 40;

/// Warm-up requests of each run, untimed: a process's first requests run measurably slower
/// (first touch of the model's weights and of the caches; 22 against 27 tokens/s here), and
/// the two runs are different processes, so each gets one round of clients first.
fn warmup(o: &ServeBenchOptions) -> usize {
    o.clients.min(o.requests)
}

struct DaemonRun {
    side: SideReport,
    ttft: Vec<f64>,
    queued: Vec<f64>,
    peak_rss: u64,
    pool_peak: u64,
}

/// The daemon child, killed if the bench fails half way.
struct DaemonChild(Child);

impl Drop for DaemonChild {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `VmHWM` of `pid`, bytes.
fn peak_rss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// One request over a fresh connection: (status, body as it arrived, time to the first
/// token event).
async fn request(
    sock: &Path,
    method: &str,
    path: &str,
    body: String,
) -> std::result::Result<(u16, Vec<u8>, Option<Duration>), String> {
    let t0 = Instant::now();
    let stream = tokio::net::UnixStream::connect(sock)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (mut tx, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(conn);
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "kvstackd")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| format!("request: {e}"))?;
    let resp = tx
        .send_request(req)
        .await
        .map_err(|e| format!("send: {e}"))?;
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    let mut out = Vec::new();
    let mut first = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| format!("body: {e}"))?;
        if let Some(d) = frame.data_ref() {
            out.extend_from_slice(d);
            if first.is_none() && out.windows(8).any(|w| w == b"\"token\":") {
                first = Some(t0.elapsed());
            }
        }
    }
    Ok((status, out, first))
}

/// Tokens and the server's queued time (ms) of a streamed completion, or why it failed.
fn parse_stream(body: &[u8]) -> std::result::Result<(u64, f64), String> {
    let text = String::from_utf8_lossy(body);
    if text.contains("event: error") {
        return Err(text.into_owned());
    }
    let mut tokens = 0u64;
    let mut queued = None;
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(data).map_err(|e| format!("event {data}: {e}"))?;
        if v["choices"][0]["token"].is_u64() {
            tokens += 1;
        }
        if let Some(q) = v["usage"]["kvstack"]["ttft_queued_ms"].as_f64() {
            queued = Some(q);
        }
    }
    match queued {
        Some(q) => Ok((tokens, q)),
        None => Err(format!("no usage in the stream: {text}")),
    }
}

/// Tokens, the server's queued ms and the client's time to first token of one request.
type Sample = std::result::Result<(u64, f64, Option<Duration>), String>;

/// Requests `base..base + count` from `clients` concurrent client tasks.
async fn run_clients(
    sock: &Path,
    clients: usize,
    base: usize,
    count: usize,
    prompt_tokens: usize,
    max_tokens: usize,
) -> Result<Vec<Sample>> {
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..clients.min(count) {
        let (sock, next) = (sock.to_path_buf(), std::sync::Arc::clone(&next));
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= count {
                    return samples;
                }
                let body = serde_json::json!({
                    "prompt": prompt(base + i, prompt_tokens), "max_tokens": max_tokens,
                    "temperature": 0, "stream": true
                })
                .to_string();
                let r = match request(&sock, "POST", "/v1/completions", body).await {
                    Ok((200, b, first)) => parse_stream(&b).map(|(t, q)| (t, q, first)),
                    Ok((st, b, _)) => Err(format!("{st}: {}", String::from_utf8_lossy(&b))),
                    Err(e) => Err(e),
                };
                samples.push(r);
            }
        }));
    }
    let mut out = Vec::with_capacity(count);
    for t in tasks {
        out.extend(
            t.await
                .map_err(|e| Error::Run(format!("a client task: {e}")))?,
        );
    }
    Ok(out)
}

fn daemon(o: &ServeBenchOptions, root: &Path) -> Result<DaemonRun> {
    let sock = root.join("kvstackd.sock");
    let cfg_path = root.join("kvstackd.toml");
    std::fs::write(&cfg_path, config_text(o, &root.join("daemon"), &sock))
        .map_err(io("writing", &cfg_path))?;
    let log_path = root.join("kvstackd.log");
    let log = std::fs::File::create(&log_path).map_err(io("creating", &log_path))?;
    let child = Command::new(&o.kvstackd)
        .arg("--config")
        .arg(&cfg_path)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .map_err(io("starting", &o.kvstackd))?;
    let mut child = DaemonChild(child);
    let pid = child.0.id();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(io("starting the client runtime in", root))?;
    let run = rt.block_on(async {
        let t0 = Instant::now();
        loop {
            if let Ok((200, _, _)) = request(&sock, "GET", "/readyz", String::new()).await {
                break;
            }
            if t0.elapsed() > Duration::from_secs(120) {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                return Err(Error::Run(format!(
                    "kvstackd not ready in 120 s; its log:\n{log}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The pool's size, sampled while the clients run.
        let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let sampler = {
            let (sock, sampling) = (sock.clone(), std::sync::Arc::clone(&sampling));
            tokio::spawn(async move {
                let mut peak = 0u64;
                while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok((200, m, _)) = request(&sock, "GET", "/metrics", String::new()).await
                    {
                        let m = String::from_utf8_lossy(&m);
                        if let Some(v) = m
                            .lines()
                            .find(|l| l.starts_with("kvstack_dram_pool_bytes "))
                            .and_then(|l| l.split_whitespace().nth(1))
                            .and_then(|v| v.parse::<f64>().ok())
                        {
                            peak = peak.max(v as u64);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                peak
            })
        };
        let (clients, p, m) = (o.clients, o.prompt_tokens, o.max_tokens);
        let warm = run_clients(&sock, clients, WARMUP_BASE, warmup(o), p, m).await?;
        if let Some(e) = warm.iter().find_map(|s| s.as_ref().err()) {
            return Err(Error::Run(format!(
                "a warm-up request through kvstackd failed: {e}"
            )));
        }
        let t0 = Instant::now();
        let samples = run_clients(&sock, clients, 0, o.requests, p, m).await?;
        let mut side = SideReport::default();
        let (mut ttft, mut queued) = (Vec::new(), Vec::new());
        {
            for s in samples {
                match s {
                    Ok((tokens, q, first)) => {
                        side.requests += 1;
                        side.tokens += tokens;
                        if let Some(f) = first {
                            ttft.push(f.as_secs_f64() * 1e3);
                            queued.push(q);
                        }
                    }
                    Err(e) => {
                        log::warn!("a request through kvstackd failed: {e}");
                        side.errors += 1;
                    }
                }
            }
        }
        side.seconds = t0.elapsed().as_secs_f64();
        side.requests_per_s = side.requests as f64 / side.seconds;
        side.tokens_per_s = side.tokens as f64 / side.seconds;
        sampling.store(false, std::sync::atomic::Ordering::Relaxed);
        let pool_peak = sampler.await.unwrap_or(0);
        Ok((side, ttft, queued, pool_peak))
    });
    let (side, ttft, queued, pool_peak) = run?;
    let peak_rss = peak_rss(pid);
    // SIGTERM: the daemon drains, flushes and exits 0; anything else is a failure.
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.0.try_wait().map_err(io("waiting for", &o.kvstackd))? {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            return Err(Error::Run(
                "kvstackd did not exit 60 s after SIGTERM".into(),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if !status.success() {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        return Err(Error::Run(format!(
            "kvstackd exited with {status} after SIGTERM; its log:\n{log}"
        )));
    }
    Ok(DaemonRun {
        side,
        ttft,
        queued,
        peak_rss,
        pool_peak,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_stream_parsing() {
        let p = Percentiles::of((1..=100).map(f64::from).collect());
        assert_eq!((p.p50, p.p99), (51.0, 99.0));
        let body = b"data: {\"choices\":[{\"token\":5}]}\n\ndata: {\"choices\":[{\"token\":6}]}\n\ndata: {\"choices\":[{\"finish_reason\":\"length\"}],\"usage\":{\"kvstack\":{\"ttft_queued_ms\":2.5}}}\n\ndata: [DONE]\n\n";
        assert_eq!(parse_stream(body).unwrap(), (2, 2.5));
        assert!(parse_stream(b"event: error\ndata: {}\n\n").is_err());
        assert!(parse_stream(b"data: {\"choices\":[{\"token\":5}]}\n\n").is_err());
        assert_ne!(prompt(0, 8), prompt(1, 8));
        assert!(prompt(3, 500).iter().all(|&t| t < 250));
    }
}
