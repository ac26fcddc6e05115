//! lowwater-core: the two tables whose leaks hurt real systems most.
//!
//! * [`FetchBuffer`]: a consumer's shard fetch buffer (`shard_id -> shard`).
//! * [`InterceptTable`]: request bodies of in-flight model calls.
//!
//! Both are lock-free concurrent maps (papaya) with explicit eviction only, a
//! capacity bound that refuses instead of evicting, exact stats, and prompt
//! release: a removed payload is taken out of its map cell at removal, so it
//! is freed when its last [`std::sync::Arc`] drops rather than when the map's
//! deferred reclamation gets to the cell.  Pure Rust: no pyo3 here.

#![deny(missing_docs)]

mod accounting;
pub mod dtype;
pub mod error;
pub mod fetch_buffer;
pub mod intercept;
pub mod payload;
mod sync;

pub use error::TableError;
pub use fetch_buffer::{FetchBuffer, FetchStats, PendingShard, Shard};
pub use intercept::{Intercept, InterceptStats, InterceptTable};
pub use payload::{LiveBytes, Payload, PayloadMut};
