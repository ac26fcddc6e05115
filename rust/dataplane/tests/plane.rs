//! The data plane end to end on loopback: a real server, a tiny hyper
//! upstream in the test, a hyper client.  No wall-clock assertion: waits
//! are for a condition (bounded, failing with a message), and the one
//! "not yet" check (the held terminal event) can only pass wrongly, never fail
//! wrongly, on a slow machine.
#![cfg(not(loom))]

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body::{Body, Frame};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use lowwater_dataplane::{Config, DataPlane, Stats, TurnRecord};
use tokio::sync::mpsc;

#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOC: lowwater_dataplane::Allocator = lowwater_dataplane::Allocator;

const UPSTREAM_KEY: &str = "upstream-key";

// --- the test's upstream ------------------------------------------------------

/// Hanging upstream streams the plane has let go of (the process's count).
static HUNG_STREAMS_DROPPED: AtomicU64 = AtomicU64::new(0);

/// A body fed from a channel (the upstream's SSE streams).
struct ChanBody(mpsc::Receiver<Bytes>);

impl Body for ChanBody {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|c| c.map(|b| Ok(Frame::data(b))))
    }
}

type UpBody = http_body_util::Either<Full<Bytes>, ChanBody>;

fn full(status: u16, ct: &'static str, body: impl Into<Bytes>) -> Response<UpBody> {
    let mut r = Response::new(UpBody::Left(Full::new(body.into())));
    *r.status_mut() = StatusCode::from_u16(status).unwrap();
    r.headers_mut().insert("content-type", HeaderValue::from_static(ct));
    r
}

/// `count_drop`: count the plane letting go of the hanging stream in
/// `HUNG_STREAMS_DROPPED` (one test's model only, as tests run in parallel).
fn sse(events: Vec<&'static str>, then_hang: bool, count_drop: bool) -> Response<UpBody> {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        for e in events {
            if tx.send(Bytes::from_static(e.as_bytes())).await.is_err() {
                return;
            }
        }
        if then_hang {
            tx.closed().await; // hold the stream open until the plane drops it
            if count_drop {
                HUNG_STREAMS_DROPPED.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    let mut r = Response::new(UpBody::Right(ChanBody(rx)));
    r.headers_mut().insert("content-type", HeaderValue::from_static("text/event-stream"));
    r
}

/// Behaviour by the request's `model`: `echo`, `stream`, `hang`,
/// `stream-hang`, `stream-quiet` (as `stream-hang`, counted), `fail` (500), `jitter` (echo after a short varying delay).
async fn upstream_answer(req: Request<Incoming>, n: Arc<AtomicU64>) -> Response<UpBody> {
    let auth = req.headers().get("authorization").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let path = req.uri().path().to_string();
    let body = req.into_body().collect().await.unwrap().to_bytes();
    if auth != format!("Bearer {UPSTREAM_KEY}") {
        return full(401, "application/json", format!("{{\"error\":\"upstream saw {auth:?}\"}}"));
    }
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let model = v["model"].as_str().unwrap_or("").to_string();
    match model.as_str() {
        "stream" => sse(vec!["data: {\"i\":1}\n\n", "data: {\"i\":2}\n\n", "data: [DONE]\n\n"], false, false),
        "stream-hang" => sse(vec!["data: {\"i\":1}\n\n"], true, false),
        "stream-quiet" => sse(vec!["data: {\"i\":1}\n\n"], true, true),
        "hang" => std::future::pending().await,
        "fail" => full(500, "application/json", "{\"error\":\"boom\"}"),
        "not-json" => full(200, "application/json", "{\"cut"),
        "stream-bad" => sse(vec!["data: {\"i\":1}\n\n", "data: {\"i\"\n\n", "data: [DONE]\n\n"], false, false),
        _ => {
            if model == "jitter" {
                let k = n.fetch_add(1, Ordering::Relaxed) % 5;
                tokio::time::sleep(Duration::from_micros(200 * k)).await;
            }
            full(200, "application/json", format!("{{\"path\":{path:?},\"model\":{model:?}}}"))
        }
    }
}

/// Start the upstream on `rt`; its base URL.
fn start_upstream(rt: &tokio::runtime::Runtime) -> String {
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    let n = Arc::new(AtomicU64::new(0));
    rt.spawn(async move {
        loop {
            let (s, _) = listener.accept().await.unwrap();
            let n = Arc::clone(&n);
            tokio::spawn(async move {
                let svc = service_fn(move |req| {
                    let n = Arc::clone(&n);
                    async move { Ok::<_, Infallible>(upstream_answer(req, n).await) }
                });
                let _ = http1::Builder::new().serve_connection(TokioIo::new(s), svc).await;
            });
        }
    });
    format!("http://{addr}/v1")
}

// --- harness -----------------------------------------------------------------------

struct Harness {
    rt: tokio::runtime::Runtime,
    plane: Arc<DataPlane>,
    client: Client<HttpConnector, Full<Bytes>>,
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn harness(tweak: impl FnOnce(&mut Config)) -> Harness {
    let rt = runtime();
    let mut config = Config::new(start_upstream(&rt));
    config.upstream_key = Some(UPSTREAM_KEY.into());
    config.retries = 0;
    tweak(&mut config);
    let plane = Arc::new(DataPlane::start(config, "127.0.0.1:0".parse().unwrap()).unwrap());
    let client = Client::builder(TokioExecutor::new()).build_http();
    Harness { rt, plane, client }
}

impl Drop for Harness {
    fn drop(&mut self) {
        // The upstream's hanging handlers must not hold the test's exit.
        std::mem::replace(&mut self.rt, runtime()).shutdown_background();
    }
}

fn request(addr: SocketAddr, path: &str, headers: &[(&str, &str)], body: impl Into<Bytes>) -> Request<Full<Bytes>> {
    let mut b = Request::post(format!("http://{addr}{path}")).header("content-type", "application/json");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Full::new(body.into())).unwrap()
}

fn chat_body(model: &str, stream: bool, contents: &[&str]) -> String {
    let msgs: Vec<_> = contents.iter().map(|c| serde_json::json!({"role": "user", "content": c})).collect();
    serde_json::json!({"model": model, "stream": stream, "messages": msgs}).to_string()
}

impl Harness {
    fn addr(&self) -> SocketAddr {
        self.plane.local_addr()
    }

    /// POST and read the whole answer.
    fn call(&self, req: Request<Full<Bytes>>) -> (u16, HeaderMap, Bytes) {
        let c = self.client.clone();
        self.rt.block_on(async move {
            let r = c.request(req).await.unwrap();
            let (parts, body) = r.into_parts();
            (parts.status.as_u16(), parts.headers, body.collect().await.unwrap().to_bytes())
        })
    }

    fn chat(&self, secret: &str, model: &str, contents: &[&str]) -> (u16, Bytes) {
        let auth = format!("Bearer {secret}");
        let (s, _, b) = self.call(request(
            self.addr(),
            "/v1/chat/completions",
            &[("authorization", &auth)],
            chat_body(model, false, contents),
        ));
        (s, b)
    }

    /// Wait (bounded) until `cond` holds on the stats.
    fn wait_stats(&self, what: &str, cond: impl Fn(&Stats) -> bool) -> Stats {
        for _ in 0..2000 {
            let s = self.plane.stats();
            if cond(&s) {
                return s;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("{what}: never reached; stats {:?}", self.plane.stats());
    }
}

/// Wait for the wakeup fd, then drain (bounded).
fn next_records(plane: &DataPlane) -> Vec<TurnRecord> {
    for _ in 0..200 {
        let mut p = libc::pollfd { fd: plane.queue().wakeup_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut p, 1, 50) };
        let got = plane.queue().drain();
        if !got.is_empty() {
            return got;
        }
    }
    panic!("no record arrived");
}

/// A control plane stand-in: drains on wakeup, keeps the records, acks each.
struct Acker {
    stop: Arc<AtomicBool>,
    records: Arc<Mutex<Vec<TurnRecord>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Acker {
    fn start(plane: &Arc<DataPlane>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let records = Arc::new(Mutex::new(Vec::new()));
        let (plane, s, r) = (Arc::clone(plane), Arc::clone(&stop), Arc::clone(&records));
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let mut p = libc::pollfd { fd: plane.queue().wakeup_fd(), events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid pollfd.
                unsafe { libc::poll(&mut p, 1, 20) };
                for rec in plane.queue().drain() {
                    let seq = rec.seq;
                    r.lock().unwrap().push(rec); // kept before the ack releases the call
                    plane.queue().ack(seq);
                }
            }
        });
        Acker { stop, records, thread: Some(thread) }
    }

    fn take(&self) -> Vec<TurnRecord> {
        std::mem::take(&mut *self.records.lock().unwrap())
    }
}

impl Drop for Acker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = self.thread.take().unwrap().join();
    }
}

fn json(b: &[u8]) -> serde_json::Value {
    serde_json::from_slice(b).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(b)))
}

// --- tests -------------------------------------------------------------------------

#[test]
fn forwards_records_and_hands_over_only_new_messages() {
    let h = harness(|_| {});
    let acker = Acker::start(&h.plane);
    h.plane.register("r1", "s1").unwrap();
    let (status, body) = h.chat("s1", "echo", &["hi"]);
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    let answer = json(&body);
    assert_eq!(answer["path"], "/v1/chat/completions", "the upstream's own path under its base URL");
    assert_eq!(answer["model"], "echo");
    let (status, _) = h.chat("s1", "echo", &["hi", "again", "more"]);
    assert_eq!(status, 200);
    // A rewrite: the first message changed.
    assert_eq!(h.chat("s1", "echo", &["HI", "again"]).0, 200);
    h.wait_stats("three records acked", |s| s.ok == 3 && s.awaiting_ack == 0);
    let recs = acker.take();
    assert_eq!(recs.len(), 3);
    let (a, b, c) = (&recs[0], &recs[1], &recs[2]);
    assert_eq!(&*a.rollout_id, "r1");
    assert_eq!(h.plane.protocols().get(a.protocol).unwrap().name, "openai.chat");
    assert_eq!((a.status, a.streamed, a.model.as_str()), (200, false, "echo"));
    assert_eq!(a.response, body_of("echo"), "the record holds the answer's bytes");
    assert_eq!((a.request.kept, a.request.previous, a.request.messages.len()), (0, 0, 1));
    assert_eq!(json(&a.request.messages[0])["content"], "hi");
    assert_eq!((b.request.kept, b.request.previous), (1, 1), "only the new messages are handed over");
    let contents: Vec<_> = b.request.messages.iter().map(|m| json(m)["content"].clone()).collect();
    assert_eq!(contents, ["again", "more"]);
    assert_eq!((c.request.kept, c.request.previous, c.request.messages.len()), (0, 3, 2), "a rewrite");
    assert!(a.timings.started_s > 1.0e9 && a.timings.duration_s >= a.timings.upstream_s);
    assert!(a.error.is_none());
    assert_eq!(h.plane.unregister("r1"), Some(0));
}

#[test]
fn records_carry_the_tools_offered_as_sent() {
    let h = harness(|_| {});
    let acker = Acker::start(&h.plane);
    h.plane.register("r1", "s1").unwrap();
    let tools = r#"[{"type":"function","function":{"name":"add","parameters":{}}}]"#;
    let with = format!(r#"{{"model":"echo","messages":[{{"role":"user","content":"hi"}}],"tools":{tools}}}"#);
    for body in [with, chat_body("echo", false, &["hi", "again"])] {
        let (status, _, _) = h.call(request(h.addr(), "/v1/chat/completions", &[("x-api-key", "s1")], body));
        assert_eq!(status, 200);
    }
    h.wait_stats("two records acked", |s| s.ok == 2 && s.awaiting_ack == 0);
    let recs = acker.take();
    let expected = format!(r#"{{"tools":{tools}}}"#);
    assert_eq!(recs[0].tools.as_deref(), Some(expected.as_bytes()), "the tools field's bytes as sent");
    assert_eq!(recs[1].tools, None, "a call offering no tools");
}

fn body_of(model: &str) -> Bytes {
    Bytes::from(format!("{{\"path\":\"/v1/chat/completions\",\"model\":{model:?}}}"))
}

#[test]
fn refusals_are_4xx_with_protocol_shaped_bodies() {
    let h = harness(|c| c.max_body_bytes = 1024);
    h.plane.register("r1", "s1").unwrap();
    h.plane.register("r2", "s2").unwrap();
    let a = h.addr();
    let ok_body = chat_body("echo", false, &["hi"]);
    let cases: Vec<(Request<Full<Bytes>>, u16, &str)> = vec![
        (request(a, "/v1/chat/completions", &[], ok_body.clone()), 401, "missing API key"),
        (request(a, "/v1/chat/completions", &[("authorization", "Bearer nope")], ok_body.clone()), 401, "unknown"),
        (
            request(a, "/v1/chat/completions", &[("authorization", "Bearer s1"), ("x-api-key", "s2")], ok_body.clone()),
            401,
            "two rollouts",
        ),
        (request(a, "/v1/chat/completions", &[("x-api-key", "s1")], "{not json"), 400, "malformed JSON"),
        (
            request(a, "/v1/chat/completions", &[("x-api-key", "s1")], "{\"model\":\"m\"}"),
            400,
            "missing field 'messages'",
        ),
        (request(a, "/v1/chat/completions", &[("x-api-key", "s1")], vec![b' '; 4096]), 413, "over the limit"),
        (request(a, "/v1/nope", &[("x-api-key", "s1")], ok_body.clone()), 404, "no route"),
    ];
    for (req, status, why) in cases {
        let (got, headers, body) = h.call(req);
        assert_eq!(got, status, "{why}: {}", String::from_utf8_lossy(&body));
        let v = json(&body);
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(why), "{why}: {msg}");
        if status == 401 || status == 413 {
            assert_eq!(headers.get("connection").unwrap(), "close", "answered before the body was read");
        }
    }
    // Anthropic-shaped errors on its route.
    let (got, _, body) = h.call(request(a, "/v1/messages", &[("x-api-key", "nope")], "{}"));
    assert_eq!(got, 401);
    assert_eq!(json(&body)["type"], "error");
    assert_eq!(json(&body)["error"]["type"], "authentication_error");
    // Not a POST: 405 with allow.
    let c = h.client.clone();
    let (got, allow) = h.rt.block_on(async move {
        let req = Request::get(format!("http://{a}/v1/chat/completions")).body(Full::new(Bytes::new())).unwrap();
        let r = c.request(req).await.unwrap();
        (r.status().as_u16(), r.headers().get("allow").cloned())
    });
    assert_eq!((got, allow.unwrap()), (405, HeaderValue::from_static("POST")));
    let s = h.plane.stats();
    assert_eq!((s.ok, s.failed, s.queued), (0, 0, 0), "refusals are not recorded");
}

#[test]
fn upstream_failures_are_502_and_504_and_recorded() {
    let h = harness(|c| c.upstream_timeout = Duration::from_millis(300));
    let acker = Acker::start(&h.plane);
    h.plane.register("r", "s").unwrap();
    let (status, body) = h.chat("s", "fail", &["x"]);
    assert_eq!(status, 502, "a 5xx after the retries");
    assert!(json(&body)["error"]["message"].as_str().unwrap().contains("upstream answered 500"));
    let (status, body) = h.chat("s", "hang", &["x"]);
    assert_eq!(status, 504, "{}", String::from_utf8_lossy(&body));
    h.wait_stats("two failures recorded", |s| s.failed == 2 && s.awaiting_ack == 0);
    let recs = acker.take();
    assert_eq!(recs.iter().map(|r| r.status).collect::<Vec<_>>(), [502, 504]);
    assert!(recs.iter().all(|r| r.error.is_some()));
    assert_eq!(recs[0].response, Bytes::from_static(b"{\"error\":\"boom\"}"), "the upstream's body is kept");

    // Nothing listening upstream: 502 at once.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}/v1", dead.local_addr().unwrap());
    drop(dead);
    let h2 = harness(|c| c.upstream = dead_url);
    let _acker2 = Acker::start(&h2.plane);
    h2.plane.register("r", "s").unwrap();
    let (status, body) = h2.chat("s", "echo", &["x"]);
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&body));
}

/// An upstream that resets its first `resets` connections once it has the
/// request's head (SO_LINGER 0: an RST, as a crashed or overloaded server
/// gives), then answers 200 on the next; its URL.
fn resetting_upstream(resets: usize) -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    std::thread::spawn(move || {
        for (i, conn) in listener.incoming().enumerate() {
            let Ok(mut conn) = conn else { return };
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf);
            if i < resets {
                socket_linger_zero(&conn);
                drop(conn);
                continue;
            }
            let body = r#"{"choices":[{"message":{"role":"assistant","content":"4"}}]}"#;
            let answer = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            let _ = conn.write_all(answer.as_bytes());
        }
    });
    url
}

/// SO_LINGER with a zero timeout on `conn`, so closing it sends an RST.
fn socket_linger_zero(conn: &std::net::TcpStream) {
    use std::os::fd::AsRawFd;
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: a valid socket fd and a correctly sized option value.
    unsafe {
        libc::setsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            std::ptr::addr_of!(linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

/// One chat call through a plane with one retry in front of
/// [`resetting_upstream`]`(resets)`: its status, body and the plane's stats.
fn call_with_one_retry(resets: usize) -> (u16, Bytes, Stats) {
    let h = harness(|c| {
        c.upstream = resetting_upstream(resets);
        c.retries = 1;
        c.backoff = Duration::ZERO;
    });
    let _acker = Acker::start(&h.plane);
    h.plane.register("r", "s").unwrap();
    let (status, body) = h.chat("s", "echo", &["x"]);
    (status, body, h.plane.stats())
}

#[test]
fn a_reset_before_the_answer_is_retried_and_the_last_one_is_502() {
    // Retried: the agent saw nothing yet (the Python client retried a
    // ReadError too); a load spike's resets must not fail the rollout.
    let (status, body, stats) = call_with_one_retry(1);
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!((stats.upstream_requests, stats.upstream_retried), (2, 1));

    // Out of retries: the reset is a 502 naming it.
    let (status, body, _) = call_with_one_retry(2);
    assert_eq!(status, 502, "{}", String::from_utf8_lossy(&body));
    assert!(json(&body)["error"]["message"].as_str().unwrap().contains("upstream unreachable"));
}

/// Read a streamed answer's frames on `rt` into a channel, so the test can
/// check what has arrived so far.
fn stream_frames(h: &Harness, req: Request<Full<Bytes>>) -> (u16, mpsc::UnboundedReceiver<Bytes>) {
    let c = h.client.clone();
    let (tx, rx) = mpsc::unbounded_channel();
    let status = h.rt.block_on(async move {
        let r = c.request(req).await.unwrap();
        let status = r.status().as_u16();
        let mut body = r.into_body();
        tokio::spawn(async move {
            while let Some(Ok(f)) = body.frame().await {
                if let Ok(d) = f.into_data() {
                    let _ = tx.send(d);
                }
            }
        });
        status
    });
    (status, rx)
}

/// Send `req` on `rt` in the background; its status once answered.
fn spawn_call(h: &Harness, req: Request<Full<Bytes>>) -> tokio::task::JoinHandle<u16> {
    let c = h.client.clone();
    h.rt.spawn(async move {
        let r = c.request(req).await.unwrap();
        let status = r.status().as_u16();
        let _ = r.into_body().collect().await;
        status
    })
}

fn read_until(h: &Harness, rx: &mut mpsc::UnboundedReceiver<Bytes>, seen: &mut Vec<u8>, needle: &str) {
    h.rt.block_on(async {
        while !String::from_utf8_lossy(seen).contains(needle) {
            let chunk = tokio::time::timeout(Duration::from_secs(10), rx.recv()).await;
            match chunk {
                Ok(Some(c)) => seen.extend_from_slice(&c),
                _ => panic!("stream ended before {needle:?}: {}", String::from_utf8_lossy(seen)),
            }
        }
    });
}

#[test]
fn a_client_leaving_a_quiet_stream_ends_the_upstream_call_and_is_recorded() {
    use std::io::{Read, Write};
    let h = harness(|_| {});
    let acker = Acker::start(&h.plane);
    h.plane.register("r", "s").unwrap();
    let dropped = HUNG_STREAMS_DROPPED.load(Ordering::Relaxed);
    let body = chat_body("stream-quiet", true, &["hi"]);
    let mut agent = std::net::TcpStream::connect(h.addr()).unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: plane\r\ncontent-type: application/json\r\n\
         authorization: Bearer s\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    agent.write_all(head.as_bytes()).unwrap();
    agent.write_all(body.as_bytes()).unwrap();
    agent.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("{\"i\":1}") {
        let mut buf = [0u8; 1024];
        let n = agent.read(&mut buf).expect("the first event within 10 s");
        assert!(n > 0, "the plane closed: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    // The upstream is now quiet (it sent its one event and hangs): the agent
    // leaves, and nothing more will be sent that could notice it.
    drop(agent);
    h.wait_stats("the call recorded as disconnected", |s| s.disconnected == 1 && s.in_flight == 0);
    for _ in 0..2000 {
        if HUNG_STREAMS_DROPPED.load(Ordering::Relaxed) > dropped {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(HUNG_STREAMS_DROPPED.load(Ordering::Relaxed) > dropped, "the upstream call still open");
    h.wait_stats("the record drained", |s| s.queued == 0 && s.awaiting_ack == 0);
    let recs = acker.take();
    assert_eq!(recs.len(), 1);
    assert_eq!(recs[0].error.as_deref(), Some("the client disconnected before the answer was complete"));
}

#[test]
fn stream_relays_events_and_holds_the_terminal_one_until_acked() {
    let h = harness(|_| {});
    h.plane.register("r", "s").unwrap();
    let body = chat_body("stream", true, &["hi"]);
    let req = request(h.addr(), "/v1/chat/completions", &[("authorization", "Bearer s")], body);
    let (status, mut rx) = stream_frames(&h, req);
    assert_eq!(status, 200);
    let mut seen = Vec::new();
    read_until(&h, &mut rx, &mut seen, "{\"i\":2}");
    let recs = next_records(&h.plane);
    assert_eq!(recs.len(), 1);
    let rec = &recs[0];
    assert!(rec.streamed && rec.error.is_none());
    assert_eq!(&rec.response[..], b"data: {\"i\":1}\n\ndata: {\"i\":2}\n\ndata: [DONE]\n\n");
    // Recorded, not acked: the terminal event has not gone out.
    let early = h.rt.block_on(async { tokio::time::timeout(Duration::from_millis(200), rx.recv()).await });
    assert!(early.is_err(), "the terminal event was released before the ack: {early:?}");
    assert!(!String::from_utf8_lossy(&seen).contains("[DONE]"));
    assert_eq!(h.plane.stats().awaiting_ack, 1);
    assert!(h.plane.queue().ack(rec.seq));
    read_until(&h, &mut rx, &mut seen, "data: [DONE]\n\n");
    assert_eq!(&seen[..], &rec.response[..], "the agent got exactly the upstream's events");
    h.wait_stats("the relay ended", |s| s.active_calls == 0 && s.ok == 1);
}

/// With `release_when_readable`, a call whose answer is JSON goes out without
/// the ack and its record still reaches the queue (its batch's wakeup comes
/// within `RELEASED_RECORD_DELAY`); one the control plane may fail waits.
#[test]
fn readable_answers_go_out_without_the_ack_and_others_wait_for_it() {
    let h = harness(|c| c.release_when_readable = true);
    h.plane.register("r", "s").unwrap();
    // Nobody acks: a held call would hang, so each call is bounded.
    let bounded = |req: Request<Full<Bytes>>| {
        let c = h.client.clone();
        h.rt.block_on(async move {
            tokio::time::timeout(Duration::from_secs(10), async move {
                let r = c.request(req).await.unwrap();
                let status = r.status().as_u16();
                (status, r.into_body().collect().await.unwrap().to_bytes())
            })
            .await
            .expect("a readable answer waited for the ack")
        })
    };
    let chat = |model: &str, stream: bool| {
        request(h.addr(), "/v1/chat/completions", &[("authorization", "Bearer s")], chat_body(model, stream, &["hi"]))
    };
    let (status, body) = bounded(chat("echo", false));
    assert_eq!((status, body), (200, body_of("echo")));
    let (status, body) = bounded(chat("stream", true));
    assert_eq!(status, 200);
    assert_eq!(&body[..], b"data: {\"i\":1}\n\ndata: {\"i\":2}\n\ndata: [DONE]\n\n");
    // An upstream failure: no verdict changes it.
    h.plane.register("f", "sf").unwrap();
    let req =
        request(h.addr(), "/v1/chat/completions", &[("authorization", "Bearer sf")], chat_body("fail", false, &["x"]));
    assert_eq!(bounded(req).0, 502);
    let mut recs = Vec::new();
    while recs.len() < 3 {
        recs.extend(next_records(&h.plane));
    }
    assert_eq!(recs.iter().map(|r| r.status).collect::<Vec<_>>(), [200, 200, 502]);
    assert_eq!((h.plane.stats().awaiting_ack, h.plane.stats().released), (0, 3));

    // Not JSON: held for the control plane's verdict, as without the option.
    let mut answer = spawn_call(&h, chat("not-json", false));
    let rec = next_records(&h.plane).remove(0);
    assert_eq!(h.plane.stats().awaiting_ack, 1);
    let early = h.rt.block_on(async { tokio::time::timeout(Duration::from_millis(200), &mut answer).await });
    assert!(early.is_err(), "an unreadable answer went out before its verdict: {early:?}");
    assert!(h.plane.queue().fail(rec.seq, 502, "not a response object"));
    assert_eq!(h.rt.block_on(answer).unwrap(), 502);
    h.wait_stats("the failed call ended", |s| s.awaiting_ack == 0 && s.active_calls == 0);
    // A stream with an event that is not JSON: its terminal event waits too.
    let (status, mut rx) = stream_frames(&h, chat("stream-bad", true));
    assert_eq!(status, 200);
    let mut seen = Vec::new();
    read_until(&h, &mut rx, &mut seen, "{\"i\"\n\n");
    let rec = next_records(&h.plane).remove(0);
    let early = h.rt.block_on(async { tokio::time::timeout(Duration::from_millis(200), rx.recv()).await });
    assert!(early.is_err(), "the terminal event went out before the verdict: {early:?}");
    assert!(h.plane.queue().ack(rec.seq));
    read_until(&h, &mut rx, &mut seen, "data: [DONE]\n\n");
    let s = h.wait_stats("the stream ended", |s| s.awaiting_ack == 0 && s.active_calls == 0);
    assert_eq!(s.released, 3, "the two held calls are not counted");
}

/// A protocol whose reader may fail on odd JSON keeps every answer for the verdict.
#[test]
fn a_protocol_that_does_not_read_any_json_is_always_held() {
    let h = harness(|c| {
        c.release_when_readable = true;
        let mut chat = lowwater_dataplane::ProtocolSpec::openai_chat();
        chat.reads_any_json = false;
        c.protocols = lowwater_dataplane::ProtocolTable::new(vec![chat]).unwrap();
    });
    h.plane.register("r", "s").unwrap();
    let req =
        request(h.addr(), "/v1/chat/completions", &[("authorization", "Bearer s")], chat_body("echo", false, &["hi"]));
    let mut answer = spawn_call(&h, req);
    let rec = next_records(&h.plane).remove(0);
    assert_eq!(h.plane.stats().awaiting_ack, 1);
    let early = h.rt.block_on(async { tokio::time::timeout(Duration::from_millis(200), &mut answer).await });
    assert!(early.is_err(), "released without the verdict: {early:?}");
    assert!(h.plane.queue().ack(rec.seq));
    assert_eq!(h.rt.block_on(answer).unwrap(), 200);
    h.wait_stats("the call ended", |s| s.awaiting_ack == 0 && s.active_calls == 0);
}

#[test]
fn unregister_answers_a_pending_call_410_at_once() {
    let h = harness(|_| {});
    h.plane.register("r", "s").unwrap();
    let c = h.client.clone();
    let req =
        request(h.addr(), "/v1/chat/completions", &[("authorization", "Bearer s")], chat_body("hang", false, &["x"]));
    let pending = h.rt.spawn(async move {
        let r = c.request(req).await.unwrap();
        let status = r.status().as_u16();
        (status, r.into_body().collect().await.unwrap().to_bytes())
    });
    h.wait_stats("the call is in flight", |s| s.in_flight == 1);
    assert_eq!(h.plane.unregister("r"), Some(1));
    let (status, body) = h.rt.block_on(pending).unwrap();
    assert_eq!(status, 410);
    assert!(json(&body)["error"]["message"].as_str().unwrap().contains("closed"));
    let s = h.wait_stats("the call ended", |s| s.active_calls == 0);
    assert_eq!((s.closed, s.queued, s.in_flight, s.open_rollouts, s.secrets), (1, 0, 0, 0, 0));
    // The secret is gone with the rollout.
    assert_eq!(h.chat("s", "echo", &["x"]).0, 401);
}

#[test]
fn unregister_breaks_a_stream_under_way_with_an_error_event() {
    let h = harness(|_| {});
    h.plane.register("r", "s").unwrap();
    let body = chat_body("stream-hang", true, &["hi"]);
    let req = request(h.addr(), "/v1/chat/completions", &[("authorization", "Bearer s")], body);
    let (status, mut rx) = stream_frames(&h, req);
    assert_eq!(status, 200);
    let mut seen = Vec::new();
    read_until(&h, &mut rx, &mut seen, "{\"i\":1}");
    assert_eq!(h.plane.unregister("r"), Some(1));
    read_until(&h, &mut rx, &mut seen, "event: error");
    let end = h.rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(c) = rx.recv().await {
                seen.extend_from_slice(&c);
            }
        })
        .await
    });
    assert!(end.is_ok(), "the stream ended after its error event");
    let text = String::from_utf8_lossy(&seen);
    assert!(text.contains("was closed") && !text.contains("[DONE]"), "{text}");
    let s = h.wait_stats("the relay ended", |s| s.active_calls == 0);
    assert_eq!((s.closed, s.queued, s.ok), (1, 0, 0), "a broken-off stream is not recorded");
}

/// Unregister racing in-flight calls, many times over: each call is either
/// answered and recorded exactly once, or answered 410 (or, for a stream,
/// broken off) and not recorded.  Never both, never neither.
#[test]
fn unregister_racing_calls_is_recorded_xor_refused() {
    let h = harness(|_| {});
    let acker = Acker::start(&h.plane);
    let rounds = 60;
    let mut outcomes: HashMap<String, (u16, bool)> = HashMap::new();
    for i in 0..rounds {
        let (id, secret) = (format!("r{i}"), format!("s{i}"));
        h.plane.register(&id, &secret).unwrap();
        let stream = i % 3 == 0;
        let model = if stream { "stream" } else { "jitter" };
        let req = request(
            h.addr(),
            "/v1/chat/completions",
            &[("authorization", &format!("Bearer {secret}"))],
            chat_body(model, stream, &["x"]),
        );
        let c = h.client.clone();
        let call = h.rt.spawn(async move {
            let r = c.request(req).await.unwrap();
            let status = r.status().as_u16();
            // A broken-off stream ends in an error after its last frame: keep what came.
            let mut body = r.into_body();
            let mut got = Vec::new();
            while let Some(Ok(f)) = body.frame().await {
                if let Ok(d) = f.into_data() {
                    got.extend_from_slice(&d);
                }
            }
            (status, Bytes::from(got))
        });
        // Let the call get somewhere between "not yet begun" and "answered".
        std::thread::sleep(Duration::from_micros(150 * (i % 7) as u64));
        h.plane.unregister(&id);
        let (status, body) = h.rt.block_on(call).unwrap();
        let text = String::from_utf8_lossy(&body).to_string();
        let completed = match status {
            200 if stream => text.contains("[DONE]"),
            200 => true,
            // Refused: the secret was gone (401) or the rollout closed (410).
            401 | 410 => false,
            other => panic!("round {i}: status {other}: {text}"),
        };
        if stream && status == 200 && !completed {
            assert!(text.contains("event: error"), "a broken stream ends in an error event: {text}");
        }
        outcomes.insert(id, (status, completed));
    }
    let s = h.wait_stats("every call ended and was acked", |s| s.active_calls == 0 && s.awaiting_ack == 0);
    let mut kinds: HashMap<(u16, bool), usize> = HashMap::new();
    for o in outcomes.values() {
        *kinds.entry(*o).or_default() += 1;
    }
    eprintln!("outcomes (status, completed) -> count: {kinds:?}; stats {s:?}");
    let mut recorded: HashMap<String, usize> = HashMap::new();
    for r in acker.take() {
        *recorded.entry(r.rollout_id.to_string()).or_default() += 1;
    }
    for (id, (status, completed)) in &outcomes {
        let n = recorded.get(id).copied().unwrap_or(0);
        assert_eq!(n, usize::from(*completed), "{id}: status {status}, completed {completed}, {n} records");
    }
    assert_eq!((s.open_rollouts, s.secrets, s.in_flight, s.queued), (0, 0, 0, 0));
}

#[test]
fn tables_are_empty_after_many_rollouts() {
    let h = harness(|_| {});
    let acker = Acker::start(&h.plane);
    let n = 64;
    for i in 0..n {
        let (id, secret) = (format!("r{i}"), format!("s{i}"));
        h.plane.register(&id, &secret).unwrap();
        assert_eq!(h.chat(&secret, "echo", &["a"]).0, 200);
        assert_eq!(h.chat(&secret, "echo", &["a", "b"]).0, 200);
        assert_eq!(h.plane.unregister(&id), Some(0));
    }
    let s = h.wait_stats("every call ended", |s| s.active_calls == 0 && s.awaiting_ack == 0);
    assert_eq!(
        (s.open_rollouts, s.secrets, s.in_flight, s.queued, s.awaiting_ack, s.calls, s.ok, s.failed, s.closed),
        (0, 0, 0, 0, 0, 2 * n, 2 * n, 0, 0)
    );
    assert_eq!(acker.take().len(), 2 * n as usize);
    // Every body was held in the table for its call, and none is left.
    let t = h.plane.table().stats();
    assert_eq!((t.entries, t.bytes, t.live_bytes, t.inserts, t.discards, t.open_rollouts), (0, 0, 0, 2 * n, 2 * n, 0));
    assert_eq!((s.intercepts, s.intercept_bytes), (0, 0));
}

#[test]
fn a_pending_call_holds_its_body_in_the_table_until_it_ends() {
    let table = Arc::new(lowwater_dataplane::InterceptTable::new(None, 1 << 20));
    let h = harness(|c| c.table = Some(Arc::clone(&table)));
    h.plane.register("r", "s").unwrap();
    assert!(table.is_open("r"));
    let body = chat_body("hang", false, &["x"]);
    let len = body.len() as u64;
    let c = h.client.clone();
    let req = request(h.addr(), "/v1/chat/completions", &[("authorization", "Bearer s")], body);
    let pending = h.rt.spawn(async move { c.request(req).await.unwrap().status().as_u16() });
    h.wait_stats("the call is in flight", |s| s.in_flight == 1);
    let held = table.rollout_requests("r");
    assert_eq!(held.len(), 1);
    assert_eq!(table.get(&held[0]).unwrap().payload.as_slice().len() as u64, len);
    assert_eq!((h.plane.stats().intercepts, h.plane.stats().intercept_bytes), (1, len));
    // Unregister cancels the call and sweeps (or the call discards) its body.
    h.plane.unregister("r");
    assert_eq!(h.rt.block_on(pending).unwrap(), 410);
    h.wait_stats("the call ended", |s| s.active_calls == 0);
    let t = table.stats();
    assert_eq!((t.entries, t.bytes, t.open_rollouts), (0, 0, 0));
    assert!(!table.is_open("r"));
}

#[test]
fn a_full_table_refuses_the_call_503_with_retry_after() {
    let table = Arc::new(lowwater_dataplane::InterceptTable::new(Some(8), 1 << 20));
    let h = harness(|c| c.table = Some(Arc::clone(&table)));
    h.plane.register("r", "s").unwrap();
    let auth = "Bearer s".to_string();
    let req = request(h.addr(), "/v1/chat/completions", &[("authorization", &auth)], chat_body("echo", false, &["x"]));
    let (status, headers, body) = h.call(req);
    assert_eq!(status, 503);
    assert_eq!(headers.get("retry-after").unwrap(), "1");
    assert!(json(&body)["error"]["message"].as_str().unwrap().contains("intercept table is full"));
    let s = h.wait_stats("the call ended", |s| s.active_calls == 0);
    assert_eq!((s.in_flight, s.queued, s.failed, s.intercepts), (0, 0, 1, 0));
    assert_eq!(table.stats().rejected, 1);
}

#[test]
fn https_upstream_needs_the_tls_feature() {
    let r = DataPlane::start(Config::new("https://example.invalid/v1"), "127.0.0.1:0".parse().unwrap());
    if cfg!(feature = "tls") {
        assert!(r.is_ok());
    } else {
        assert!(matches!(
            r,
            Err(lowwater_dataplane::StartError::Config(lowwater_dataplane::ConfigError::HttpsNeedsTls))
        ));
    }
    assert!(DataPlane::start(Config::new("ftp://x/v1"), "127.0.0.1:0".parse().unwrap()).is_err());
}

/// Whatever a client sends as a body, the answer is a 4xx with a reason,
/// never a 500 and never a hang (a deterministic spread of garbage and
/// near-misses of a valid request).
#[test]
fn garbage_bodies_are_400_never_500() {
    let h = harness(|_| {});
    let _acker = Acker::start(&h.plane); // a near-miss may still be a valid call, held for its ack
    h.plane.register("r", "s").unwrap();
    let valid = chat_body("echo", false, &["hi"]).into_bytes();
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut bodies: Vec<Vec<u8>> = vec![
        Vec::new(),
        b"null".to_vec(),
        b"\"str\"".to_vec(),
        b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\"}]".to_vec(),
        vec![0xff, 0xfe, b'{'],
        format!("{{\"model\":\"m\",\"messages\":{}{}}}", "[".repeat(200), "]".repeat(200)).into_bytes(),
    ];
    for _ in 0..40 {
        let len = (next() % 64) as usize;
        bodies.push((0..len).map(|_| next() as u8).collect());
        // A valid request with one byte changed or cut short.
        let mut near = valid.clone();
        let i = (next() as usize) % near.len();
        near[i] = next() as u8;
        bodies.push(near);
        bodies.push(valid[..(next() as usize) % valid.len()].to_vec());
    }
    for body in bodies {
        let req = request(h.addr(), "/v1/chat/completions", &[("x-api-key", "s")], body.clone());
        let (status, _, answer) = h.call(req);
        let shown = String::from_utf8_lossy(&body).to_string();
        assert!(status == 400 || status == 200, "{status} for {shown:?}");
        if status == 400 {
            assert!(!json(&answer)["error"]["message"].as_str().unwrap().is_empty(), "{shown:?}");
        }
    }
}
