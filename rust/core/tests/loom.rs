//! Loom models of the two protocols the tables' correctness rests on.
//!
//! Run with: `RUSTFLAGS="--cfg loom" cargo test -p lowwater-core --release --test loom`
//! (src/sync.rs swaps papaya and arc-swap for loom-visible stand-ins).
#![cfg(loom)]

use loom::sync::Arc;
use loom::thread;
use lowwater_core::{FetchBuffer, InterceptTable, TableError};

/// Take on remove: two concurrent removals of one shard and a reader.  Exactly
/// one removal wins, the reader sees the whole payload or nothing, and the
/// accounting ends exact with the payload released once the last view drops.
#[test]
fn take_on_remove_has_one_winner_and_releases() {
    loom::model(|| {
        let b = Arc::new(FetchBuffer::new(None, 1 << 20));
        b.put("s", &[7u8; 8], "uint8", &[8], "").unwrap();
        let popper = |b: Arc<FetchBuffer>| thread::spawn(move || b.pop("s").map(|s| s.payload.as_slice().to_vec()));
        let p1 = popper(Arc::clone(&b));
        let p2 = popper(Arc::clone(&b));
        let reader = {
            let b = Arc::clone(&b);
            thread::spawn(move || b.get("s"))
        };
        let r1 = p1.join().unwrap();
        let r2 = p2.join().unwrap();
        let seen = reader.join().unwrap();
        assert_eq!(r1.is_some() as u8 + r2.is_some() as u8, 1, "exactly one removal wins");
        for got in [r1, r2].into_iter().flatten() {
            assert_eq!(got, vec![7u8; 8]);
        }
        let st = b.stats();
        assert_eq!((st.entries, st.bytes, st.removals), (0, 0, 1));
        match seen {
            Some(view) => {
                assert_eq!(view.payload.as_slice(), &[7u8; 8]);
                assert_eq!(st.live_bytes, 8, "a held view keeps its payload");
                drop(view);
                assert_eq!(b.stats().live_bytes, 0);
            }
            None => assert_eq!(st.live_bytes, 0, "no view: released at removal"),
        }
    });
}

/// Replace against remove: the old payload is released exactly once.
#[test]
fn replace_racing_pop_accounts_exactly() {
    loom::model(|| {
        let b = Arc::new(FetchBuffer::new(None, 1 << 20));
        b.put("s", &[1u8; 4], "uint8", &[4], "").unwrap();
        let putter = {
            let b = Arc::clone(&b);
            thread::spawn(move || b.put("s", &[2u8; 6], "uint8", &[6], "").unwrap())
        };
        let popped = {
            let b = Arc::clone(&b);
            thread::spawn(move || b.pop("s").map(|s| s.payload.len()))
        };
        putter.join().unwrap();
        let popped = popped.join().unwrap();
        let st = b.stats();
        let held = b.get("s").map(|s| s.payload.len() as u64).unwrap_or(0);
        assert_eq!(st.bytes, held);
        assert_eq!(st.entries, (held > 0) as u64);
        assert_eq!(st.live_bytes, held);
        assert!(matches!(popped, None | Some(4) | Some(6)));
    });
}

/// Insert against close: no intercept outlives its rollout's close, and every
/// insert that reported success is in the list the close returned.
#[test]
fn insert_racing_close_never_leaks() {
    loom::model(|| {
        let t = Arc::new(InterceptTable::new(None, 1 << 20));
        t.open_rollout("r");
        let inserter = {
            let t = Arc::clone(&t);
            thread::spawn(move || t.insert("q", "r", b"body", "chat", false))
        };
        let closer = {
            let t = Arc::clone(&t);
            thread::spawn(move || t.close_rollout("r"))
        };
        let inserted = inserter.join().unwrap();
        let swept = closer.join().unwrap();
        match inserted {
            Ok(()) => assert_eq!(swept, vec!["q".to_string()]),
            Err(TableError::RolloutClosed { .. }) => {}
            Err(e) => panic!("unexpected {e}"),
        }
        assert!(t.is_empty(), "an intercept outlived its rollout's close");
        let st = t.stats();
        assert_eq!((st.entries, st.bytes, st.live_bytes, st.open_rollouts), (0, 0, 0, 0));
        assert_eq!(st.inserts, st.swept);
    });
}

/// Discard against close: exactly one of them removes the intercept.
#[test]
fn discard_racing_close_removes_once() {
    loom::model(|| {
        let t = Arc::new(InterceptTable::new(None, 1 << 20));
        t.open_rollout("r");
        t.insert("q", "r", b"xy", "chat", true).unwrap();
        let discarder = {
            let t = Arc::clone(&t);
            thread::spawn(move || t.discard("q"))
        };
        let closer = {
            let t = Arc::clone(&t);
            thread::spawn(move || t.close_rollout("r"))
        };
        let discarded = discarder.join().unwrap();
        let swept = closer.join().unwrap();
        assert_eq!(discarded as usize + swept.len(), 1);
        let st = t.stats();
        assert_eq!((st.entries, st.bytes, st.discards + st.swept), (0, 0, 1));
    });
}

/// Discard against a re-insert of the same id: the discard must not untrack
/// the new intercept, or the rollout's close would leave it behind.
#[test]
fn discard_racing_reinsert_keeps_new_intercept_tracked() {
    loom::model(|| {
        let t = Arc::new(InterceptTable::new(None, 1 << 20));
        t.open_rollout("r");
        t.insert("q", "r", b"old", "chat", false).unwrap();
        let discarder = {
            let t = Arc::clone(&t);
            thread::spawn(move || t.discard("q"))
        };
        let reinserter = {
            let t = Arc::clone(&t);
            thread::spawn(move || t.insert("q", "r", b"new", "chat", false))
        };
        assert!(discarder.join().unwrap());
        let reinserted = reinserter.join().unwrap();
        let swept = t.close_rollout("r");
        assert_eq!(swept.len(), reinserted.is_ok() as usize, "close must sweep a live re-insert");
        assert!(t.is_empty(), "an intercept outlived its rollout's close");
    });
}
