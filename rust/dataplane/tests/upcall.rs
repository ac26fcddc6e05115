//! Upcalls end to end on loopback (src/upcall.rs): intercepted calls resumed
//! unchanged or with a new body, rejected, cancelled by `unregister`, left by
//! their client, answered by the plane's close; Python routes.  After each,
//! no upcall is left pending.  No wall-clock assertion: waits are for a
//! condition (bounded, failing with a message).
#![cfg(not(loom))]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use lowwater_dataplane::{
    AnswerError, Config, ConfigError, DataPlane, Intercept, StartError, Stats, TurnRecord, Upcall, UpcallKind,
};

#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOC: lowwater_dataplane::Allocator = lowwater_dataplane::Allocator;

/// The upstream answers `{"got": <the body it received>}`; model `hang` never answers.
async fn upstream_answer(req: Request<Incoming>) -> Response<Full<Bytes>> {
    let body = req.into_body().collect().await.unwrap().to_bytes();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    if v["model"] == "hang" {
        std::future::pending::<()>().await;
    }
    let mut r = Response::new(Full::new(Bytes::from(serde_json::json!({ "got": v }).to_string())));
    r.headers_mut().insert("content-type", HeaderValue::from_static("application/json"));
    r
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

fn start_upstream(rt: &tokio::runtime::Runtime) -> String {
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(async move {
        loop {
            let (s, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let svc = service_fn(|req| async move { Ok::<_, Infallible>(upstream_answer(req).await) });
                let _ = http1::Builder::new().serve_connection(TokioIo::new(s), svc).await;
            });
        }
    });
    format!("http://{addr}/v1")
}

struct Harness {
    rt: tokio::runtime::Runtime,
    plane: Arc<DataPlane>,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Drop for Harness {
    fn drop(&mut self) {
        std::mem::replace(&mut self.rt, runtime()).shutdown_background();
    }
}

fn harness(tweak: impl FnOnce(&mut Config)) -> Harness {
    let rt = runtime();
    let mut config = Config::new(start_upstream(&rt));
    config.retries = 0;
    config.hold_for_ack = false;
    tweak(&mut config);
    let plane = Arc::new(DataPlane::start(config, "127.0.0.1:0".parse().unwrap()).unwrap());
    let client = Client::builder(TokioExecutor::new()).build_http();
    Harness { rt, plane, client }
}

type Answer = (u16, HeaderMap, Bytes);

impl Harness {
    fn addr(&self) -> SocketAddr {
        self.plane.local_addr()
    }

    /// Send `req` on the harness's runtime; the answer's handle.
    fn send(&self, req: Request<Full<Bytes>>) -> tokio::task::JoinHandle<Answer> {
        let c = self.client.clone();
        self.rt.spawn(async move {
            let r = c.request(req).await.unwrap();
            let (parts, body) = r.into_parts();
            (parts.status.as_u16(), parts.headers, body.collect().await.unwrap().to_bytes())
        })
    }

    fn join(&self, h: tokio::task::JoinHandle<Answer>) -> Answer {
        self.rt.block_on(h).unwrap()
    }

    /// The next upcalls (bounded wait on the upcall fd).
    fn upcalls(&self) -> Vec<Upcall> {
        for _ in 0..400 {
            let mut p = libc::pollfd { fd: self.plane.upcalls().wakeup_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            unsafe { libc::poll(&mut p, 1, 50) };
            let got = self.plane.upcalls().drain();
            if !got.is_empty() {
                return got;
            }
        }
        panic!("no upcall arrived; stats {:?}", self.plane.stats());
    }

    fn one_upcall(&self) -> Upcall {
        let mut got = self.upcalls();
        assert_eq!(got.len(), 1, "{got:?}");
        got.pop().unwrap()
    }

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

    fn settled(&self) -> Stats {
        self.wait_stats("every call ended", |s| s.active_calls == 0)
    }

    fn records(&self) -> Vec<TurnRecord> {
        self.plane.queue().drain()
    }
}

fn post(addr: SocketAddr, path: &str, secret: &str, body: impl Into<Bytes>) -> Request<Full<Bytes>> {
    Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .header("authorization", format!("Bearer {secret}"))
        .body(Full::new(body.into()))
        .unwrap()
}

fn chat(model: &str, contents: &[&str]) -> String {
    let msgs: Vec<_> = contents.iter().map(|c| serde_json::json!({"role": "user", "content": c})).collect();
    serde_json::json!({"model": model, "messages": msgs}).to_string()
}

fn json(b: &[u8]) -> serde_json::Value {
    serde_json::from_slice(b).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(b)))
}

const CHAT: &str = "/v1/chat/completions";

#[test]
fn a_resumed_call_forwards_the_agents_bytes_or_the_hooks_and_records_what_was_sent() {
    let h = harness(|c| c.intercept = Intercept::All);
    h.plane.register("r", "s").unwrap();
    // Unchanged.
    let call = h.send(post(h.addr(), CHAT, "s", chat("m", &["hi"])));
    let up = h.one_upcall();
    assert_eq!(up.kind, UpcallKind::Intercept);
    assert_eq!((up.rollout_id.as_deref(), up.protocol.as_deref()), (Some("r"), Some("openai.chat")));
    assert_eq!(json(&up.body)["messages"][0]["content"], "hi");
    assert_eq!(h.plane.stats().pending_upcalls, 1);
    assert_eq!(h.plane.upcalls().resume(up.id, None), Ok(true));
    assert_eq!(h.plane.upcalls().resume(up.id, None), Ok(false), "answered once");
    let (status, _, body) = h.join(call);
    assert_eq!(status, 200);
    assert_eq!(json(&body)["got"]["messages"][0]["content"], "hi");
    // Rewritten: the upstream and the record get the hook's body.
    let call = h.send(post(h.addr(), CHAT, "s", chat("m", &["hi", "secret@example.com"])));
    let up = h.one_upcall();
    let new = chat("m2", &["hi", "<email>"]);
    assert_eq!(h.plane.upcalls().resume(up.id, Some(Bytes::from(new))), Ok(true));
    let (status, _, body) = h.join(call);
    assert_eq!(status, 200);
    assert_eq!(json(&body)["got"]["messages"][1]["content"], "<email>");
    assert_eq!(json(&body)["got"]["model"], "m2");
    let s = h.settled();
    assert_eq!((s.pending_upcalls, s.upcalls, s.ok, s.in_flight), (0, 2, 2, 0));
    let records = h.records();
    assert_eq!(records.len(), 2);
    let r = &records[1];
    assert_eq!(r.model, "m2");
    assert_eq!((r.request.kept, r.request.previous), (1, 1), "the delta is of the body forwarded");
    assert_eq!(json(&r.request.messages[0])["content"], "<email>");
}

#[test]
fn an_intercept_upcall_carries_the_agents_headers_but_not_its_secret() {
    let h = harness(|c| c.intercept = Intercept::All);
    h.plane.register("r", "s").unwrap();
    let mut req = post(h.addr(), CHAT, "s", chat("m", &["hi"]));
    let headers = req.headers_mut();
    headers.insert("x-api-key", HeaderValue::from_static("s"));
    headers.insert("user-agent", HeaderValue::from_static("OpenAI/Python 2.8.1"));
    headers.append("x-trace", HeaderValue::from_static("a"));
    headers.append("x-trace", HeaderValue::from_static("b"));
    let call = h.send(req);
    let up = h.one_upcall();
    let names: Vec<&[u8]> = up.headers.iter().map(|(k, _)| &k[..]).collect();
    assert!(!names.contains(&&b"authorization"[..]) && !names.contains(&&b"x-api-key"[..]), "{names:?}");
    let get = |name: &[u8]| -> Vec<&[u8]> {
        up.headers.iter().filter(|(k, _)| &k[..] == name).map(|(_, v)| &v[..]).collect()
    };
    assert_eq!(get(b"user-agent"), [&b"OpenAI/Python 2.8.1"[..]]);
    assert_eq!(get(b"x-trace"), [&b"a"[..], &b"b"[..]], "repeated headers stay repeated, in order");
    assert_eq!(get(b"content-type"), [&b"application/json"[..]]);
    assert_eq!(h.plane.upcalls().resume(up.id, None), Ok(true));
    assert_eq!(h.join(call).0, 200);
}

#[test]
fn a_broken_rewrite_is_a_400_naming_it_and_nothing_is_recorded() {
    let h = harness(|c| c.intercept = Intercept::All);
    h.plane.register("r", "s").unwrap();
    let call = h.send(post(h.addr(), CHAT, "s", chat("m", &["hi"])));
    let up = h.one_upcall();
    let broken = Bytes::from_static(br#"{"model": 3, "messages": []}"#);
    assert_eq!(h.plane.upcalls().resume(up.id, Some(broken)), Ok(true));
    let (status, _, body) = h.join(call);
    assert_eq!(status, 400);
    let msg = json(&body)["error"]["message"].as_str().unwrap().to_owned();
    assert!(msg.contains("intercepted request") && msg.contains("model"), "{msg}");
    let s = h.settled();
    assert_eq!((s.pending_upcalls, s.refused, s.ok, s.queued), (0, 1, 0, 0));
}

#[test]
fn a_rejected_call_gets_its_status_in_the_protocols_error_body() {
    let h = harness(|c| c.intercept = Intercept::All);
    h.plane.register("r", "s").unwrap();
    let call = h.send(post(h.addr(), CHAT, "s", chat("m", &["hi"])));
    let up = h.one_upcall();
    assert_eq!(h.plane.upcalls().reject(up.id, 200, "no"), Err(AnswerError::Status(200)));
    assert_eq!(h.plane.upcalls().reject(up.id, 600, "no"), Err(AnswerError::Status(600)));
    assert_eq!(
        h.plane.upcalls().respond(up.id, 200, &[], Bytes::new()),
        Err(AnswerError::WrongKind { id: up.id, is: UpcallKind::Intercept })
    );
    assert_eq!(h.plane.stats().pending_upcalls, 1, "a refused answer leaves the upcall waiting");
    assert_eq!(h.plane.upcalls().reject(up.id, 403, "not on my watch"), Ok(true));
    let (status, _, body) = h.join(call);
    assert_eq!(status, 403);
    assert_eq!(json(&body)["error"]["message"], "not on my watch");
    // Anthropic's flavour on its route.
    let anthropic = serde_json::json!({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]});
    let call = h.send(post(h.addr(), "/v1/messages", "s", anthropic.to_string()));
    let up = h.one_upcall();
    assert_eq!(up.protocol.as_deref(), Some("anthropic.messages"));
    assert_eq!(h.plane.upcalls().reject(up.id, 429, "slow down"), Ok(true));
    let (status, _, body) = h.join(call);
    assert_eq!(status, 429);
    let body = json(&body);
    assert_eq!((body["type"].as_str(), body["error"]["message"].as_str()), (Some("error"), Some("slow down")));
    let s = h.settled();
    assert_eq!((s.pending_upcalls, s.refused, s.ok, s.queued, s.in_flight), (0, 2, 0, 0, 0));
}

#[test]
fn intercept_by_protocol_name_leaves_the_others_on_the_fast_path() {
    let h = harness(|c| c.intercept = Intercept::Protocols(vec!["anthropic.messages".into()]));
    h.plane.register("r", "s").unwrap();
    let (status, _, _) = h.join(h.send(post(h.addr(), CHAT, "s", chat("m", &["hi"]))));
    assert_eq!(status, 200);
    assert_eq!(h.settled().upcalls, 0);
    let bad = Config { intercept: Intercept::Protocols(vec!["nope".into()]), ..Config::new("http://127.0.0.1:1/v1") };
    match DataPlane::start(bad, "127.0.0.1:0".parse().unwrap()) {
        Err(StartError::Config(ConfigError::Upcall(why))) => assert!(why.contains("nope"), "{why}"),
        other => panic!("{other:?}"),
    }
    let bad = Config { python_routes: vec!["admin".into()], ..Config::new("http://127.0.0.1:1/v1") };
    assert!(matches!(DataPlane::start(bad, "127.0.0.1:0".parse().unwrap()), Err(StartError::Config(_))));
}

#[test]
fn unregister_answers_a_pending_upcall_410_and_a_later_answer_is_a_no_op() {
    let h = harness(|c| c.intercept = Intercept::All);
    h.plane.register("r", "s").unwrap();
    let call = h.send(post(h.addr(), CHAT, "s", chat("m", &["hi"])));
    let up = h.one_upcall();
    assert_eq!(h.plane.unregister("r"), Some(1), "the waiting upcall is counted");
    assert_eq!(h.plane.stats().pending_upcalls, 0, "removed by unregister itself");
    assert_eq!(h.plane.upcalls().resume(up.id, None), Ok(false));
    assert_eq!(h.plane.upcalls().reject(up.id, 400, "x"), Ok(false));
    let (status, _, body) = h.join(call);
    assert_eq!(status, 410);
    assert!(json(&body)["error"]["message"].as_str().unwrap().contains("closed"));
    let s = h.settled();
    assert_eq!((s.pending_upcalls, s.closed, s.queued, s.in_flight), (0, 1, 0, 0));
}

#[test]
fn a_client_that_leaves_takes_its_upcall_with_it() {
    let h = harness(|c| {
        c.intercept = Intercept::All;
        c.python_routes = vec!["/lowwater/".into()];
    });
    h.plane.register("r", "s").unwrap();
    let call = h.send(post(h.addr(), CHAT, "s", chat("m", &["hi"])));
    let route = h.send(post(h.addr(), "/lowwater/stats", "", ""));
    let got = {
        let mut got = h.upcalls();
        while got.len() < 2 {
            got.extend(h.upcalls());
        }
        got
    };
    assert_eq!(h.plane.stats().pending_upcalls, 2);
    call.abort();
    route.abort();
    let s = h.wait_stats("the handlers went away", |s| s.pending_upcalls == 0 && s.active_calls == 0);
    assert_eq!((s.in_flight, s.queued), (0, 0));
    for up in got {
        assert_eq!(h.plane.upcalls().resume(up.id, None), Ok(false), "gone, whatever its kind");
        assert_eq!(h.plane.upcalls().respond(up.id, 200, &[], Bytes::new()), Ok(false));
    }
}

#[test]
fn closing_the_upcalls_answers_503_and_refuses_new_ones() {
    let h = harness(|c| {
        c.intercept = Intercept::All;
        c.python_routes = vec!["/".into()];
    });
    h.plane.register("r", "s").unwrap();
    let call = h.send(post(h.addr(), CHAT, "s", chat("m", &["hi"])));
    let route = h.send(post(h.addr(), "/anything", "", ""));
    let mut n = h.upcalls().len();
    while n < 2 {
        n += h.upcalls().len();
    }
    assert_eq!(h.plane.upcalls().close(), 2);
    assert_eq!(h.plane.stats().pending_upcalls, 0);
    assert_eq!(h.join(call).0, 503);
    assert_eq!(h.join(route).0, 503);
    assert_eq!(h.join(h.send(post(h.addr(), CHAT, "s", chat("m", &["hi"])))).0, 503);
    let s = h.settled();
    assert_eq!((s.pending_upcalls, s.in_flight, s.queued), (0, 0, 0));
}

#[test]
fn python_routes_relay_the_request_and_the_answer() {
    let h = harness(|c| c.python_routes = vec!["/lowwater/".into()]);
    let req = Request::put(format!("http://{}/lowwater/rollouts/a%20b?x=1&y=2", h.addr()))
        .header("x-admin-key", "k")
        .body(Full::new(Bytes::from_static(b"{\"a\": 1}")))
        .unwrap();
    let call = h.send(req);
    let up = h.one_upcall();
    assert_eq!(up.kind, UpcallKind::Route);
    assert_eq!((up.method.as_str(), up.path.as_str()), ("PUT", "/lowwater/rollouts/a%20b?x=1&y=2"));
    assert!(up.headers.iter().any(|(k, v)| &k[..] == b"x-admin-key" && &v[..] == b"k"), "{:?}", up.headers);
    assert_eq!(&up.body[..], b"{\"a\": 1}");
    assert_eq!(up.rollout_id, None);
    assert!(matches!(h.plane.upcalls().resume(up.id, None), Err(AnswerError::WrongKind { .. })));
    assert!(matches!(h.plane.upcalls().respond(up.id, 101, &[], Bytes::new()), Err(AnswerError::Status(101))));
    assert!(matches!(
        h.plane.upcalls().respond(up.id, 200, &[(b"bad name", b"v")], Bytes::new()),
        Err(AnswerError::Header(_))
    ));
    let headers: [(&[u8], &[u8]); 3] =
        [(b"content-type", b"application/json"), (b"x-one", b"1"), (b"content-length", b"999")];
    assert_eq!(h.plane.upcalls().respond(up.id, 201, &headers, Bytes::from_static(b"{\"ok\":true}")), Ok(true));
    let (status, headers, body) = h.join(call);
    assert_eq!(status, 201);
    assert_eq!(headers["x-one"], "1");
    assert_eq!(headers["content-length"], "11", "the plane frames the body itself");
    assert_eq!(&body[..], b"{\"ok\":true}");
    // Outside the prefixes (by whole segments): 404 as before, no upcall.
    for path in ["/other", "/lowwaterx/stats"] {
        let (status, _, _) = h.join(h.send(post(h.addr(), path, "", "")));
        assert_eq!(status, 404, "{path}");
    }
    // The prefix itself is under it.
    let call = h.send(post(h.addr(), "/lowwater", "", ""));
    let up = h.one_upcall();
    assert_eq!(up.path, "/lowwater");
    assert_eq!(h.plane.upcalls().respond(up.id, 204, &[], Bytes::new()), Ok(true));
    assert_eq!(h.join(call).0, 204);
    let s = h.settled();
    assert_eq!((s.pending_upcalls, s.upcalls), (0, 2));
}

#[test]
fn resume_racing_unregister_gives_one_answer_and_leaves_nothing() {
    let h = harness(|c| c.intercept = Intercept::All);
    let ok = Arc::new(Mutex::new(0u32));
    for i in 0..60 {
        let rid = format!("r{i}");
        let secret = format!("s{i}");
        h.plane.register(&rid, &secret).unwrap();
        let call = h.send(post(h.addr(), CHAT, &secret, chat("m", &["hi"])));
        let up = h.one_upcall();
        let go = Arc::new(AtomicBool::new(false));
        let (plane, g) = (Arc::clone(&h.plane), Arc::clone(&go));
        let resumer = std::thread::spawn(move || {
            while !g.load(Ordering::Acquire) {
                std::hint::spin_loop();
            }
            plane.upcalls().resume(up.id, None).unwrap()
        });
        go.store(true, Ordering::Release);
        if i % 2 == 1 {
            std::thread::yield_now();
        }
        let cancelled = h.plane.unregister(&rid).unwrap();
        let resumed = resumer.join().unwrap();
        let (status, _, _) = h.join(call);
        if !resumed {
            assert_eq!((status, cancelled), (410, 1), "unregister took the upcall");
        } else {
            // Resumed first: the call then met its closed rollout (410), or
            // began before the close and was cancelled or recorded.
            assert!(status == 410 || status == 200, "{status}");
            if status == 200 {
                *ok.lock().unwrap() += 1;
            }
        }
        let s = h.wait_stats("the call ended", |s| s.active_calls == 0);
        assert_eq!((s.pending_upcalls, s.in_flight, s.open_rollouts), (0, 0, 0), "round {i}");
    }
    let recorded = h.records().len() as u32;
    assert_eq!(recorded, *ok.lock().unwrap(), "a 200 is recorded, a 410 is not");
}
