//! What one held call costs the data plane: live heap bytes per call by
//! allocation size, and resident bytes per call, with `N` calls (argument 1,
//! default 2,000) held open at an upstream that accepts and never answers.
//!
//! `cargo run --release -p lowwater-dataplane --no-default-features --example held_alloc -- 4000`
//! (without `--no-default-features` the counted allocator is mimalloc).
//! The clients and the upstream are plain blocking sockets, so nothing but
//! the plane allocates while the calls open. docs/dataplane.md#per-open-rollout
//! reads its output.
// Under `--cfg loom` the crate has no server (tokio is not built): nothing to run.
#![cfg_attr(loom, allow(dead_code, unused_imports))]

#[cfg(any(not(feature = "mimalloc"), loom))]
use std::alloc::System;
use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicI64, Ordering};

#[cfg(loom)]
fn main() {}

/// Live bytes and allocations by size class (`[2^(k-1), 2^k)` in slot `k`).
struct Counting;

const SLOTS: usize = 24;
static BYTES: [AtomicI64; SLOTS] = [const { AtomicI64::new(0) }; SLOTS];
static COUNT: [AtomicI64; SLOTS] = [const { AtomicI64::new(0) }; SLOTS];

#[cfg(all(feature = "mimalloc", not(loom)))]
static INNER: mimalloc::MiMalloc = mimalloc::MiMalloc;
#[cfg(loom)]
static INNER: System = System;
// The extension's allocator: hyper's buffers on pages of their own.
#[cfg(all(not(feature = "mimalloc"), not(loom)))]
static INNER: lowwater_dataplane::BufferAlloc<System> = lowwater_dataplane::BufferAlloc::new(System);

fn slot(size: usize) -> usize {
    ((usize::BITS - size.max(1).leading_zeros()) as usize).min(SLOTS - 1)
}

fn count(size: usize, sign: i64) {
    let k = slot(size);
    BYTES[k].fetch_add(sign * size as i64, Ordering::Relaxed);
    COUNT[k].fetch_add(sign, Ordering::Relaxed);
}

// SAFETY: forwards every call to the inner allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size(), 1);
        // SAFETY: the caller's contract, passed on.
        unsafe { INNER.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(layout.size(), -1);
        // SAFETY: the caller's contract, passed on.
        unsafe { INNER.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

#[cfg(not(loom))]
fn snapshot() -> Vec<(i64, i64)> {
    (0..SLOTS).map(|k| (BYTES[k].load(Ordering::Relaxed), COUNT[k].load(Ordering::Relaxed))).collect()
}

#[cfg(not(loom))]
fn rss_bytes() -> i64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("Linux /proc");
    statm.split_whitespace().nth(1).and_then(|p| p.parse::<i64>().ok()).expect("statm's resident pages") * 4096
}

#[cfg(not(loom))]
fn main() {
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    use lowwater_dataplane::{Config, DataPlane};

    let n: usize = std::env::args().nth(1).map_or(2000, |s| s.parse().expect("N: a count of calls"));
    let upstream = TcpListener::bind("127.0.0.1:0").unwrap();
    upstream.set_nonblocking(true).unwrap();
    let mut config = Config::new(format!("http://{}/v1", upstream.local_addr().unwrap()));
    config.retries = 0;
    // Argument 2: the plane's max_concurrency (default N + 1: every call
    // reaches the upstream; the default configuration's 1,024 queues the rest).
    config.max_concurrency = std::env::args().nth(2).map_or(n + 1, |s| s.parse().expect("a count of calls"));
    let reach = config.max_concurrency.min(n);
    let plane = DataPlane::start(config, "127.0.0.1:0".parse().unwrap()).unwrap();
    for i in 0..n {
        plane.register(&format!("r{i}"), &format!("lw-secret-{i:08}")).unwrap();
    }
    let (mut clients, mut held) = (Vec::with_capacity(n), Vec::with_capacity(n));
    std::thread::sleep(Duration::from_millis(300));
    let (before, rss_before) = (snapshot(), rss_bytes());
    let body = br#"{"model":"m","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"What is 2+2? Answer with one number."}],"max_tokens":16}"#;
    for i in 0..n {
        let mut s = TcpStream::connect(plane.local_addr()).unwrap();
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: plane\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nauthorization: Bearer lw-secret-{i:08}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(body).unwrap();
        clients.push(s);
        while let Ok((c, _)) = upstream.accept() {
            held.push(c);
        }
    }
    for _ in 0..500 {
        while let Ok((c, _)) = upstream.accept() {
            held.push(c);
        }
        if plane.stats().in_flight as usize >= n && held.len() >= reach {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    let (after, rss_after) = (snapshot(), rss_bytes());
    println!("{n} calls held ({} upstream connections, {} in flight)", held.len(), plane.stats().in_flight);
    let mut total = 0;
    for k in 0..SLOTS {
        let (bytes, allocs) = (after[k].0 - before[k].0, after[k].1 - before[k].1);
        total += bytes;
        if allocs != 0 {
            let low = if k == 0 { 0 } else { 1usize << (k - 1) };
            println!(
                "  size {low:>7}..{:<7} {:8.1} B/call in {:5.2} allocations",
                1usize << k,
                bytes as f64 / n as f64,
                allocs as f64 / n as f64
            );
        }
    }
    println!(
        "heap {:.0} B/call allocated; RSS {:.0} B/call",
        total as f64 / n as f64,
        (rss_after - rss_before) as f64 / n as f64
    );
}
