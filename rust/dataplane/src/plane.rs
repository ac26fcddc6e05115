//! The data plane as a whole: configuration, start, the control API, stats.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use lowwater_core::InterceptTable;
use tokio::sync::oneshot;

use crate::divergence::MessageHasher;
use crate::error::{ConfigError, RegisterError};
use crate::protocol::ProtocolTable;
use crate::queue::CompletionQueue;
use crate::rewrite::Rewrites;
use crate::rollouts::RolloutTable;
use crate::server::{accept_loop, Counters, Shared};
use crate::trim::Trimmer;
use crate::upcall::{Intercept, Upcalls};
use crate::upstream::Upstream;

/// The listen backlog of the plane's socket (uvicorn's default is 2048;
/// the kernel caps it at `net.core.somaxconn`).
const LISTEN_BACKLOG: u32 = 4096;

/// How the data plane runs.  [`Config::new`] gives the Python server's defaults.
#[derive(Clone)]
pub struct Config {
    /// The upstream's base URL (`http://127.0.0.1:8000/v1`); a call to
    /// `/v1/chat/completions` goes to `{upstream}/chat/completions`.
    pub upstream: String,
    /// Sent upstream as `Authorization: Bearer` and `x-api-key` in place of
    /// the rollout's secret (`None`: no key is sent).
    pub upstream_key: Option<String>,
    /// The routes.
    pub protocols: ProtocolTable,
    /// Largest request body accepted, bytes (64 MiB); larger is a 413.
    pub max_body_bytes: usize,
    /// Largest non-streamed upstream answer read, bytes (256 MiB); larger is a 502.
    pub max_response_bytes: usize,
    /// The longest a request's body may take to arrive, from the handler's
    /// start to its last byte (60 s, as the header read timeout); past it
    /// the call is a 408 (`connection: close`), not recorded.
    pub body_read_timeout: Duration,
    /// Connect timeout, and the longest wait for the upstream's head or for
    /// any chunk of its body (600 s); past it the call is a 504 (or a cut stream).
    pub upstream_timeout: Duration,
    /// Retries of an error before the answer's head (connect, reset, closed), a 429 or
    /// a 5xx, before the answer reaches the agent (3).
    pub retries: u32,
    /// First backoff step (0.5 s); full jitter, doubling per attempt.
    pub backoff: Duration,
    /// Longest backoff, and the cap on a `Retry-After` (8 s).
    pub max_backoff: Duration,
    /// Upstream calls at once (1,024); more wait for a slot.
    pub max_concurrency: usize,
    /// Idle upstream connections are closed after this (5 s).
    pub pool_idle_timeout: Duration,
    /// Hold each call's last bytes until the control plane acks its record
    /// (true).  Off, they go out as soon as the record is queued, and records
    /// reach the wakeup fd in batches as released ones do (below).
    pub hold_for_ack: bool,
    /// With `hold_for_ack`, hold only the calls whose record needs the
    /// control plane's verdict (false: hold every call).  A call's last
    /// bytes go out as soon as its record is queued when its protocol
    /// [`reads_any_json`](crate::ProtocolSpec::reads_any_json), it was not
    /// handed to the control plane as an intercept upcall (its
    /// `intercept_response` hooks run before the ack), and its answer is
    /// JSON (each event's data, for a stream) or an error the verdict cannot
    /// change.  Such records reach the wakeup fd in batches, at most
    /// [`RELEASED_RECORD_DELAY`](crate::RELEASED_RECORD_DELAY) after the
    /// first, not one wakeup per call; a control plane that shows turns
    /// must drain before it reads them (the Python side's `Records.flush`).
    pub release_when_readable: bool,
    /// Tokio worker threads ([`default_worker_threads`]: 1 on two cores or
    /// fewer, else 2): a bounded runtime, so the data plane's allocator
    /// caches are per a fixed few threads.
    pub worker_threads: usize,
    /// Where request bodies are held for the life of their call (`None`: a
    /// new unbounded table with a 1 MiB mmap threshold).  Shared with the
    /// control plane, which reads its counters; a bounded table refuses a
    /// call over its capacity with 503 and `retry-after: 1`.
    pub table: Option<Arc<InterceptTable>>,
    /// Request rewrites by protocol name (none): see [`Rewrites`].
    pub rewrites: HashMap<String, Rewrites>,
    /// Which protocols' calls are handed to the control plane before
    /// forwarding, as intercept upcalls (off: no call waits on Python).
    pub intercept: Intercept,
    /// Path prefixes (each starting with `/`; `"/"` catches every path)
    /// whose requests, when no protocol route matches, are handed to the
    /// control plane as route upcalls; empty (the default): those are 404.
    /// A prefix matches by whole segments: `/lowwater/` (or `/lowwater`)
    /// takes `/lowwater` and `/lowwater/stats`, not `/lowwaterx`.
    pub python_routes: Vec<String>,
    /// Give glibc's free heap pages back to the OS (`malloc_trim(0)`, on a
    /// thread of its own) once for a second no call started, no client
    /// connection ended and no rollout closed, and again after
    /// the idle upstream connections have closed (true).  Without it a
    /// burst of open rollouts leaves the process at its peak (measured in
    /// src/trim.rs and docs/dataplane.md#the-allocator).  No effect without glibc.
    pub trim_when_idle: bool,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key is a credential: never in a debug print.
        f.debug_struct("Config")
            // A URL's `user:password@` is a credential too.
            .field("upstream", &self.upstream.rsplit_once('@').map_or(self.upstream.as_str(), |(_, host)| host))
            .field("upstream_key", &self.upstream_key.as_ref().map(|_| "<redacted>"))
            .field("max_body_bytes", &self.max_body_bytes)
            .field("hold_for_ack", &self.hold_for_ack)
            .field("release_when_readable", &self.release_when_readable)
            .field("worker_threads", &self.worker_threads)
            .field("table", &self.table.as_ref().map(|t| t.stats()))
            .finish_non_exhaustive()
    }
}

/// A rollout's own upstream and model (see [`DataPlane::register_with`]);
/// the default is the plane's upstream and key and the agent's model.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RolloutOptions {
    /// The rollout's upstream base URL (`http://host:port/v1`).
    pub upstream: Option<String>,
    /// The key sent to the rollout's upstream.
    pub api_key: Option<String>,
    /// Sent upstream as the request's `model` in place of the agent's, and
    /// recorded as the turn's model.
    pub model: Option<String>,
}

/// The default [`Config::worker_threads`]: 1 where the process may use two
/// cores or fewer (`std::thread::available_parallelism`, which heeds CPU
/// affinity and cgroup quotas), else 2.
///
/// On two cores a second worker has no core of its own: the control plane's
/// Trio thread, the agents and often the upstream share them, and tokio
/// wakes the idle worker on nearly every task it schedules.  In alternating
/// latency runs (benches/interception.py, 2 cores, 2026-11-27) one worker
/// took the plane's added p50 from 0.506-0.562 ms to 0.454-0.500, with the
/// same throughput at concurrency 256 and the 16,384-call burst's targets
/// met (first response 0.29 s, 7,978 B per open rollout).  With more cores a
/// second worker keeps one large body's parse (up to 64 MiB) from stalling
/// every other call.
pub fn default_worker_threads() -> usize {
    match std::thread::available_parallelism() {
        Ok(n) if n.get() > 2 => 2,
        _ => 1,
    }
}

impl Config {
    /// The defaults, forwarding to `upstream`.
    pub fn new(upstream: impl Into<String>) -> Self {
        Config {
            upstream: upstream.into(),
            upstream_key: None,
            protocols: ProtocolTable::builtin(),
            max_body_bytes: 64 << 20,
            max_response_bytes: 256 << 20,
            body_read_timeout: Duration::from_secs(60),
            upstream_timeout: Duration::from_secs(600),
            retries: 3,
            backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(8),
            max_concurrency: 1024,
            pool_idle_timeout: Duration::from_secs(5),
            hold_for_ack: true,
            release_when_readable: false,
            worker_threads: default_worker_threads(),
            table: None,
            rewrites: HashMap::new(),
            intercept: Intercept::Off,
            python_routes: Vec::new(),
            trim_when_idle: true,
        }
    }
}

/// Why [`DataPlane::start`] failed.
#[derive(Debug)]
pub enum StartError {
    /// The configuration is unusable.
    Config(ConfigError),
    /// Binding the listener, making the wakeup fd or the runtime failed.
    Io(std::io::Error),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Config(e) => e.fmt(f),
            StartError::Io(e) => write!(f, "cannot start the data plane: {e}"),
        }
    }
}

impl std::error::Error for StartError {}

impl From<ConfigError> for StartError {
    fn from(e: ConfigError) -> Self {
        StartError::Config(e)
    }
}

impl From<std::io::Error> for StartError {
    fn from(e: std::io::Error) -> Self {
        StartError::Io(e)
    }
}

/// A snapshot of the data plane's tables and counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Stats {
    /// Rollouts open (registered, not unregistered).
    pub open_rollouts: usize,
    /// Live secrets (equals `open_rollouts` at rest).
    pub secrets: usize,
    /// Calls begun in an open rollout and neither recorded nor cancelled.
    pub in_flight: usize,
    /// Handlers and relays running (0 once every call has ended).
    pub active_calls: u64,
    /// Client connections open.
    pub connections: u64,
    /// Records waiting to be drained.
    pub queued: usize,
    /// Records whose call still holds its last bytes for an ack.
    pub awaiting_ack: usize,
    /// Calls recorded whose last bytes went out without waiting for the ack
    /// ([`Config::release_when_readable`]), since start.
    pub released: u64,
    /// Calls received on a protocol route (any outcome).
    pub calls: u64,
    /// Calls recorded with a 2xx answer.
    pub ok: u64,
    /// Calls recorded with an upstream error status or a failure.
    pub failed: u64,
    /// Calls answered 410 or broken off because their rollout closed (not recorded).
    pub closed: u64,
    /// Streams whose client left before the end (not recorded).
    pub disconnected: u64,
    /// Calls refused before forwarding (400, 401, 413, an interceptor's
    /// reject; not recorded).
    pub refused: u64,
    /// Request bodies held in the intercept table now (equals the calls
    /// between their body's read and their end).
    pub intercepts: usize,
    /// Their bytes.
    pub intercept_bytes: u64,
    /// Upstream attempts sent (retries included) since start.
    pub upstream_requests: u64,
    /// Of those, retries (after a connect error, 429 or 5xx).
    pub upstream_retried: u64,
    /// Upcalls waiting for the control plane's answer (0 at rest).
    pub pending_upcalls: usize,
    /// Upcalls made (intercept and route).
    pub upcalls: u64,
    /// Times the plane gave glibc's free heap pages back to the OS
    /// (`malloc_trim`, once quiet; see [`Config::trim_when_idle`]).
    pub trims: u64,
}

/// A running data plane: its own tokio runtime, listener and tables.
///
/// Dropping it stops the server (in-flight calls are dropped with the
/// runtime).  Do not drop it from inside an async context of another runtime
/// only if that runtime forbids blocking: shutdown does not block.
pub struct DataPlane {
    shared: Arc<Shared>,
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    runtime: Option<tokio::runtime::Runtime>,
    trimmer: Trimmer,
}

impl std::fmt::Debug for DataPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataPlane").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl DataPlane {
    /// Start serving on `listen` (port 0: an OS-chosen port; see
    /// [`DataPlane::local_addr`]).  Callable from any thread, async or not.
    ///
    /// # Errors
    /// [`StartError::Config`] for an unusable configuration (bad upstream
    /// URL, https without the `tls` feature, a zero limit);
    /// [`StartError::Io`] if the address cannot be bound.
    pub fn start(config: Config, listen: SocketAddr) -> Result<Self, StartError> {
        if config.max_body_bytes == 0 {
            return Err(ConfigError::Limit("max_body_bytes").into());
        }
        if config.worker_threads == 0 {
            return Err(ConfigError::Limit("worker_threads").into());
        }
        if config.body_read_timeout.is_zero() {
            return Err(ConfigError::Limit("body_read_timeout").into());
        }
        let upstream = Upstream::new(&config)?;
        let rewrites = rewrites_by_id(&config.protocols, config.rewrites)?;
        let upcalls = Upcalls::new(&config.protocols, &config.intercept, &config.python_routes)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.worker_threads)
            .thread_name("lowwater-dataplane")
            .enable_io()
            .enable_time()
            .build()?;
        let listener = {
            let _in = runtime.enter();
            let socket =
                if listen.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
            // As std's bind does: a restarted proxy rebinds its port at once.
            socket.set_reuseaddr(true)?;
            socket.bind(listen)?;
            // Agents connect in bursts (a group's rollouts start together,
            // 256 at once in benches/interception.py): past std's backlog of
            // 128 the kernel drops handshakes (a client waits a 1 s SYN
            // retransmit) or answers with SYN cookies, which lose TCP options
            // and can end in resets.
            socket.listen(LISTEN_BACKLOG)?
        };
        let addr = listener.local_addr()?;
        let table = config.table.unwrap_or_else(|| Arc::new(InterceptTable::new(None, 1 << 20)));
        let shared = Arc::new(Shared {
            table,
            request_prefix: request_prefix(addr),
            next_request: AtomicU64::new(0),
            rollouts: RolloutTable::new(),
            queue: CompletionQueue::new()?,
            protocols: config.protocols,
            upstream,
            hasher: MessageHasher::new(),
            max_body_bytes: config.max_body_bytes,
            max_response_bytes: config.max_response_bytes,
            body_read_timeout: config.body_read_timeout,
            hold_for_ack: config.hold_for_ack,
            release_when_readable: config.release_when_readable,
            rewrites: arc_swap::ArcSwap::from_pointee(rewrites),
            counters: Counters::default(),
            upcalls,
        });
        let (stop, stopped) = oneshot::channel();
        let trimmer = Trimmer::start(&shared, config.pool_idle_timeout, config.trim_when_idle)?;
        runtime.spawn(accept_loop(Arc::clone(&shared), listener, stopped));
        Ok(DataPlane { shared, addr, stop: Some(stop), runtime: Some(runtime), trimmer })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Open a rollout (see [`RolloutTable::register`]).
    ///
    /// # Errors
    /// As [`RolloutTable::register`].
    pub fn register(&self, rollout_id: &str, secret: &str) -> Result<(), RegisterError> {
        self.shared.rollouts.register(rollout_id, secret)?;
        self.shared.table.open_rollout(rollout_id);
        Ok(())
    }

    /// Open a rollout with its own upstream, key or model ([`RolloutOptions`]):
    /// its calls go to `{upstream}{path without /v1}` with its key, and carry
    /// its model.  `GET /v1/models` names that model.
    ///
    /// # Errors
    /// As [`RolloutTable::register`], and [`RegisterError::Config`] for an
    /// upstream URL or key the plane could not start with.
    pub fn register_with(&self, rollout_id: &str, secret: &str, options: &RolloutOptions) -> Result<(), RegisterError> {
        let target = self.shared.upstream.target(options.upstream.as_deref(), options.api_key.as_deref())?;
        self.shared.rollouts.register_with(rollout_id, secret, target, options.model.as_deref())?;
        self.shared.table.open_rollout(rollout_id);
        Ok(())
    }

    /// Close a rollout, cancelling its in-flight calls (see
    /// [`RolloutTable::unregister`]); `None` if it was not open.
    ///
    /// Its upcalls waiting for an answer are answered 410 too (counted in
    /// the result), and a later answer to them is a no-op.
    pub fn unregister(&self, rollout_id: &str) -> Option<usize> {
        let rollout = self.shared.rollouts.get(rollout_id);
        let cancelled = self.shared.rollouts.unregister(rollout_id);
        // After the cancel: a call that raced it to an insert either sees the
        // rollout closed or has its body swept here.
        self.shared.table.close_rollout(rollout_id);
        let cancelled = cancelled?;
        // Its memory is freed: a trim is due once the plane is still.
        self.shared.counters.releases.fetch_add(1, Ordering::Relaxed);
        // After the close: an upcall inserted later sees the rollout closed.
        let upcalls = rollout.map_or(0, |r| self.shared.upcalls.cancel_rollout(&r));
        Some(cancelled + upcalls)
    }

    /// The intercept table holding the in-flight calls' request bodies.
    pub fn table(&self) -> &Arc<InterceptTable> {
        &self.shared.table
    }

    /// The upcalls: their wakeup fd, drain, and the answers.
    pub fn upcalls(&self) -> &Upcalls {
        &self.shared.upcalls
    }

    /// Replace the request rewrites (see [`Config::rewrites`]) for the calls
    /// that start from now on.
    ///
    /// # Errors
    /// [`ConfigError::Rewrite`] for a protocol the table lacks (nothing changed).
    pub fn set_rewrites(&self, rewrites: HashMap<String, Rewrites>) -> Result<(), ConfigError> {
        let by_id = rewrites_by_id(&self.shared.protocols, rewrites)?;
        self.shared.rewrites.store(Arc::new(by_id));
        Ok(())
    }

    /// Switch which protocols' calls are intercepted from now on (see
    /// [`Config::intercept`]).
    ///
    /// # Errors
    /// [`ConfigError::Upcall`] for a name no protocol has (nothing changed).
    pub fn set_intercept(&self, intercept: &Intercept) -> Result<(), ConfigError> {
        self.shared.upcalls.set_intercept(&self.shared.protocols, intercept)
    }

    /// The completion queue: wakeup fd, drain, ack.
    pub fn queue(&self) -> &CompletionQueue {
        &self.shared.queue
    }

    /// The routes (a record's `protocol` indexes this table).
    pub fn protocols(&self) -> &ProtocolTable {
        &self.shared.protocols
    }

    /// A snapshot of the tables and counters.
    pub fn stats(&self) -> Stats {
        let sh = &self.shared;
        let c = &sh.counters;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        Stats {
            open_rollouts: sh.rollouts.len(),
            secrets: sh.rollouts.secrets(),
            in_flight: sh.rollouts.in_flight(),
            active_calls: get(&c.active_calls),
            connections: get(&c.connections),
            queued: sh.queue.len(),
            awaiting_ack: sh.queue.awaiting_ack(),
            released: get(&c.released),
            calls: get(&c.calls),
            ok: get(&c.ok),
            failed: get(&c.failed),
            closed: get(&c.closed),
            disconnected: get(&c.disconnected),
            refused: get(&c.refused),
            intercepts: sh.table.len(),
            intercept_bytes: sh.table.stats().bytes,
            upstream_requests: get(&sh.upstream.requests),
            upstream_retried: get(&sh.upstream.retried),
            pending_upcalls: sh.upcalls.pending(),
            upcalls: sh.upcalls.total(),
            trims: get(&c.trims),
        }
    }

    /// Stop accepting, release held calls, and stop the runtime without
    /// waiting for its tasks (safe from any context).
    pub fn shutdown(mut self) {
        self.stop_now();
    }

    /// Stop like [`DataPlane::shutdown`], then wait up to `timeout` for the
    /// runtime's worker threads to exit (joined: none is left running when it
    /// returns in time).  Blocks the calling thread; do not call it from
    /// inside another tokio runtime.
    pub fn shutdown_and_join(mut self, timeout: Duration) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.shared.upcalls.close();
        self.shared.queue.release_all();
        self.trimmer.stop_and_join();
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_timeout(timeout);
        }
    }

    fn stop_now(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.shared.upcalls.close();
        self.shared.queue.release_all();
        self.trimmer.stop();
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// `rewrites` by protocol id, empty rule sets dropped.
fn rewrites_by_id(
    protocols: &ProtocolTable,
    mut rewrites: HashMap<String, Rewrites>,
) -> Result<Vec<Option<Rewrites>>, ConfigError> {
    let mut out = Vec::with_capacity(protocols.len());
    for id in 0..protocols.len() {
        let name = protocols.get(id as u16).map(|s| s.name.as_str()).unwrap_or_default();
        out.push(rewrites.remove(name).filter(|r| !r.is_empty()));
    }
    if let Some(name) = rewrites.keys().next() {
        return Err(ConfigError::Rewrite(format!("no protocol {name:?}")));
    }
    Ok(out)
}

impl Drop for DataPlane {
    fn drop(&mut self) {
        self.stop_now();
    }
}

/// A prefix for this plane's request ids, so two planes sharing one table
/// (or a plane beside another writer) never collide: the port and the start
/// time in nanoseconds.
fn request_prefix(addr: SocketAddr) -> String {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("dp{}-{:x}-", addr.port(), nanos)
}
