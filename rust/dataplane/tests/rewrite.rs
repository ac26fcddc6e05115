//! Rewrites, per-rollout upstreams and `GET /v1/models` end to end on
//! loopback: upstreams in the test echo what they received (their name, the
//! key, the path, the body's bytes), so each test reads what was forwarded.
#![cfg(not(loom))]

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use lowwater_dataplane::{
    Config, ConfigError, DataPlane, RegisterError, Rewrites, RolloutOptions, StartError, TurnRecord,
};
use serde_json::{json, Value};

#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOC: lowwater_dataplane::Allocator = lowwater_dataplane::Allocator;

/// An upstream named `name`: answers 200 with what it received, as JSON.
fn start_upstream(rt: &tokio::runtime::Runtime, name: &'static str) -> String {
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    rt.spawn(async move {
        loop {
            let (s, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<Incoming>| async move {
                    let auth = req.headers().get("authorization").map(|v| v.to_str().unwrap().to_string());
                    let key = req.headers().get("x-api-key").map(|v| v.to_str().unwrap().to_string());
                    let path = req.uri().path().to_string();
                    let body = req.into_body().collect().await.unwrap().to_bytes();
                    let echo = json!({
                        "upstream": name, "auth": auth, "key": key, "path": path,
                        "body": String::from_utf8(body.to_vec()).unwrap(),
                    });
                    let mut r = Response::new(Full::new(Bytes::from(echo.to_string())));
                    r.headers_mut().insert("content-type", "application/json".parse().unwrap());
                    Ok::<_, Infallible>(r)
                });
                let _ = http1::Builder::new().serve_connection(TokioIo::new(s), svc).await;
            });
        }
    });
    format!("http://{addr}/v1")
}

struct Rig {
    rt: tokio::runtime::Runtime,
    plane: DataPlane,
    other: String,
}

impl Drop for Rig {
    fn drop(&mut self) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        std::mem::replace(&mut self.rt, rt).shutdown_background();
    }
}

fn rig(rewrites: HashMap<String, Rewrites>) -> Rig {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut config = Config::new(start_upstream(&rt, "main"));
    let other = start_upstream(&rt, "other");
    config.upstream_key = Some("plane-key".into());
    config.retries = 0;
    config.hold_for_ack = false;
    config.rewrites = rewrites;
    let plane = DataPlane::start(config, "127.0.0.1:0".parse().unwrap()).unwrap();
    Rig { rt, plane, other }
}

impl Rig {
    fn addr(&self) -> SocketAddr {
        self.plane.local_addr()
    }

    fn send(&self, req: Request<Full<Bytes>>) -> (u16, Bytes) {
        let client = Client::builder(TokioExecutor::new()).build_http();
        self.rt.block_on(async move {
            let r = tokio::time::timeout(Duration::from_secs(20), client.request(req)).await.unwrap().unwrap();
            let status = r.status().as_u16();
            (status, r.into_body().collect().await.unwrap().to_bytes())
        })
    }

    /// POST `body` to `path` as `secret`; the upstream's echo.
    fn post(&self, secret: &str, path: &str, body: &str) -> Value {
        let req = Request::post(format!("http://{}{path}", self.addr()))
            .header("authorization", format!("Bearer {secret}"))
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        let (status, bytes) = self.send(req);
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&bytes));
        serde_json::from_slice(&bytes).unwrap()
    }

    fn get_models(&self, method: &str, secret: Option<&str>) -> (u16, Bytes) {
        let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
        let mut b = Request::builder().method(method).uri(format!("http://{}/v1/models", self.addr()));
        if let Some(s) = secret {
            b = b.header("x-api-key", s);
        }
        let req = b.body(Empty::new()).unwrap();
        self.rt.block_on(async move {
            let r = client.request(req).await.unwrap();
            let status = r.status().as_u16();
            (status, r.into_body().collect().await.unwrap().to_bytes())
        })
    }

    fn records(&self, n: usize) -> Vec<TurnRecord> {
        let mut out = Vec::new();
        for _ in 0..4000 {
            out.extend(self.plane.queue().drain());
            if out.len() >= n {
                return out;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        panic!("{} of {n} records arrived", out.len());
    }
}

const LOGPROBS_INCLUDE: &str = r#""message.output_text.logprobs""#;
const MAX_TOKENS: [&str; 3] = ["max_tokens", "max_completion_tokens", "max_output_tokens"];

/// What the Python server does with request_logprobs and `--max-tokens 64`.
fn python_like_rules() -> HashMap<String, Rewrites> {
    let mut chat = Rewrites::new();
    chat.set("logprobs", "true").unwrap().set("return_token_ids", "true").unwrap();
    chat.defaults("max_tokens", "64", &MAX_TOKENS).unwrap();
    let mut responses = Rewrites::new();
    responses.append("include", LOGPROBS_INCLUDE).unwrap();
    responses.defaults("max_output_tokens", "64", &MAX_TOKENS).unwrap();
    HashMap::from([("openai.chat".to_string(), chat), ("openai.responses".to_string(), responses)])
}

#[test]
fn the_upstream_receives_the_rewritten_body_and_the_turn_the_agents_messages() {
    let r = rig(python_like_rules());
    r.plane.register_with("r1", "s1", &RolloutOptions { model: Some("served".into()), ..Default::default() }).unwrap();
    r.plane.register("r2", "s2").unwrap();
    let body = r#"{"model":"agent", "messages":[{"role":"user","content":"hi"}] }"#;
    let echo = r.post("s1", "/v1/chat/completions", body);
    assert_eq!(echo["upstream"], "main");
    assert_eq!(echo["path"], "/v1/chat/completions");
    assert_eq!(
        echo["body"],
        r#"{"model":"served", "messages":[{"role":"user","content":"hi"}] ,"logprobs":true,"return_token_ids":true,"max_tokens":64}"#,
        "spliced: every other byte as sent"
    );
    let rec = r.records(1).pop().unwrap();
    assert_ne!(rec.model, "served", "the record names the model the agent asked for, not the override");
    assert_eq!(rec.request.messages, vec![Bytes::from_static(br#"{"role":"user","content":"hi"}"#)]);

    // Nothing to rewrite: the agent's bytes, as sent.
    let sent = r#"{ "max_completion_tokens":5,"logprobs":true,"model":"agent","return_token_ids":true,
        "messages":[{"role":"user","content":"hi"}]}"#;
    assert_eq!(r.post("s2", "/v1/chat/completions", sent)["body"], sent);
    assert_eq!(r.records(1).pop().unwrap().model, "agent");

    // Responses: include gets the logprobs item, max_output_tokens its default.
    let echo = r.post("s2", "/v1/responses", r#"{"model":"agent","input":"hi","include":["x"]}"#);
    let forwarded: Value = serde_json::from_str(echo["body"].as_str().unwrap()).unwrap();
    assert_eq!(
        forwarded,
        json!({"model": "agent", "input": "hi", "include": ["x", "message.output_text.logprobs"], "max_output_tokens": 64})
    );
    let rec = r.records(1).pop().unwrap();
    assert_eq!(rec.request.messages, vec![Bytes::from_static(b"\"hi\"")]);
    // Anthropic has no rules here: only the rollout's model.
    r.plane
        .register_with("r3", "s3", &RolloutOptions { model: Some("claude-x".into()), ..Default::default() })
        .unwrap();
    let echo =
        r.post("s3", "/v1/messages", r#"{"model":"a","max_tokens":5,"messages":[{"role":"user","content":"x"}]}"#);
    assert_eq!(echo["body"], r#"{"model":"claude-x","max_tokens":5,"messages":[{"role":"user","content":"x"}]}"#);
}

#[test]
fn per_rollout_upstreams_get_their_own_calls_with_their_own_keys() {
    let r = rig(HashMap::new());
    let other = r.other.clone();
    let opts = |upstream: Option<&str>, key: Option<&str>| RolloutOptions {
        upstream: upstream.map(String::from),
        api_key: key.map(String::from),
        model: None,
    };
    r.plane.register_with("plain", "s0", &opts(None, None)).unwrap();
    r.plane.register_with("own", "s1", &opts(Some(&other), Some("other-key"))).unwrap();
    r.plane.register_with("own-url", "s2", &opts(Some(&format!("{other}/")), None)).unwrap();
    r.plane.register_with("own-key", "s3", &opts(None, Some("k3"))).unwrap();
    let body = r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#;
    for _ in 0..2 {
        // Twice: pooled connections stay with their origin.
        for (secret, upstream, key) in [
            ("s0", "main", "plane-key"),
            ("s1", "other", "other-key"),
            ("s2", "other", "plane-key"),
            ("s3", "main", "k3"),
        ] {
            let echo = r.post(secret, "/v1/chat/completions", body);
            assert_eq!(echo["upstream"], upstream, "{secret}");
            assert_eq!(echo["auth"], format!("Bearer {key}"), "{secret}");
            assert_eq!(echo["key"], key, "{secret}");
            assert_eq!(echo["path"], "/v1/chat/completions", "{secret}");
            assert_eq!(echo["body"], body, "{secret}: no rewrite, the agent's bytes");
        }
    }
    let recs = r.records(8);
    assert_eq!(recs.iter().filter(|rec| &*rec.rollout_id == "own").count(), 2);
}

#[test]
fn bad_rollout_upstreams_are_refused_at_register() {
    let r = rig(HashMap::new());
    let bad = |url: &str| {
        let o = RolloutOptions { upstream: Some(url.into()), ..Default::default() };
        r.plane.register_with("r", "s", &o).unwrap_err()
    };
    assert!(matches!(bad("ftp://host/v1"), RegisterError::Config(ConfigError::Upstream(_))));
    assert!(matches!(bad("not a url"), RegisterError::Config(ConfigError::Upstream(_))));
    #[cfg(not(feature = "tls"))]
    assert_eq!(bad("https://api.example.com/v1"), RegisterError::Config(ConfigError::HttpsNeedsTls));
    let o = RolloutOptions { api_key: Some("bad\nkey".into()), ..Default::default() };
    assert!(matches!(r.plane.register_with("r", "s", &o), Err(RegisterError::Config(_))));
    assert_eq!(r.plane.stats().open_rollouts, 0, "nothing registered");
    r.plane.register("r", "s").unwrap();
}

#[test]
fn rewrites_are_checked_at_start() {
    let mut config = Config::new("http://127.0.0.1:1/v1");
    config.rewrites.insert("no.such".into(), Rewrites::new());
    let err = DataPlane::start(config, "127.0.0.1:0".parse().unwrap()).unwrap_err();
    assert!(matches!(err, StartError::Config(ConfigError::Rewrite(_))), "{err}");
}

#[test]
fn models_lists_the_rollouts_model() {
    let r = rig(HashMap::new());
    r.plane.register("plain", "s0").unwrap();
    r.plane.register_with("named", "s1", &RolloutOptions { model: Some("qwen".into()), ..Default::default() }).unwrap();
    let (status, body) = r.get_models("GET", Some("s0"));
    assert_eq!(status, 200);
    assert_eq!(
        body,
        concat!(
            r#"{"object":"list","data":[{"id":"lowwater-upstream","object":"model","type":"model","created":0,"#,
            r#""owned_by":"lowwater","display_name":"lowwater-upstream","created_at":"1970-01-01T00:00:00Z"}],"#,
            r#""has_more":false,"first_id":"lowwater-upstream","last_id":"lowwater-upstream"}"#
        )
    );
    let (status, body) = r.get_models("GET", Some("s1"));
    assert_eq!(status, 200);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!((&v["data"][0]["id"], &v["first_id"]), (&json!("qwen"), &json!("qwen")));
    assert_eq!(r.get_models("GET", Some("nope")).0, 401);
    assert_eq!(r.get_models("GET", None).0, 401);
    assert_eq!(r.get_models("POST", Some("s0")).0, 405);
    let s = r.plane.stats();
    assert_eq!((s.calls, s.queued), (0, 0), "not a model call: nothing counted or recorded");
}

#[test]
fn a_protocol_routed_at_models_keeps_its_posts() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut config = Config::new(start_upstream(&rt, "main"));
    let mut spec = lowwater_dataplane::ProtocolSpec::openai_chat();
    spec.name = "plugin".into();
    spec.path = "/v1/models".into();
    config.protocols = lowwater_dataplane::ProtocolTable::new(vec![spec]).unwrap();
    config.hold_for_ack = false;
    let plane = DataPlane::start(config, "127.0.0.1:0".parse().unwrap()).unwrap();
    let r = Rig { other: String::new(), plane, rt };
    r.plane.register("r", "s").unwrap();
    let echo = r.post("s", "/v1/models", r#"{"model":"m","messages":[{"role":"user"}]}"#);
    assert_eq!(echo["path"], "/v1/models");
    let (status, body) = r.get_models("GET", Some("s"));
    assert_eq!(status, 200);
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["object"], "list");
}
