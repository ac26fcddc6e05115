//! A held call keeps its request body once: in the intercept table, shared
//! with the upstream request.  A large body is read straight into the
//! table's memory, never into a heap buffer first; a call held for minutes
//! at a slow upstream once kept the agent's whole history twice (a 4 MiB
//! body cost 8 MiB for the call's life).  Counted with a global allocator
//! that tallies live heap bytes (and their peak), plus the table's own
//! count of its payload bytes, so the figure is deterministic (no RSS
//! sampling).
#![cfg(not(loom))]

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use lowwater_dataplane::{Config, DataPlane};

/// Live heap bytes, over every thread, and the most there were since the
/// test last reset it.
static LIVE: AtomicI64 = AtomicI64::new(0);
static PEAK: AtomicI64 = AtomicI64::new(0);

fn grew(by: i64) {
    let now = LIVE.fetch_add(by, Ordering::Relaxed) + by;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

struct Counting;

// SAFETY: forwards every call to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        grew(layout.size() as i64);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        grew(new_size as i64 - layout.size() as i64);
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// A guard against a hang, not a timing assertion.
const GUARD: Duration = Duration::from_secs(30);

/// Read one request from `s`: its head, then `content-length` bytes.  The
/// body is counted, not kept: the test's own heap would count in the peak.
fn read_request(s: &mut TcpStream) -> usize {
    let mut head = Vec::new();
    let mut chunk = vec![0u8; 1 << 16];
    let (len, mut got) = loop {
        let n = s.read(&mut chunk).expect("the plane forwards the request");
        assert!(n > 0, "the plane closed the upstream connection");
        head.extend_from_slice(&chunk[..n]);
        let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
        let text = String::from_utf8_lossy(&head[..end]).to_ascii_lowercase();
        let len: usize = text
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map(|v| v.trim().parse().unwrap())
            .expect("a content-length");
        break (len, head.len() - (end + 4));
    };
    while got < len {
        let n = s.read(&mut chunk).expect("the plane forwards the request");
        assert!(n > 0, "the plane closed the upstream connection");
        got += n;
    }
    len
}

/// Send one call of `rollout`'s key with `body` on a new connection.
fn send(plane: &DataPlane, body: &str) -> TcpStream {
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: plane\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nauthorization: Bearer lw-held-body-secret\r\n\r\n",
        body.len()
    );
    let mut client = TcpStream::connect(plane.local_addr()).unwrap();
    client.set_read_timeout(Some(GUARD)).unwrap();
    client.write_all(head.as_bytes()).unwrap();
    client.write_all(body.as_bytes()).unwrap();
    client
}

fn until(plane: &DataPlane, done: impl Fn(&lowwater_dataplane::Stats) -> bool) {
    for _ in 0..6000 {
        if done(&plane.stats()) {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("never settled: {:?}", plane.stats());
}

#[test]
fn a_held_call_keeps_its_body_once() {
    const IMAGE_BYTES: usize = 4 << 20;
    let upstream = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut config = Config::new(format!("http://{}/v1", upstream.local_addr().unwrap()));
    config.retries = 0;
    // The test drains the records itself and acks nothing.
    config.hold_for_ack = false;
    let plane = DataPlane::start(config, "127.0.0.1:0".parse().unwrap()).unwrap();
    plane.register("r1", "lw-held-body-secret").unwrap();
    // Turn 1 sends a 4 MiB message and is answered; turn 2 resends it with
    // one short message more, the agent's usual call: its delta is small,
    // so what the held call keeps is its body (in the table) and little else.
    let first = format!(r#"{{"role":"user","content":"{}"}}"#, "x".repeat(IMAGE_BYTES));
    let turn1 = format!(r#"{{"model":"m","messages":[{first}]}}"#);
    let turn2 = format!(r#"{{"model":"m","messages":[{first},{{"role":"user","content":"and?"}}]}}"#);
    let mut client = send(&plane, &turn1);
    let (mut upstream1, _) = upstream.accept().unwrap();
    upstream1.set_read_timeout(Some(GUARD)).unwrap();
    assert_eq!(read_request(&mut upstream1), turn1.len());
    let answer = r#"{"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}]}"#;
    write!(
        upstream1,
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{answer}",
        answer.len()
    )
    .unwrap();
    let mut got = [0u8; 4096];
    assert!(client.read(&mut got).unwrap() > 0, "turn 1 is answered");
    drop(client);
    until(&plane, |s| s.in_flight == 0 && s.active_calls == 0);
    assert_eq!(plane.queue().drain().len(), 1);

    let before = LIVE.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let client = send(&plane, &turn2);
    // A new upstream connection: turn 1's answer closed its own.
    let (mut held, _) = upstream.accept().unwrap();
    held.set_read_timeout(Some(GUARD)).unwrap();
    // The upstream has the whole body: the call is past every copy it makes.
    assert_eq!(read_request(&mut held), turn2.len());
    // Heap bytes, and the table's payload bytes (a payload this large is a
    // mapping of its own, outside the heap).
    let heap = LIVE.load(Ordering::Relaxed) - before;
    let table = plane.table().stats().live_bytes as i64;
    let stats = plane.stats();
    assert_eq!((stats.in_flight, stats.intercepts), (1, 1), "{stats:?}");
    assert_eq!(table, turn2.len() as i64, "the table holds the body");
    // One copy of the body plus the call's few kilobytes; two copies failed.
    assert!(
        heap + table < (turn2.len() + turn2.len() / 4) as i64,
        "a held call of a {} byte body keeps {heap} heap bytes besides the table's {table}",
        turn2.len()
    );
    // Nor was it ever on the heap on its way in: read into a buffer and then
    // copied into the table, the heap peaked at the body's size over `before`.
    let peak = PEAK.load(Ordering::Relaxed) - before;
    assert!(
        peak < (turn2.len() / 4) as i64,
        "the heap peaked {peak} bytes over its start while a {} byte body was read",
        turn2.len()
    );
    // The client leaves: the call ends and is recorded (a 499 turn with the
    // small delta), and its body is freed.
    drop(client);
    until(&plane, |s| s.in_flight == 0 && s.intercepts == 0 && s.active_calls == 0);
    assert_eq!(plane.queue().drain().len(), 1);
    let left = LIVE.load(Ordering::Relaxed) - before;
    assert!(left < (turn2.len() / 8) as i64, "{left} heap bytes left after the call ended");
    assert_eq!(plane.table().stats().live_bytes, 0);
    drop(held);
}
