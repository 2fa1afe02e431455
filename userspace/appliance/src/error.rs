//! The appliance's errors: configuration, start-up (sockets, systemd), the engine below.

use std::path::PathBuf;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of kvstackd.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A config key has a bad value (or a required one is missing).
    #[error("config key `{key}`: {reason}")]
    Config {
        /// The key (`engine.chunk`, `tenant[1].api_key_sha256`, `--listen`).
        key: String,
        /// What is wrong.
        reason: String,
    },

    /// The config file cannot be read or is not valid TOML (unknown keys included).
    #[error("config file {}: {reason}", path.display())]
    ConfigFile {
        /// The file.
        path: PathBuf,
        /// What is wrong, with the line where TOML gives one.
        reason: String,
    },

    /// A socket could not be bound, adopted or prepared.
    #[error("listening on {addr}: {source}")]
    Listen {
        /// The address (`unix:PATH`, `tcp:ADDR`, `LISTEN_FDS #n`).
        addr: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },

    /// Other start-up I/O: the runtime, the data directory.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },

    /// A KV-cache API frame is malformed (`docs/kv-protocol.md`).
    #[error("frame field `{field}`: {reason}")]
    Frame {
        /// The field or section (`magic`, `header`, `blocks[3]`, `crc32c[3]`, `window`).
        field: String,
        /// What is wrong.
        reason: String,
    },

    /// The engine thread stopped (it failed or the daemon is shutting down).
    #[error("the engine is not running")]
    EngineGone,

    /// The engine, the model or the tiers.
    #[error(transparent)]
    Engine(#[from] kvstack_engine::Error),

    /// The tiers (KV-cache API).
    #[error(transparent)]
    Tiers(#[from] kvstack_tiers::Error),

    /// The model (tokenizer).
    #[error(transparent)]
    Model(#[from] kvstack_model::Error),
}
