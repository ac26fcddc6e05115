//! Errors of the tables.  The binding crate maps each variant to a named
//! Python exception (see `rust/py/src/errors.rs`).

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableError {
    /// The insert would take the table over its capacity; nothing was evicted.
    Full { requested: u64, used: u64, capacity: u64 },
    /// The key is already held (intercept table only; the fetch buffer replaces).
    Duplicate { key: String },
    /// The rollout is not open, or closed while the insert ran.
    RolloutClosed { rollout_id: String },
    /// Payload length does not match shape × itemsize, or a bad dtype/shape.
    Invalid { reason: String },
    /// The operating system refused memory for a payload.
    Alloc { bytes: usize, reason: String },
}

impl fmt::Display for TableError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TableError::Full { requested, used, capacity } => write!(
                f,
                "table full: {requested} bytes requested, {used} of {capacity} bytes in use"
            ),
            TableError::Duplicate { key } => write!(f, "{key:?} is already held"),
            TableError::RolloutClosed { rollout_id } => write!(f, "rollout {rollout_id:?} is not open"),
            TableError::Invalid { reason } => f.write_str(reason),
            TableError::Alloc { bytes, reason } => write!(f, "could not allocate {bytes} bytes: {reason}"),
        }
    }
}

impl std::error::Error for TableError {}
