//! Connection buffers on pages of their own, given back to the OS when freed.
//!
//! hyper gives every HTTP/1.1 connection an 8 KiB write buffer when it is
//! served and reserves 8 KiB for each read (`INIT_BUFFER_SIZE`; no setting
//! makes either smaller).  A call held open (or queued for the upstream) has
//! read a few hundred bytes and written none, so most of those buffers are
//! never touched; but glibc carves them from its heap between small
//! allocations, writes a chunk header before each, and puts other
//! connections' small objects in the same pages, so the untouched bytes are
//! resident anyway.  `examples/held_alloc.rs` counted 14.3 KB resident per
//! queued call on glibc (22.1 KB allocated, 16.4 KB of it the two buffers),
//! and mimalloc was worse (23.8 KB: it writes a free-list link into each
//! block).
//!
//! [`BufferAlloc`] serves allocations of hyper's buffer size class,
//! (4 KiB, 8 KiB], from 8 KiB slots of their own `mmap`ed chunks: nothing but
//! the buffer's owner writes to a slot (no header, no link: the free list is
//! an index stack beside the chunks), so an untouched buffer costs no
//! resident page, and a freed slot is given back at once with
//! `madvise(MADV_DONTNEED)`: a burst's buffers do not wait for `malloc_trim`.
//! That costs a call about three `madvise`s (its connections' read buffers
//! cycle) and the page faults of reusing the slots.  Keeping the last 32
//! freed slots resident for reuse, always, saved ~0.03 ms of added latency,
//! and cost 4 KB more per held call in the 16,384-call burst (12.0 against
//! 8.0 KB): a warm slot has a dirty page, and the buffer it goes to next
//! is often one a held call never touches.  So a freed slot stays warm
//! only while the pool is nearly idle (fewer than [`WARM_BELOW_USED`] slots
//! in use: a few connections, where the madvise and the faults are on
//! every call's path), at most [`WARM_SLOTS`] of them (256 KiB), and the
//! plane's idle trim gives those back too ([`release_warm`]); in a burst
//! every slot goes back at once, as before.
//! Every other allocation goes to the inner allocator unchanged.  When the
//! pool cannot grow (its [`MAX_CHUNKS`] chunks in use, or `mmap` refused, as
//! under an `RLIMIT_AS` cap) the buffer comes from the inner allocator too.
//!
//! The pool's state is one lock taken for a push or a pop (a chunk's `mmap`
//! when it grows); the `madvise` runs outside it.  The lock is a spin lock
//! (the `spin` crate's, yielding its core while it waits; it allocates
//! nothing, as an allocator's lock must not), made safe across `fork()` as
//! glibc's malloc is: a `pthread_atfork` handler takes it before the fork
//! and both processes release it after.  With a `std::sync::Mutex` a fork while another thread
//! held it (a tokio worker freeing a buffer) left the child's copy locked
//! for good, and the child's first buffer of this size hung: Python's
//! `os.fork()` and multiprocessing's default start method on Linux fork a
//! trainer that may hold a live data plane (tests/bufalloc.rs forks while
//! three threads churn buffers).

use std::alloc::{GlobalAlloc, Layout};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};

use spin::mutex::SpinMutex;
use spin::relax::Yield;

/// The slot size: hyper's `INIT_BUFFER_SIZE`.
pub const SLOT_BYTES: usize = 8192;
/// The smallest size served from the pool (exclusive): smaller allocations
/// share pages with their neighbours anyway.
const MIN_EXCLUSIVE: usize = 4096;
/// Slots per chunk (one 2 MiB `mmap`).
const SLOTS_PER_CHUNK: usize = 256;
const CHUNK_BYTES: usize = SLOT_BYTES * SLOTS_PER_CHUNK;
/// Chunks the pool may map: 4 GiB of address space, 524,288 slots (two per
/// held call's connection, 16,384 calls need 64 chunks).
pub const MAX_CHUNKS: usize = 2048;
const MAX_SLOTS: usize = MAX_CHUNKS * SLOTS_PER_CHUNK;
/// Freed slots kept resident for reuse while the pool is nearly idle.
pub const WARM_SLOTS: usize = 32;
/// A freed slot stays warm only while fewer slots than this are in use: a
/// sequential agent's connection uses 2-6; a burst's thousands never keep one.
pub const WARM_BELOW_USED: usize = 64;

/// A global allocator that puts hyper's connection buffers on pages of
/// their own (see the module docs) and everything else on `A`.
///
/// ```ignore
/// #[global_allocator]
/// static ALLOC: lowwater_dataplane::BufferAlloc<std::alloc::System> =
///     lowwater_dataplane::BufferAlloc::new(std::alloc::System);
/// ```
pub struct BufferAlloc<A> {
    inner: A,
}

impl<A> BufferAlloc<A> {
    /// Wrap `inner`, which serves every allocation outside the pool's size class.
    pub const fn new(inner: A) -> Self {
        BufferAlloc { inner }
    }
}

/// The pool: chunk bases (in mapping order, and sorted for lookup) and the
/// stack of free slot indices.  All zeros when empty, so the static lives in
/// `.bss` and only the pages the pool uses become resident.
struct Pool {
    /// Chunk `i`'s base address, for `i < chunks`.
    bases: [usize; MAX_CHUNKS],
    /// `(base, i)` for `i < chunks`, sorted by base: a freed pointer's chunk.
    sorted: [(usize, u32); MAX_CHUNKS],
    chunks: usize,
    /// Free slot indices (`chunk * SLOTS_PER_CHUNK + slot`); `free[..top]`.
    free: [u32; MAX_SLOTS],
    top: usize,
    /// Freed slots still resident (not given back), `warm[..warm_top]`:
    /// handed out first, zeroed by hand for `alloc_zeroed`.
    warm: [u32; WARM_SLOTS],
    warm_top: usize,
    /// Slots handed out now (for [`pooled_slots`]).
    used: usize,
}

/// The pool behind its lock (see the module docs for why not a `Mutex`):
/// held for a push, a pop or a lookup (a chunk's `mmap` at most), so a
/// waiter yields its core until it is free.
static POOL: SpinMutex<Pool, Yield> = SpinMutex::new(Pool {
    bases: [0; MAX_CHUNKS],
    sorted: [(0, 0); MAX_CHUNKS],
    chunks: 0,
    free: [0; MAX_SLOTS],
    top: 0,
    warm: [0; WARM_SLOTS],
    warm_top: 0,
    used: 0,
});

/// Whether the fork handlers are installed (on the pool's first chunk).
static AT_FORK: AtomicBool = AtomicBool::new(false);

fn pooled(layout: Layout) -> bool {
    layout.size() > MIN_EXCLUSIVE && layout.size() <= SLOT_BYTES && layout.align() <= 4096
}

impl Pool {
    fn address(&self, slot: u32) -> *mut u8 {
        let slot = slot as usize;
        (self.bases[slot / SLOTS_PER_CHUNK] + (slot % SLOTS_PER_CHUNK) * SLOT_BYTES) as *mut u8
    }

    /// The slot index of `p`, if `p` is a slot of one of the pool's chunks.
    fn slot_of(&self, p: usize) -> Option<u32> {
        let sorted = &self.sorted[..self.chunks];
        // The last chunk whose base is at or below p.
        let k = sorted.partition_point(|&(base, _)| base <= p).checked_sub(1)?;
        let (base, chunk) = sorted[k];
        let off = p - base;
        if off >= CHUNK_BYTES || off % SLOT_BYTES != 0 {
            return None;
        }
        Some(chunk * SLOTS_PER_CHUNK as u32 + (off / SLOT_BYTES) as u32)
    }

    /// Map one more chunk and put its slots on the free stack (highest
    /// first, so slots are handed out in address order); false if it cannot.
    fn grow(&mut self) -> bool {
        if self.chunks == MAX_CHUNKS {
            return false;
        }
        // SAFETY: an anonymous private mapping of fresh pages; no existing
        // memory is touched.  MAP_NORESERVE: the pages are committed as they
        // are written, which is the point.
        let base = unsafe {
            libc::mmap(
                ptr::null_mut(),
                CHUNK_BYTES,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return false;
        }
        install_fork_handlers();
        let (base, i) = (base as usize, self.chunks);
        self.bases[i] = base;
        let at = self.sorted[..i].partition_point(|&(b, _)| b < base);
        self.sorted.copy_within(at..i, at + 1);
        self.sorted[at] = (base, i as u32);
        self.chunks += 1;
        for s in (0..SLOTS_PER_CHUNK).rev() {
            self.free[self.top] = (i * SLOTS_PER_CHUNK + s) as u32;
            self.top += 1;
        }
        true
    }

    /// A slot to hand out, and whether it is warm (its bytes are a former
    /// owner's, not zeros): a warm one first.
    fn pop(&mut self) -> Option<(*mut u8, bool)> {
        if self.warm_top > 0 {
            self.warm_top -= 1;
            self.used += 1;
            return Some((self.address(self.warm[self.warm_top]), true));
        }
        if self.top == 0 && !self.grow() {
            return None;
        }
        self.top -= 1;
        self.used += 1;
        Some((self.address(self.free[self.top]), false))
    }

    /// Keep freed `slot` resident if the pool is nearly idle and has room
    /// for a warm slot; false if it must be given back.
    fn keep_warm(&mut self, slot: u32) -> bool {
        if self.used > WARM_BELOW_USED || self.warm_top == WARM_SLOTS {
            return false;
        }
        self.warm[self.warm_top] = slot;
        self.warm_top += 1;
        self.used -= 1;
        true
    }

    fn push_free(&mut self, slot: u32) {
        let top = self.top;
        self.free[top] = slot;
        self.top += 1;
    }
}

/// Before `fork()`: take the lock, so no other thread is inside the pool
/// when the child's copy of it is made.
extern "C" fn before_fork() {
    std::mem::forget(POOL.lock());
}

/// After `fork()`, in the parent and in the child (its only thread): let go.
extern "C" fn after_fork() {
    // SAFETY: `before_fork` took the lock in this thread (the child's only
    // one) and forgot its guard; nothing else can hold it here.
    unsafe { POOL.force_unlock() };
}

/// Install the fork handlers once.  Called with the lock held: glibc's
/// `pthread_atfork` allocates a handful of bytes, never of the pool's size.
fn install_fork_handlers() {
    if !AT_FORK.swap(true, Ordering::Relaxed) {
        // SAFETY: the handlers are plain functions that touch only POOL's lock.
        unsafe {
            libc::pthread_atfork(Some(before_fork), Some(after_fork), Some(after_fork));
        }
    }
}

/// Slots handed out now and chunks mapped (for tests and `examples/held_alloc.rs`).
pub fn pooled_slots() -> (usize, usize) {
    let p = POOL.lock();
    (p.used, p.chunks)
}

/// Freed slots kept resident now (at most [`WARM_SLOTS`]; for tests).
pub fn warm_slots() -> usize {
    POOL.lock().warm_top
}

/// Give the warm slots' pages back (the plane's idle trim calls this), so
/// an idle plane keeps no freed buffer resident; returns how many.
pub fn release_warm() -> usize {
    let mut taken = [(0u32, ptr::null_mut::<u8>()); WARM_SLOTS];
    let n = {
        let mut pool = POOL.lock();
        let n = pool.warm_top;
        for (i, t) in taken[..n].iter_mut().enumerate() {
            let slot = pool.warm[i];
            *t = (slot, pool.address(slot));
        }
        pool.warm_top = 0;
        n
    };
    // Outside the lock, as in `release`: the slots are on neither stack
    // meanwhile, so no one can hand them out.
    for &(_, p) in &taken[..n] {
        // SAFETY: a freed slot of the pool's own mapping, owned by no one.
        unsafe {
            libc::madvise(p.cast(), SLOT_BYTES, libc::MADV_DONTNEED);
        }
    }
    let mut pool = POOL.lock();
    for &(slot, _) in &taken[..n] {
        pool.push_free(slot);
    }
    n
}

/// Put a freed slot back: warm if the pool is nearly idle, else its pages
/// given back first.
fn release(slot: u32, p: *mut u8) {
    if POOL.lock().keep_warm(slot) {
        return;
    }
    // SAFETY: `p` is the start of an 8 KiB slot inside a mapping the pool
    // owns, and its owner has freed it: nobody reads or writes it until it is
    // handed out again, which cannot happen before it is pushed below.  The
    // next use reads zeros (MADV_DONTNEED on a private anonymous mapping).
    unsafe {
        libc::madvise(p.cast(), SLOT_BYTES, libc::MADV_DONTNEED);
    }
    let mut pool = POOL.lock();
    pool.push_free(slot);
    pool.used -= 1;
}

// SAFETY: a pooled pointer is an 8 KiB, 8 KiB-aligned slot no one else holds
// (popped under the lock), which satisfies any layout `pooled` accepts;
// every other call is the inner allocator's, with the caller's contract.
unsafe impl<A: GlobalAlloc> GlobalAlloc for BufferAlloc<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if pooled(layout) {
            if let Some((p, _)) = POOL.lock().pop() {
                return p;
            }
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if pooled(layout) {
            // A cold slot is zeros: fresh pages, or given back by
            // MADV_DONTNEED; a warm one holds its last owner's bytes.
            let popped = POOL.lock().pop();
            if let Some((p, warm)) = popped {
                if warm {
                    // SAFETY: the slot is 8 KiB and now ours alone.
                    unsafe { ptr::write_bytes(p, 0, SLOT_BYTES) };
                }
                return p;
            }
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        if pooled(layout) {
            let slot = POOL.lock().slot_of(p as usize);
            if let Some(slot) = slot {
                release(slot, p);
                return;
            }
        }
        // SAFETY: not a slot, so the inner allocator's: the caller's contract.
        unsafe { self.inner.dealloc(p, layout) }
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller guarantees new_size, rounded up to the
        // alignment, does not overflow isize.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        if !pooled(layout) && !pooled(new_layout) {
            // SAFETY: neither side is the pool's: the caller's contract.
            return unsafe { self.inner.realloc(p, layout, new_size) };
        }
        if pooled(layout) && pooled(new_layout) && POOL.lock().slot_of(p as usize).is_some() {
            // A slot is 8 KiB whatever size was asked: it already fits.
            return p;
        }
        // SAFETY: as alloc and dealloc; the copy is within both blocks.
        unsafe {
            let q = self.alloc(new_layout);
            if !q.is_null() {
                ptr::copy_nonoverlapping(p, q, layout.size().min(new_size));
                self.dealloc(p, layout);
            }
            q
        }
    }
}
