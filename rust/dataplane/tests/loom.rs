//! Loom models of `unregister` racing in-flight calls (src/lifecycle.rs).
//!
//! Run with: `RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom cargo test -p lowwater-dataplane --release --test loom`
//! (a second or two once built).  Under `--cfg loom` the crate compiles only
//! the call lifecycle, on loom's `Mutex`; the HTTP side (tokio cannot be built
//! under `--cfg loom` outside its own tests) is exercised by tests/plane.rs,
//! whose `unregister_racing_calls_is_recorded_xor_refused` races the same
//! protocol through real requests.
//!
//! What is checked, in every interleaving: a call is recorded, cancelled, or
//! refused, exactly one of them; the closer's count of cancelled calls
//! matches; a recorded call's record is in the queue by the time `close`
//! returns (so a control plane draining after `unregister` sees it); nothing
//! is left in flight.
#![cfg(loom)]

use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::{Arc, Mutex};
use loom::thread;
use lowwater_dataplane::lifecycle::{Calls, Cancelled, Closed};

/// A call's cancellation signal: counts itself woken when dropped.
struct Signal(Arc<AtomicUsize>);

impl Drop for Signal {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Recorded,
    Cancelled,
    Refused,
}

fn model<F: Fn() + Sync + Send + 'static>(bound: Option<usize>, f: F) {
    let mut builder = loom::model::Builder::new();
    if std::env::var_os("LOOM_MAX_PREEMPTIONS").is_none() {
        builder.preemption_bound = bound;
    }
    builder.check(f);
}

/// One call: begin, then commit by pushing its record.
fn call(calls: &Calls<Signal>, queue: &Mutex<Vec<u64>>, woken: &Arc<AtomicUsize>, tag: u64) -> Outcome {
    match calls.begin(Signal(Arc::clone(woken))) {
        Err(Closed) => Outcome::Refused,
        Ok(id) => match calls.commit(id, || queue.lock().unwrap().push(tag)) {
            Ok(()) => Outcome::Recorded,
            Err(Cancelled) => Outcome::Cancelled,
        },
    }
}

#[test]
fn unregister_racing_a_call_is_recorded_xor_cancelled() {
    model(None, || {
        let calls = Arc::new(Calls::<Signal>::new());
        let queue = Arc::new(Mutex::new(Vec::new()));
        let woken = Arc::new(AtomicUsize::new(0));
        let caller = {
            let (calls, queue, woken) = (Arc::clone(&calls), Arc::clone(&queue), Arc::clone(&woken));
            thread::spawn(move || call(&calls, &queue, &woken, 1))
        };
        let cancelled = calls.close().expect("first close").len();
        let queued_at_close = queue.lock().unwrap().len();
        let outcome = caller.join().unwrap();
        let queued = queue.lock().unwrap().len();
        match outcome {
            Outcome::Recorded => {
                assert_eq!((cancelled, queued, queued_at_close), (0, 1, 1), "recorded before close returned")
            }
            Outcome::Cancelled => assert_eq!((cancelled, queued), (1, 0), "cancelled: counted, never recorded"),
            Outcome::Refused => assert_eq!((cancelled, queued), (0, 0)),
        }
        assert_eq!(calls.in_flight(), 0);
        // The signal was dropped whatever happened (woken by the close, or
        // released by the commit or the refusal): none is left holding a call.
        assert_eq!(woken.load(Ordering::SeqCst), 1);
    });
}

#[test]
fn two_calls_and_unregister() {
    model(Some(3), || {
        let calls = Arc::new(Calls::<Signal>::new());
        let queue = Arc::new(Mutex::new(Vec::new()));
        let woken = Arc::new(AtomicUsize::new(0));
        let spawn = |tag| {
            let (calls, queue, woken) = (Arc::clone(&calls), Arc::clone(&queue), Arc::clone(&woken));
            thread::spawn(move || call(&calls, &queue, &woken, tag))
        };
        let (a, b) = (spawn(1), spawn(2));
        let cancelled = calls.close().expect("first close").len();
        let outcomes = [a.join().unwrap(), b.join().unwrap()];
        let queue = queue.lock().unwrap().clone();
        let recorded = outcomes.iter().filter(|o| **o == Outcome::Recorded).count();
        let n_cancelled = outcomes.iter().filter(|o| **o == Outcome::Cancelled).count();
        assert_eq!(queue.len(), recorded, "one record per recorded call, none for the others");
        assert_eq!(cancelled, n_cancelled);
        assert_eq!(calls.in_flight(), 0);
        assert!(calls.close().is_none(), "close is idempotent");
        assert_eq!(woken.load(Ordering::SeqCst), 2);
    });
}

#[test]
fn client_leaving_racing_unregister() {
    model(None, || {
        let calls = Arc::new(Calls::<Signal>::new());
        let woken = Arc::new(AtomicUsize::new(0));
        let id = calls.begin(Signal(Arc::clone(&woken))).unwrap();
        let leaver = {
            let calls = Arc::clone(&calls);
            thread::spawn(move || calls.abandon(id))
        };
        let cancelled = calls.close().unwrap().len();
        let abandoned = leaver.join().unwrap();
        assert!(abandoned ^ (cancelled == 1), "exactly one of them removed the call");
        assert_eq!(woken.load(Ordering::SeqCst), 1);
        assert_eq!(calls.in_flight(), 0);
    });
}

// --- upcalls (src/upcall.rs) ------------------------------------------------------

mod upcalls {
    use loom::sync::atomic::{AtomicBool, Ordering};
    use loom::sync::{Arc, Mutex};
    use loom::thread;
    use lowwater_dataplane::lifecycle::Calls;
    use lowwater_dataplane::upcall::{Pending, UpcallKind};

    /// An upcall's answer channel: what reached the agent.
    struct Sink(Arc<Mutex<Vec<&'static str>>>);

    impl Sink {
        fn send(self, what: &'static str) {
            self.0.lock().unwrap().push(what);
        }
    }

    const OWNER: usize = 1;

    /// The handler's `ask`: insert, refuse itself if the rollout closed
    /// meanwhile, else hand the id to the control plane (the mailbox).
    fn ask(
        pending: &Pending<Sink>,
        rollout: &Calls<()>,
        answers: &Arc<Mutex<Vec<&'static str>>>,
        mailbox: &Mutex<Option<u64>>,
    ) -> u64 {
        let id = pending.insert(Some(OWNER), UpcallKind::Intercept, Sink(Arc::clone(answers))).unwrap();
        if rollout.is_closed() {
            if pending.forget(id) {
                answers.lock().unwrap().push("gone (self)");
            }
        } else {
            *mailbox.lock().unwrap() = Some(id);
        }
        id
    }

    /// `DataPlane::unregister`: close the rollout, then take its upcalls;
    /// `done` once it returned.
    fn unregister(pending: &Pending<Sink>, rollout: &Calls<()>, done: &AtomicBool) {
        rollout.close();
        for s in pending.take_owner(OWNER) {
            s.send("gone");
        }
        done.store(true, Ordering::SeqCst);
    }

    /// The control plane: resume whatever it has seen.  A resume begun after
    /// `unregister` returned must find nothing (it is a no-op returning False).
    fn resume(pending: &Pending<Sink>, mailbox: &Mutex<Option<u64>>, done: &AtomicBool) {
        let later = done.load(Ordering::SeqCst);
        let seen = *mailbox.lock().unwrap();
        if let Some(id) = seen {
            if let Some(s) = pending.take(id, UpcallKind::Intercept).unwrap() {
                assert!(!later, "an upcall of an unregistered rollout was still waiting");
                s.send("resumed");
            }
        }
    }

    #[test]
    fn resume_racing_unregister_gives_exactly_one_answer() {
        super::model(None, || {
            let pending = Arc::new(Pending::<Sink>::new());
            let rollout = Arc::new(Calls::<()>::new());
            let answers = Arc::new(Mutex::new(Vec::new()));
            let mailbox = Arc::new(Mutex::new(None));
            let done = Arc::new(AtomicBool::new(false));
            let (p, r, d) = (Arc::clone(&pending), Arc::clone(&rollout), Arc::clone(&done));
            let closer = thread::spawn(move || unregister(&p, &r, &d));
            let (p, m, d) = (Arc::clone(&pending), Arc::clone(&mailbox), Arc::clone(&done));
            let python = thread::spawn(move || resume(&p, &m, &d));
            ask(&pending, &rollout, &answers, &mailbox);
            closer.join().unwrap();
            python.join().unwrap();
            // Python may have looked before the id was published: a second
            // look, after unregister returned, must find nothing.
            resume(&pending, &mailbox, &done);
            let got = answers.lock().unwrap().clone();
            assert_eq!(got.len(), 1, "exactly one answer reaches the agent: {got:?}");
            assert!(pending.is_empty(), "the entry is always removed");
        });
    }

    #[test]
    fn a_client_leaving_racing_resume_and_unregister_leaves_nothing() {
        super::model(None, || {
            let pending = Arc::new(Pending::<Sink>::new());
            let rollout = Arc::new(Calls::<()>::new());
            let answers = Arc::new(Mutex::new(Vec::new()));
            let mailbox = Arc::new(Mutex::new(None));
            let done = Arc::new(AtomicBool::new(false));
            let (p, r, d) = (Arc::clone(&pending), Arc::clone(&rollout), Arc::clone(&done));
            let closer = thread::spawn(move || unregister(&p, &r, &d));
            let (p, m, d) = (Arc::clone(&pending), Arc::clone(&mailbox), Arc::clone(&done));
            let python = thread::spawn(move || resume(&p, &m, &d));
            let id = ask(&pending, &rollout, &answers, &mailbox);
            // The client leaves: the handler's guard forgets the upcall.
            let forgot = pending.forget(id);
            closer.join().unwrap();
            python.join().unwrap();
            let got = answers.lock().unwrap().clone();
            assert!(got.len() <= 1, "{got:?}");
            if forgot {
                assert!(got.is_empty(), "nobody answered an upcall its handler forgot: {got:?}");
            }
            assert!(pending.is_empty());
        });
    }
}
