//! Error types of the simulator library: configuration problems (reported to whoever wrote the
//! fleet file, naming the field or value at fault) and start-up failures.

use std::path::PathBuf;

/// A fleet file or preset that cannot be turned into pods.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read fleet file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The JSON is malformed, has an unknown field or a value of the wrong type.
    #[error("invalid fleet file: {0}")]
    Json(#[from] serde_json::Error),
    /// A GPU key that has no profile.
    #[error("unknown gpu `{gpu}` (known: {known})")]
    UnknownGpu {
        /// The key given.
        gpu: String,
        /// The keys that exist.
        known: String,
    },
    /// A model whose architecture could not be inferred from its name.
    #[error("no architecture profile matches model `{model}`; set `arch` to one of: {known}")]
    UnknownModel {
        /// The model name.
        model: String,
        /// The profile keys that exist.
        known: String,
    },
    /// An `arch` key that has no profile.
    #[error("unknown arch `{arch}` (known: {known})")]
    UnknownArch {
        /// The key given.
        arch: String,
        /// The profile keys that exist.
        known: String,
    },
    /// A field whose value is out of range or inconsistent with another.
    #[error("pod `{pod}`: {message}")]
    Invalid {
        /// The pod (or `fleet` for top-level fields).
        pod: String,
        /// What is wrong.
        message: String,
    },
    /// The model's weights leave no room for a KV cache on that GPU.
    #[error("pod `{pod}`: model `{model}` leaves no KV-cache memory on a `{gpu}`")]
    DoesNotFit {
        /// The pod.
        pod: String,
        /// The model.
        model: String,
        /// The GPU key.
        gpu: String,
    },
    /// An unknown preset name.
    #[error("unknown preset `{0}` (known: demo)")]
    UnknownPreset(String),
}

/// A failure while starting the fleet.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A pod or the admin API could not bind its address.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The ports file could not be written.
    #[error("cannot write ports file {path}: {source}")]
    PortsFile {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
}
