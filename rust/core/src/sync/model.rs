//! Lock-free stand-ins for papaya's map and arc-swap's slots under `--cfg loom`.
//!
//! Built on loom's atomics only (no `Mutex`, no `SeqCst`), with the orderings
//! the production types promise and no stronger: an immutable version is
//! published by a `compare_exchange(Release, Acquire)` and read by an
//! `Acquire` load, which may return an older version than the newest one, as
//! a papaya lookup or an arc-swap load may.  See the parent module's docs.
//!
//! Nothing is reclaimed while the structure lives: a replaced version stays
//! allocated (and readable through references handed out earlier) until its
//! owner drops, as papaya defers reclamation under its guards.  The models are
//! a handful of operations, so this costs nothing there.

use std::borrow::Borrow;
use std::hash::{Hash, Hasher};
use std::marker::PhantomData;
use std::ptr;
use std::sync::Arc;

use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

/// One immutable version of a [`Versioned`] list.
struct Version<T> {
    items: Vec<T>,
    /// The version this one replaced; the chain is freed when the owner drops.
    prev: *mut Version<T>,
}

/// A list replaced as a whole by compare-and-swap: the stand-in for arc-swap's
/// `ArcSwap<Vec<T>>` under `rcu`, and the bucket of [`Map`].
pub(super) struct Versioned<T> {
    head: AtomicPtr<Version<T>>,
    /// Items are shared between threads and dropped by whichever drops the
    /// list: Send and Sync only for `T: Send + Sync`, like `Arc<T>`.
    _owns: PhantomData<Arc<T>>,
}

impl<T> Versioned<T> {
    pub(super) fn new(items: Vec<T>) -> Self {
        let first = Box::into_raw(Box::new(Version { items, prev: ptr::null_mut() }));
        Versioned { head: AtomicPtr::new(first), _owns: PhantomData }
    }

    /// The current version (`Acquire`; may be older than the newest store).
    pub(super) fn load(&self) -> &[T] {
        let cur = self.head.load(Ordering::Acquire);
        // SAFETY: `head` always points to a version made by `new` or `update`,
        // and versions are freed only in `drop`, which needs `&mut self`.
        unsafe { &(*cur).items }
    }

    /// Replace the list by the first part of `f(current)`, returning its second
    /// part; `None` from `f` leaves the list as it is.  `f` runs again when
    /// another update won the race (lock-free: a failed CAS means one succeeded).
    pub(super) fn update<'a, R>(&'a self, mut f: impl FnMut(&'a [T]) -> Option<(Vec<T>, R)>) -> Option<R> {
        let mut cur = self.head.load(Ordering::Acquire);
        loop {
            // SAFETY: as in `load`; the version outlives `'a` (freed only in `drop`).
            let (items, out) = f(unsafe { &(*cur).items })?;
            let next = Box::into_raw(Box::new(Version { items, prev: cur }));
            // Success needs no Acquire: versions are never freed or reused while
            // `self` lives, so a successful CAS replaced the very version `cur`
            // was loaded from, with Acquire, above.
            match self.head.compare_exchange(cur, next, Ordering::Release, Ordering::Acquire) {
                Ok(_) => return Some(out),
                Err(actual) => {
                    // SAFETY: `next` was never published; `prev` is not owned by it.
                    drop(unsafe { Box::from_raw(next) });
                    cur = actual;
                }
            }
        }
    }
}

impl<T> Drop for Versioned<T> {
    fn drop(&mut self) {
        let mut cur = self.head.with_mut(|p| *p);
        while !cur.is_null() {
            // SAFETY: every version in the chain was published exactly once and
            // is reachable exactly once from `head`; `&mut self` means no reader.
            let version = unsafe { Box::from_raw(cur) };
            cur = version.prev;
        }
    }
}

/// Buckets of the model map: more than one so that keys of one map do not all
/// contend, few so that iterating a map stays a handful of loads.
const BUCKETS: usize = 4;

/// The stand-in for papaya's `HashMap`: a fixed array of buckets, each a
/// [`Versioned`] list of `(key, value)` replaced by CAS.
pub(super) struct Map<K, V> {
    buckets: [Versioned<(K, Arc<V>)>; BUCKETS],
}

impl<K: Hash + Eq + Clone, V> Map<K, V> {
    pub(super) fn new() -> Self {
        Map { buckets: std::array::from_fn(|_| Versioned::new(Vec::new())) }
    }

    fn bucket<Q: Hash + ?Sized>(&self, key: &Q) -> &Versioned<(K, Arc<V>)> {
        // A fixed hasher: loom replays executions and needs the same buckets each time.
        let mut h = std::hash::DefaultHasher::new();
        key.hash(&mut h);
        &self.buckets[(h.finish() % BUCKETS as u64) as usize]
    }

    /// The value under `key`; it stays readable for as long as the map lives,
    /// even after a concurrent removal (papaya's guard semantics).
    pub(super) fn get<Q>(&self, key: &Q) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.bucket(key).load().iter().find(|(k, _)| k.borrow() == key).map(|(_, v)| &**v)
    }

    /// Insert or replace; returns the replaced value.
    pub(super) fn insert(&self, key: K, value: V) -> Option<&V> {
        let value = Arc::new(value);
        self.bucket(&key)
            .update(|items| {
                let old = items.iter().find(|(k, _)| *k == key).map(|(_, v)| &**v);
                let mut next: Vec<_> = items.iter().filter(|(k, _)| *k != key).cloned().collect();
                next.push((key.clone(), Arc::clone(&value)));
                Some((next, old))
            })
            .flatten()
    }

    /// Insert only if `key` is absent; otherwise hand `value` back.
    pub(super) fn try_insert(&self, key: K, value: V) -> Result<(), V> {
        let value = Arc::new(value);
        let inserted = self.bucket(&key).update(|items| {
            if items.iter().any(|(k, _)| *k == key) {
                return None;
            }
            let mut next = items.to_vec();
            next.push((key.clone(), Arc::clone(&value)));
            Some((next, ()))
        });
        match inserted {
            Some(()) => Ok(()),
            // Only versions that lost their CAS held clones, and they are freed.
            None => Err(Arc::try_unwrap(value).ok().expect("an unpublished value has one owner")),
        }
    }

    /// Remove `key` if `pred` holds for it (re-checked if the bucket changed
    /// meanwhile, as papaya's `remove_if` does); returns the removed value.
    pub(super) fn remove_if<Q>(&self, key: &Q, mut pred: impl FnMut(&K, &V) -> bool) -> Option<&V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.bucket(key).update(|items| {
            let i = items.iter().position(|(k, _)| k.borrow() == key)?;
            let (k, v) = &items[i];
            if !pred(k, v) {
                return None;
            }
            let mut next = items.to_vec();
            next.remove(i);
            Some((next, &**v))
        })
    }

    /// Every entry of each bucket's current version.
    pub(super) fn for_each(&self, mut f: impl FnMut(&K, &V)) {
        for bucket in &self.buckets {
            for (k, v) in bucket.load() {
                f(k, v);
            }
        }
    }
}

/// `Slot` state: the value has not been taken yet.
const PRESENT: usize = 1;
/// `Slot` state: one unit of the count of threads inside `load` or `take`.
const READER: usize = 2;

/// The stand-in for arc-swap's `ArcSwapOption<T>` as the tables use it: set
/// once at creation, loaded, and taken (swapped for `None`) at most once.
///
/// A loader or taker registers in `state` before touching `value`, and only
/// while the value is present; whoever leaves last after the value was taken
/// drops the slot's own reference.  So the payload is released at removal
/// (not when the map's version chain drops), and no clone can race the drop:
/// loom's `UnsafeCell` checks that.
pub(super) struct Slot<T> {
    state: AtomicUsize,
    value: UnsafeCell<Option<Arc<T>>>,
}

// SAFETY: `value` is read (cloned) only by threads registered while it was
// present, and written once (the slot's reference dropped) by the last of
// them to leave after it was taken; no thread registers after that.  The
// AcqRel read-modify-writes on `state` order every read before that write.
// Sharing `Arc<T>` across threads needs `T: Send + Sync`.
unsafe impl<T: Send + Sync> Sync for Slot<T> {}

impl<T> Slot<T> {
    pub(super) fn new(value: Arc<T>) -> Self {
        Slot { state: AtomicUsize::new(PRESENT), value: UnsafeCell::new(Some(value)) }
    }

    pub(super) fn load(&self) -> Option<Arc<T>> {
        if !self.enter() {
            return None;
        }
        let value = self.clone_value();
        self.leave();
        value
    }

    /// Exactly one caller over the slot's life gets `Some`.
    pub(super) fn take(&self) -> Option<Arc<T>> {
        if !self.enter() {
            return None;
        }
        let won = self.state.fetch_and(!PRESENT, Ordering::AcqRel) & PRESENT != 0;
        let value = if won { self.clone_value() } else { None };
        self.leave();
        value
    }

    /// Register as a reader if the value is still present.  The first read is
    /// a plain `Acquire` load, as arc-swap's is: a taken slot costs no RMW.
    fn enter(&self) -> bool {
        let mut cur = self.state.load(Ordering::Acquire);
        loop {
            if cur & PRESENT == 0 {
                return false;
            }
            match self.state.compare_exchange(cur, cur + READER, Ordering::Acquire, Ordering::Acquire) {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    fn clone_value(&self) -> Option<Arc<T>> {
        // SAFETY: the caller registered while the value was present, so the
        // slot's reference is not dropped before the caller leaves.
        self.value.with(|v| unsafe { (*v).clone() })
    }

    fn leave(&self) {
        // READER alone: PRESENT is clear (taken) and we were the last reader.
        if self.state.fetch_sub(READER, Ordering::AcqRel) == READER {
            // SAFETY: nobody is registered, and nobody can register any more.
            drop(self.value.with_mut(|v| unsafe { (*v).take() }));
        }
    }
}
