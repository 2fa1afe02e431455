//! End-to-end tests across the kvstack crates live in `tests/tests/`; this library is empty.
//!
//! - `layers.rs`: the workspace's layering, read from `cargo metadata` (every dependency
//!   points to a crate of lower rank).
