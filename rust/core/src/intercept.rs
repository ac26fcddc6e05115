//! The intercept table: `request_id -> intercept` for in-flight model calls.
//!
//! An intercept (the raw request body of one model call) is held for exactly
//! the life of the call: discarded once its response is delivered, or swept
//! when its rollout closes.  Only open rollouts are tracked, so nothing grows
//! with the number of rollouts ever seen (no tombstones).
//!
//! Insert against close: an insert adds its entry and its id to the rollout's
//! request set, then re-checks the rollout's `closed` flag; a close sets the
//! flag, then sweeps the request set.  A SeqCst fence on each side between
//! the write and the read (the store-buffer pattern) guarantees at least one
//! side sees the other, so no intercept outlives its rollout's close.  The
//! map and the request list give no such guarantee themselves (papaya and
//! arc-swap publish with Release and read with Acquire): both fences are
//! needed, and the loom model `insert_racing_close_never_leaks` fails without
//! either (tests/loom.rs; src/sync.rs keeps the model's map and list that
//! weak).  Given both fences, the flag's own SeqCst is not needed (Relaxed
//! would do, by the fence-to-fence rule), so loom cannot catch weakening it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::accounting::Accounting;
use crate::error::TableError;
use crate::payload::{Payload, PayloadMut};
use crate::sync::{fence, AtomicBool, AtomicU64, CowList, Map, Ordering, Slot};

/// One intercepted model call.
pub struct Intercept {
    /// The call's id, its key in the table.
    pub request_id: Arc<str>,
    /// Unique per insert into this table.
    pub seq: u64,
    /// The rollout whose close sweeps this intercept.
    pub rollout_id: Arc<str>,
    /// The model API the body is written for (free text, e.g. `"chat"`).
    pub protocol: Box<str>,
    /// Whether the call asked for a streamed response.
    pub stream: bool,
    /// When the intercept was inserted.
    pub created: Instant,
    /// The raw request body.
    pub payload: Payload,
}

impl Intercept {
    /// Time since the intercept was inserted (monotonic clock; the binding
    /// reports it in seconds).
    pub fn age(&self) -> Duration {
        self.created.elapsed()
    }
}

struct Rollout {
    closed: AtomicBool,
    /// (request id, insert sequence number) of each call held for the
    /// rollout; the number lets a discard remove its own id and not that of
    /// a re-insert of the same id that landed between its two steps.
    requests: CowList<(Arc<str>, u64)>,
}

/// Exact counters of an [`InterceptTable`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct InterceptStats {
    /// Intercepts held now.
    pub entries: u64,
    /// Body bytes held now (including reservations of inserts in progress).
    pub bytes: u64,
    /// Largest `bytes` seen after a completed insert.
    pub peak_bytes: u64,
    /// Body bytes still allocated, including removed ones a view holds.
    pub live_bytes: u64,
    /// Rollouts open now.
    pub open_rollouts: u64,
    /// Inserts that stored an intercept (one later swept by its insert's own
    /// closed-rollout check included).
    pub inserts: u64,
    /// Intercepts removed by [`InterceptTable::discard`].
    pub discards: u64,
    /// Intercepts removed because their rollout closed (by the close's sweep,
    /// or by an insert that found its rollout closed under it).
    pub swept: u64,
    /// Inserts refused over capacity ([`TableError::Full`]).
    pub rejected: u64,
}

/// The intercept table: `request_id -> intercept` for in-flight model calls,
/// grouped by rollout, with an optional capacity bound in body bytes.
pub struct InterceptTable {
    entries: Map<Arc<str>, Slot<Intercept>>,
    rollouts: Map<Arc<str>, Rollout>,
    acct: Accounting,
    mmap_threshold: usize,
    open_rollouts: AtomicU64,
    discards: AtomicU64,
    swept: AtomicU64,
    next_seq: AtomicU64,
}

impl InterceptTable {
    /// `capacity_bytes`: bound on held body bytes (`None`: unbounded).
    /// `mmap_threshold`: bodies of at least this many bytes get their own
    /// anonymous mapping.
    pub fn new(capacity_bytes: Option<u64>, mmap_threshold: usize) -> Self {
        InterceptTable {
            entries: Map::new(),
            rollouts: Map::new(),
            acct: Accounting::new(capacity_bytes),
            mmap_threshold,
            open_rollouts: AtomicU64::new(0),
            discards: AtomicU64::new(0),
            swept: AtomicU64::new(0),
            next_seq: AtomicU64::new(0),
        }
    }

    /// The bound on held body bytes given at construction (`None`: unbounded).
    pub fn capacity_bytes(&self) -> Option<u64> {
        self.acct.capacity()
    }

    /// Bodies of at least this many bytes get their own anonymous mapping.
    pub fn mmap_threshold(&self) -> usize {
        self.mmap_threshold
    }

    /// Start tracking `rollout_id`; idempotent.
    pub fn open_rollout(&self, rollout_id: &str) {
        let fresh = Rollout { closed: AtomicBool::new(false), requests: CowList::new() };
        if self.rollouts.try_insert(Arc::from(rollout_id), fresh).is_ok() {
            self.open_rollouts.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// True while `rollout_id` is open (opened and not yet closed).
    pub fn is_open(&self, rollout_id: &str) -> bool {
        self.rollouts.contains(rollout_id)
    }

    /// Stop tracking `rollout_id` and remove every intercept it still holds.
    /// Returns the removed request ids (so the caller can resolve the
    /// handlers still waiting on them); empty when the rollout was not open.
    pub fn close_rollout(&self, rollout_id: &str) -> Vec<String> {
        let swept = self.rollouts.remove_with(rollout_id, |rollout| {
            rollout.closed.store(true, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            let mut swept = Vec::new();
            for (req, _) in rollout.requests.snapshot().iter() {
                if self.remove_owned(req, rollout_id) {
                    swept.push(req.to_string());
                }
            }
            swept
        });
        match swept {
            Some(list) => {
                self.open_rollouts.fetch_sub(1, Ordering::Relaxed);
                list
            }
            None => Vec::new(),
        }
    }

    /// Remove `req` if it is held for `rollout_id`; counts it as swept.
    fn remove_owned(&self, req: &str, rollout_id: &str) -> bool {
        let taken = self
            .entries
            .remove_if_with(
                req,
                |_, slot| slot.load().is_some_and(|i| &*i.rollout_id == rollout_id),
                |slot| slot.take(),
            )
            .flatten();
        match taken {
            Some(intercept) => {
                self.acct.released(intercept.payload.len() as u64);
                self.swept.fetch_add(1, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// Hold `body` as the intercept `request_id` of `rollout_id`.
    ///
    /// Errors: [`TableError::RolloutClosed`] when the rollout is not open or
    /// closed during the insert (the entry is then not held);
    /// [`TableError::Duplicate`] when `request_id` is already held;
    /// [`TableError::Full`] over capacity; [`TableError::Alloc`].
    pub fn insert(
        &self,
        request_id: &str,
        rollout_id: &str,
        body: &[u8],
        protocol: &str,
        stream: bool,
    ) -> Result<(), TableError> {
        let copy = || Payload::copy_from(body, self.mmap_threshold, &self.acct.live);
        self.insert_with(request_id, rollout_id, body.len(), copy, protocol, stream)
    }

    /// A writable payload of `len` bytes for a body read straight into the
    /// memory this table will hold ([`PayloadMut::receiving`]: at or above
    /// the table's `mmap_threshold` a mapping of its own, its pages faulted
    /// as they are written).  Its bytes count in the table's `live_bytes`
    /// from now; they become an entry's with [`InterceptTable::insert_payload`]
    /// once filled and frozen, without the copy [`InterceptTable::insert`]
    /// makes.  Nothing is reserved against the capacity before that insert,
    /// as for a body read into a buffer of the caller's.
    ///
    /// Errors: [`TableError::Alloc`] when the memory cannot be had.
    pub fn receive_buffer(&self, len: usize) -> Result<PayloadMut, TableError> {
        PayloadMut::receiving(len, self.mmap_threshold, &self.acct.live)
    }

    /// Hold `payload` as the intercept `request_id` of `rollout_id`, as
    /// [`InterceptTable::insert`] holds a copy of its body: the payload of a
    /// [`InterceptTable::receive_buffer`] of this table is held as it is; one
    /// made for another table is copied (its bytes count in that table's
    /// `live_bytes`, which this table cannot take over).
    ///
    /// Errors: as [`InterceptTable::insert`]; a refused payload is dropped
    /// (its memory freed).
    pub fn insert_payload(
        &self,
        request_id: &str,
        rollout_id: &str,
        payload: Payload,
        protocol: &str,
        stream: bool,
    ) -> Result<(), TableError> {
        let n = payload.len();
        let own = || {
            if payload.counts_in(&self.acct.live) {
                Ok(payload)
            } else {
                Payload::copy_from(payload.as_slice(), self.mmap_threshold, &self.acct.live)
            }
        };
        self.insert_with(request_id, rollout_id, n, own, protocol, stream)
    }

    /// The insert behind [`InterceptTable::insert`] and
    /// [`InterceptTable::insert_payload`]: `payload()` gives the `n` bytes
    /// to hold, called once the cheap refusals passed and the bytes are
    /// reserved.
    fn insert_with(
        &self,
        request_id: &str,
        rollout_id: &str,
        n: usize,
        payload: impl FnOnce() -> Result<Payload, TableError>,
        protocol: &str,
        stream: bool,
    ) -> Result<(), TableError> {
        let closed = || TableError::RolloutClosed { rollout_id: rollout_id.to_string() };
        let duplicate = || TableError::Duplicate { key: request_id.to_string() };
        // Cheap early refusals, before reserving and copying a large body.
        if !self.rollouts.contains(rollout_id) {
            return Err(closed());
        }
        if self.entries.contains(request_id) {
            return Err(duplicate());
        }
        let n = n as u64;
        self.acct.reserve(n, 0)?;
        let payload = match payload() {
            Ok(p) => p,
            Err(e) => {
                self.acct.unreserve(n);
                return Err(e);
            }
        };
        let key: Arc<str> = Arc::from(request_id);
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let intercept = Arc::new(Intercept {
            request_id: Arc::clone(&key),
            seq,
            rollout_id: Arc::from(rollout_id),
            protocol: protocol.into(),
            stream,
            created: Instant::now(),
            payload,
        });
        let outcome = self.rollouts.get_with(rollout_id, |rollout| {
            if self.entries.try_insert(Arc::clone(&key), Slot::new(intercept)).is_err() {
                return Err(duplicate());
            }
            self.acct.committed();
            rollout.requests.update(|held| {
                let mut next = Vec::with_capacity(held.len() + 1);
                next.extend(held.iter().cloned());
                next.push((Arc::clone(&key), seq));
                Some(next)
            });
            fence(Ordering::SeqCst);
            if rollout.closed.load(Ordering::SeqCst) {
                // The close may or may not have seen our id: remove our own
                // entry if it is still there, so it cannot outlive the rollout.
                self.remove_owned(request_id, rollout_id);
                return Err(closed());
            }
            Ok(())
        });
        match outcome {
            Some(Ok(())) => {
                self.acct.settled();
                Ok(())
            }
            Some(Err(e @ TableError::Duplicate { .. })) => {
                self.acct.unreserve(n);
                Err(e)
            }
            Some(Err(e)) => Err(e),
            None => {
                self.acct.unreserve(n);
                Err(closed())
            }
        }
    }

    /// The intercept held under `request_id`, if any.
    pub fn get(&self, request_id: &str) -> Option<Arc<Intercept>> {
        self.entries.get_with(request_id, |slot| slot.load()).flatten()
    }

    /// Remove `request_id`; true only for the call that removed it.
    pub fn discard(&self, request_id: &str) -> bool {
        let Some(intercept) = self.entries.remove_with(request_id, |slot| slot.take()).flatten() else {
            return false;
        };
        self.acct.released(intercept.payload.len() as u64);
        self.discards.fetch_add(1, Ordering::Relaxed);
        // Keep the rollout's request set from growing with delivered calls.
        self.rollouts.get_with(&*intercept.rollout_id, |rollout| {
            rollout.requests.update(|held| {
                let mine = held.iter().position(|(req, seq)| *seq == intercept.seq && &**req == request_id)?;
                let mut next = held.to_vec();
                next.swap_remove(mine);
                Some(next)
            });
        });
        true
    }

    /// Request ids held for longer than `older_than`.
    pub fn stale(&self, older_than: Duration) -> Vec<String> {
        let mut out = Vec::new();
        self.entries.for_each(|req, slot| {
            if slot.load().is_some_and(|i| i.age() > older_than) {
                out.push(req.to_string());
            }
        });
        out
    }

    /// Request ids currently held for `rollout_id` (empty if not open).
    pub fn rollout_requests(&self, rollout_id: &str) -> Vec<String> {
        self.rollouts
            .get_with(rollout_id, |r| {
                r.requests
                    .snapshot()
                    .iter()
                    .filter(|(req, _)| self.entries.contains(&**req))
                    .map(|(req, _)| req.to_string())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// True when an intercept is held under `request_id`.
    pub fn contains(&self, request_id: &str) -> bool {
        self.entries.contains(request_id)
    }

    /// The request ids held now (a snapshot; concurrent inserts and removals
    /// may or may not show).
    pub fn keys(&self) -> Vec<Arc<str>> {
        self.entries.keys()
    }

    /// Number of intercepts held.
    pub fn len(&self) -> usize {
        Accounting::load(&self.acct.entries) as usize
    }

    /// True when no intercept is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The counters; exact once concurrent callers have returned.
    pub fn stats(&self) -> InterceptStats {
        InterceptStats {
            entries: Accounting::load(&self.acct.entries),
            bytes: Accounting::load(&self.acct.bytes),
            peak_bytes: Accounting::load(&self.acct.peak),
            live_bytes: self.acct.live.get(),
            open_rollouts: Accounting::load(&self.open_rollouts),
            inserts: Accounting::load(&self.acct.inserts),
            discards: Accounting::load(&self.discards),
            swept: Accounting::load(&self.swept),
            rejected: Accounting::load(&self.acct.rejected),
        }
    }
}
