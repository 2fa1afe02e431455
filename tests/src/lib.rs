//! End-to-end tests across the kvstack crates live in `tests/tests/`; this library is empty.
//!
//! Tests here combine layers the way the runtime does (plan + codecs + arithmetic) and load
//! inputs from `../shared` beside the repository root, never from copies.
