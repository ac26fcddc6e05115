//! Loom models of the two protocols the tables' correctness rests on.
//!
//! Run with: `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p lowwater-core --release --test loom`
//! (13-20 s on two cores once built, most of it `insert_racing_close_never_leaks`;
//! about 55 s more to build from scratch).
//!
//! Under `--cfg loom`, src/sync.rs swaps papaya and arc-swap for lock-free
//! stand-ins on loom's atomics with the orderings production has and no
//! stronger, and the tables keep their own atomics and fences, so removing a
//! fence or weakening an ordering of insert-vs-close makes
//! `insert_racing_close_never_leaks` fail.  The two `*_litmus` models check
//! that the stand-ins stay that weak: a lookup may miss a concurrent unfenced
//! insert (store buffering), which the former `Mutex` stand-ins forbade and
//! which hid a mutation removing both fences.
//!
//! The two-thread models run exhaustively; the three-thread one is bounded to
//! [`THREE_THREAD_PREEMPTIONS`] preemptions.  `LOOM_MAX_PREEMPTIONS` in the
//! environment overrides every bound (e.g. `LOOM_MAX_PREEMPTIONS=2` for a
//! quick run; every mutation below is still caught at 2).
#![cfg(loom)]

use std::sync::atomic::{AtomicBool, Ordering};

use loom::sync::Arc;
use loom::thread;
use lowwater_core::{FetchBuffer, InterceptTable, TableError};

/// Preemption bound of the three-thread model (7 s at 3; 25 s at 4; unbounded
/// runs for many minutes).
const THREE_THREAD_PREEMPTIONS: usize = 3;

/// Run `f` under loom with at most `bound` preemptions (`None`: exhaustive),
/// unless `LOOM_MAX_PREEMPTIONS` is set.
fn model<F: Fn() + Sync + Send + 'static>(bound: Option<usize>, f: F) {
    let mut builder = loom::model::Builder::new();
    if std::env::var_os("LOOM_MAX_PREEMPTIONS").is_none() {
        builder.preemption_bound = bound;
    }
    builder.check(f);
}

/// Take on remove: two concurrent removals of one shard and a reader.  Exactly
/// one removal wins, the reader sees the whole payload or nothing, and the
/// accounting ends exact with the payload released once the last view drops.
#[test]
fn take_on_remove_has_one_winner_and_releases() {
    model(Some(THREE_THREAD_PREEMPTIONS), || {
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
    model(None, || {
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
///
/// The store-buffer pattern of `InterceptTable::insert` and `close_rollout`:
/// without the SeqCst fence on either side, loom finds the execution where the
/// insert reads `closed == false` and the close reads the request list from
/// before the insert's CAS, and the insert's intercept outlives the close.
#[test]
fn insert_racing_close_never_leaks() {
    model(None, || {
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
    model(None, || {
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
    model(None, || {
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

/// Store buffering through the map stand-in: each thread puts into one buffer,
/// then looks in the other, with no fence between.  Both lookups may miss, as
/// they may with papaya (an insert is a Release CAS, a lookup an Acquire load).
/// A stand-in that ordered more than that (a lock) would make the outcome
/// unreachable and hide missing fences in the tables; this model fails then.
#[test]
fn map_litmus_lookups_may_miss_unfenced_inserts() {
    let both_missed = std::sync::Arc::new(AtomicBool::new(false));
    let seen = std::sync::Arc::clone(&both_missed);
    model(None, move || {
        let a = Arc::new(FetchBuffer::new(None, 1 << 20));
        let b = Arc::new(FetchBuffer::new(None, 1 << 20));
        let other = {
            let (a, b) = (Arc::clone(&a), Arc::clone(&b));
            thread::spawn(move || {
                b.put("y", &[1], "uint8", &[1], "").unwrap();
                a.contains("x")
            })
        };
        a.put("x", &[1], "uint8", &[1], "").unwrap();
        let saw_y = b.contains("y");
        let saw_x = other.join().unwrap();
        if !saw_x && !saw_y {
            seen.store(true, Ordering::Relaxed);
        }
    });
    assert!(both_missed.load(Ordering::Relaxed), "the map stand-in orders more than papaya does");
}

/// Store buffering through the request-list stand-in: an insert (the list's
/// CAS, then the table's fence) against a put into a buffer followed by a read
/// of the rollout's list with no fence.  Both may miss, as with arc-swap (an
/// `rcu` CAS against an Acquire load): the fence on one side alone does not
/// order the other.  A locking list would make the outcome unreachable.
#[test]
fn list_litmus_snapshot_may_miss_an_unfenced_update() {
    let both_missed = std::sync::Arc::new(AtomicBool::new(false));
    let seen = std::sync::Arc::clone(&both_missed);
    model(None, move || {
        let t = Arc::new(InterceptTable::new(None, 1 << 20));
        let b = Arc::new(FetchBuffer::new(None, 1 << 20));
        t.open_rollout("r");
        let other = {
            let (t, b) = (Arc::clone(&t), Arc::clone(&b));
            thread::spawn(move || {
                b.put("y", &[1], "uint8", &[1], "").unwrap();
                t.rollout_requests("r")
            })
        };
        t.insert("q", "r", b"x", "chat", false).unwrap();
        let saw_y = b.contains("y");
        let listed = other.join().unwrap();
        if listed.is_empty() && !saw_y {
            seen.store(true, Ordering::Relaxed);
        }
    });
    assert!(both_missed.load(Ordering::Relaxed), "the list stand-in orders more than arc-swap does");
}
