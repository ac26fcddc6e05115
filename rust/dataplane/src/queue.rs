//! The completion queue: turn records handed to the control plane.
//!
//! The data plane pushes one [`TurnRecord`] per recorded call; the control
//! plane (a Trio loop, later) waits for [`CompletionQueue::wakeup_fd`] to be
//! readable, calls [`CompletionQueue::drain`], appends the turns to their
//! trajectories, and [`CompletionQueue::ack`]s each record's `seq`.  Until
//! the ack, the call's last bytes (a stream's terminal event, a whole
//! non-streamed answer) are held, so an agent never sees the end of an
//! answer whose turn is not recorded.
//!
//! The wakeup fd is an eventfd on Linux (a pipe elsewhere).  It is written
//! only when a record lands on an empty queue, and `drain` clears it before
//! taking the records, so no wakeup is lost and a burst costs one write.
//!
//! Neither table keeps a burst's capacity: `drain` hands the queue's own
//! buffer to the caller, and the ack map gives back its table once it is
//! mostly empty.  Kept, a burst's size stayed allocated for the plane's
//! life: in the interception bench's hold phase (16,384 held calls answered
//! at once) the heap its first burst left fell from 2.12 to 1.94 MB when
//! they stopped keeping it (benches/README.md; tests below).

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use bytes::Bytes;
use tokio::sync::oneshot;

use crate::protocol::ProtocolId;

/// The part of a request a turn keeps: the messages the rollout had not sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestDelta {
    /// How many leading messages equal the rollout's previous request's; the
    /// delta starts at this index of the request's messages list.
    pub kept: usize,
    /// How many messages the previous request had; `kept < previous` means
    /// the agent rewrote its history, and the request is
    /// `previous_request[..kept] + messages`.
    pub previous: usize,
    /// The messages from `kept` on, each its JSON text as sent (for a plain
    /// string `input` of the responses protocol: that JSON string).
    pub messages: Vec<Bytes>,
}

/// Timings of one call, in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timings {
    /// When the request's head arrived, seconds since the Unix epoch.
    pub started_s: f64,
    /// From the request's arrival to the upstream's response head (0 if none came).
    pub upstream_s: f64,
    /// From the request's arrival to the record (the answer's end, before the held bytes).
    pub duration_s: f64,
}

/// One model call of a rollout, as handed to the control plane.
#[derive(Debug, Clone)]
pub struct TurnRecord {
    /// Acknowledge with this ([`CompletionQueue::ack`]) to release the held bytes.
    pub seq: u64,
    /// The rollout the call belongs to.
    pub rollout_id: std::sync::Arc<str>,
    /// The call's id: its key in the intercept table while it ran, and the
    /// id an upcall about the same call carries (unique per data plane).
    pub request_id: std::sync::Arc<str>,
    /// The protocol's index in the data plane's protocol table.
    pub protocol: ProtocolId,
    /// The `model` the agent asked for (`""` if the protocol has none).
    pub model: String,
    /// Whether the agent asked for a stream.
    pub streamed: bool,
    /// The new messages.
    pub request: RequestDelta,
    /// The tools the agent offered: a JSON object of the request's tool
    /// fields as sent (`{"tools":[...]}`; OpenAI chat also `functions`), or
    /// `None` when it had none (see [`crate::protocol::ParsedRequest::tools`]).
    pub tools: Option<Bytes>,
    /// The status the agent was answered with: the upstream's, or 502/504.
    pub status: u16,
    /// The upstream's answer: the whole body, or for a stream every event
    /// relayed (line endings normalised to `\n`), terminal event included.
    pub response: Bytes,
    /// Why the call failed (upstream unreachable, timed out, stream cut), if it did.
    pub error: Option<String>,
    /// Timings.
    pub timings: Timings,
}

/// What the control plane says of a recorded call as it releases it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Verdict {
    /// Deliver the held bytes as they are ([`CompletionQueue::ack`]).
    #[default]
    Deliver,
    /// The control plane could not read the answer (its protocol found it
    /// malformed): a whole answer is replaced by this status and reason in
    /// the protocol's error body; a stream gets an error event with the
    /// reason instead of its terminal event and is broken off
    /// ([`CompletionQueue::fail`]).
    Fail {
        /// The status for a whole answer (a stream's 200 is already sent).
        status: u16,
        /// What the agent reads.
        reason: String,
    },
}

/// Records waiting for the control plane, with the fd that says so.
#[derive(Debug)]
pub struct CompletionQueue {
    records: Mutex<VecDeque<TurnRecord>>,
    /// Held calls by record seq.  A mutex, not papaya: papaya drops a removed
    /// value only when its deferred reclamation runs, and the dropped sender is
    /// what releases the call, so an ack must take the sender out at once.
    acks: Mutex<HashMap<u64, oneshot::Sender<Verdict>, foldhash::fast::RandomState>>,
    next_seq: AtomicU64,
    wakeup: Wakeup,
    /// The wakeup fd was written since the last drain.
    signalled: AtomicBool,
}

impl CompletionQueue {
    /// An empty queue with a fresh wakeup fd.
    ///
    /// # Errors
    /// The OS error if the eventfd (or pipe) cannot be made.
    pub fn new() -> std::io::Result<Self> {
        let wakeup = Wakeup::new()?;
        Ok(CompletionQueue {
            records: Mutex::new(VecDeque::new()),
            acks: Mutex::new(HashMap::default()),
            next_seq: AtomicU64::new(0),
            wakeup,
            signalled: AtomicBool::new(false),
        })
    }

    /// The fd that becomes readable when records are waiting; wait on it,
    /// then [`CompletionQueue::drain`].  Owned by the queue: do not close it.
    pub fn wakeup_fd(&self) -> RawFd {
        self.wakeup.fd()
    }

    /// A fresh record sequence number.
    pub(crate) fn next_seq(&self) -> u64 {
        self.next_seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Queue `record`; with `ack`, the caller's held bytes wait for
    /// [`CompletionQueue::ack`] of `record.seq` and the wakeup fd is written
    /// at once (unless it was since the last drain).  Without, the fd is
    /// left alone: `true` means the record landed on an empty queue and the
    /// caller must see to a [`CompletionQueue::wake`] soon (the data plane
    /// batches released records: one wakeup per batch, not per call).
    pub(crate) fn push(&self, record: TurnRecord, ack: Option<oneshot::Sender<Verdict>>) -> bool {
        let held = ack.is_some();
        if let Some(ack) = ack {
            // Before the record is visible, so an ack right after drain finds it.
            self.lock_acks().insert(record.seq, ack);
        }
        let was_empty = {
            let mut q = self.records.lock().unwrap_or_else(PoisonError::into_inner);
            let was_empty = q.is_empty();
            q.push_back(record);
            was_empty
        };
        if held {
            // A released record may wait on the queue for its batch's wakeup;
            // a held call must not wait with it.
            self.wake();
            return false;
        }
        was_empty
    }

    /// Make the wakeup fd readable, unless it was since the last drain.
    pub fn wake(&self) {
        if !self.signalled.swap(true, Ordering::AcqRel) {
            self.wakeup.wake();
        }
    }

    /// Every waiting record, oldest first (clears the wakeup fd first).
    pub fn drain(&self) -> Vec<TurnRecord> {
        // Before the fd is cleared: a push from here on writes it again (at
        // worst one wakeup that finds the queue empty), never none.
        self.signalled.store(false, Ordering::Release);
        self.wakeup.clear();
        // The queue's buffer leaves with the records (no copy, no capacity
        // kept): the next push starts an empty queue.
        let taken = std::mem::take(&mut *self.records.lock().unwrap_or_else(PoisonError::into_inner));
        Vec::from(taken)
    }

    /// Release the held bytes of record `seq`; `false` if nothing waits on
    /// it (acked already, its client left, or pushed without an ack).
    pub fn ack(&self, seq: u64) -> bool {
        self.release(seq, Verdict::Deliver)
    }

    /// Release record `seq`'s call with an error instead of its held bytes
    /// (see [`Verdict::Fail`]); `false` as for [`CompletionQueue::ack`].
    pub fn fail(&self, seq: u64, status: u16, reason: impl Into<String>) -> bool {
        self.release(seq, Verdict::Fail { status, reason: reason.into() })
    }

    fn release(&self, seq: u64, verdict: Verdict) -> bool {
        let sender = {
            let mut acks = self.lock_acks();
            let sender = acks.remove(&seq);
            shrink(&mut acks);
            sender
        };
        match sender {
            Some(tx) => {
                let _ = tx.send(verdict); // the call may have ended meanwhile
                true
            }
            None => false,
        }
    }

    /// Release every held call (shutdown, or a control plane that stops acking).
    pub fn release_all(&self) -> usize {
        let held: Vec<_> = {
            let mut acks = self.lock_acks();
            let held = acks.drain().collect();
            shrink(&mut acks);
            held
        };
        let n = held.len();
        drop(held);
        n
    }

    /// How many records wait to be drained.
    pub fn len(&self) -> usize {
        self.records.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// Whether no record waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many drained or queued records still hold their call's last bytes.
    pub fn awaiting_ack(&self) -> usize {
        self.lock_acks().len()
    }

    fn lock_acks(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<u64, oneshot::Sender<Verdict>, foldhash::fast::RandomState>> {
        self.acks.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Ack maps at most this many buckets big keep their table whatever they hold.
const KEEP_ACK_BUCKETS: usize = 1024;

/// Give back most of a big ack map's table once it is a sixteenth full: a
/// burst's table (32,768 buckets after 16,384 held calls) is not kept for
/// the few calls after it.  Each shrink rehashes at most a sixteenth of the
/// capacity, after at least that many removals since the table grew.
fn shrink<V, S: std::hash::BuildHasher>(map: &mut HashMap<u64, V, S>) {
    let capacity = map.capacity();
    if capacity > KEEP_ACK_BUCKETS && map.len() * 16 < capacity {
        map.shrink_to(map.len() * 4);
    }
}

/// A wakeup fd: readable while something waits to be drained.  An eventfd
/// on Linux (a pipe elsewhere), written once when a queue goes from empty
/// to non-empty and cleared before the queue is taken, so no wakeup is lost
/// and a burst costs one write.  Shared by the record queue and the upcalls.
#[derive(Debug)]
pub(crate) struct Wakeup {
    read: OwnedFd,
    /// The pipe's write end (`None` for an eventfd, which is both ends).
    write: Option<OwnedFd>,
}

impl Wakeup {
    pub(crate) fn new() -> std::io::Result<Self> {
        let (read, write) = wakeup_fd()?;
        Ok(Wakeup { read, write })
    }

    /// The fd to wait on (owned here: never close it).
    pub(crate) fn fd(&self) -> RawFd {
        self.read.as_raw_fd()
    }

    pub(crate) fn wake(&self) {
        let fd = self.write.as_ref().unwrap_or(&self.read).as_raw_fd();
        let one: u64 = 1;
        let len = if self.write.is_some() { 1 } else { 8 };
        // SAFETY: `fd` is open for the owner's life; `one` outlives the call.
        // A full pipe (EAGAIN) already signals readable; nothing to do then.
        let _ = unsafe { libc::write(fd, (&one as *const u64).cast(), len) };
    }

    pub(crate) fn clear(&self) {
        let mut buf = [0u8; 64];
        let len = if self.write.is_some() { buf.len() } else { 8 };
        loop {
            // SAFETY: the fd is open and non-blocking; `buf` is valid for `len` bytes.
            let n = unsafe { libc::read(self.read.as_raw_fd(), buf.as_mut_ptr().cast(), len) };
            // An eventfd read resets its counter in one go; a pipe is read until empty.
            if n <= 0 || self.write.is_none() {
                break;
            }
        }
    }
}

#[cfg(target_os = "linux")]
fn wakeup_fd() -> std::io::Result<(OwnedFd, Option<OwnedFd>)> {
    // SAFETY: plain syscall; the fd is checked before it is owned.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by eventfd and is owned by nobody else.
    Ok((unsafe { OwnedFd::from_raw_fd(fd) }, None))
}

#[cfg(not(target_os = "linux"))]
fn wakeup_fd() -> std::io::Result<(OwnedFd, Option<OwnedFd>)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two fds pipe writes.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    for fd in fds {
        // SAFETY: both fds were just made by pipe.
        unsafe {
            libc::fcntl(fd, libc::F_SETFL, libc::O_NONBLOCK);
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        }
    }
    // SAFETY: both fds were just made by pipe and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), Some(OwnedFd::from_raw_fd(fds[1]))) })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(fd: RawFd) -> bool {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, zero timeout.
        unsafe { libc::poll(&mut p, 1, 0) == 1 }
    }

    fn record(q: &CompletionQueue) -> TurnRecord {
        TurnRecord {
            request_id: "q".into(),
            seq: q.next_seq(),
            rollout_id: "r".into(),
            protocol: 0,
            model: String::new(),
            streamed: false,
            request: RequestDelta { kept: 0, previous: 0, messages: Vec::new() },
            tools: None,
            status: 200,
            response: Bytes::new(),
            error: None,
            timings: Timings { started_s: 0.0, upstream_s: 0.0, duration_s: 0.0 },
        }
    }

    #[test]
    fn wakeup_fd_follows_the_queue() {
        let q = CompletionQueue::new().unwrap();
        assert!(!readable(q.wakeup_fd()));
        // Released records leave the fd to the caller: the first one says so.
        assert!(q.push(record(&q), None));
        assert!(!q.push(record(&q), None));
        assert!(!readable(q.wakeup_fd()));
        q.wake();
        assert!(readable(q.wakeup_fd()));
        let got = q.drain();
        assert_eq!(got.iter().map(|r| r.seq).collect::<Vec<_>>(), [0, 1]);
        assert!(!readable(q.wakeup_fd()), "drain clears the fd");
        assert!(q.drain().is_empty());
    }

    #[test]
    fn a_held_record_wakes_at_once_even_behind_released_ones() {
        let q = CompletionQueue::new().unwrap();
        assert!(q.push(record(&q), None)); // its batch's wakeup is still to come
        let (tx, _rx) = oneshot::channel();
        assert!(!q.push(record(&q), Some(tx)));
        assert!(readable(q.wakeup_fd()), "the held call does not wait for the batch");
        assert_eq!(q.drain().len(), 2);
        // Another held record after the drain writes the fd again.
        let (tx, _rx2) = oneshot::channel();
        q.push(record(&q), Some(tx));
        assert!(readable(q.wakeup_fd()));
        q.drain();
        q.release_all();
    }

    #[test]
    fn ack_wakes_the_holder_once() {
        let q = CompletionQueue::new().unwrap();
        let (tx, mut rx) = oneshot::channel();
        let r = record(&q);
        let seq = r.seq;
        q.push(r, Some(tx));
        assert_eq!(q.awaiting_ack(), 1);
        assert!(matches!(rx.try_recv(), Err(oneshot::error::TryRecvError::Empty)));
        assert!(q.ack(seq));
        assert!(!q.ack(seq));
        assert!(rx.try_recv().is_ok());
        assert_eq!(q.awaiting_ack(), 0);
    }

    fn ack_capacity(q: &CompletionQueue) -> usize {
        q.lock_acks().capacity()
    }

    #[test]
    fn a_burst_leaves_no_capacity_behind() {
        let q = CompletionQueue::new().unwrap();
        let mut held = Vec::new();
        for _ in 0..16_384 {
            let (tx, rx) = oneshot::channel();
            let r = record(&q);
            held.push((r.seq, rx));
            q.push(r, Some(tx));
        }
        assert!(ack_capacity(&q) >= 16_384);
        let drained = q.drain();
        assert_eq!(drained.len(), 16_384);
        assert_eq!(q.records.lock().unwrap().capacity(), 0, "the queue's buffer left with the records");
        // A few calls stay held past the burst: their entries stay, the table shrinks.
        for (seq, _) in &held[..16_380] {
            assert!(q.ack(*seq));
        }
        assert_eq!(q.awaiting_ack(), 4);
        assert!(ack_capacity(&q) <= KEEP_ACK_BUCKETS, "{} buckets kept for 4 entries", ack_capacity(&q));
        for (seq, mut rx) in held.drain(..).skip(16_380) {
            assert!(rx.try_recv().is_err(), "still held");
            assert!(q.ack(seq));
            assert!(rx.try_recv().is_ok());
        }
        assert!(ack_capacity(&q) <= KEEP_ACK_BUCKETS);
    }

    #[test]
    fn release_all_leaves_no_capacity_behind() {
        let q = CompletionQueue::new().unwrap();
        let receivers: Vec<_> = (0..4096)
            .map(|_| {
                let (tx, rx) = oneshot::channel();
                q.push(record(&q), Some(tx));
                rx
            })
            .collect();
        assert_eq!(q.release_all(), 4096);
        assert_eq!(ack_capacity(&q), 0);
        drop(receivers);
    }
}
