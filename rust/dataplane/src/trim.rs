//! Giving glibc's freed heap pages back to the OS once the plane goes quiet.
//!
//! glibc keeps the pages a burst freed: in the standalone plane process
//! (benches/interception.py, two bursts of 16,384 rollouts each holding a
//! call open) the resident size rested at 297 MiB after the first burst and
//! 390 MiB after the second, against a 42 MiB baseline, with every
//! connection, call and rollout gone.  `malloc_trim(0)` once the plane was
//! quiet brought it to 60 MiB and 65 MiB.  Bounding the arenas
//! (`MALLOC_ARENA_MAX=2`) changed nothing (300 / 390 MiB): the pages are
//! free chunks, not extra arenas.  mimalloc as the global allocator rested at
//! 129 MiB and cost 10 KB more per open rollout (docs/dataplane.md#the-allocator).
//!
//! The trimmer is its own thread, never a tokio worker: `malloc_trim` walks
//! every arena under its lock, which would stall the calls of a busy plane.
//! Once a second it reads the counters the plane keeps anyway: calls begun,
//! client connections ended and rollouts unregistered (each may free
//! memory; their sum is the epoch), and the active calls.  It trims when the
//! epoch has not moved for a whole second and no call is active; then once more after the idle upstream
//! connections have had time to close (they close up to twice
//! `pool_idle_timeout` after their last use, and count in no epoch).  Calls
//! alone were not enough: a client slow to read 3,000 answers closed its
//! connections 20 s after the last call, after both trims, and their buffers
//! (40 MiB) stayed resident until the next call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::server::Shared;

/// How long the plane must have run no call before a trim.
const QUIET: Duration = Duration::from_secs(1);

/// Trims done (for [`crate::Stats::trims`]).
pub(crate) type TrimCount = AtomicU64;

/// The trimmer thread and the flag that stops it.
pub(crate) struct Trimmer {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Trimmer {
    /// Start the thread (none when `enabled` is false or there is no glibc to trim).
    pub(crate) fn start(sh: &Arc<Shared>, pool_idle_timeout: Duration, enabled: bool) -> std::io::Result<Self> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let thread = if enabled && cfg!(all(target_os = "linux", target_env = "gnu")) {
            let (sh, stop) = (Arc::downgrade(sh), Arc::clone(&stop));
            let late = 2 * pool_idle_timeout + QUIET;
            Some(
                std::thread::Builder::new()
                    .name("lowwater-dataplane-trim".into())
                    .spawn(move || run(&sh, &stop, late))?,
            )
        } else {
            None
        };
        Ok(Trimmer { stop, thread })
    }

    /// Tell the thread to stop (it exits at once, or after the trim under way).
    pub(crate) fn stop(&self) {
        let (flag, cv) = &*self.stop;
        *flag.lock().unwrap_or_else(|e| e.into_inner()) = true;
        cv.notify_all();
    }

    /// Stop the thread and wait for it to exit.
    pub(crate) fn stop_and_join(&mut self) {
        self.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Trimmer {
    // Not joined here: a drop may happen on a thread that must not block
    // (shutdown_and_join joins); the thread holds only a weak reference.
    fn drop(&mut self) {
        self.stop();
    }
}

/// Sleep `d` unless stopped first; false once stopped.
fn sleep(stop: &(Mutex<bool>, Condvar), d: Duration) -> bool {
    let (flag, cv) = stop;
    let deadline = Instant::now() + d;
    let mut stopped = flag.lock().unwrap_or_else(|e| e.into_inner());
    while !*stopped {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return true;
        }
        stopped = cv.wait_timeout(stopped, left).unwrap_or_else(|e| e.into_inner()).0;
    }
    false
}

fn run(sh: &std::sync::Weak<Shared>, stop: &(Mutex<bool>, Condvar), late: Duration) {
    // The epoch at the last trim; a trim is due once it has moved.
    let mut trimmed_at = 0;
    // When the second trim of a quiet spell is due, and the epoch it expects.
    let mut late_trim: Option<(Instant, u64)> = None;
    let mut before = u64::MAX;
    while sleep(stop, QUIET) {
        let Some(sh) = sh.upgrade() else { return };
        let c = &sh.counters;
        let epoch = c.calls.load(Ordering::Relaxed) + c.releases.load(Ordering::Relaxed);
        let quiet = epoch == before && c.active_calls.load(Ordering::Relaxed) == 0;
        before = epoch;
        if !quiet {
            late_trim = None;
            continue;
        }
        if epoch != trimmed_at {
            trim(&c.trims);
            trimmed_at = epoch;
            late_trim = Some((Instant::now() + late, epoch));
        } else if let Some((due, at)) = late_trim {
            if Instant::now() >= due && at == epoch {
                trim(&c.trims);
                late_trim = None;
            }
        }
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn trim(count: &TrimCount) {
    // The buffer pool's warm slots too (at most 256 KiB): an idle plane keeps
    // no freed connection buffer resident (src/bufalloc.rs).
    crate::bufalloc::release_warm();
    // SAFETY: malloc_trim takes glibc's arena locks itself; it is safe to call from any thread.
    unsafe {
        libc::malloc_trim(0);
    }
    count.fetch_add(1, Ordering::Relaxed);
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn trim(_count: &TrimCount) {}
