//! Byte and entry accounting shared by both tables, with the capacity bound.
//!
//! Bytes are reserved *before* a payload is copied, so a put over capacity is
//! refused without allocating, and released by whoever takes the payload out
//! of its slot (exactly one caller).  Counters are exact once concurrent
//! callers have returned; while a put runs, `bytes` includes its reservation.
//!
//! A replacing put is admitted against the size it replaces.  If another
//! thread removes that same id between the admission and the insert, and a
//! third put takes the freed room, `bytes` can exceed the capacity by at most
//! the replaced size until the next removal (three-way race on one id).

use std::sync::Arc;

use crate::error::TableError;
use crate::payload::LiveBytes;
use crate::sync::{AtomicU64, Ordering};

pub(crate) struct Accounting {
    capacity: Option<u64>,
    pub(crate) entries: AtomicU64,
    pub(crate) bytes: AtomicU64,
    pub(crate) peak: AtomicU64,
    pub(crate) inserts: AtomicU64,
    pub(crate) rejected: AtomicU64,
    pub(crate) live: Arc<LiveBytes>,
}

impl Accounting {
    pub(crate) fn new(capacity: Option<u64>) -> Self {
        Accounting {
            capacity,
            entries: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            inserts: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            live: Arc::new(LiveBytes::default()),
        }
    }

    pub(crate) fn capacity(&self) -> Option<u64> {
        self.capacity
    }

    /// Reserve `n` bytes.  `replacing` is the size of a payload this insert
    /// will replace: it is about to be released, so it does not count against
    /// the bound (a same-size replacement in a full buffer is admitted).
    pub(crate) fn reserve(&self, n: u64, replacing: u64) -> Result<(), TableError> {
        let mut cur = self.bytes.load(Ordering::Acquire);
        loop {
            let next = cur.saturating_add(n);
            if let Some(cap) = self.capacity {
                if next.saturating_sub(replacing) > cap {
                    self.rejected.fetch_add(1, Ordering::Relaxed);
                    return Err(TableError::Full { requested: n, used: cur, capacity: cap });
                }
            }
            match self.bytes.compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(()),
                Err(actual) => cur = actual,
            }
        }
    }

    /// A put finished (and released what it replaced): record the peak.
    ///
    /// The peak is the largest `bytes` seen after a completed insert, so a
    /// refused or failed reservation, and the moment during a replacement when
    /// both payloads are counted, do not raise it.  Under concurrency the
    /// reading may include other puts' reservations in progress.
    pub(crate) fn settled(&self) {
        self.bump_peak(self.bytes.load(Ordering::Acquire));
    }

    fn bump_peak(&self, candidate: u64) {
        let mut peak = self.peak.load(Ordering::Relaxed);
        while candidate > peak {
            match self.peak.compare_exchange_weak(peak, candidate, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return,
                Err(actual) => peak = actual,
            }
        }
    }

    /// Give back a reservation whose insert did not happen.
    pub(crate) fn unreserve(&self, n: u64) {
        self.bytes.fetch_sub(n, Ordering::AcqRel);
    }

    /// The reserved payload is now an entry.
    pub(crate) fn committed(&self) {
        self.entries.fetch_add(1, Ordering::Relaxed);
        self.inserts.fetch_add(1, Ordering::Relaxed);
    }

    /// An entry of `n` bytes was taken out of the table.
    pub(crate) fn released(&self, n: u64) {
        self.entries.fetch_sub(1, Ordering::Relaxed);
        self.bytes.fetch_sub(n, Ordering::AcqRel);
    }

    pub(crate) fn load(c: &AtomicU64) -> u64 {
        c.load(Ordering::Acquire)
    }
}
