//! The HTTP side: accept connections, answer one call.
//!
//! One call: route by path (404/405), authenticate the secret before the
//! body is read (401, `connection: close`), read the body under the limit
//! and the body read timeout (413 after draining; 400 if cut; 408 if late),
//! validate it (400 naming the problem),
//! begin the call in its rollout (410 if closed), take the message delta,
//! forward to the upstream (502/504 if it fails), then either read the whole
//! answer or relay its stream event by event, record the turn, wait for the
//! control plane's ack, and release the last bytes.  Nothing a client sends
//! can make a 500: every path returns a response built here.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use http::header::{
    ACCEPT_ENCODING, ALLOW, CACHE_CONTROL, CONNECTION, CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER,
};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use lowwater_core::{InterceptTable, TableError};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use crate::body::{read_limited, BodyError, ReadBody, Relay, ResBody};
use crate::divergence::MessageHasher;
use crate::held::Held;
use crate::lifecycle::{CallId, Cancelled};
use crate::protocol::{error_body, ErrorFlavour, ParsedRequest, ProtocolId, ProtocolSpec, ProtocolTable};
use crate::queue::{CompletionQueue, RequestDelta, Timings, TurnRecord, Verdict};
use crate::rewrite::Rewrites;
use crate::rollouts::{Rollout, RolloutTable};
use crate::sse::{Fed, SseSplitter};
use crate::upstream::{error_chain, Answer, Upstream};

/// Request headers that change what the upstream does, passed on as sent.
const FORWARD_HEADERS: [&str; 3] = ["anthropic-version", "anthropic-beta", "openai-beta"];

/// How long a send to a client that does not read may block (the Python
/// server's `SEND_TIMEOUT_S`).
const SEND_TIMEOUT: Duration = Duration::from_secs(60);

/// Bodies at least this large are copied into the intercept table, and
/// answers at least this large checked as JSON, off the async path (bytes).
const BLOCKING_COPY_BYTES: usize = 1 << 20;

/// `work()` over `len` bytes; from [`BLOCKING_COPY_BYTES`] up through
/// `block_in_place`, which first hands this worker's other calls to another
/// worker: a pass over up to 64 MiB (~10 ms) must not stall them.
fn off_worker_if_large<T>(len: usize, work: impl FnOnce() -> T) -> T {
    if len >= BLOCKING_COPY_BYTES {
        tokio::task::block_in_place(work)
    } else {
        work()
    }
}

/// Chunks a stream's relay may run ahead of its client.
const RELAY_DEPTH: usize = 16;

/// Counters and gauges behind [`crate::Stats`].
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) connections: AtomicU64,
    pub(crate) active_calls: AtomicU64,
    pub(crate) calls: AtomicU64,
    pub(crate) ok: AtomicU64,
    pub(crate) failed: AtomicU64,
    pub(crate) closed: AtomicU64,
    pub(crate) disconnected: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) trims: crate::trim::TrimCount,
    /// Recorded calls not held for the ack although `hold_for_ack` is on.
    pub(crate) released: AtomicU64,
    /// Client connections ended and rollouts unregistered: memory freed
    /// outside a call.  The trimmer watches it beside `calls`; counting calls
    /// alone missed a burst's connections closing after its last call (a
    /// slow client read its answers for 20 s after the trims, and the 3,000
    /// connections' buffers were freed untrimmed: the plane rested 40 MiB high).
    pub(crate) releases: AtomicU64,
}

/// What every connection and call shares.
pub(crate) struct Shared {
    /// Request bodies of in-flight calls (`held`).
    pub(crate) table: Arc<InterceptTable>,
    pub(crate) request_prefix: String,
    pub(crate) next_request: AtomicU64,
    pub(crate) rollouts: RolloutTable,
    pub(crate) queue: CompletionQueue,
    pub(crate) protocols: ProtocolTable,
    pub(crate) upstream: Upstream,
    pub(crate) hasher: MessageHasher,
    pub(crate) max_body_bytes: usize,
    pub(crate) max_response_bytes: usize,
    pub(crate) body_read_timeout: Duration,
    pub(crate) hold_for_ack: bool,
    pub(crate) release_when_readable: bool,
    /// Request rewrites by protocol id (`None`: forward the agent's bytes);
    /// replaced whole by `DataPlane::set_rewrites`, a call keeping the set it
    /// started with.
    pub(crate) rewrites: arc_swap::ArcSwap<Vec<Option<Rewrites>>>,
    pub(crate) counters: Counters,
    /// Upcalls to the control plane (src/upcall.rs).
    pub(crate) upcalls: crate::upcall::Upcalls,
}

/// A gauge held up while this lives (a connection, a call's task).
struct Gauge(Arc<Shared>, fn(&Counters) -> &AtomicU64);

impl Gauge {
    fn new(sh: &Arc<Shared>, which: fn(&Counters) -> &AtomicU64) -> Self {
        which(&sh.counters).fetch_add(1, Ordering::Relaxed);
        Gauge(Arc::clone(sh), which)
    }
}

impl Drop for Gauge {
    fn drop(&mut self) {
        (self.1)(&self.0.counters).fetch_sub(1, Ordering::Relaxed);
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// Accept connections until `stop` fires; each is served on its own task.
pub(crate) async fn accept_loop(sh: Arc<Shared>, listener: TcpListener, mut stop: oneshot::Receiver<()>) {
    loop {
        let accepted = tokio::select! {
            biased;
            _ = &mut stop => return,
            a = listener.accept() => a,
        };
        let Ok((stream, _)) = accepted else {
            // Out of fds or a connection reset before accept: do not spin on it.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let sh = Arc::clone(&sh);
        tokio::spawn(async move {
            let open = Gauge::new(&sh, |c| &c.connections);
            let svc = service_fn(move |req| {
                let sh = Arc::clone(&sh);
                async move { Ok::<_, Infallible>(handle(sh, req).await) }
            });
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(SEND_TIMEOUT)
                .serve_connection(TokioIo::new(stream), svc);
            let _ = conn.await;
            bump(&open.0.counters.releases); // its buffers are freed: a trim is due
        });
    }
}

pub(crate) fn respond(status: u16, content_type: &'static str, body: impl Into<Bytes>) -> Response<ResBody> {
    let mut r = Response::new(ResBody::full(body));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

pub(crate) fn error(flavour: ErrorFlavour, status: u16, reason: &str) -> Response<ResBody> {
    respond(status, "application/json", error_body(flavour, status, reason))
}

/// An answer given before the body was read: the client may still be
/// sending it, so the connection is not reused (a client that reused it got
/// "disconnected without sending a response").
pub(crate) fn closing(mut r: Response<ResBody>) -> Response<ResBody> {
    r.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
    r
}

fn bearer(value: &str) -> Option<&str> {
    let (scheme, key) = value.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
}

/// The open rollout the request's secret belongs to.
pub(crate) fn authenticate(table: &RolloutTable, headers: &HeaderMap) -> Result<Arc<Rollout>, &'static str> {
    let auth = headers.get_all(http::header::AUTHORIZATION).iter().filter_map(|v| bearer(v.to_str().ok()?));
    let api = headers.get_all("x-api-key").iter().filter_map(|v| Some(v.to_str().ok()?.trim()));
    let mut found: Option<Arc<Rollout>> = None;
    let mut any = false;
    for key in auth.chain(api).filter(|k| !k.is_empty()) {
        any = true;
        if let Some(r) = table.by_secret(key) {
            match &found {
                Some(f) if !Arc::ptr_eq(f, &r) => return Err("keys of two rollouts in one request"),
                _ => found = Some(r),
            }
        }
    }
    found.ok_or(if any { "unknown API key" } else { "missing API key (Authorization: Bearer or x-api-key)" })
}

/// Headers an intercept hook never sees: the rollout's secret (a plugin has
/// no use for it, and a logging one would write it out).
const SECRET_HEADERS: [&str; 2] = ["authorization", "x-api-key"];

/// The request's headers for an intercept upcall, as sent (names
/// lower-case, repeated names repeated), without [`SECRET_HEADERS`]; copies,
/// so the call does not pin hyper's read buffer.
pub(crate) fn hook_headers(headers: &HeaderMap) -> Vec<(Bytes, Bytes)> {
    headers
        .iter()
        .filter(|(k, _)| !SECRET_HEADERS.contains(&k.as_str()))
        .map(|(k, v)| (Bytes::copy_from_slice(k.as_str().as_bytes()), Bytes::copy_from_slice(v.as_bytes())))
        .collect()
}

fn forwarded(headers: &HeaderMap) -> Result<HeaderMap, String> {
    let mut out = HeaderMap::new();
    for name in FORWARD_HEADERS {
        for v in headers.get_all(name) {
            if !v.as_bytes().is_ascii() {
                return Err(format!("header {name} must be ASCII"));
            }
            // A copy: a clone would share, and so pin, hyper's read buffer
            // for the whole call.
            let owned = HeaderValue::from_bytes(v.as_bytes()).map_err(|_| format!("header {name} is not valid"))?;
            out.append(name, owned);
        }
    }
    Ok(out)
}

/// The request body's content coding, unless it is none or `identity`.
/// The plane reads, records and forwards the agent's JSON as sent; a
/// compressed body was refused as "malformed JSON: invalid UTF-8 at byte 1",
/// which sent the agent's author looking for a bug in their JSON.
fn coding(headers: &HeaderMap) -> Option<String> {
    headers.get_all(CONTENT_ENCODING).iter().find_map(|v| {
        let value = String::from_utf8_lossy(v.as_bytes());
        let coded = value.split(',').map(str::trim).find(|c| !c.is_empty() && !c.eq_ignore_ascii_case("identity"));
        coded.map(str::to_owned)
    })
}

fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers.get(CONTENT_LENGTH)?.to_str().ok()?.trim().parse().ok()
}

fn now_unix_s() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// Answer one request; never fails (every error is a response).
pub(crate) async fn handle(sh: Arc<Shared>, req: Request<Incoming>) -> Response<ResBody> {
    let active = Gauge::new(&sh, |c| &c.active_calls);
    let start = Instant::now();
    let started_s = now_unix_s();
    let path = req.uri().path();
    // GET is the model list's; another method goes to a protocol routed there, if any.
    if path == crate::models::PATH && (req.method() == Method::GET || sh.protocols.route(path).is_none()) {
        return crate::models::answer(&sh, &req);
    }
    let Some((pid, spec)) = sh.protocols.route(req.uri().path()) else {
        if sh.upcalls.routes_to_python(req.uri().path()) {
            return crate::upcall::route(&sh, req).await;
        }
        return closing(error(ErrorFlavour::OpenAi, 404, &format!("no route {}", req.uri().path())));
    };
    let spec = Arc::clone(spec);
    if req.method() != Method::POST {
        let mut r = closing(error(spec.flavour, 405, &format!("method {} not allowed", req.method())));
        r.headers_mut().insert(ALLOW, HeaderValue::from_static("POST"));
        return r;
    }
    bump(&sh.counters.calls);
    let rollout = match authenticate(&sh.rollouts, req.headers()) {
        Ok(r) => r,
        Err(why) => {
            bump(&sh.counters.refused);
            return closing(error(spec.flavour, 401, why));
        }
    };
    let extra = match forwarded(req.headers()) {
        Ok(h) => h,
        Err(why) => {
            bump(&sh.counters.refused);
            return closing(error(spec.flavour, 400, &why));
        }
    };
    if let Some(coding) = coding(req.headers()) {
        bump(&sh.counters.refused);
        let why = format!("content-encoding {coding} is not supported: send the request body uncompressed");
        // RFC 9110 15.5.16: a content coding the server cannot take is a 415, with what it accepts.
        let mut r = closing(error(spec.flavour, 415, &why));
        r.headers_mut().insert(ACCEPT_ENCODING, HeaderValue::from_static("identity"));
        return r;
    }
    // Only a call some intercept hook will see pays for a copy of its headers.
    let hook_headers = if sh.upcalls.intercepts(pid) { hook_headers(req.headers()) } else { Vec::new() };
    let declared = content_length(req.headers());
    let read = read_limited(req.into_body(), declared, sh.max_body_bytes, sh.body_read_timeout, Some(&sh.table));
    let body = match read.await {
        Ok(b) => b,
        Err(BodyError::TooLarge) => {
            bump(&sh.counters.refused);
            let why = format!("request body over the limit of {} bytes", sh.max_body_bytes);
            return closing(error(spec.flavour, 413, &why));
        }
        Err(BodyError::Cut(why)) => {
            bump(&sh.counters.refused);
            return closing(error(spec.flavour, 400, &why));
        }
        Err(BodyError::TimedOut) => {
            // Before `begin`: nothing is in the rollout's tables to undo.  If the
            // client is gone the write fails and hyper closes the connection.
            bump(&sh.counters.refused);
            let why = format!("request body not received within {} s", sh.body_read_timeout.as_secs_f64());
            return closing(error(spec.flavour, 408, &why));
        }
        Err(BodyError::Unheld(why)) => {
            bump(&sh.counters.failed);
            return error(spec.flavour, 503, &why);
        }
    };
    let all_rules = sh.rewrites.load_full();
    let rules = all_rules.get(usize::from(pid)).and_then(Option::as_ref);
    let rewriting = rules.is_some() || rollout.model.is_some();
    let parsed = if rewriting { spec.parse_keeping_spans(body.as_slice()) } else { spec.parse(body.as_slice()) };
    let parsed = match parsed {
        Ok(p) => p,
        Err(bad) => {
            bump(&sh.counters.refused);
            return error(spec.flavour, 400, &bad.0);
        }
    };
    // Interception: the control plane may change the body (forwarded and
    // recorded as changed) or refuse the call, before it begins.  A changed
    // body is parsed as the agent's was just above: keep the two in step.
    // The call's id from here: an intercept upcall carries it, as its record will.
    let n = sh.next_request.fetch_add(1, Ordering::Relaxed);
    let request_id: Arc<str> = Arc::from(format!("{}{n}", sh.request_prefix));
    let intercepted = sh.upcalls.intercepts(pid);
    let (body, parsed) = if intercepted {
        // A hook's body is rewritten like the agent's: keep its spans too.
        let reparse = |b: &[u8]| if rewriting { spec.parse_keeping_spans(b) } else { spec.parse(b) };
        let call =
            crate::upcall::Intercepted { request_id: &request_id, headers: hook_headers, body: body.into_bytes() };
        match crate::upcall::intercept(&sh, &rollout, &spec, call, parsed, reparse).await {
            Ok((forward, parsed)) => (ReadBody::Buffered(forward), parsed),
            Err(response) => return response,
        }
    } else {
        (body, parsed)
    };
    let (cancel_tx, cancel_rx) = oneshot::channel();
    let Ok(id) = rollout.calls.begin(cancel_tx) else {
        bump(&sh.counters.closed);
        return error(spec.flavour, 410, &format!("rollout {} was closed", rollout.id));
    };
    let held = match body {
        ReadBody::Buffered(body) => off_worker_if_large(body.len(), || {
            Held::insert(&sh.table, &request_id, &rollout.id, &spec.name, parsed.stream, &body)
        }),
        // Already in the table's memory: held as it is, no pass over it.
        ReadBody::Stored(payload) => {
            Held::insert_payload(&sh.table, &request_id, &rollout.id, &spec.name, parsed.stream, payload)
        }
    };
    let held = match held {
        Ok(h) => h,
        Err(e) => {
            rollout.calls.abandon(id);
            return match e {
                TableError::RolloutClosed { .. } => {
                    bump(&sh.counters.closed);
                    error(spec.flavour, 410, &format!("rollout {} was closed", rollout.id))
                }
                // The Python server's answer to a full table: retry shortly.
                TableError::Full { .. } => {
                    bump(&sh.counters.failed);
                    let mut r = error(spec.flavour, 503, "the intercept table is full; retry later");
                    r.headers_mut().insert(RETRY_AFTER, HeaderValue::from_static("1"));
                    r
                }
                other => {
                    bump(&sh.counters.failed);
                    error(spec.flavour, 503, &format!("the request body cannot be held: {other}"))
                }
            };
        }
    };
    // From here the agent's bytes live once, in the table: the upstream
    // request shares the table's copy.  The buffer the body was read into
    // went with the insert above, not when the call ends: a shadowed
    // binding lives to the end of the scope, and it kept every held call's
    // body twice (tests/held_body.rs).
    let body = held.bytes();
    let delta = delta(&sh, &rollout, &body, &parsed);
    // After the delta: the turn shows the agent's messages, the upstream gets the rewrite.
    let forward = crate::rewrite::forward(&body, &parsed.spans, rollout.model.as_deref(), rules);
    // A rewritten body is a copy: the agent's bytes are not kept for the call's life.
    drop(body);
    // The turn names the model the agent asked for (an override is the run's, not the agent's).
    let model = parsed.model;
    let call = Call {
        sh: Arc::clone(&sh),
        rollout,
        id,
        armed: true,
        spec,
        protocol: pid,
        model,
        streamed: parsed.stream,
        delta: Some(delta),
        tools: parsed.tools.map(Bytes::from),
        intercepted,
        start,
        started_s,
        _held: held,
        _active: active,
    };
    call.run(forward, extra, cancel_rx).await
}

/// The request's messages the rollout has not sent before, copied out of the
/// body into one buffer, so the body is freed once the upstream has it.
fn delta(sh: &Shared, rollout: &Rollout, body: &Bytes, parsed: &ParsedRequest) -> RequestDelta {
    let keys = parsed.messages.iter().map(|r| sh.hasher.key(&body[r.clone()])).collect();
    let d = rollout.advance(keys);
    let new = &parsed.messages[d.kept..];
    let mut buf = BytesMut::with_capacity(new.iter().map(|r| r.len()).sum());
    for r in new {
        buf.extend_from_slice(&body[r.clone()]);
    }
    let mut all = buf.freeze();
    let messages = new.iter().map(|r| all.split_to(r.len())).collect();
    RequestDelta { kept: d.kept, previous: d.previous, messages }
}

/// One call between `begin` and its record (or cancellation).
struct Call {
    sh: Arc<Shared>,
    rollout: Arc<Rollout>,
    id: CallId,
    /// Still registered in the rollout: dropping the call abandons it.
    armed: bool,
    spec: Arc<ProtocolSpec>,
    protocol: ProtocolId,
    model: String,
    streamed: bool,
    delta: Option<RequestDelta>,
    tools: Option<Bytes>,
    /// Handed to the control plane as an intercept upcall: its
    /// `intercept_response` hooks run before the ack, so it is always held.
    intercepted: bool,
    start: Instant,
    started_s: f64,
    /// The request body in the intercept table, discarded when the call ends
    /// (answered, failed, cancelled, or dropped when its client left).
    _held: Held,
    /// Counts the call as active until its last byte is handed over.
    _active: Gauge,
}

/// The error a call's turn records when its client left before the answer
/// was complete (the Python server's wording).
const DISCONNECTED: &str = "the client disconnected before the answer was complete";

/// The status a turn records for a call whose client left (nginx's "client
/// closed request"; no response was sent).
const CLIENT_CLOSED: u16 = 499;

impl Drop for Call {
    fn drop(&mut self) {
        // Still armed: the client left (hyper dropped the handler, or the
        // relay found the client gone) before the call was recorded.  The
        // turn is recorded with that error, as the trainer must see the call
        // was made (it may have consumed upstream tokens); dropping the call
        // closes the upstream request, which stops the generation.
        if self.armed {
            bump(&self.sh.counters.disconnected);
            let upstream_s = self.start.elapsed().as_secs_f64();
            if self.commit(CLIENT_CLOSED, Bytes::new(), Some(DISCONNECTED.into()), upstream_s, false).is_err() {
                // Unregistered meanwhile: nothing to record.
                self.armed = false;
            }
        }
    }
}

impl Call {
    fn closed(&mut self) -> Response<ResBody> {
        self.armed = false;
        bump(&self.sh.counters.closed);
        error(self.spec.flavour, 410, &format!("rollout {} was closed during the call", self.rollout.id))
    }

    async fn run(mut self, body: Bytes, extra: HeaderMap, mut cancel: oneshot::Receiver<()>) -> Response<ResBody> {
        let sh = Arc::clone(&self.sh);
        let answer = tokio::select! {
            biased;
            _ = &mut cancel => return self.closed(),
            a = sh.upstream.post(self.rollout.upstream.as_deref(), &self.spec.path, body, &extra) => a,
        };
        let upstream_s = self.start.elapsed().as_secs_f64();
        let answer = match answer {
            Ok(a) => a,
            Err(e) => {
                let reason = e.reason();
                return match self.commit(e.status(), Bytes::new(), Some(reason.clone()), 0.0, true) {
                    Err(Cancelled) => self.closed(),
                    Ok(ack) => {
                        // Failed already: a verdict cannot make it worse.
                        wait(ack).await;
                        error(self.spec.flavour, e.status(), &reason)
                    }
                };
            }
        };
        let status = answer.response.status();
        let headers = answer.response.headers();
        let is_sse = headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().get(..17).is_some_and(|t| t.eq_ignore_ascii_case("text/event-stream")));
        if self.streamed && status.is_success() && is_sse {
            let (tx, rx) = mpsc::channel(RELAY_DEPTH);
            let mut r = Response::new(ResBody::Stream(rx, false));
            *r.status_mut() = status;
            r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
            r.headers_mut().insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
            tokio::spawn(self.relay(answer, cancel, tx, upstream_s));
            return r;
        }
        let content_type = headers.get(CONTENT_TYPE).cloned();
        let retry_after = headers.get(RETRY_AFTER).cloned();
        let read = tokio::select! {
            biased;
            _ = &mut cancel => return self.closed(),
            r = read_whole(answer, sh.upstream.timeout, sh.max_response_bytes) => r,
        };
        let (status, bytes, err) = match read {
            // A 5xx left after the retries is the upstream failing: 502, as in
            // the Python server; the record keeps the upstream's body.
            Ok(bytes) if status.is_server_error() => {
                (502, bytes, Some(format!("upstream answered {}", status.as_u16())))
            }
            Ok(bytes) => (status.as_u16(), bytes, None),
            Err(e) => (e.status(), Bytes::new(), Some(e.reason())),
        };
        // The control plane fails only a 2xx answer it cannot parse.  Checked
        // only when the check can release the call; a large answer's parse
        // (up to max_response_bytes) off the worker's other calls, as its copy.
        let readable = self.may_release()
            && (err.is_some()
                || !(200..300).contains(&status)
                || off_worker_if_large(bytes.len(), || crate::readable::is_json(&bytes)));
        match self.commit(status, bytes.clone(), err.clone(), upstream_s, readable) {
            Err(Cancelled) => self.closed(),
            Ok(ack) => {
                let verdict = wait(ack).await;
                if let Some(why) = err {
                    return error(self.spec.flavour, status, &why);
                }
                if let Verdict::Fail { status, reason } = verdict {
                    // The control plane could not read the answer: the agent
                    // must not take it for a good one.
                    return error(self.spec.flavour, status, &reason);
                }
                let mut r = Response::new(ResBody::full(bytes));
                *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
                let ct = content_type.unwrap_or(HeaderValue::from_static("application/json"));
                r.headers_mut().insert(CONTENT_TYPE, ct);
                if let Some(ra) = retry_after {
                    r.headers_mut().insert(RETRY_AFTER, ra);
                }
                r
            }
        }
    }

    /// Whether this call may go out without the ack, if its answer is readable.
    fn may_release(&self) -> bool {
        self.sh.release_when_readable && self.spec.reads_any_json && !self.intercepted
    }

    /// Record the turn (under the rollout's lock: see `lifecycle`), returning
    /// what to wait on before the last bytes go out.
    ///
    /// `readable`: the answer is one the control plane can read without an
    /// error (JSON; each event's data, for a stream), or an error no verdict
    /// changes; with `release_when_readable` such a call is not held.
    fn commit(
        &mut self,
        status: u16,
        response: Bytes,
        error: Option<String>,
        upstream_s: f64,
        readable: bool,
    ) -> Result<Option<oneshot::Receiver<Verdict>>, Cancelled> {
        let sh = &self.sh;
        let release = readable && self.may_release();
        let (ack_tx, ack_rx) = if sh.hold_for_ack && !release {
            let (t, r) = oneshot::channel();
            (Some(t), Some(r))
        } else {
            (None, None)
        };
        let ok = error.is_none() && (200..300).contains(&status);
        let record = TurnRecord {
            seq: sh.queue.next_seq(),
            rollout_id: Arc::clone(&self.rollout.id),
            request_id: self._held.request_id(),
            protocol: self.protocol,
            model: std::mem::take(&mut self.model),
            streamed: self.streamed,
            request: self.delta.take().unwrap_or(RequestDelta { kept: 0, previous: 0, messages: Vec::new() }),
            tools: self.tools.take(),
            status,
            response,
            error,
            timings: Timings { started_s: self.started_s, upstream_s, duration_s: self.start.elapsed().as_secs_f64() },
        };
        self.armed = false;
        let queue: &CompletionQueue = &sh.queue;
        let batch_starts = self.rollout.calls.commit(self.id, || queue.push(record, ack_tx))?;
        if batch_starts {
            wake_later(sh);
        }
        if sh.hold_for_ack && release {
            bump(&sh.counters.released);
        }
        bump(if ok { &sh.counters.ok } else { &sh.counters.failed });
        Ok(ack_rx)
    }

    /// Relay an upstream stream event by event; hold the terminal event until
    /// the turn is recorded and acked.
    async fn relay(
        mut self,
        answer: Answer,
        mut cancel: oneshot::Receiver<()>,
        tx: mpsc::Sender<Relay>,
        upstream_s: f64,
    ) {
        let status = answer.response.status().as_u16();
        let timeout = self.sh.upstream.timeout;
        let (response, permit) = (answer.response, answer._permit);
        let mut body = response.into_body();
        // The JSON check of each event only where it can release the call.
        let mut split = SseSplitter::new(self.spec.terminal.clone()).with_json_check(self.may_release());
        let (mut acc, mut held) = (BytesMut::new(), BytesMut::new());
        let mut error: Option<String> = None;
        loop {
            let frame = tokio::select! {
                biased;
                _ = &mut cancel => return self.stream_closed(&tx).await,
                // The client left while the upstream is quiet: without this
                // the relay (and the upstream call) lived on until the
                // upstream's next event or its timeout, up to 600 s.
                _ = tx.closed() => return, // dropping `self` records it
                f = tokio::time::timeout(timeout, body.frame()) => f,
            };
            let data = match frame {
                Err(_) => {
                    error = Some("upstream stream timed out".into());
                    break;
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    error = Some(format!("upstream stream cut: {}", error_chain(&e)));
                    break;
                }
                Ok(Some(Ok(f))) => match f.into_data() {
                    Ok(d) => d,
                    Err(_) => continue,
                },
            };
            let fed = split.feed(&data);
            keep(&fed, &mut acc, &mut held);
            if !fed.relay.is_empty() {
                let sent = tokio::select! {
                    biased;
                    _ = &mut cancel => return self.stream_closed(&tx).await,
                    s = tx.send(Relay::Data(fed.relay)) => s,
                };
                if sent.is_err() {
                    return; // the client left: dropping `self` records it so
                }
            }
            if split.seen_terminal() {
                // Read the upstream's end too, so its connection can be reused.
                while let Ok(Some(Ok(f))) = tokio::time::timeout(timeout, body.frame()).await {
                    if let Ok(d) = f.into_data() {
                        keep(&split.feed(&d), &mut acc, &mut held);
                    }
                }
                break;
            }
        }
        let fed = split.finish();
        keep(&fed, &mut acc, &mut held);
        let tail = fed.relay;
        drop((body, permit));
        if !split.seen_terminal() {
            acc.extend_from_slice(split.pending());
            error.get_or_insert_with(|| "upstream stream ended before its terminal event".into());
        }
        let readable = error.is_some() || split.all_json();
        let out = match self.commit(status, acc.freeze(), error.clone(), upstream_s, readable) {
            Err(Cancelled) => return self.stream_closed(&tx).await,
            Ok(ack) => {
                let verdict = tokio::select! {
                    v = wait(ack) => v,
                    _ = tx.closed() => return,
                };
                if let (None, Verdict::Fail { reason, .. }) = (&error, verdict) {
                    error = Some(reason);
                }
                let mut out = BytesMut::from(&tail[..]);
                match &error {
                    None => out.extend_from_slice(&held),
                    // A cut stream is an error event to the agent, never an empty success.
                    Some(why) => out.extend_from_slice(&self.spec.error_event(why)),
                }
                out.freeze()
            }
        };
        let sent = tokio::time::timeout(SEND_TIMEOUT, tx.send(Relay::Data(out))).await;
        if error.is_some() && matches!(sent, Ok(Ok(()))) {
            let _ = tx.send(Relay::Break).await;
        }
    }

    /// The rollout closed under a stream: an error event, then the connection is broken off.
    async fn stream_closed(&mut self, tx: &mpsc::Sender<Relay>) {
        self.armed = false;
        bump(&self.sh.counters.closed);
        let event = self.spec.error_event(&format!("rollout {} was closed during the call", self.rollout.id));
        let _ = tokio::time::timeout(SEND_TIMEOUT, tx.send(Relay::Data(event.into()))).await;
        let _ = tx.send(Relay::Break).await;
    }
}

fn keep(fed: &Fed, acc: &mut BytesMut, held: &mut BytesMut) {
    acc.extend_from_slice(&fed.relay);
    if let Some(t) = &fed.terminal {
        acc.extend_from_slice(t);
        held.extend_from_slice(t);
    }
}

/// How long a released record (one whose call did not wait for the ack)
/// may wait on the queue before the wakeup fd says so: the records of the
/// calls released meanwhile go with it, one wakeup of the control plane per
/// batch, not per call.  With a wakeup per call the Python thread's work
/// competed with the agents and the upstream for the cores on every call
/// (benches/README.md); 5 ms bounds what a batch holds to 5 ms of calls.
pub const RELEASED_RECORD_DELAY: Duration = Duration::from_millis(5);

/// Write the wakeup fd [`RELEASED_RECORD_DELAY`] from now (at once outside
/// a runtime: a call dropped while the runtime shuts down).
fn wake_later(sh: &Arc<Shared>) {
    match tokio::runtime::Handle::try_current() {
        Ok(rt) => {
            let sh = Arc::clone(sh);
            rt.spawn(async move {
                tokio::time::sleep(RELEASED_RECORD_DELAY).await;
                sh.queue.wake();
            });
        }
        Err(_) => sh.queue.wake(),
    }
}

/// The control plane's verdict on a recorded call; a release (shutdown, or
/// `release_all`) delivers the bytes as they are.
async fn wait(ack: Option<oneshot::Receiver<Verdict>>) -> Verdict {
    match ack {
        Some(rx) => rx.await.unwrap_or_default(),
        None => Verdict::Deliver,
    }
}

/// Read a whole upstream answer, each chunk within `timeout`, at most `limit` bytes.
async fn read_whole(answer: Answer, timeout: Duration, limit: usize) -> Result<Bytes, crate::upstream::UpstreamError> {
    use crate::upstream::UpstreamError;
    let mut body = answer.response.into_body();
    let mut buf = BytesMut::new();
    loop {
        match tokio::time::timeout(timeout, body.frame()).await {
            Err(_) => return Err(UpstreamError::Timeout),
            Ok(None) => return Ok(buf.freeze()),
            Ok(Some(Err(e))) => return Err(UpstreamError::Failed(format!("upstream answer cut: {}", error_chain(&e)))),
            Ok(Some(Ok(f))) => {
                if let Ok(d) = f.into_data() {
                    if buf.len() + d.len() > limit {
                        return Err(UpstreamError::Failed(format!("upstream answer over {limit} bytes")));
                    }
                    buf.extend_from_slice(&d);
                }
            }
        }
    }
}
