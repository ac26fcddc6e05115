//! Unit tests of both tables through the public API.
#![cfg(not(loom))]

use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use lowwater_core::{FetchBuffer, InterceptTable, TableError};

fn buf(cap: Option<u64>) -> FetchBuffer {
    FetchBuffer::new(cap, 4096)
}

#[test]
fn put_get_pop_round_trip_and_stats() {
    let b = buf(None);
    let data: Vec<u8> = (0..48u8).collect();
    b.put("a", &data, "float32", &[3, 4], "node-1").unwrap();
    let s = b.get("a").unwrap();
    assert_eq!(s.payload.as_slice(), &data[..]);
    assert_eq!(s.dtype, "float32");
    assert_eq!(&*s.shape, &[3, 4]);
    assert_eq!(&*s.owner, "node-1");
    assert!(b.get("missing").is_none());
    let st = b.stats();
    assert_eq!((st.entries, st.bytes, st.inserts, st.hits, st.misses), (1, 48, 1, 1, 1));
    let popped = b.pop("a").unwrap();
    assert!(b.pop("a").is_none());
    let st = b.stats();
    assert_eq!((st.entries, st.bytes, st.removals, st.live_bytes), (0, 0, 1, 48));
    drop((s, popped));
    assert_eq!(b.stats().live_bytes, 0);
}

#[test]
fn size_must_match_shape_and_dtype() {
    let b = buf(None);
    let err = b.put("a", &[0u8; 7], "int64", &[1], "").unwrap_err();
    assert!(matches!(err, TableError::Invalid { .. }), "{err}");
    let err = b.put("a", &[0u8; 8], "int65", &[1], "").unwrap_err();
    assert!(err.to_string().contains("unknown dtype"), "{err}");
    let err = b.put("a", &[], "uint8", &[usize::MAX, 2], "").unwrap_err();
    assert!(err.to_string().contains("overflows"), "{err}");
    b.put("empty", &[], "bfloat16", &[0, 5], "").unwrap();
    assert_eq!(b.get("empty").unwrap().payload.len(), 0);
    assert_eq!(b.stats().rejected, 0);
}

#[test]
fn capacity_refuses_instead_of_evicting() {
    let b = buf(Some(100));
    b.put("a", &[1u8; 60], "uint8", &[60], "").unwrap();
    let err = b.put("b", &[2u8; 41], "uint8", &[41], "").unwrap_err();
    assert!(matches!(err, TableError::Full { requested: 41, used: 60, capacity: 100 }), "{err}");
    assert!(b.contains("a"));
    assert_eq!(b.stats().rejected, 1);
    // Replacing "a" with a payload that fits once the old one is gone is admitted.
    b.put("a", &[3u8; 100], "uint8", &[100], "").unwrap();
    let st = b.stats();
    assert_eq!((st.entries, st.bytes, st.removals, st.inserts), (1, 100, 1, 2));
}

#[test]
fn replace_releases_old_payload() {
    let b = buf(None);
    b.put("a", &[1u8; 10], "uint8", &[10], "").unwrap();
    let old = b.get("a").unwrap();
    b.put("a", &[2u8; 20], "uint8", &[20], "").unwrap();
    assert_eq!(old.payload.as_slice(), &[1u8; 10]);
    let st = b.stats();
    assert_eq!((st.entries, st.bytes, st.live_bytes), (1, 20, 30));
    drop(old);
    assert_eq!(b.stats().live_bytes, 20);
}

#[test]
fn large_payloads_are_mapped() {
    let b = buf(None);
    let big = vec![7u8; 8192];
    b.put("big", &big, "uint8", &[8192], "").unwrap();
    b.put("small", &big[..100], "uint8", &[100], "").unwrap();
    assert!(b.get("big").unwrap().payload.is_mapped());
    assert!(!b.get("small").unwrap().payload.is_mapped());
    assert_eq!(b.get("big").unwrap().payload.as_slice(), &big[..]);
}

#[test]
fn clear_skips_unknown_and_counts() {
    let b = buf(None);
    for i in 0..5 {
        b.put(&format!("s{i}"), &[i as u8; 4], "uint8", &[4], "").unwrap();
    }
    assert_eq!(b.clear(&["s0", "s1", "nope"]), 2);
    assert_eq!(b.clear_all(), 3);
    assert_eq!(b.clear_all(), 0);
    assert!(b.is_empty());
    assert_eq!(b.stats().bytes, 0);
}

#[test]
fn concurrent_pops_have_one_winner() {
    let b = Arc::new(buf(None));
    for i in 0..200 {
        b.put(&format!("k{i}"), &[1u8; 16], "uint8", &[16], "").unwrap();
    }
    let barrier = Arc::new(Barrier::new(4));
    let wins: usize = (0..4)
        .map(|_| {
            let (b, barrier) = (Arc::clone(&b), Arc::clone(&barrier));
            thread::spawn(move || {
                barrier.wait();
                (0..200).filter(|i| b.pop(&format!("k{i}")).is_some()).count()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .sum();
    assert_eq!(wins, 200);
    let st = b.stats();
    assert_eq!((st.entries, st.bytes, st.live_bytes, st.removals, st.hits), (0, 0, 0, 200, 200));
    assert_eq!(st.misses, 600);
}

#[test]
fn intercept_lifecycle() {
    let t = InterceptTable::new(None, 4096);
    assert!(matches!(t.insert("q", "r", b"{}", "chat", false), Err(TableError::RolloutClosed { .. })));
    t.open_rollout("r");
    t.open_rollout("r");
    assert_eq!(t.stats().open_rollouts, 1);
    t.insert("q1", "r", b"{\"a\":1}", "chat", false).unwrap();
    t.insert("q2", "r", b"{}", "messages", true).unwrap();
    assert!(matches!(t.insert("q1", "r", b"x", "chat", false), Err(TableError::Duplicate { .. })));
    let v = t.get("q2").unwrap();
    assert_eq!((&*v.protocol, v.stream, &*v.rollout_id), ("messages", true, "r"));
    assert!(t.discard("q1"));
    assert!(!t.discard("q1"));
    assert_eq!(t.rollout_requests("r"), vec!["q2".to_string()]);
    assert_eq!(t.close_rollout("r"), vec!["q2".to_string()]);
    assert!(t.close_rollout("r").is_empty());
    let st = t.stats();
    assert_eq!((st.entries, st.bytes, st.open_rollouts, st.inserts, st.discards, st.swept), (0, 0, 0, 2, 1, 1));
    assert_eq!(st.live_bytes, 2, "the held view keeps its body alive");
    drop(v);
    assert_eq!(t.stats().live_bytes, 0);
}

#[test]
fn intercept_capacity_and_stale() {
    let t = InterceptTable::new(Some(10), 4096);
    t.open_rollout("r");
    t.insert("a", "r", &[0u8; 8], "chat", false).unwrap();
    assert!(matches!(t.insert("b", "r", &[0u8; 8], "chat", false), Err(TableError::Full { .. })));
    assert_eq!(t.stats().rejected, 1);
    assert!(t.stale(Duration::from_secs(3600)).is_empty());
    thread::sleep(Duration::from_millis(5));
    assert_eq!(t.stale(Duration::from_millis(1)), vec!["a".to_string()]);
}

#[test]
fn a_received_payload_is_held_without_a_copy() {
    let t = InterceptTable::new(Some(3 * 8192), 4096);
    t.open_rollout("r");
    // Filled in place, counted live from the start, reserved only by the insert.
    let mut m = t.receive_buffer(8192).unwrap();
    assert_eq!((t.stats().live_bytes, t.stats().bytes), (8192, 0));
    m.as_mut_slice().fill(b'x');
    let p = m.freeze().unwrap();
    assert!(p.is_mapped(), "at the threshold: a mapping of its own");
    let at = p.as_slice().as_ptr();
    t.insert_payload("q1", "r", p, "chat", false).unwrap();
    let held = t.get("q1").unwrap();
    assert_eq!(held.payload.as_slice().as_ptr(), at, "the same memory, not a copy");
    assert!(held.payload.as_slice().iter().all(|&b| b == b'x'));
    let st = t.stats();
    assert_eq!((st.entries, st.bytes, st.live_bytes, st.inserts), (1, 8192, 8192, 1));
    // Refusals drop the payload: closed rollout, duplicate id, over capacity.
    let fresh = |t: &InterceptTable| t.receive_buffer(8192).unwrap().freeze().unwrap();
    let refused =
        |r| matches!(r, Err(TableError::RolloutClosed { .. } | TableError::Duplicate { .. } | TableError::Full { .. }));
    assert!(refused(t.insert_payload("q2", "gone", fresh(&t), "chat", false)));
    assert!(refused(t.insert_payload("q1", "r", fresh(&t), "chat", false)));
    t.insert_payload("q2", "r", fresh(&t), "chat", false).unwrap();
    t.insert_payload("q3", "r", fresh(&t), "chat", false).unwrap();
    assert!(refused(t.insert_payload("q4", "r", fresh(&t), "chat", false)));
    let st = t.stats();
    assert_eq!((st.entries, st.bytes, st.live_bytes, st.rejected), (3, 3 * 8192, 3 * 8192, 1));
    drop(held);
    assert_eq!(t.close_rollout("r").len(), 3);
    assert_eq!((t.stats().bytes, t.stats().live_bytes), (0, 0));
}

#[test]
fn a_payload_of_another_table_is_copied() {
    let (a, b) = (InterceptTable::new(None, 4096), InterceptTable::new(None, 4096));
    b.open_rollout("r");
    let mut m = a.receive_buffer(5000).unwrap();
    m.as_mut_slice()[4999] = 7;
    let p = m.freeze().unwrap();
    let at = p.as_slice().as_ptr();
    b.insert_payload("q", "r", p, "chat", false).unwrap();
    let held = b.get("q").unwrap();
    assert_ne!(held.payload.as_slice().as_ptr(), at);
    assert_eq!(held.payload.as_slice()[4999], 7);
    // Each table counts only its own bytes: `a`'s payload was dropped after the copy.
    assert_eq!((a.stats().live_bytes, b.stats().live_bytes, b.stats().bytes), (0, 5000, 5000));
}

/// Pages of `bytes` resident now (mincore(2)); `bytes` starts on a page.
#[cfg(target_os = "linux")]
fn resident_pages(bytes: &mut [u8]) -> usize {
    let pages = bytes.len().div_ceil(4096);
    let mut vec = vec![0u8; pages];
    // SAFETY: a live mapping of `bytes.len()` bytes, `vec` one byte per page.
    let rc = unsafe { libc::mincore(bytes.as_mut_ptr().cast(), bytes.len(), vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    vec.iter().filter(|&&v| v & 1 == 1).count()
}

#[cfg(target_os = "linux")]
#[test]
fn a_received_payload_costs_pages_only_as_they_are_populated_or_written() {
    // Under the huge-page size, so pages are 4 KiB and the counts exact.
    let len = 1536 << 10;
    let t = InterceptTable::new(None, 4096);
    let mut m = t.receive_buffer(len).unwrap();
    assert_eq!(resident_pages(m.as_mut_slice()), 0, "a declared size not yet sent costs nothing");
    m.populate(0, 256 << 10);
    assert_eq!(resident_pages(m.as_mut_slice()), 64, "the populated step, no more");
    m.as_mut_slice()[len - 1] = 1;
    assert_eq!(resident_pages(m.as_mut_slice()), 65, "and a written page");
    // Out of range: nothing, and no panic.
    m.populate(len - 4096, 8192);
    m.populate(usize::MAX, 2);
    assert_eq!(resident_pages(m.as_mut_slice()), 65);
}

#[test]
fn a_small_received_payload_is_on_the_heap() {
    let t = InterceptTable::new(None, 4096);
    let p = t.receive_buffer(100).unwrap().freeze().unwrap();
    assert!(!p.is_mapped());
    assert_eq!(p.as_slice(), &[0u8; 100][..]);
    assert_eq!(t.stats().live_bytes, 100);
    drop(p);
    assert_eq!(t.stats().live_bytes, 0);
}

#[test]
fn insert_racing_close_never_leaks() {
    for round in 0..50 {
        let t = Arc::new(InterceptTable::new(None, 1 << 20));
        let rid = format!("r{round}");
        t.open_rollout(&rid);
        let barrier = Arc::new(Barrier::new(3));
        let inserters: Vec<_> = (0..2)
            .map(|w| {
                let (t, barrier, rid) = (Arc::clone(&t), Arc::clone(&barrier), rid.clone());
                thread::spawn(move || {
                    barrier.wait();
                    let mut ok = Vec::new();
                    for i in 0..100 {
                        let id = format!("{w}-{i}");
                        match t.insert(&id, &rid, &[1u8; 32], "chat", false) {
                            Ok(()) => ok.push(id),
                            Err(TableError::RolloutClosed { .. }) => {}
                            Err(e) => panic!("unexpected {e}"),
                        }
                    }
                    ok
                })
            })
            .collect();
        let closer = {
            let (t, barrier, rid) = (Arc::clone(&t), Arc::clone(&barrier), rid.clone());
            thread::spawn(move || {
                barrier.wait();
                t.close_rollout(&rid)
            })
        };
        let ok: Vec<String> = inserters.into_iter().flat_map(|h| h.join().unwrap()).collect();
        let swept = closer.join().unwrap();
        assert!(t.is_empty(), "an intercept outlived its rollout's close");
        for id in &ok {
            assert!(swept.contains(id), "{id} was inserted but not reported by close");
        }
        let st = t.stats();
        assert_eq!((st.bytes, st.entries, st.open_rollouts), (0, 0, 0));
        assert_eq!(st.inserts, st.swept);
    }
}
