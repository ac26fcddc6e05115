//! Errors of the tables.  The binding crate maps each variant to a named
//! Python exception (see `rust/py/src/errors.rs`).

use std::fmt;

/// Why a table operation was refused.  Every refusal leaves the table as it
/// was: nothing is evicted, and a reservation made for the refused insert is
/// given back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableError {
    /// The insert would take the table over its capacity; nothing was evicted.
    Full {
        /// Payload bytes the refused insert asked for.
        requested: u64,
        /// Payload bytes held (and reserved by inserts in progress) when it was refused.
        used: u64,
        /// The table's bound, in bytes.
        capacity: u64,
    },
    /// The key is already held (intercept table only; the fetch buffer replaces).
    Duplicate {
        /// The id that is already held.
        key: String,
    },
    /// The rollout is not open, or closed while the insert ran.
    RolloutClosed {
        /// The rollout the insert named.
        rollout_id: String,
    },
    /// Payload length does not match shape × itemsize, or a bad dtype/shape.
    Invalid {
        /// What was wrong, for a person to read.
        reason: String,
    },
    /// The operating system refused memory for a payload.
    Alloc {
        /// Size of the refused allocation, in bytes.
        bytes: usize,
        /// The allocator's or the OS's error.
        reason: String,
    },
}

impl fmt::Display for TableError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TableError::Full { requested, used, capacity } => {
                write!(f, "table full: {requested} bytes requested, {used} of {capacity} bytes in use")
            }
            TableError::Duplicate { key } => write!(f, "{key:?} is already held"),
            TableError::RolloutClosed { rollout_id } => write!(f, "rollout {rollout_id:?} is not open"),
            TableError::Invalid { reason } => f.write_str(reason),
            TableError::Alloc { bytes, reason } => write!(f, "could not allocate {bytes} bytes: {reason}"),
        }
    }
}

impl std::error::Error for TableError {}
