//! Concurrency primitives the tables are written against.
//!
//! Normal builds use papaya's lock-free map and arc-swap's atomic slot.  Under
//! `--cfg loom` both are replaced by stand-ins built on loom's primitives, so
//! the loom model (tests/loom.rs) explores the tables' own protocols (take on
//! remove, insert against close) with every interleaving loom can produce.
//! Stand-ins hand out values after releasing their lock, as papaya hands out
//! references that stay valid under a guard after a concurrent removal: the
//! model must not get a serialisation the real map does not give.

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
    inner: loom::sync::Mutex<Option<std::sync::Arc<T>>>,
}

impl<T> Slot<T> {
    pub(crate) fn new(value: std::sync::Arc<T>) -> Self {
        #[cfg(not(loom))]
        {
            Slot { inner: arc_swap::ArcSwapOption::new(Some(value)) }
        }
        #[cfg(loom)]
        {
            Slot { inner: loom::sync::Mutex::new(Some(value)) }
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
            self.inner.lock().unwrap().clone()
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
            self.inner.lock().unwrap().take()
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
    inner: loom::sync::Mutex<std::collections::HashMap<K, std::sync::Arc<V>>>,
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
        Map { inner: loom::sync::Mutex::new(std::collections::HashMap::new()) }
    }

    fn cloned<Q>(&self, key: &Q) -> Option<std::sync::Arc<V>>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.inner.lock().unwrap().get(key).cloned()
    }

    pub(crate) fn get_with<Q, R>(&self, key: &Q, f: impl FnOnce(&V) -> R) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let v = self.cloned(key);
        v.map(|v| f(&v))
    }

    pub(crate) fn contains<Q>(&self, key: &Q) -> bool
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.inner.lock().unwrap().contains_key(key)
    }

    pub(crate) fn insert_with<R>(&self, key: K, value: V, on_old: impl FnOnce(&V) -> R) -> Option<R> {
        let old = self.inner.lock().unwrap().insert(key, std::sync::Arc::new(value));
        old.map(|v| on_old(&v))
    }

    pub(crate) fn try_insert(&self, key: K, value: V) -> Result<(), V> {
        let mut map = self.inner.lock().unwrap();
        if map.contains_key(&key) {
            return Err(value);
        }
        map.insert(key, std::sync::Arc::new(value));
        Ok(())
    }

    pub(crate) fn remove_with<Q, R>(&self, key: &Q, f: impl FnOnce(&V) -> R) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let old = self.inner.lock().unwrap().remove(key);
        old.map(|v| f(&v))
    }

    pub(crate) fn remove_if_with<Q, R>(
        &self,
        key: &Q,
        mut pred: impl FnMut(&K, &V) -> bool,
        f: impl FnOnce(&V) -> R,
    ) -> Option<R>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        let old = {
            let mut map = self.inner.lock().unwrap();
            let hit = map.get_key_value(key).map(|(k, v)| pred(k, v)).unwrap_or(false);
            if hit {
                map.remove(key)
            } else {
                None
            }
        };
        old.map(|v| f(&v))
    }

    pub(crate) fn for_each(&self, mut f: impl FnMut(&K, &V)) {
        let items: Vec<(K, std::sync::Arc<V>)> =
            self.inner.lock().unwrap().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        for (k, v) in items {
            f(&k, &v);
        }
    }

    pub(crate) fn keys(&self) -> Vec<K> {
        self.inner.lock().unwrap().keys().cloned().collect()
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
    inner: loom::sync::Mutex<std::sync::Arc<Vec<T>>>,
}

impl<T: Clone> CowList<T> {
    pub(crate) fn new() -> Self {
        #[cfg(not(loom))]
        {
            CowList { inner: arc_swap::ArcSwap::from_pointee(Vec::new()) }
        }
        #[cfg(loom)]
        {
            CowList { inner: loom::sync::Mutex::new(std::sync::Arc::new(Vec::new())) }
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
            let mut cur = self.inner.lock().unwrap();
            if let Some(next) = f(&cur) {
                *cur = std::sync::Arc::new(next);
            }
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
            std::sync::Arc::clone(&self.inner.lock().unwrap())
        }
    }
}
