//! `BufferAlloc`: hyper-sized buffers come from the pool, hold what is
//! written to them, cost no resident page until written, and are given back
//! to the OS when freed; every other size is the inner allocator's.
#![cfg(not(loom))]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::Mutex;

use lowwater_dataplane::bufalloc::{pooled_slots, release_warm, warm_slots, SLOT_BYTES, WARM_BELOW_USED, WARM_SLOTS};
use lowwater_dataplane::BufferAlloc;
use proptest::prelude::*;

#[global_allocator]
static ALLOC: BufferAlloc<System> = BufferAlloc::new(System);

/// The tests read process-wide counts (slots in use, RSS): one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn rss_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("Linux /proc");
    statm.split_whitespace().nth(1).and_then(|p| p.parse::<usize>().ok()).expect("resident pages") * 4096
}

fn buffer(n: usize) -> Vec<u8> {
    Vec::with_capacity(n)
}

#[test]
fn hypers_buffer_size_comes_from_the_pool_and_goes_back() {
    let _s = serial();
    release_warm(); // other tests' last frees
    let (before, _) = pooled_slots();
    let mut b = buffer(SLOT_BYTES);
    assert_eq!(pooled_slots().0, before + 1);
    assert_eq!(b.as_ptr() as usize % SLOT_BYTES, 0, "a slot is slot-aligned");
    b.extend((0..SLOT_BYTES).map(|i| (i % 251) as u8));
    assert!(b.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
    drop(b);
    assert_eq!(pooled_slots().0, before);
    // The pool is nearly idle: the slot stays warm, and a zeroed buffer
    // that gets it is zeroed by hand.
    assert_eq!(warm_slots(), 1);
    let z = vec![0u8; SLOT_BYTES];
    assert_eq!(warm_slots(), 0, "the warm slot is handed out first");
    assert!(z.iter().all(|&x| x == 0), "a warm slot handed to alloc_zeroed is zeros");
    let mut w = z;
    w.fill(9);
    drop(w);
    assert_eq!((warm_slots(), release_warm(), warm_slots()), (1, 1, 0));
    // Given back with MADV_DONTNEED: the next buffer reads zeros unasked.
    let mut again = buffer(SLOT_BYTES);
    // SAFETY: u8 has no invalid values; reading what the allocator handed out.
    unsafe { again.set_len(SLOT_BYTES) };
    assert!(again.iter().all(|&x| x == 0), "a given-back slot is zeros, not the last owner's bytes");
}

#[test]
fn a_burst_keeps_no_warm_slot_and_an_idle_pool_at_most_a_few() {
    let _s = serial();
    release_warm();
    const N: usize = 2000;
    let mut held: Vec<Vec<u8>> = (0..N).map(|_| buffer(SLOT_BYTES)).collect();
    for b in &mut held {
        b.resize(SLOT_BYTES, 3);
    }
    // Freed while thousands stay in use: each goes back at once.
    held.truncate(N / 2);
    assert_eq!(warm_slots(), 0, "a busy pool keeps no freed slot resident");
    let rss0 = rss_bytes();
    drop(held);
    assert!(warm_slots() <= WARM_SLOTS, "{} warm slots", warm_slots());
    assert!(warm_slots() > 0, "the last {WARM_BELOW_USED} frees find the pool nearly idle");
    let resident = rss_bytes();
    assert!(resident < rss0, "the burst's buffers went back as they were freed");
    let released = release_warm();
    assert!(released > 0 && warm_slots() == 0);
    let after = rss_bytes();
    assert!(
        after + released * SLOT_BYTES / 2 <= resident,
        "release_warm gave back {released} slots' pages: {resident} -> {after} bytes"
    );
}

#[test]
fn a_buffer_grown_within_the_size_class_stays_in_its_slot() {
    let _s = serial();
    let mut b = buffer(5000);
    b.extend((0..5000).map(|i| (i % 13) as u8));
    let at = b.as_ptr();
    b.reserve_exact(SLOT_BYTES - b.len());
    assert_eq!(b.as_ptr(), at, "no copy: the slot already holds 8 KiB");
    assert!(b.iter().enumerate().all(|(i, &x)| x == (i % 13) as u8));
    b.reserve_exact(SLOT_BYTES + 1 - b.len());
    assert_ne!(b.as_ptr(), at, "out of the size class: moved to the inner allocator");
    assert!(b.iter().enumerate().all(|(i, &x)| x == (i % 13) as u8));
}

#[test]
fn other_sizes_are_the_inner_allocators() {
    let _s = serial();
    let (before, _) = pooled_slots();
    let small = buffer(4096);
    let large = buffer(SLOT_BYTES + 1);
    let aligned = Layout::from_size_align(SLOT_BYTES, 8192).unwrap();
    // SAFETY: a valid non-zero layout; freed below with the same layout.
    let p = unsafe { ALLOC.alloc(aligned) };
    assert_eq!(pooled_slots().0, before, "4096, 8193 bytes and 8 KiB alignment are not pooled");
    // SAFETY: allocated above with this layout.
    unsafe { ALLOC.dealloc(p, aligned) };
    drop((small, large));
}

#[test]
fn untouched_buffers_are_not_resident_and_freed_ones_leave() {
    let _s = serial();
    const N: usize = 4000; // 31 MiB of buffers
    let rss0 = rss_bytes();
    let mut held: Vec<Vec<u8>> = (0..N).map(|_| buffer(SLOT_BYTES)).collect();
    let untouched = rss_bytes().saturating_sub(rss0);
    assert!(untouched < N * 1024, "{N} untouched 8 KiB buffers made {untouched} bytes resident");
    for b in &mut held {
        b.resize(SLOT_BYTES, 7);
    }
    let touched = rss_bytes().saturating_sub(rss0);
    assert!(touched > N * SLOT_BYTES * 3 / 4, "written buffers are resident ({touched} bytes)");
    drop(held);
    let after = rss_bytes().saturating_sub(rss0);
    assert!(after < N * 1024, "freed buffers left {after} bytes resident (no trim needed)");
}

#[test]
fn threads_share_the_pool() {
    let _s = serial();
    let (before, _) = pooled_slots();
    std::thread::scope(|s| {
        for t in 0..4u8 {
            s.spawn(move || {
                for round in 0..500u32 {
                    let mut bufs: Vec<Vec<u8>> = (0..8).map(|_| buffer(SLOT_BYTES)).collect();
                    for (k, b) in bufs.iter_mut().enumerate() {
                        b.resize(SLOT_BYTES, t ^ (k as u8) ^ (round as u8));
                    }
                    for (k, b) in bufs.iter().enumerate() {
                        let want = t ^ (k as u8) ^ (round as u8);
                        assert!(b.iter().all(|&x| x == want), "a slot was handed to two owners");
                    }
                }
            });
        }
    });
    assert_eq!(pooled_slots().0, before);
}

/// Forks made while three threads allocate and free pool buffers; each child
/// takes one buffer and exits.  With the pool behind a `std::sync::Mutex`
/// a fork landing while another thread held it left the child's copy locked,
/// and the child hung on its first buffer.
#[test]
fn a_child_forked_while_threads_use_the_pool_can_use_it() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::{Duration, Instant};

    const FORKS: usize = 200;
    let _s = serial();
    let stop = AtomicBool::new(false);
    let hung = std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let b = buffer(SLOT_BYTES);
                    std::hint::black_box(&b);
                }
            });
        }
        let mut hung = None;
        for i in 0..FORKS {
            // SAFETY: the child runs only the allocator and _exit.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork failed");
            if pid == 0 {
                let b = buffer(SLOT_BYTES);
                std::hint::black_box(&b);
                drop(b);
                // SAFETY: ends the child at once, running no destructor of the parent's.
                unsafe { libc::_exit(0) };
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            let mut status = 0;
            loop {
                // SAFETY: waiting on our own child.
                let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
                if r == pid {
                    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "child {i}: status {status}");
                    break;
                }
                if Instant::now() > deadline {
                    // SAFETY: our own child, hung; reaped right after.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                        libc::waitpid(pid, &mut status, 0);
                    }
                    hung = Some(i);
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            if hung.is_some() {
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
        hung
    });
    assert_eq!(hung, None, "a child forked while the pool was locked hung on its first buffer");
}

#[derive(Debug, Clone)]
enum Op {
    Alloc(usize),
    Grow(usize, usize),
    Free(usize),
}

fn op() -> impl Strategy<Value = Op> {
    // Sizes around the pool's bounds: 4096 (inner), 4097..=8192 (pool), above (inner).
    let size = prop_oneof![1usize..64, 4090usize..4100, 8185usize..8200, 12000usize..20000];
    prop_oneof![
        size.clone().prop_map(Op::Alloc),
        (any::<usize>(), size).prop_map(|(i, s)| Op::Grow(i, s)),
        any::<usize>().prop_map(Op::Free),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever mix of sizes is allocated, grown across the pool's bounds and
    /// freed, every buffer keeps its own bytes, and the pool ends as it began.
    #[test]
    fn buffers_keep_their_bytes(ops in prop::collection::vec(op(), 1..120)) {
        let _s = serial();
        let (before, _) = pooled_slots();
        let mut live: Vec<(Vec<u8>, u8)> = Vec::new();
        for (n, op) in ops.into_iter().enumerate() {
            let tag = n as u8;
            match op {
                Op::Alloc(size) => {
                    let mut b = buffer(size);
                    b.resize(size, tag);
                    live.push((b, tag));
                }
                Op::Grow(i, size) if !live.is_empty() => {
                    let k = i % live.len();
                    let (b, t) = &mut live[k];
                    let had = b.len();
                    // Vec growth reallocs: into, out of, or within the pool.
                    b.reserve_exact(size.saturating_sub(b.capacity()));
                    b.resize(had.max(size), *t);
                    b.shrink_to_fit();
                }
                Op::Free(i) if !live.is_empty() => {
                    let k = i % live.len();
                    live.swap_remove(k);
                }
                _ => {}
            }
            for (b, t) in &live {
                prop_assert!(b.iter().all(|x| x == t));
            }
        }
        drop(live);
        prop_assert_eq!(pooled_slots().0, before);
    }
}
