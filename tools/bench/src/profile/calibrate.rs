//! Calibration of the prefill cost model on the real engine: the first requests of a trace
//! through `kvstack_engine::Service` on the built-in model (the V4.1-Flash cache geometry with
//! a small hidden size, weights from a seed), without tiers, so every token is computed.

use std::time::Instant;

use kvstack_cache::CacheOptions;
use kvstack_engine::{EngineOptions, Event, ModelSource, RequestSpec, Service, ServiceOptions};
use kvstack_kernels::model::Sampling;
use serde::Serialize;

use super::tokens::Sessions;
use super::trace::Trace;
use crate::{Error, Result};

/// What the engine measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Calibration {
    /// The model.
    pub model: String,
    /// Requests run.
    pub requests: u64,
    /// Prompt tokens computed (each prompt cut to the cap).
    pub tokens: u64,
    /// Tokens per prompt at most.
    pub max_tokens: u64,
    /// Prefill rows per second the engine measured.
    pub prefill_tokens_per_s: f64,
    /// Wall seconds of the whole calibration (model generation included).
    pub seconds: f64,
}

/// Runs the first `requests` prompts of `trace` (their first `max_tokens` tokens, mapped into
/// the model's vocabulary) one after another, one output token each, and returns the
/// engine's prefill rate.
///
/// # Errors
/// The engine's errors; [`Error::Run`] when a request fails.
pub fn calibrate(
    trace: &Trace,
    sessions: &Sessions,
    requests: usize,
    max_tokens: usize,
    threads: usize,
) -> Result<Calibration> {
    let start = Instant::now();
    let model = ModelSource::BuiltinTiny { seed: 1 };
    let name = model.name();
    let mut opts = ServiceOptions::new(model);
    opts.threads = threads.max(1);
    opts.engine = EngineOptions {
        cache: CacheOptions {
            context_limit: (max_tokens as u64 + 16).next_multiple_of(256),
            max_sequences: 2,
            ..CacheOptions::default()
        },
        ..EngineOptions::default()
    };
    let mut service = Service::open(opts)?;
    let vocab = service.engine().model().dims().vocab.max(1) as u32;
    let mut buf = Vec::new();
    let mut tokens = 0u64;
    let n = requests.min(trace.requests.len());
    for i in 0..n {
        sessions.prompt(trace, i, &mut buf);
        buf.truncate(max_tokens.max(1));
        let prompt: Vec<u32> = buf.iter().map(|t| t % vocab).collect();
        tokens += prompt.len() as u64;
        let session = service.open_session("calibration");
        service.submit(
            session,
            RequestSpec {
                tokens: prompt,
                max_new_tokens: 1,
                sampling: Sampling::Greedy,
                seed: i as u64,
            },
        )?;
        while !service.is_idle() {
            for ev in service.step()? {
                if let Event::Failed { error, .. } = ev {
                    return Err(Error::Run(format!("calibration request {i}: {error}")));
                }
            }
        }
        service.close_session(session)?;
    }
    let rate = service.engine().stats().prefill_rate();
    service.close()?;
    Ok(Calibration {
        model: name,
        requests: n as u64,
        tokens,
        max_tokens: max_tokens as u64,
        prefill_tokens_per_s: rate,
        seconds: start.elapsed().as_secs_f64(),
    })
}
