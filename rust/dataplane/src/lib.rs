//! lowwater-dataplane: the interception proxy's data plane in Rust.
//!
//! An HTTP/1.1 server (hyper on a bounded tokio runtime) that takes an
//! agent's OpenAI/Anthropic-compatible model calls, authenticates each by its
//! rollout's secret, forwards it to the upstream with the upstream's key
//! (the plane's, or the rollout's own: [`DataPlane::register_with`]),
//! rewritten as configured ([`Rewrites`], [`rewrite`]), relays the answer
//! (SSE event by event), and hands each finished call to the control plane
//! as a [`TurnRecord`] through a [`CompletionQueue`] with a wakeup fd.  It
//! also answers `GET /v1/models` with the rollout's model.  The control plane (Python, in a later step) registers and
//! unregisters rollouts, turns records into trajectory turns, and acks them;
//! see docs/dataplane.md for the boundary.  Pure Rust, no pyo3.
//!
//! # Status codes
//!
//! | status | when |
//! |---|---|
//! | 400 | malformed JSON, nesting deeper than [`protocol::MAX_JSON_DEPTH`], a missing or mistyped field, a forwarded header that is not ASCII, a body cut short |
//! | 401 | missing or unknown secret, or keys of two rollouts (`connection: close`: the body is not read) |
//! | 404 / 405 | no such route / not a POST (with `allow: POST`); `/v1/models` not a GET (`allow: GET`) |
//! | 408 | the body not all received within [`Config::body_read_timeout`] (`connection: close`) |
//! | 410 | the rollout was closed before or during the call, or while an upcall of it waited (a stream under way gets an error event instead) |
//! | 413 | body over [`Config::max_body_bytes`] (the rest is drained first) |
//! | upstream's | the upstream's answer, passed on (429 with its `retry-after`) |
//! | control plane's | an intercepted call rejected ([`Upcalls::reject`], 400-599), a Python route's answer ([`Upcalls::respond`]) |
//! | 503 | the plane closing while an upcall waits, or an upcall asked after ([`Upcalls::close`]) |
//! | 502 | upstream unreachable, 5xx after retries, an answer cut or too large |
//! | 504 | upstream timeout |
//!
//! The plane itself never answers 500 (an interceptor's reject may); error
//! bodies have the protocol's shape.
//!
//! # Allocator
//!
//! glibc malloc keeps the pages freed into its arenas, so a burst handled by
//! tokio's worker threads would leave the process's resident size at the
//! burst's peak (measured in the standalone plane process after 16,384 open
//! rollouts: 297 MiB resting against a 42 MiB baseline).  The plane gives
//! them back itself: with [`Config::trim_when_idle`] (on by default) a
//! thread of its own calls `malloc_trim(0)` once the plane has been still
//! for a second (no call started, connection ended or rollout closed), and again once the idle upstream connections have closed (60 MiB
//! resting in the same run).  The final artifact chooses the global
//! allocator; the extension module keeps glibc's, under [`BufferAlloc`]
//! (hyper's 8 KiB connection buffers on pages of their own, given back when freed).  The crate can also be
//! built for mimalloc (feature `mimalloc`, on by default; [`Allocator`]),
//! which the crate's own tests use: compiled with `local_dynamic_tls`,
//! because the default initial-exec TLS model can fail with "cannot allocate
//! memory in static TLS block" in a library CPython `dlopen`s.  As the
//! extension's global allocator it rested at 129 MiB in the same bench and
//! cost more per open rollout (docs/dataplane.md#the-allocator).  The
//! runtime is bounded too ([`Config::worker_threads`], 1 or 2 by default:
//! [`default_worker_threads`]).
//!
//! # Cargo features
//!
//! * `mimalloc` (default): mimalloc as [`Allocator`], for an artifact's
//!   `#[global_allocator]` (the crate's tests set it).
//! * `tls` (off by default; the wheel turns it on): rustls (ring) for
//!   `https://` upstreams, trusting the Mozilla roots and the PEM file
//!   `SSL_CERT_FILE` names.  Off, an https upstream is refused at start
//!   ([`ConfigError::HttpsNeedsTls`]); loopback upstreams need none.
//!
//! Under `--cfg loom` only [`lifecycle`] is compiled (tests/loom.rs models
//! `unregister` racing in-flight calls).

#![deny(missing_docs)]

pub mod lifecycle;
mod sync;

#[cfg(not(loom))]
mod body;
#[cfg(not(loom))]
pub mod bufalloc;
#[cfg(not(loom))]
pub mod divergence;
#[cfg(not(loom))]
pub mod error;
#[cfg(not(loom))]
mod held;
#[cfg(not(loom))]
mod models;
#[cfg(not(loom))]
mod plane;
#[cfg(not(loom))]
pub mod protocol;
#[cfg(not(loom))]
pub mod queue;
#[cfg(not(loom))]
pub mod readable;
#[cfg(not(loom))]
pub mod rewrite;
#[cfg(not(loom))]
pub mod rollouts;
#[cfg(not(loom))]
mod scan;
#[cfg(not(loom))]
mod server;
#[cfg(not(loom))]
pub mod sse;
#[cfg(not(loom))]
mod trim;
pub mod upcall;
#[cfg(not(loom))]
mod upstream;

/// The byte buffer of the control API's bodies (the `bytes` crate's).
#[cfg(not(loom))]
pub use bufalloc::BufferAlloc;
#[cfg(not(loom))]
pub use bytes::Bytes;
#[cfg(not(loom))]
pub use error::{ConfigError, RegisterError};
/// The intercept table the plane holds request bodies in (from `lowwater-core`).
#[cfg(not(loom))]
pub use lowwater_core::InterceptTable;
#[cfg(not(loom))]
pub use plane::{default_worker_threads, Config, DataPlane, RolloutOptions, StartError, Stats};
#[cfg(not(loom))]
pub use protocol::{ProtocolId, ProtocolSpec, ProtocolTable};
#[cfg(not(loom))]
pub use queue::{CompletionQueue, RequestDelta, Timings, TurnRecord, Verdict};
#[cfg(not(loom))]
pub use rewrite::Rewrites;
#[cfg(not(loom))]
pub use rollouts::RolloutTable;
/// How long a record released without the ack may wait for its batch's wakeup.
#[cfg(not(loom))]
pub use server::RELEASED_RECORD_DELAY;
#[cfg(not(loom))]
pub use upcall::{AnswerError, Intercept, Upcall, UpcallKind, Upcalls};

/// The data plane's allocator, for the final artifact's `#[global_allocator]`
/// (see the crate docs' Allocator section).
#[cfg(all(feature = "mimalloc", not(loom)))]
pub use mimalloc::MiMalloc as Allocator;
