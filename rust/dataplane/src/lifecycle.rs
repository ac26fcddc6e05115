//! The life of a rollout's calls: begin, commit (record) or cancel, close.
//!
//! This is the one place where `unregister` races in-flight calls, so it is
//! kept free of tokio and papaya and modelled under loom (tests/loom.rs).  The
//! rule it enforces: a call that began either commits its turn record or is
//! cancelled by the close, never both and never neither, and a call that
//! begins after the close is refused.
//!
//! One small mutex per rollout guards its in-flight list; only the calls of
//! that rollout and its `unregister` take it, each for a push, a removal or a
//! scan of a few entries.  The commit runs the caller's closure (pushing the
//! record onto the completion queue) under that lock, so when
//! [`Calls::close`] returns, every call it did not cancel has its record in
//! the queue already: a control plane that drains the queue after
//! `unregister` sees the rollout's every recorded turn.

use crate::sync::{lock, Mutex};

/// A call's id within its rollout (unique for the rollout's life).
pub type CallId = u64;

/// The rollout was closed before the call began: answer 410.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed;

/// The rollout was closed while the call was in flight (its signal was
/// handed to the closer): the call answers 410 (or an error event) and is
/// not recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cancelled;

struct State<S> {
    closed: bool,
    next_id: CallId,
    /// In-flight calls and their cancellation signals; a rollout has a few.
    calls: Vec<(CallId, S)>,
}

/// The in-flight calls of one rollout, with the signal that cancels each.
///
/// `S` is whatever wakes a cancelled call: the server uses a
/// `tokio::sync::oneshot::Sender` (dropping it wakes the call), the loom
/// model uses `()`.
pub struct Calls<S> {
    state: Mutex<State<S>>,
}

impl<S> Default for Calls<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Calls<S> {
    /// An open rollout with no call in flight.
    pub fn new() -> Self {
        Calls { state: Mutex::new(State { closed: false, next_id: 0, calls: Vec::new() }) }
    }

    /// Start a call whose cancellation is `signal`.
    ///
    /// # Errors
    /// [`Closed`] if the rollout was already closed (the signal is dropped).
    pub fn begin(&self, signal: S) -> Result<CallId, Closed> {
        let mut st = lock(&self.state);
        if st.closed {
            return Err(Closed);
        }
        let id = st.next_id;
        st.next_id += 1;
        st.calls.push((id, signal));
        Ok(id)
    }

    /// Commit call `id`: run `record` (which hands the turn to the control
    /// plane) under the rollout's lock, so a concurrent close either sees the
    /// call gone with its record queued, or cancels it before `record` runs.
    ///
    /// # Errors
    /// [`Cancelled`] if a close took the call first (`record` is not run).
    pub fn commit<R>(&self, id: CallId, record: impl FnOnce() -> R) -> Result<R, Cancelled> {
        let mut st = lock(&self.state);
        let pos = st.calls.iter().position(|(c, _)| *c == id).ok_or(Cancelled)?;
        let (_, signal) = st.calls.swap_remove(pos);
        let out = record();
        drop(st);
        drop(signal);
        Ok(out)
    }

    /// Drop call `id` without a record (its client left, or it ended before
    /// anything could be recorded); `false` if a close had taken it already.
    pub fn abandon(&self, id: CallId) -> bool {
        let mut st = lock(&self.state);
        let found = st.calls.iter().position(|(c, _)| *c == id).map(|pos| st.calls.swap_remove(pos));
        drop(st);
        found.is_some()
    }

    /// Close the rollout: refuse new calls and take every in-flight call's
    /// signal (the caller fires them, outside the lock).  `None` if the
    /// rollout was closed already (close is idempotent).
    pub fn close(&self) -> Option<Vec<S>> {
        let mut st = lock(&self.state);
        if st.closed {
            return None;
        }
        st.closed = true;
        Some(st.calls.drain(..).map(|(_, s)| s).collect())
    }

    /// Whether [`Calls::close`] ran.
    pub fn is_closed(&self) -> bool {
        lock(&self.state).closed
    }

    /// How many calls are in flight.
    pub fn in_flight(&self) -> usize {
        lock(&self.state).calls.len()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn begin_commit_close() {
        let c: Calls<u8> = Calls::new();
        let a = c.begin(1).unwrap();
        let b = c.begin(2).unwrap();
        assert_eq!(c.in_flight(), 2);
        assert_eq!(c.commit(a, || 7), Ok(7));
        assert_eq!(c.close(), Some(vec![2]));
        assert_eq!(c.commit(b, || 8), Err(Cancelled), "a cancelled call is never recorded");
        assert_eq!(c.begin(3), Err(Closed));
        assert_eq!(c.close(), None, "close is idempotent");
        assert_eq!(c.in_flight(), 0);
    }

    #[test]
    fn abandon_removes_once() {
        let c: Calls<()> = Calls::new();
        let a = c.begin(()).unwrap();
        assert!(c.abandon(a));
        assert!(!c.abandon(a));
        assert_eq!(c.commit(a, || ()), Err(Cancelled));
    }
}
