//! The errors of config parsing, the layer plan and the cache arithmetic.
//!
//! Every variant points at the offending input: the file (for I/O and JSON errors), the config
//! field as written in the file (`text_config.` prefixed when the text model is nested), and
//! for layer-plan violations the layer index.

use std::path::PathBuf;

use crate::config::Generation;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of config parsing, the layer plan and the cache arithmetic.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The config file could not be read.
    #[error("{}: cannot read config", path.display())]
    Io {
        /// The file that was being read.
        path: PathBuf,
        /// Why: an I/O error, not a regular file, or over the size limit.
        #[source]
        source: crate::files::FileError,
    },

    /// The config text is not valid JSON.
    #[error("{}: invalid JSON", path.display())]
    Json {
        /// The file the text came from (`<string>` for text passed in memory).
        path: PathBuf,
        /// The parser's error, with line and column.
        #[source]
        source: serde_json::Error,
    },

    /// A field the requested computation needs is absent (or JSON `null`).
    #[error("config field `{field}` is missing")]
    MissingField {
        /// The field, as written in the file (e.g. `text_config.head_dim`).
        field: String,
    },

    /// A field is present but has the wrong type or an unusable value.
    #[error("config field `{field}` is invalid: {reason}")]
    InvalidField {
        /// The field, as written in the file.
        field: String,
        /// What is wrong with it.
        reason: String,
    },

    /// The layer plan described by the config violates a rule of spec §4.
    #[error("layer {layer}: `{field}`: {reason}")]
    Plan {
        /// The layer the violation is about.
        layer: usize,
        /// The config field that has to change to fix it.
        field: String,
        /// Which rule is violated, and how.
        reason: String,
    },

    /// A storage-format name that is not known.
    #[error("unknown {kind} format {name:?} (expected one of: {expected})")]
    UnknownFormat {
        /// `global` or `index`.
        kind: &'static str,
        /// The name that was given.
        name: String,
        /// The accepted names, comma separated.
        expected: String,
    },

    /// A storage format that cannot describe this generation's cache entries.
    #[error("{kind} format `{format}` does not apply to {generation}: {reason}")]
    FormatNotApplicable {
        /// `global` or `index`.
        kind: &'static str,
        /// The format's name.
        format: &'static str,
        /// The generation of the model.
        generation: Generation,
        /// Why it does not apply.
        reason: String,
    },
}

impl Error {
    /// The config field an error is about, when it is a config or plan error about one.
    pub fn field(&self) -> Option<&str> {
        match self {
            Error::MissingField { field }
            | Error::InvalidField { field, .. }
            | Error::Plan { field, .. } => Some(field),
            _ => None,
        }
    }

    /// The layer a layer-plan error is about.
    pub fn layer(&self) -> Option<usize> {
        match self {
            Error::Plan { layer, .. } => Some(*layer),
            _ => None,
        }
    }
}
