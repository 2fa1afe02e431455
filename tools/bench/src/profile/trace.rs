//! Request traces in the Mooncake FAST'25 JSONL format: one request a line, `timestamp` (ms
//! from the start), `input_length`, `output_length` (tokens) and `hash_ids` (one id per
//! 512-token block of the prompt; equal ids mean equal prefixes). Other fields are ignored.
//!
//! The parser is bounded and strict, so that it can be fed any bytes (a fuzz target calls
//! [`parse_trace`]): a line over [`MAX_TRACE_LINE_BYTES`] is refused before it is parsed,
//! every field is range-checked, and an error names the line and the field.

use std::path::Path;

use crate::{Error, Result};

/// Tokens per hash id.
pub const TRACE_BLOCK_TOKENS: u64 = 512;

/// Longest line accepted (a 126K-token prompt's line is about 2 KB).
pub const MAX_TRACE_LINE_BYTES: usize = 1 << 20;

/// Largest trace file read.
pub const MAX_TRACE_FILE_BYTES: u64 = 256 << 20;

/// Longest prompt accepted, in tokens.
pub const MAX_INPUT_TOKENS: u64 = 16 << 20;

/// Longest output accepted, in tokens.
pub const MAX_OUTPUT_TOKENS: u64 = 1 << 20;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceRequest {
    /// Arrival, milliseconds from the start of the trace.
    pub timestamp_ms: u64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Output tokens.
    pub output_length: u64,
    /// One id per 512-token block of the prompt (the last may be partial).
    pub hash_ids: Vec<u64>,
}

impl TraceRequest {
    /// Whole 512-token blocks of the prompt.
    pub fn full_blocks(&self) -> usize {
        (self.input_length / TRACE_BLOCK_TOKENS) as usize
    }
}

/// A parsed trace, requests in arrival order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Trace {
    /// The requests.
    pub requests: Vec<TraceRequest>,
}

impl Trace {
    /// Prompt tokens of all requests.
    pub fn input_tokens(&self) -> u64 {
        self.requests.iter().map(|r| r.input_length).sum()
    }

    /// Milliseconds from the first arrival to the last.
    pub fn span_ms(&self) -> u64 {
        match (self.requests.first(), self.requests.last()) {
            (Some(a), Some(b)) => b.timestamp_ms - a.timestamp_ms,
            _ => 0,
        }
    }
}

fn bad(line: usize, field: Option<&'static str>, reason: impl Into<String>) -> Error {
    Error::Trace {
        line,
        field,
        reason: reason.into(),
    }
}

fn integer(
    obj: &serde_json::Map<String, serde_json::Value>,
    line: usize,
    field: &'static str,
    lo: u64,
    hi: u64,
) -> Result<u64> {
    let v = obj
        .get(field)
        .ok_or_else(|| bad(line, Some(field), "missing"))?;
    let n = v.as_u64().ok_or_else(|| {
        bad(
            line,
            Some(field),
            format!("{v} is not a non-negative integer"),
        )
    })?;
    if !(lo..=hi).contains(&n) {
        return Err(bad(line, Some(field), format!("{n} is not in {lo}..={hi}")));
    }
    Ok(n)
}

/// Parses one line (number `line`, from 1, for errors); `Ok(None)` for a blank line.
///
/// # Errors
/// [`Error::Trace`] naming the line and the field: too long, not a JSON object, a field
/// missing, of the wrong type or out of range, `hash_ids` not `ceil(input_length / 512)`
/// long.
pub fn parse_trace_line(text: &[u8], line: usize) -> Result<Option<TraceRequest>> {
    if text.len() > MAX_TRACE_LINE_BYTES {
        return Err(bad(
            line,
            None,
            format!(
                "{} bytes is longer than the {MAX_TRACE_LINE_BYTES}-byte limit",
                text.len()
            ),
        ));
    }
    if text.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let value: serde_json::Value = serde_json::from_slice(text)
        .map_err(|e| bad(line, None, format!("not valid JSON: {e}")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| bad(line, None, "not a JSON object"))?;
    let timestamp_ms = integer(obj, line, "timestamp", 0, u64::MAX / 4)?;
    let input_length = integer(obj, line, "input_length", 1, MAX_INPUT_TOKENS)?;
    let output_length = integer(obj, line, "output_length", 0, MAX_OUTPUT_TOKENS)?;
    let ids = obj
        .get("hash_ids")
        .ok_or_else(|| bad(line, Some("hash_ids"), "missing"))?
        .as_array()
        .ok_or_else(|| bad(line, Some("hash_ids"), "not an array"))?;
    let want = input_length.div_ceil(TRACE_BLOCK_TOKENS) as usize;
    if ids.len() != want {
        return Err(bad(
            line,
            Some("hash_ids"),
            format!(
                "{} ids, but an input of {input_length} tokens has {want} blocks of {TRACE_BLOCK_TOKENS}",
                ids.len()
            ),
        ));
    }
    let hash_ids = ids
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64().ok_or_else(|| {
                bad(
                    line,
                    Some("hash_ids"),
                    format!("element {i} ({v}) is not a non-negative integer"),
                )
            })
        })
        .collect::<Result<Vec<u64>>>()?;
    Ok(Some(TraceRequest {
        timestamp_ms,
        input_length,
        output_length,
        hash_ids,
    }))
}

/// Parses a whole trace from bytes, at most `max_requests` requests (the rest is not read).
/// Timestamps must not decrease.
///
/// # Errors
/// As [`parse_trace_line`]; a timestamp before the previous request's.
pub fn parse_trace(bytes: &[u8], max_requests: Option<usize>) -> Result<Trace> {
    let mut requests: Vec<TraceRequest> = Vec::new();
    let limit = max_requests.unwrap_or(usize::MAX);
    for (i, text) in bytes.split(|&b| b == b'\n').enumerate() {
        if requests.len() >= limit {
            break;
        }
        let Some(r) = parse_trace_line(text, i + 1)? else {
            continue;
        };
        if let Some(prev) = requests.last()
            && r.timestamp_ms < prev.timestamp_ms
        {
            return Err(bad(
                i + 1,
                Some("timestamp"),
                format!(
                    "{} ms is earlier than the previous request's {} ms (requests must be in \
                     arrival order)",
                    r.timestamp_ms, prev.timestamp_ms
                ),
            ));
        }
        requests.push(r);
    }
    Ok(Trace { requests })
}

/// [`parse_trace`] over text.
///
/// # Errors
/// As [`parse_trace`].
pub fn parse_trace_str(text: &str, max_requests: Option<usize>) -> Result<Trace> {
    parse_trace(text.as_bytes(), max_requests)
}

/// Reads and parses a trace file (a regular file of at most [`MAX_TRACE_FILE_BYTES`]).
///
/// # Errors
/// [`Error::TraceFile`]; as [`parse_trace`].
pub fn read_trace(path: &Path, max_requests: Option<usize>) -> Result<Trace> {
    let bytes =
        kvstack_spec::files::read_regular(path, MAX_TRACE_FILE_BYTES).map_err(|source| {
            Error::TraceFile {
                path: path.to_path_buf(),
                source,
            }
        })?;
    parse_trace(&bytes, max_requests)
}
