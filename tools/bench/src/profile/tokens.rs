//! Token ids and sessions for a trace that has neither.
//!
//! - **Tokens**: block id `h` stands for 512 tokens, token `j` of it `mix(h, j)`: the same id
//!   gives the same tokens wherever it appears, so prefixes match exactly where the trace
//!   says they do.
//! - **Sessions** (inferred, [`Sessions::infer`]): a request whose whole blocks begin with all
//!   the whole blocks of an earlier, shorter request is that request's next turn (the first
//!   such request only; later ones share the prefix as other sessions). In a conversation the
//!   next prompt contains the previous prompt and its answer, but the trace's ids cannot say
//!   so for the previous prompt's partial last block (its id hashed fewer tokens) nor for the
//!   answer (it has no ids). So the previous turn's partial block takes the tokens of the
//!   block the next turn has there, and its output tokens are the next turn's tokens at those
//!   positions (as far as the next prompt reaches; beyond it, tokens of their own). Without
//!   inference ([`Sessions::none`]) every request is its own session and a turn shares with
//!   the previous one only the whole blocks the ids say.

use std::collections::HashMap;

use super::trace::{TRACE_BLOCK_TOKENS, Trace};

/// Token ids are below this (any `u32` would do for the tiers; a bound keeps them valid for
/// vocabularies of real models).
const TOKEN_RANGE: u64 = 1 << 17;

fn mix(mut x: u64) -> u64 {
    // splitmix64's finaliser: consecutive inputs give unrelated outputs.
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Token `offset` of block id `id`.
fn block_token(id: u64, offset: u64) -> u32 {
    (mix(id.wrapping_mul(TRACE_BLOCK_TOKENS) ^ offset.rotate_left(48)) % TOKEN_RANGE) as u32
}

/// A token of request `req` that no other request has (an output nobody continues).
fn own_token(req: usize, pos: u64) -> u32 {
    (mix(mix(req as u64 | 1 << 63) ^ pos) % TOKEN_RANGE) as u32
}

/// Sessions of a trace and the token ids of every request.
#[derive(Clone, Debug, Default)]
pub struct Sessions {
    /// The next turn of each request.
    next: Vec<Option<u32>>,
    /// The session of each request (numbered by first request).
    session: Vec<u32>,
    /// Partial blocks whose tokens are another block's.
    alias: HashMap<u64, u64>,
    sessions: u32,
}

impl Sessions {
    /// Every request its own session; tokens from the ids alone.
    pub fn none(trace: &Trace) -> Sessions {
        let n = trace.requests.len();
        Sessions {
            next: vec![None; n],
            session: (0..n as u32).collect(),
            alias: HashMap::new(),
            sessions: n as u32,
        }
    }

    /// Sessions inferred from prefix extension (module docs).
    pub fn infer(trace: &Trace) -> Sessions {
        let reqs = &trace.requests;
        let n = reqs.len();
        let mut next: Vec<Option<u32>> = vec![None; n];
        let mut prev: Vec<Option<u32>> = vec![None; n];
        let mut alias = HashMap::new();
        // (whole blocks, id of the last whole block) -> the latest request ending its whole
        // blocks there. Ids chain, so an equal id at an equal position means an equal prefix.
        let mut ends: HashMap<(usize, u64), usize> = HashMap::new();
        for (i, r) in reqs.iter().enumerate() {
            let full = r.full_blocks().min(r.hash_ids.len());
            for k in (1..=full).rev() {
                let Some(&e) = ends.get(&(k, r.hash_ids[k - 1])) else {
                    continue;
                };
                let earlier = &reqs[e];
                if next[e].is_some() || earlier.input_length >= r.input_length {
                    continue;
                }
                next[e] = Some(i as u32);
                prev[i] = Some(e as u32);
                let tail = earlier.full_blocks();
                if let (Some(&x), Some(&y)) = (earlier.hash_ids.get(tail), r.hash_ids.get(tail))
                    && x != y
                {
                    alias.entry(x).or_insert(y);
                }
                break;
            }
            if full > 0 {
                ends.insert((full, r.hash_ids[full - 1]), i);
            }
        }
        let mut session = vec![0u32; n];
        let mut sessions = 0u32;
        for i in 0..n {
            session[i] = match prev[i] {
                Some(p) => session[p as usize],
                None => {
                    sessions += 1;
                    sessions - 1
                }
            };
        }
        Sessions {
            next,
            session,
            alias,
            sessions,
        }
    }

    /// Sessions found.
    pub fn count(&self) -> u32 {
        self.sessions
    }

    /// Requests that continue an earlier one.
    pub fn continued(&self) -> usize {
        self.next.iter().filter(|n| n.is_some()).count()
    }

    /// The session of request `req`.
    pub fn session(&self, req: usize) -> u32 {
        self.session.get(req).copied().unwrap_or(u32::MAX)
    }

    /// The next turn of request `req`, if it has one.
    pub fn next(&self, req: usize) -> Option<usize> {
        self.next.get(req).copied().flatten().map(|n| n as usize)
    }

    /// The block whose tokens `id` has (itself unless it is an aliased partial block).
    fn resolve(&self, mut id: u64) -> u64 {
        // Aliases point from an earlier request's block to a later one's; a chain is at most
        // as long as a session, and the bound only guards against a malformed trace.
        for _ in 0..1024 {
            match self.alias.get(&id) {
                Some(&to) if to != id => id = to,
                _ => break,
            }
        }
        id
    }

    /// The prompt tokens of request `req`, appended to `out` (cleared first).
    pub fn prompt(&self, trace: &Trace, req: usize, out: &mut Vec<u32>) {
        out.clear();
        let Some(r) = trace.requests.get(req) else {
            return;
        };
        for (b, &id) in r.hash_ids.iter().enumerate() {
            let base = self.resolve(id);
            let first = b as u64 * TRACE_BLOCK_TOKENS;
            let n = (r.input_length - first).min(TRACE_BLOCK_TOKENS);
            out.extend((0..n).map(|j| block_token(base, j)));
        }
    }

    /// The output tokens of request `req` (positions `input_length ..` of its sequence),
    /// appended to `out` (cleared first): the next turn's prompt tokens there, as far as it
    /// reaches, then tokens of its own.
    pub fn output(&self, trace: &Trace, req: usize, out: &mut Vec<u32>) {
        out.clear();
        let Some(r) = trace.requests.get(req) else {
            return;
        };
        let (start, end) = (r.input_length, r.input_length + r.output_length);
        let mut upto = start;
        if let Some(nx) = self.next(req).and_then(|n| trace.requests.get(n)) {
            upto = end.min(nx.input_length);
            let mut p = start;
            while p < upto {
                let b = (p / TRACE_BLOCK_TOKENS) as usize;
                let base = self.resolve(nx.hash_ids.get(b).copied().unwrap_or(0));
                let block_end = ((b as u64 + 1) * TRACE_BLOCK_TOKENS).min(upto);
                out.extend((p..block_end).map(|q| block_token(base, q % TRACE_BLOCK_TOKENS)));
                p = block_end;
            }
        }
        out.extend((upto..end).map(|p| own_token(req, p)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::trace::parse_trace_str;

    #[test]
    fn equal_ids_give_equal_tokens_and_turns_continue() {
        let t = parse_trace_str(
            concat!(
                r#"{"timestamp": 0, "input_length": 700, "output_length": 100, "hash_ids": [1, 2]}"#,
                "\n",
                r#"{"timestamp": 5, "input_length": 1100, "output_length": 10, "hash_ids": [1, 3, 4]}"#,
                "\n",
                r#"{"timestamp": 9, "input_length": 600, "output_length": 10, "hash_ids": [1, 5]}"#,
            ),
            None,
        )
        .unwrap();
        let s = Sessions::infer(&t);
        assert_eq!(s.next(0), Some(1));
        assert_eq!(
            s.next(1),
            None,
            "request 2 does not extend request 1's whole blocks"
        );
        assert_eq!(s.next(2), None);
        assert_eq!((s.session(0), s.session(1), s.session(2)), (0, 0, 1));
        let (mut a, mut b, mut o) = (Vec::new(), Vec::new(), Vec::new());
        s.prompt(&t, 0, &mut a);
        s.prompt(&t, 1, &mut b);
        s.output(&t, 0, &mut o);
        assert_eq!(a.len(), 700);
        assert_eq!(o.len(), 100);
        // The next turn holds the whole previous turn: prompt, then output.
        assert_eq!(&b[..700], &a[..]);
        assert_eq!(&b[700..800], &o[..]);
        // Without inference only the whole block is shared.
        let none = Sessions::none(&t);
        none.prompt(&t, 0, &mut a);
        none.prompt(&t, 1, &mut b);
        assert_eq!(&a[..512], &b[..512]);
        assert_ne!(&a[512..600], &b[512..600]);
        none.output(&t, 0, &mut o);
        assert_ne!(&b[700..800], &o[..]);
    }
}
