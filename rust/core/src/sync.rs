//! Concurrency primitives the tables are written against.
//!
//! Normal builds use papaya's lock-free map and arc-swap's atomic slots.
//! Under `--cfg loom` both are replaced by lock-free stand-ins built on loom's
//! atomics (the `model` module below), so the loom models (tests/loom.rs)
//! explore the tables' own protocols (take on remove, insert against close)
//! with the atomics, orderings and fences production uses.
//!
//! The stand-ins must not order more than the real types do, or a missing
//! fence in a table goes unnoticed (it did while they were `Mutex`es: a lock
//! release/acquire pair orders both sides of insert-vs-close by itself).  What
//! production guarantees, and so all the stand-ins give:
//!
//! * papaya: a lookup is an `Acquire` load of the entry; an insert or removal
//!   is a `compare_exchange(Release, Acquire)` on it; a value stays readable
//!   under a guard after a concurrent removal (reclamation is deferred).
//! * arc-swap: `load`/`load_full` are `Acquire` (the implementation happens to
//!   use `SeqCst` for its debt list, which its own docs do not promise for the
//!   data); `swap` and the CAS under `rcu` are `AcqRel`.
//!
//! So each stand-in publishes an immutable version with a `Release` CAS and
//! reads it with an `Acquire` load: no locks, no `SeqCst`, and no
//! read-modify-write where production only loads (a loom RMW always reads the
//! newest value, a plain load may read an older one, as on real hardware).
//! The one exception is the loom [`Slot`]'s `load`, which must register as a
//! reader (an RMW on the slot's own state) before cloning; slots are only
//! read after the reads that close the insert-vs-close window, so this cannot
//! hide a missing fence there.

use std::borrow::Borrow;
use std::hash::Hash;

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};

/// A value cell whose payload is taken out at removal.
///
/// The map may keep a removed cell until its reclamation batch fills (papaya
/// reclaims through seize in batches); only this small shell waits, because
/// whoever removes the cell takes the payload `Arc` out of it at once.
pub(crate) struct Slot<T> {
    #[cfg(not(loom))]
    inner: arc_swap::ArcSwapOption<T>,
    #[cfg(loom)]
    inner: model::Slot<T>,
}

impl<T> Slot<T> {
    pub(crate) fn new(value: std::sync::Arc<T>) -> Self {
        #[cfg(not(loom))]
        {
            Slot { inner: arc_swap::ArcSwapOption::new(Some(value)) }
        }
        #[cfg(loom)]
        {
            Slot { inner: model::Slot::new(value) }
        }
    }

    /// The payload, or `None` once it was taken (a concurrent removal won).
    pub(crate) fn load(&self) -> Option<std::sync::Arc<T>> {
        #[cfg(not(loom))]
        {
            self.inner.load_full()
        }
        #[cfg(loom)]
        {
            self.inner.load()
        }
    }

    /// Take the payload out; exactly one caller gets `Some`.
    pub(crate) fn take(&self) -> Option<std::sync::Arc<T>> {
        #[cfg(not(loom))]
        {
            self.inner.swap(None)
        }
        #[cfg(loom)]
        {
            self.inner.take()
        }
    }
}

/// A concurrent map whose operations run a closure on the value they touch.
///
/// The closure sees a value that stays valid for the closure's duration even
/// if another thread removes it meanwhile (papaya's guard semantics).
pub(crate) struct Map<K, V> {
    // foldhash instead of SipHash: keys are ids lowwater or its trainer made,
    // and hashing is a visible share of a 1 KiB put (benches/tables.py).
    #[cfg(not(loom))]
    inner: papaya::HashMap<K, V, foldhash::fast::RandomState>,
    #[cfg(loom)]
    inner: model::Map<K, V>,
}

#[cfg(not(loom))]
impl<K: Hash + Eq + Clone, V> Map<K, V> {
    pub(crate) fn new() -> Self {
        // Blocking resize: incremental resizing made every op during a resize help
        // copy (8% of a put/pop loop in perf); a table of ids resizes rarely.
        Map {
            inner: papaya::HashMap::builder()
                .hasher(foldhash::fast::RandomState::default())
                .resize_mode(papaya::ResizeMode::Blocking)
                .build(),
        }
    }

    pub(crate) fn get_with<Q, R>(&self, key: &Q, f: impl FnOnce(&V) -> R) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let guard = self.inner.pin();
        guard.get(key).map(f)
    }

    pub(crate) fn contains<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.inner.pin().contains_key(key)
    }

    /// Insert or replace; `on_old` runs on the replaced value, if any.
    pub(crate) fn insert_with<R>(&self, key: K, value: V, on_old: impl FnOnce(&V) -> R) -> Option<R> {
        let guard = self.inner.pin();
        guard.insert(key, value).map(on_old)
    }

    /// Insert only if absent; on a duplicate the value is handed back.
    pub(crate) fn try_insert(&self, key: K, value: V) -> Result<(), V> {
        let guard = self.inner.pin();
        match guard.try_insert(key, value) {
            Ok(_) => Ok(()),
            Err(occupied) => Err(occupied.not_inserted),
        }
    }

    pub(crate) fn remove_with<Q, R>(&self, key: &Q, f: impl FnOnce(&V) -> R) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let guard = self.inner.pin();
        guard.remove(key).map(f)
    }

    /// Remove `key` only if `pred` holds for its current value.
    pub(crate) fn remove_if_with<Q, R>(
        &self,
        key: &Q,
        pred: impl FnMut(&K, &V) -> bool,
        f: impl FnOnce(&V) -> R,
    ) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let guard = self.inner.pin();
        match guard.remove_if(key, pred) {
            Ok(Some((_, v))) => Some(f(v)),
            _ => None,
        }
    }

    pub(crate) fn for_each(&self, mut f: impl FnMut(&K, &V)) {
        let guard = self.inner.pin();
        for (k, v) in guard.iter() {
            f(k, v);
        }
    }

    pub(crate) fn keys(&self) -> Vec<K> {
        let guard = self.inner.pin();
        guard.keys().cloned().collect()
    }
}

#[cfg(loom)]
impl<K: Hash + Eq + Clone, V> Map<K, V> {
    pub(crate) fn new() -> Self {
        Map { inner: model::Map::new() }
    }

    pub(crate) fn get_with<Q, R>(&self, key: &Q, f: impl FnOnce(&V) -> R) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.inner.get(key).map(f)
    }

    pub(crate) fn contains<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.inner.get(key).is_some()
    }

    pub(crate) fn insert_with<R>(&self, key: K, value: V, on_old: impl FnOnce(&V) -> R) -> Option<R> {
        self.inner.insert(key, value).map(on_old)
    }

    pub(crate) fn try_insert(&self, key: K, value: V) -> Result<(), V> {
        self.inner.try_insert(key, value)
    }

    pub(crate) fn remove_with<Q, R>(&self, key: &Q, f: impl FnOnce(&V) -> R) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.inner.remove_if(key, |_, _| true).map(f)
    }

    pub(crate) fn remove_if_with<Q, R>(
        &self,
        key: &Q,
        pred: impl FnMut(&K, &V) -> bool,
        f: impl FnOnce(&V) -> R,
    ) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.inner.remove_if(key, pred).map(f)
    }

    pub(crate) fn for_each(&self, mut f: impl FnMut(&K, &V)) {
        self.inner.for_each(|k, v| f(k, v));
    }

    pub(crate) fn keys(&self) -> Vec<K> {
        let mut keys = Vec::new();
        self.inner.for_each(|k, _| keys.push(k.clone()));
        keys
    }
}

/// A short list replaced as a whole by compare-and-swap (read-copy-update).
///
/// Each open rollout keeps the ids of its in-flight calls in one of these.
/// It was a papaya map per rollout, and every papaya map owns a seize
/// collector: 18 KB of RSS per open rollout, over half the 32 KB
/// budget at 16,384 held rollouts (benches/interception.py).  The list is
/// a pointer plus one small allocation, and an update stays lock-free (a
/// failed CAS means another update succeeded).  A rollout holds a few calls
/// at a time, so copying the list on each update is cheap; many concurrent
/// calls in one rollout cost O(n) per update.
pub(crate) struct CowList<T> {
    #[cfg(not(loom))]
    inner: arc_swap::ArcSwap<Vec<T>>,
    #[cfg(loom)]
    inner: model::Versioned<T>,
}

impl<T: Clone> CowList<T> {
    pub(crate) fn new() -> Self {
        #[cfg(not(loom))]
        {
            CowList { inner: arc_swap::ArcSwap::from_pointee(Vec::new()) }
        }
        #[cfg(loom)]
        {
            CowList { inner: model::Versioned::new(Vec::new()) }
        }
    }

    /// Replace the list by `f(current)`; `f` may run more than once when
    /// updates race, and returning `None` leaves the list as it is.
    pub(crate) fn update(&self, mut f: impl FnMut(&[T]) -> Option<Vec<T>>) {
        #[cfg(not(loom))]
        {
            self.inner.rcu(|cur| match f(cur) {
                Some(next) => std::sync::Arc::new(next),
                None => std::sync::Arc::clone(cur),
            });
        }
        #[cfg(loom)]
        {
            self.inner.update(|cur| f(cur).map(|next| (next, ())));
        }
    }

    /// The list as of now; later updates do not change the snapshot.
    pub(crate) fn snapshot(&self) -> std::sync::Arc<Vec<T>> {
        #[cfg(not(loom))]
        {
            self.inner.load_full()
        }
        #[cfg(loom)]
        {
            std::sync::Arc::new(self.inner.load().to_vec())
        }
    }
}

#[cfg(loom)]
mod model;
