//! The shard fetch buffer: `shard_id -> shard`, explicit eviction only.
//!
//! A consumer process fills it with shards fetched from their owners; the
//! trainer drains it at step end with [`FetchBuffer::clear`].  Nothing is
//! evicted behind the caller's back: over capacity, a put is refused.

use std::sync::Arc;

use crate::accounting::Accounting;
use crate::dtype::{expected_nbytes, lookup};
use crate::error::TableError;
use crate::payload::{Payload, PayloadMut};
use crate::sync::{AtomicU64, Map, Ordering, Slot};

/// One shard: a contiguous payload and what it holds.
pub struct Shard {
    /// The shard's id, its key in the buffer.
    pub id: Arc<str>,
    /// Element type, by its numpy name (one of [`crate::dtype::DTYPES`]).
    pub dtype: &'static str,
    /// Dimensions, in elements; `payload.len()` is their product times the
    /// dtype's item size in bytes.
    pub shape: Box<[usize]>,
    /// Who the shard was fetched from (free text; may be empty).
    pub owner: Box<str>,
    /// The shard's bytes.
    pub payload: Payload,
}

/// A put in progress ([`FetchBuffer::reserve`]): its payload is written in
/// place, then [`FetchBuffer::commit`]ted or [`FetchBuffer::abandon`]ed on the
/// buffer that reserved it (dropping it without either leaves its bytes
/// reserved in that buffer's `bytes` count).
pub struct PendingShard {
    id: Arc<str>,
    dtype: &'static str,
    shape: Box<[usize]>,
    owner: Box<str>,
    payload: PayloadMut,
}

impl PendingShard {
    /// The bytes to fill (`prod(shape) * itemsize(dtype)` of them, zeroed).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.payload.as_mut_slice()
    }

    /// The shard's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Size of the payload in bytes.
    pub fn len(&self) -> usize {
        self.payload.len()
    }

    /// True for a zero-byte payload.
    pub fn is_empty(&self) -> bool {
        self.payload.is_empty()
    }
}

/// Exact counters of a [`FetchBuffer`] (all bytes are payload bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FetchStats {
    /// Shards held now.
    pub entries: u64,
    /// Payload bytes held now (including reservations of puts in progress).
    pub bytes: u64,
    /// Largest `bytes` seen after a completed put.
    pub peak_bytes: u64,
    /// Payload bytes still allocated, including removed ones a view holds.
    pub live_bytes: u64,
    /// Puts that stored a shard (replacements included).
    pub inserts: u64,
    /// `get`/`pop` calls that found their shard.
    pub hits: u64,
    /// `get`/`pop` calls that did not.
    pub misses: u64,
    /// Shards taken out: popped, cleared, or replaced by a put.
    pub removals: u64,
    /// Puts refused over capacity ([`TableError::Full`]).
    pub rejected: u64,
}

/// A consumer's shard fetch buffer: `shard_id -> shard`, a lock-free map with
/// explicit eviction only and an optional capacity bound in payload bytes.
pub struct FetchBuffer {
    map: Map<Arc<str>, Slot<Shard>>,
    acct: Accounting,
    mmap_threshold: usize,
    hits: AtomicU64,
    misses: AtomicU64,
    removals: AtomicU64,
}

impl FetchBuffer {
    /// `capacity_bytes`: bound on held payload bytes (`None`: unbounded).
    /// `mmap_threshold`: payloads of at least this many bytes get their own
    /// anonymous mapping.
    pub fn new(capacity_bytes: Option<u64>, mmap_threshold: usize) -> Self {
        FetchBuffer {
            map: Map::new(),
            acct: Accounting::new(capacity_bytes),
            mmap_threshold,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            removals: AtomicU64::new(0),
        }
    }

    /// The bound on held payload bytes given at construction (`None`: unbounded).
    pub fn capacity_bytes(&self) -> Option<u64> {
        self.acct.capacity()
    }

    /// Payloads of at least this many bytes get their own anonymous mapping.
    pub fn mmap_threshold(&self) -> usize {
        self.mmap_threshold
    }

    /// Copy `data` in as shard `id`, replacing (and releasing) any shard held
    /// under that id.
    ///
    /// Errors: [`TableError::Invalid`] when `data.len()` is not
    /// `prod(shape) * itemsize(dtype)` or the dtype is unknown;
    /// [`TableError::Full`] over capacity; [`TableError::Alloc`] when the OS
    /// refuses the memory.
    pub fn put(&self, id: &str, data: &[u8], dtype: &str, shape: &[usize], owner: &str) -> Result<(), TableError> {
        let expected = expected_nbytes(dtype, shape)?;
        if data.len() != expected {
            return Err(TableError::Invalid {
                reason: format!(
                    "shard {id:?}: {} bytes do not match shape {shape:?} of {dtype} ({expected} bytes)",
                    data.len()
                ),
            });
        }
        let (dtype, _) = lookup(dtype)?;
        let n = data.len() as u64;
        self.acct.reserve(n, self.replacing(id))?;
        let payload = match Payload::copy_from(data, self.mmap_threshold, &self.acct.live) {
            Ok(p) => p,
            Err(e) => {
                self.acct.unreserve(n);
                return Err(e);
            }
        };
        let key: Arc<str> = Arc::from(id);
        let shard = Arc::new(Shard { id: Arc::clone(&key), dtype, shape: shape.into(), owner: owner.into(), payload });
        self.store(key, shard);
        Ok(())
    }

    /// Start a put whose bytes are written in place: validates `dtype` and
    /// `shape`, reserves the bytes against the capacity bound (they count in
    /// `bytes` until [`FetchBuffer::commit`] or [`FetchBuffer::abandon`]) and
    /// allocates the zero-filled payload.  The shard is not visible until
    /// committed.  This is the receive path of a fetch: a socket reads
    /// straight into [`PendingShard::as_mut_slice`], with no copy after.
    ///
    /// Errors: as [`FetchBuffer::put`].
    pub fn reserve(&self, id: &str, dtype: &str, shape: &[usize], owner: &str) -> Result<PendingShard, TableError> {
        let n = expected_nbytes(dtype, shape)?;
        let (dtype, _) = lookup(dtype)?;
        self.acct.reserve(n as u64, self.replacing(id))?;
        match PayloadMut::zeroed(n, self.mmap_threshold, &self.acct.live) {
            Ok(payload) => {
                Ok(PendingShard { id: Arc::from(id), dtype, shape: shape.into(), owner: owner.into(), payload })
            }
            Err(e) => {
                self.acct.unreserve(n as u64);
                Err(e)
            }
        }
    }

    /// Insert a filled [`PendingShard`] of this buffer, replacing (and
    /// releasing) any shard held under its id, exactly as a put does.
    ///
    /// Errors: [`TableError::Alloc`] when its mapping cannot be made read-only
    /// (nothing is inserted; the reservation is given back).
    pub fn commit(&self, pending: PendingShard) -> Result<(), TableError> {
        let n = pending.payload.len() as u64;
        let PendingShard { id, dtype, shape, owner, payload } = pending;
        let payload = match payload.freeze() {
            Ok(p) => p,
            Err(e) => {
                self.acct.unreserve(n);
                return Err(e);
            }
        };
        let shard = Arc::new(Shard { id: Arc::clone(&id), dtype, shape, owner, payload });
        self.store(id, shard);
        Ok(())
    }

    /// Bytes of the shard `id` a put would replace, for the capacity check;
    /// only a bounded buffer needs them (an extra lookup per put).
    fn replacing(&self, id: &str) -> u64 {
        match self.acct.capacity() {
            Some(_) => self.map.get_with(id, |slot| slot.load().map_or(0, |s| s.payload.len() as u64)).unwrap_or(0),
            None => 0,
        }
    }

    /// Publish `shard`, whose bytes are reserved, under `key`, replacing (and
    /// releasing) any shard held there: the one insert path of put and commit.
    fn store(&self, key: Arc<str>, shard: Arc<Shard>) {
        self.acct.committed();
        if let Some(old) = self.map.insert_with(key, Slot::new(shard), |old| old.take()).flatten() {
            // The replaced shard is released now; a view may still hold it.
            self.released(&old);
        }
        self.acct.settled();
    }

    /// Count `shard` out of the table (a view may still hold its payload).
    fn released(&self, shard: &Shard) {
        self.acct.released(shard.payload.len() as u64);
        self.removals.fetch_add(1, Ordering::Relaxed);
    }

    /// Give back a [`PendingShard`]'s reservation without inserting it (a
    /// fetch that failed half-way); its payload is freed.
    pub fn abandon(&self, pending: PendingShard) {
        self.acct.unreserve(pending.payload.len() as u64);
    }

    /// The shard held under `id`, if any (counts a hit or a miss).
    pub fn get(&self, id: &str) -> Option<Arc<Shard>> {
        let found = self.map.get_with(id, |slot| slot.load()).flatten();
        self.count_lookup(found.is_some());
        found
    }

    /// Remove and return the shard held under `id` (counts a hit or a miss).
    pub fn pop(&self, id: &str) -> Option<Arc<Shard>> {
        let found = self.take(id);
        self.count_lookup(found.is_some());
        found
    }

    fn count_lookup(&self, hit: bool) {
        let c = if hit { &self.hits } else { &self.misses };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Remove `id` and release its payload from the table; exactly one
    /// concurrent caller gets the shard.
    fn take(&self, id: &str) -> Option<Arc<Shard>> {
        let shard = self.map.remove_with(id, |slot| slot.take()).flatten()?;
        self.released(&shard);
        Some(shard)
    }

    /// Remove each of `ids` that is held; unknown ids are skipped.  Returns
    /// how many entries this call removed.
    pub fn clear<S: AsRef<str>>(&self, ids: &[S]) -> usize {
        ids.iter().filter(|id| self.take(id.as_ref()).is_some()).count()
    }

    /// Remove every entry; returns how many this call removed.
    pub fn clear_all(&self) -> usize {
        let keys = self.map.keys();
        keys.iter().filter(|id| self.take(id).is_some()).count()
    }

    /// True when a shard is held under `id` (counts neither a hit nor a miss).
    pub fn contains(&self, id: &str) -> bool {
        self.map.contains(id)
    }

    /// The ids held now (a snapshot; concurrent puts and removals may or may
    /// not show).
    pub fn keys(&self) -> Vec<Arc<str>> {
        self.map.keys()
    }

    /// Number of shards held.
    pub fn len(&self) -> usize {
        Accounting::load(&self.acct.entries) as usize
    }

    /// True when no shard is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The counters; exact once concurrent callers have returned.
    pub fn stats(&self) -> FetchStats {
        FetchStats {
            entries: Accounting::load(&self.acct.entries),
            bytes: Accounting::load(&self.acct.bytes),
            peak_bytes: Accounting::load(&self.acct.peak),
            live_bytes: self.acct.live.get(),
            inserts: Accounting::load(&self.acct.inserts),
            hits: Accounting::load(&self.hits),
            misses: Accounting::load(&self.misses),
            removals: Accounting::load(&self.removals),
            rejected: Accounting::load(&self.acct.rejected),
        }
    }
}
