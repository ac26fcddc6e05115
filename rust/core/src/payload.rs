//! Payload storage: the bytes of one shard or one request body.
//!
//! Small payloads are ordinary heap allocations.  Payloads of at least the
//! table's `mmap_threshold` get their own anonymous mapping: glibc's dynamic
//! mmap threshold rises after a large free, so later payloads of the same size
//! would come from arenas that are never returned to the OS; a private
//! mapping is unmapped on drop whatever the allocator does.

use std::sync::Arc;

use crate::error::TableError;
use crate::sync::{AtomicU64, Ordering};

enum Storage {
    Heap(Box<[u8]>),
    Mapped(memmap2::Mmap),
}

/// Bytes still allocated by a table's payloads, including payloads that were
/// removed from the table but are still held by a view.
#[derive(Default)]
pub struct LiveBytes(AtomicU64);

impl LiveBytes {
    /// The figure now, in bytes.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

/// An immutable byte payload that reports its release to its table's
/// [`LiveBytes`] when the last reference drops.
pub struct Payload {
    storage: Storage,
    live: Arc<LiveBytes>,
}

/// A fresh anonymous mapping of `len` bytes with its pages faulted in by the
/// `mmap` call itself (`MAP_POPULATE`), for memory about to be written whole.
fn populated_mapping(len: usize) -> std::io::Result<memmap2::MmapMut> {
    memmap2::MmapOptions::new().len(len).populate().map_anon()
}

impl Payload {
    /// Copy `src` into a new payload; at or above `mmap_threshold` bytes the
    /// copy goes into a fresh anonymous mapping.
    ///
    /// Errors: [`TableError::Alloc`] when the mapping cannot be created.
    pub fn copy_from(src: &[u8], mmap_threshold: usize, live: &Arc<LiveBytes>) -> Result<Self, TableError> {
        let storage = if !src.is_empty() && src.len() >= mmap_threshold {
            // MAP_POPULATE: every page is written at once below.  Taking them
            // in the mmap call, not one fault per 4 KiB page under the copy
            // (17 % of the data plane's CPU for sequential 1 MiB requests),
            // took 0.5 ms off each such call's added latency.
            let mut map = populated_mapping(src.len())
                .map_err(|e| TableError::Alloc { bytes: src.len(), reason: e.to_string() })?;
            map.copy_from_slice(src);
            // Read-only from here on: views hand Python a read-only buffer, and
            // a write through a stray pointer now faults instead of corrupting.
            Storage::Mapped(
                map.make_read_only().map_err(|e| TableError::Alloc { bytes: src.len(), reason: e.to_string() })?,
            )
        } else {
            // One pass: reserve exactly, then copy (no zero-fill first).  A
            // fallible reserve: `Vec::with_capacity` aborts the whole process
            // when the allocator refuses (found by tests/native/test_alloc_failure.py).
            let mut v = Vec::new();
            v.try_reserve_exact(src.len())
                .map_err(|e| TableError::Alloc { bytes: src.len(), reason: e.to_string() })?;
            v.extend_from_slice(src);
            Storage::Heap(v.into_boxed_slice())
        };
        live.0.fetch_add(src.len() as u64, Ordering::AcqRel);
        Ok(Payload { storage, live: Arc::clone(live) })
    }

    /// The payload's bytes.
    pub fn as_slice(&self) -> &[u8] {
        match &self.storage {
            Storage::Heap(b) => b,
            Storage::Mapped(m) => m,
        }
    }

    /// Size of the payload in bytes.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// True for a zero-byte payload.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True when the payload lives in its own anonymous mapping.
    pub fn is_mapped(&self) -> bool {
        matches!(self.storage, Storage::Mapped(_))
    }

    /// True when the payload's bytes count in `live` (it was made for the
    /// table that owns `live`).
    pub(crate) fn counts_in(&self, live: &Arc<LiveBytes>) -> bool {
        Arc::ptr_eq(&self.live, live)
    }
}

impl AsRef<[u8]> for Payload {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Drop for Payload {
    fn drop(&mut self) {
        self.live.0.fetch_sub(self.len() as u64, Ordering::AcqRel);
    }
}

/// Size of a transparent huge page on x86-64 and arm64 with 4 KiB pages
/// (bytes): payloads at least this large are mapped with `MADV_HUGEPAGE`.
pub const HUGE_PAGE_BYTES: usize = 2 << 20;

/// An anonymous mapping of `len` bytes advised to use transparent huge pages,
/// or `None` when `len` is under [`HUGE_PAGE_BYTES`], the platform has no
/// such advice, or the kernel refuses it (built without THP).
fn huge_mapping(len: usize) -> Option<memmap2::MmapMut> {
    if len < HUGE_PAGE_BYTES {
        return None;
    }
    #[cfg(target_os = "linux")]
    {
        let map = memmap2::MmapOptions::new().len(len).map_anon().ok()?;
        map.advise(memmap2::Advice::HugePage).ok()?;
        Some(map)
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

enum StorageMut {
    Heap(Box<[u8]>),
    Mapped(memmap2::MmapMut),
}

/// A payload being filled in place (a shard received straight into its final
/// memory, with no copy); writable until [`PayloadMut::freeze`] turns it into
/// an immutable [`Payload`].  Its bytes count in [`LiveBytes`] from creation.
pub struct PayloadMut {
    storage: Option<StorageMut>,
    len: usize,
    live: Arc<LiveBytes>,
}

impl PayloadMut {
    /// A zero-filled payload of `len` bytes; at or above `mmap_threshold`
    /// bytes a fresh anonymous mapping.
    ///
    /// The pages are about to be written whole (a shard received in place),
    /// and faulting in fresh pages, not copying, is what bounds the receive:
    /// * from [`HUGE_PAGE_BYTES`] up the mapping asks for transparent huge
    ///   pages (`MADV_HUGEPAGE`) and is faulted by the receive itself: 32
    ///   faults for 64 MiB instead of 16 384.  On the 2-core VM the benches
    ///   run on a 64 MiB loopback receive took 47–61 ms this way against
    ///   68–120 ms populated with 4 KiB pages (`benches/ray_backend.py`'s
    ///   HTTP fetch; a host's first huge-page fault may also compact memory
    ///   once).  Where the kernel refuses the advice it falls back to:
    /// * `MAP_POPULATE`: the pages faulted in one call, a third of the time of
    ///   16 384 separate faults for 64 MiB (60 ms against 173 ms, same VM).
    ///
    /// Errors: [`TableError::Alloc`] when the memory cannot be had.
    pub fn zeroed(len: usize, mmap_threshold: usize, live: &Arc<LiveBytes>) -> Result<Self, TableError> {
        Self::new(len, mmap_threshold, true, live)
    }

    /// A payload of `len` bytes about to be written as they arrive (a request
    /// body read from its connection): as [`PayloadMut::zeroed`], but a
    /// mapping under [`HUGE_PAGE_BYTES`] is not populated up front: its pages
    /// are faulted in as they are written (or by [`PayloadMut::populate`]),
    /// so a size declared but not yet sent costs no memory (a client that
    /// declares 64 MiB and stalls holds no 64 MiB).
    ///
    /// Errors: [`TableError::Alloc`] when the memory cannot be had.
    pub fn receiving(len: usize, mmap_threshold: usize, live: &Arc<LiveBytes>) -> Result<Self, TableError> {
        Self::new(len, mmap_threshold, false, live)
    }

    /// [`PayloadMut::zeroed`] (`populate`: a mapping's pages faulted in by
    /// the `mmap` call) and [`PayloadMut::receiving`] (not).
    fn new(len: usize, mmap_threshold: usize, populate: bool, live: &Arc<LiveBytes>) -> Result<Self, TableError> {
        let alloc = |reason: String| TableError::Alloc { bytes: len, reason };
        let storage = if len != 0 && len >= mmap_threshold {
            StorageMut::Mapped(match huge_mapping(len) {
                Some(map) => map,
                None if populate => populated_mapping(len).map_err(|e| alloc(e.to_string()))?,
                None => memmap2::MmapOptions::new().len(len).map_anon().map_err(|e| alloc(e.to_string()))?,
            })
        } else {
            let mut v = Vec::new();
            v.try_reserve_exact(len).map_err(|e| alloc(e.to_string()))?;
            v.resize(len, 0);
            StorageMut::Heap(v.into_boxed_slice())
        };
        live.0.fetch_add(len as u64, Ordering::AcqRel);
        Ok(PayloadMut { storage: Some(storage), len, live: Arc::clone(live) })
    }

    /// Fault in the pages of `len` bytes from `offset` (about to be
    /// written) in one call (`MADV_POPULATE_WRITE`, Linux 5.14 and later),
    /// not one page fault per 4 KiB page under the write: on the 2-core VM
    /// the benches run on such faults cost about as much as copying the
    /// page (docs/dataplane.md).  A no-op for a heap payload, for a range
    /// outside the payload, and where the kernel lacks the advice (the
    /// write then faults the pages in as usual).
    pub fn populate(&mut self, offset: usize, len: usize) {
        #[cfg(target_os = "linux")]
        if let Some(StorageMut::Mapped(m)) = &self.storage {
            if offset.checked_add(len).is_some_and(|end| end <= self.len) && len > 0 {
                let _ = m.advise_range(memmap2::Advice::PopulateWrite, offset, len);
            }
        }
        #[cfg(not(target_os = "linux"))]
        let _ = (offset, len);
    }

    /// The bytes to fill.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.storage {
            Some(StorageMut::Heap(b)) => b,
            Some(StorageMut::Mapped(m)) => m,
            None => &mut [],
        }
    }

    /// Size of the payload in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-byte payload.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The filled payload, immutable from here on (a mapping is made
    /// read-only, as [`Payload::copy_from`] does).
    ///
    /// Errors: [`TableError::Alloc`] when the mapping cannot be protected
    /// (the payload is then released).
    pub fn freeze(mut self) -> Result<Payload, TableError> {
        let storage = match self.storage.take() {
            Some(StorageMut::Heap(b)) => Storage::Heap(b),
            Some(StorageMut::Mapped(m)) => Storage::Mapped(m.make_read_only().map_err(|e| {
                self.live.0.fetch_sub(self.len as u64, Ordering::AcqRel);
                TableError::Alloc { bytes: self.len, reason: e.to_string() }
            })?),
            None => Storage::Heap(Box::default()),
        };
        Ok(Payload { storage, live: Arc::clone(&self.live) })
    }
}

impl Drop for PayloadMut {
    fn drop(&mut self) {
        if self.storage.is_some() {
            self.live.0.fetch_sub(self.len as u64, Ordering::AcqRel);
        }
    }
}
