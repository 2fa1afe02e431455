//! The non-attention math of the V4.1 forward pass (spec §9): hyper-connections, the MoE and
//! sampling. Attention lives in [`crate::csa2`]; the runtime strings the pieces together.

pub mod hc;
pub mod moe;
pub mod sample;

pub use hc::{HcMix, HcShape, HcSite};
pub use moe::{Expert, MoeShape, Route};
pub use sample::{Sampling, argmax, sample};
