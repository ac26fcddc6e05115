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
use http::header::{ALLOW, CACHE_CONTROL, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

use crate::body::{read_limited, BodyError, ResBody};
use crate::divergence::MessageHasher;
use crate::lifecycle::{CallId, Cancelled};
use crate::protocol::{error_body, ErrorFlavour, ParsedRequest, ProtocolId, ProtocolSpec, ProtocolTable};
use crate::queue::{CompletionQueue, RequestDelta, Timings, TurnRecord};
use crate::rollouts::{Rollout, RolloutTable};
use crate::sse::{Fed, SseSplitter};
use crate::upstream::{error_chain, Answer, Upstream};

/// Request headers that change what the upstream does, passed on as sent.
const FORWARD_HEADERS: [&str; 3] = ["anthropic-version", "anthropic-beta", "openai-beta"];

/// How long a send to a client that does not read may block (the Python
/// server's `SEND_TIMEOUT_S`).
const SEND_TIMEOUT: Duration = Duration::from_secs(60);

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
}

/// What every connection and call shares.
pub(crate) struct Shared {
    pub(crate) rollouts: RolloutTable,
    pub(crate) queue: CompletionQueue,
    pub(crate) protocols: ProtocolTable,
    pub(crate) upstream: Upstream,
    pub(crate) hasher: MessageHasher,
    pub(crate) max_body_bytes: usize,
    pub(crate) max_response_bytes: usize,
    pub(crate) body_read_timeout: Duration,
    pub(crate) hold_for_ack: bool,
    pub(crate) counters: Counters,
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
            let _open = Gauge::new(&sh, |c| &c.connections);
            let svc = service_fn(move |req| {
                let sh = Arc::clone(&sh);
                async move { Ok::<_, Infallible>(handle(sh, req).await) }
            });
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(SEND_TIMEOUT)
                .serve_connection(TokioIo::new(stream), svc);
            let _ = conn.await;
        });
    }
}

fn respond(status: u16, content_type: &'static str, body: impl Into<Bytes>) -> Response<ResBody> {
    let mut r = Response::new(ResBody::full(body));
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    r.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

fn error(flavour: ErrorFlavour, status: u16, reason: &str) -> Response<ResBody> {
    respond(status, "application/json", error_body(flavour, status, reason))
}

/// An answer given before the body was read: the client may still be
/// sending it, so the connection is not reused (a client that reused it got
/// "disconnected without sending a response").
fn closing(mut r: Response<ResBody>) -> Response<ResBody> {
    r.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
    r
}

fn bearer(value: &str) -> Option<&str> {
    let (scheme, key) = value.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
}

/// The open rollout the request's secret belongs to.
fn authenticate(table: &RolloutTable, headers: &HeaderMap) -> Result<Arc<Rollout>, &'static str> {
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

fn forwarded(headers: &HeaderMap) -> Result<HeaderMap, String> {
    let mut out = HeaderMap::new();
    for name in FORWARD_HEADERS {
        for v in headers.get_all(name) {
            if !v.as_bytes().is_ascii() {
                return Err(format!("header {name} must be ASCII"));
            }
            out.append(name, v.clone());
        }
    }
    Ok(out)
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
    let Some((pid, spec)) = sh.protocols.route(req.uri().path()) else {
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
    let declared = content_length(req.headers());
    let body = match read_limited(req.into_body(), declared, sh.max_body_bytes, sh.body_read_timeout).await {
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
    };
    let parsed = match spec.parse(&body) {
        Ok(p) => p,
        Err(bad) => {
            bump(&sh.counters.refused);
            return error(spec.flavour, 400, &bad.0);
        }
    };
    let (cancel_tx, cancel_rx) = oneshot::channel();
    let Ok(id) = rollout.calls.begin(cancel_tx) else {
        bump(&sh.counters.closed);
        return error(spec.flavour, 410, &format!("rollout {} was closed", rollout.id));
    };
    let delta = delta(&sh, &rollout, &body, &parsed);
    let call = Call {
        sh: Arc::clone(&sh),
        rollout,
        id,
        armed: true,
        spec,
        protocol: pid,
        model: parsed.model,
        streamed: parsed.stream,
        delta: Some(delta),
        tools: parsed.tools.map(Bytes::from),
        start,
        started_s,
        _active: active,
    };
    call.run(body, extra, cancel_rx).await
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
    start: Instant,
    started_s: f64,
    /// Counts the call as active until its last byte is handed over.
    _active: Gauge,
}

impl Drop for Call {
    fn drop(&mut self) {
        // The client left (hyper dropped the handler) or the relay ended
        // without a record: the call leaves the rollout's in-flight list.
        if self.armed {
            self.rollout.calls.abandon(self.id);
        }
    }
}

impl Call {
    fn closed(&mut self) -> Response<ResBody> {
        self.armed = false;
        bump(&self.sh.counters.closed);
        error(self.spec.flavour, 410, &format!("rollout {} was closed", self.rollout.id))
    }

    async fn run(mut self, body: Bytes, extra: HeaderMap, mut cancel: oneshot::Receiver<()>) -> Response<ResBody> {
        let sh = Arc::clone(&self.sh);
        let answer = tokio::select! {
            biased;
            _ = &mut cancel => return self.closed(),
            a = sh.upstream.post(&self.spec.path, body, &extra) => a,
        };
        let upstream_s = self.start.elapsed().as_secs_f64();
        let answer = match answer {
            Ok(a) => a,
            Err(e) => {
                let reason = e.reason();
                return match self.commit(e.status(), Bytes::new(), Some(reason.clone()), 0.0) {
                    Err(Cancelled) => self.closed(),
                    Ok(ack) => {
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
            let mut r = Response::new(ResBody::Stream(rx));
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
            Ok(bytes) if status.is_server_error() => (502, bytes, Some(format!("upstream answered {status}"))),
            Ok(bytes) => (status.as_u16(), bytes, None),
            Err(e) => (e.status(), Bytes::new(), Some(e.reason())),
        };
        match self.commit(status, bytes.clone(), err.clone(), upstream_s) {
            Err(Cancelled) => self.closed(),
            Ok(ack) => {
                wait(ack).await;
                if let Some(why) = err {
                    return error(self.spec.flavour, status, &why);
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

    /// Record the turn (under the rollout's lock: see `lifecycle`), returning
    /// what to wait on before the last bytes go out.
    fn commit(
        &mut self,
        status: u16,
        response: Bytes,
        error: Option<String>,
        upstream_s: f64,
    ) -> Result<Option<oneshot::Receiver<()>>, Cancelled> {
        let sh = &self.sh;
        let (ack_tx, ack_rx) = if sh.hold_for_ack {
            let (t, r) = oneshot::channel();
            (Some(t), Some(r))
        } else {
            (None, None)
        };
        let ok = error.is_none() && (200..300).contains(&status);
        let record = TurnRecord {
            seq: sh.queue.next_seq(),
            rollout_id: Arc::clone(&self.rollout.id),
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
        self.rollout.calls.commit(self.id, || queue.push(record, ack_tx))?;
        bump(if ok { &sh.counters.ok } else { &sh.counters.failed });
        Ok(ack_rx)
    }

    /// Relay an upstream stream event by event; hold the terminal event until
    /// the turn is recorded and acked.
    async fn relay(
        mut self,
        answer: Answer,
        mut cancel: oneshot::Receiver<()>,
        tx: mpsc::Sender<Bytes>,
        upstream_s: f64,
    ) {
        let status = answer.response.status().as_u16();
        let timeout = self.sh.upstream.timeout;
        let (response, permit) = (answer.response, answer._permit);
        let mut body = response.into_body();
        let mut split = SseSplitter::new(self.spec.terminal.clone());
        let (mut acc, mut held) = (BytesMut::new(), BytesMut::new());
        let mut error: Option<String> = None;
        loop {
            let frame = tokio::select! {
                biased;
                _ = &mut cancel => return self.stream_closed(&tx).await,
                f = tokio::time::timeout(timeout, body.frame()) => f,
            };
            let data = match frame {
                Err(_) => {
                    error = Some("upstream stream timed out".into());
                    break;
                }
                Ok(None) => break,
                Ok(Some(Err(e))) => {
                    error = Some(format!("upstream stream broke: {}", error_chain(&e)));
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
                    s = tx.send(fed.relay) => s,
                };
                if sent.is_err() {
                    bump(&self.sh.counters.disconnected);
                    return; // the client left: dropping `self` abandons the call
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
            error.get_or_insert_with(|| "the upstream stream ended before its terminal event".into());
        }
        let out = match self.commit(status, acc.freeze(), error.clone(), upstream_s) {
            Err(Cancelled) => return self.stream_closed(&tx).await,
            Ok(ack) => {
                tokio::select! {
                    _ = wait(ack) => {}
                    _ = tx.closed() => return,
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
        let _ = tokio::time::timeout(SEND_TIMEOUT, tx.send(out)).await;
    }

    /// The rollout closed under a stream: an error event, then the end.
    async fn stream_closed(&mut self, tx: &mpsc::Sender<Bytes>) {
        self.armed = false;
        bump(&self.sh.counters.closed);
        let event = self.spec.error_event(&format!("rollout {} was closed", self.rollout.id));
        let _ = tokio::time::timeout(SEND_TIMEOUT, tx.send(event.into())).await;
    }
}

fn keep(fed: &Fed, acc: &mut BytesMut, held: &mut BytesMut) {
    acc.extend_from_slice(&fed.relay);
    if let Some(t) = &fed.terminal {
        acc.extend_from_slice(t);
        held.extend_from_slice(t);
    }
}

async fn wait(ack: Option<oneshot::Receiver<()>>) {
    if let Some(rx) = ack {
        let _ = rx.await; // an ack or a release: either way the bytes go out
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
            Ok(Some(Err(e))) => return Err(UpstreamError::Failed(format!("answer cut: {}", error_chain(&e)))),
            Ok(Some(Ok(f))) => {
                if let Ok(d) = f.into_data() {
                    if buf.len() + d.len() > limit {
                        return Err(UpstreamError::Failed(format!("answer over {limit} bytes")));
                    }
                    buf.extend_from_slice(&d);
                }
            }
        }
    }
}
