//! Errors of the data plane's control API (the HTTP side answers with status
//! codes instead; see the crate docs' table).

use std::fmt;

/// A configuration the data plane cannot start with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigError {
    /// The upstream base URL does not parse, or is not `http://` or `https://`.
    Upstream(String),
    /// An `https://` upstream, but the crate was built without the `tls` feature.
    HttpsNeedsTls,
    /// A protocol table that cannot route (duplicate name or path, bad path).
    Protocol(String),
    /// A limit or count that must be positive is zero.
    Limit(&'static str),
    /// A request rewrite rule whose value is not JSON, or for a protocol the
    /// table does not have.
    Rewrite(String),
    /// An upcall option names no protocol, or a Python route prefix is not a path.
    Upcall(String),
    /// The TLS client cannot be built: `SSL_CERT_FILE` cannot be read or
    /// holds no certificate (the `tls` feature).
    Tls(String),
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Upstream(why) => write!(f, "bad upstream URL: {why}"),
            ConfigError::HttpsNeedsTls => {
                f.write_str("an https upstream needs the `tls` feature of lowwater-dataplane")
            }
            ConfigError::Protocol(why) => write!(f, "bad protocol table: {why}"),
            ConfigError::Limit(name) => write!(f, "{name} must be positive"),
            ConfigError::Rewrite(why) => write!(f, "bad request rewrite: {why}"),
            ConfigError::Upcall(why) => write!(f, "bad upcall option: {why}"),
            ConfigError::Tls(why) => write!(f, "TLS: {why}"),
        }
    }
}

impl std::error::Error for ConfigError {}

/// Why [`crate::RolloutTable::register`] refused a rollout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegisterError {
    /// A rollout with this id is open already.
    DuplicateRollout(String),
    /// Another open rollout has this secret.
    DuplicateSecret,
    /// The rollout id or the secret is empty.
    Empty,
    /// The rollout's own upstream URL or key is unusable (as at start).
    Config(ConfigError),
}

impl fmt::Display for RegisterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegisterError::DuplicateRollout(id) => write!(f, "rollout {id:?} is already registered"),
            RegisterError::DuplicateSecret => f.write_str("another open rollout has this secret"),
            RegisterError::Empty => f.write_str("the rollout id and the secret must not be empty"),
            RegisterError::Config(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for RegisterError {}

impl From<ConfigError> for RegisterError {
    fn from(e: ConfigError) -> Self {
        RegisterError::Config(e)
    }
}
