//! `GET /v1/models`: the one model a rollout's calls are served by, in the
//! Python server's words (its `_models`), for SDKs and agents that list
//! models before calling.

use std::sync::Arc;

use http::header::ALLOW;
use http::{HeaderValue, Method, Request};
use hyper::body::Incoming;

use crate::body::ResBody;
use crate::protocol::ErrorFlavour;
use crate::server::{authenticate, closing, error, respond, Shared};

/// The route.
pub(crate) const PATH: &str = "/v1/models";

/// The name listed when the rollout forwards the agent's model.
const UNNAMED: &str = "lowwater-upstream";

/// The answer's JSON, key for key (and in the same order) as the Python
/// server's orjson output.
pub(crate) fn body(model: Option<&str>) -> String {
    let name = serde_json::Value::from(model.unwrap_or(UNNAMED)).to_string();
    format!(
        concat!(
            r#"{{"object":"list","data":[{{"id":{n},"object":"model","type":"model","created":0,"#,
            r#""owned_by":"lowwater","display_name":{n},"created_at":"1970-01-01T00:00:00Z"}}],"#,
            r#""has_more":false,"first_id":{n},"last_id":{n}}}"#
        ),
        n = name
    )
}

/// Answer `GET /v1/models` (405 for another method, 401 without a rollout's
/// secret, both with `connection: close`: a body, if any, is not read).
pub(crate) fn answer(sh: &Arc<Shared>, req: &Request<Incoming>) -> http::Response<ResBody> {
    if req.method() != Method::GET {
        let why = format!("{PATH} takes GET, not {}", req.method());
        let mut r = closing(error(ErrorFlavour::OpenAi, 405, &why));
        r.headers_mut().insert(ALLOW, HeaderValue::from_static("GET"));
        return r;
    }
    match authenticate(&sh.rollouts, req.headers()) {
        Ok(rollout) => respond(200, "application/json", body(rollout.model.as_deref())),
        Err(why) => closing(error(ErrorFlavour::OpenAi, 401, why)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_python_servers_json() {
        let v: serde_json::Value = serde_json::from_str(&body(None)).unwrap();
        let model = serde_json::json!({
            "id": UNNAMED, "object": "model", "type": "model", "created": 0, "owned_by": "lowwater",
            "display_name": UNNAMED, "created_at": "1970-01-01T00:00:00Z",
        });
        let want = serde_json::json!({
            "object": "list", "data": [model], "has_more": false, "first_id": UNNAMED, "last_id": UNNAMED,
        });
        assert_eq!(v, want);
        let v: serde_json::Value = serde_json::from_str(&body(Some("a\"b"))).unwrap();
        assert_eq!(v["data"][0]["display_name"], "a\"b");
        assert_eq!(v["last_id"], "a\"b");
    }
}
