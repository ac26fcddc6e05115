//! The lock the call lifecycle is written against: std's `Mutex`, or loom's
//! under `--cfg loom` so tests/loom.rs explores every interleaving of
//! `unregister` against in-flight calls.

#[cfg(loom)]
pub(crate) use loom::sync::Mutex;
#[cfg(not(loom))]
pub(crate) use std::sync::Mutex;

/// Lock `m`, ignoring poisoning: the guarded state is left consistent at every
/// point a panic could unwind from (each update is one push, remove or flag).
pub(crate) fn lock<T>(m: &Mutex<T>) -> impl std::ops::DerefMut<Target = T> + '_ {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
