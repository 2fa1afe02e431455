//! The engine's errors: its own (a request it cannot take) and those of the crates it drives,
//! passed on unchanged (their messages and sources are the engine's).

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the serving engine and the service.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A request the engine cannot take.
    #[error("session {session}: {reason}")]
    Request {
        /// The session it was submitted to.
        session: u64,
        /// What is wrong with it.
        reason: String,
    },

    /// A service option is unusable (checked before anything is opened).
    #[error("invalid option `{field}`: {reason}")]
    InvalidOption {
        /// The option.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },

    /// The tiers cannot be closed or handed back: [`crate::Engine::shared_tiers`] handles
    /// are still held.
    #[error("the tiers are still in use by {others} other handle(s); drop them before closing")]
    TiersShared {
        /// Handles held besides the engine's.
        others: usize,
    },

    /// The model's config or plan.
    #[error(transparent)]
    Spec(#[from] kvstack_spec::Error),

    /// The paged cache.
    #[error(transparent)]
    Cache(#[from] kvstack_cache::Error),

    /// The SSD store, the window pool or the prefix units.
    #[error(transparent)]
    Tiers(#[from] kvstack_tiers::Error),

    /// The model: weights, attention, forward pass.
    #[error(transparent)]
    Model(#[from] kvstack_model::Error),
}
