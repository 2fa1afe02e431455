//! The profiler's trace parser (`kvstack profile replay --trace`) on arbitrary bytes, then, when
//! a trace parses, the session inference and the token derivation the replay runs on it.
//! Errors are fine (each names its line); a panic, a hang or an allocation not bounded by the
//! input's checked sizes is not.
#![no_main]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvstack_bench::profile::tokens::Sessions;
use kvstack_bench::profile::trace::parse_trace;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(trace) = parse_trace(data, Some(64)) else {
        return;
    };
    let mut prev = 0;
    for r in &trace.requests {
        assert!(r.timestamp_ms >= prev, "arrival order");
        prev = r.timestamp_ms;
        assert_eq!(r.hash_ids.len() as u64, r.input_length.div_ceil(512));
    }
    let _ = (trace.input_tokens(), trace.span_ms());
    let sessions = Sessions::infer(&trace);
    assert!(sessions.count() as usize <= trace.requests.len().max(1));
    // Token derivation of short requests only: a valid line may declare millions of tokens,
    // which the replay streams; materializing them here would only measure memory.
    let mut buf = Vec::new();
    for (i, r) in trace.requests.iter().enumerate() {
        if r.input_length > 1 << 16 {
            continue;
        }
        buf.clear();
        sessions.prompt(&trace, i, &mut buf);
        assert_eq!(buf.len() as u64, r.input_length, "request {i}");
        if let Some(next) = sessions.next(i) {
            assert!(next > i, "a session's next turn comes later");
        }
    }
});
