//! Protocol descriptors: what the data plane needs to know of a wire protocol.
//!
//! A protocol is data, not code: the route it answers, the fields a request
//! must carry (checked before anything is forwarded, so a bad request is a
//! 400 here rather than the upstream's problem), where its messages list is,
//! how its stream ends, and the shape of its errors.  Everything else a
//! protocol knows (turning an answer into a turn's completion, usage, token
//! ids) stays in Python, which receives the answer bytes in the turn record.
//! The built-in three are [`ProtocolTable::builtin`]; a Python plugin's
//! protocol becomes one more [`ProtocolSpec`].

use std::borrow::Cow;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use serde_json::value::RawValue;

use crate::error::ConfigError;
use crate::scan;

/// Deepest nesting of JSON arrays and objects a request may have (the Python
/// server's `MAX_JSON_DEPTH`: orjson writes at most 254 levels, so a deeper
/// request would be accepted and then its trajectory could not be written).
pub const MAX_JSON_DEPTH: usize = 128;

/// Index of a protocol in its [`ProtocolTable`], recorded on each turn.
pub type ProtocolId = u16;

/// The shape of error bodies and error events, so the agent's SDK raises its
/// usual exception for a proxy error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorFlavour {
    /// `{"error": {"message", "type", "param", "code"}}`; error event `event: error`.
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}`; error event `event: error`.
    Anthropic,
}

/// How a protocol's SSE stream ends: the event held until the turn is recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Terminal {
    /// An event whose data, trimmed, equals this text (OpenAI chat: `[DONE]`).
    Data(String),
    /// An event whose `event:` name, or (without a name) whose JSON data's
    /// `type`, is one of these (`message_stop`; `response.completed`, ...).
    Types(Vec<String>),
}

/// The JSON type a top-level request field must have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldKind {
    /// A string.
    String,
    /// An integer of at least 1.
    PositiveInteger,
    /// A string or an array.
    StringOrArray,
}

/// One top-level field a request is checked for (`null` counts as absent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldRule {
    /// The field's key.
    pub name: String,
    /// The type it must have when present.
    pub kind: FieldKind,
    /// Whether a request without it is refused (400).
    pub required: bool,
}

/// Where a request's messages are: the list the turn's delta is taken from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessagesRule {
    /// The top-level key (`messages`; `input` for responses).
    pub key: String,
    /// Whether a plain string stands for one user message (responses'
    /// `input`); the string's JSON text is then the one message.
    pub allow_string: bool,
    /// The roles a message may have; empty: any object is accepted.
    pub roles: Vec<String>,
}

/// Everything the data plane needs of one wire protocol.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProtocolSpec {
    /// Unique name, recorded on each turn (`openai.chat`).
    pub name: String,
    /// The route, forwarded to the same path under the upstream's base URL.
    pub path: String,
    /// The shape of error bodies and events.
    pub flavour: ErrorFlavour,
    /// The terminal SSE event.
    pub terminal: Terminal,
    /// Where the messages are.
    pub messages: MessagesRule,
    /// Top-level fields checked besides `stream` (a boolean when present)
    /// and the messages.
    pub fields: Vec<FieldRule>,
    /// Top-level fields holding the tools the agent offered (`tools`; OpenAI
    /// chat also the deprecated `functions`), copied into the record as sent
    /// for the Python protocol's `tools()` to read.
    pub tools: Vec<String>,
    /// The control plane reads any JSON answer of this protocol without an
    /// error (its Python `completion` and stream accumulator never raise on
    /// JSON), so an answer the plane finds to be JSON (each event's data,
    /// for a stream) needs no verdict: with
    /// [`Config::release_when_readable`](crate::Config::release_when_readable)
    /// its last bytes go out once its record is queued, without waiting for
    /// the ack.  False for a protocol whose reader may fail on odd JSON: its
    /// answers wait for the control plane's verdict.
    pub reads_any_json: bool,
}

fn field(name: &str, kind: FieldKind, required: bool) -> FieldRule {
    FieldRule { name: name.into(), kind, required }
}

impl ProtocolSpec {
    /// OpenAI chat completions, `POST /v1/chat/completions`, terminal `data: [DONE]`.
    pub fn openai_chat() -> Self {
        ProtocolSpec {
            name: "openai.chat".into(),
            path: "/v1/chat/completions".into(),
            flavour: ErrorFlavour::OpenAi,
            terminal: Terminal::Data("[DONE]".into()),
            messages: MessagesRule {
                key: "messages".into(),
                allow_string: false,
                roles: ["system", "developer", "user", "assistant", "tool", "function"].map(String::from).to_vec(),
            },
            fields: vec![field("model", FieldKind::String, true)],
            tools: vec!["tools".into(), "functions".into()],
            reads_any_json: true,
        }
    }

    /// OpenAI responses, `POST /v1/responses`, terminal `response.completed`
    /// (or `response.incomplete` / `response.failed`).
    pub fn openai_responses() -> Self {
        ProtocolSpec {
            name: "openai.responses".into(),
            path: "/v1/responses".into(),
            flavour: ErrorFlavour::OpenAi,
            terminal: Terminal::Types(
                ["response.completed", "response.incomplete", "response.failed"].map(String::from).to_vec(),
            ),
            messages: MessagesRule { key: "input".into(), allow_string: true, roles: Vec::new() },
            fields: vec![field("model", FieldKind::String, true)],
            tools: vec!["tools".into()],
            reads_any_json: true,
        }
    }

    /// Anthropic messages, `POST /v1/messages`, terminal `message_stop`.
    pub fn anthropic_messages() -> Self {
        ProtocolSpec {
            name: "anthropic.messages".into(),
            path: "/v1/messages".into(),
            flavour: ErrorFlavour::Anthropic,
            terminal: Terminal::Types(vec!["message_stop".into()]),
            messages: MessagesRule {
                key: "messages".into(),
                allow_string: false,
                roles: vec!["user".into(), "assistant".into()],
            },
            fields: vec![
                field("model", FieldKind::String, true),
                field("max_tokens", FieldKind::PositiveInteger, true),
                field("system", FieldKind::StringOrArray, false),
            ],
            tools: vec!["tools".into()],
            reads_any_json: true,
        }
    }
}

/// A path as routes compare it: without trailing slashes (`/` stays `/`).
fn route_key(path: &str) -> &str {
    match path.trim_end_matches('/') {
        "" => &path[..path.len().min(1)],
        trimmed => trimmed,
    }
}

/// The routes: path -> protocol.  Small (a handful of entries), so a lookup
/// is a scan of a few string comparisons.
#[derive(Debug, Clone)]
pub struct ProtocolTable {
    specs: Vec<Arc<ProtocolSpec>>,
}

impl ProtocolTable {
    /// The built-in three: OpenAI chat, OpenAI responses, Anthropic messages.
    pub fn builtin() -> Self {
        ProtocolTable::new(vec![
            ProtocolSpec::openai_chat(),
            ProtocolSpec::openai_responses(),
            ProtocolSpec::anthropic_messages(),
        ])
        .expect("the built-in protocols have distinct names and paths")
    }

    /// A table of `specs`, in order.
    ///
    /// # Errors
    /// [`ConfigError::Protocol`] for two specs with one name or one path, a
    /// path not starting with `/`, or more than 65,535 specs.
    pub fn new(specs: Vec<ProtocolSpec>) -> Result<Self, ConfigError> {
        if specs.len() > usize::from(ProtocolId::MAX) {
            return Err(ConfigError::Protocol("too many protocols".into()));
        }
        for (i, s) in specs.iter().enumerate() {
            if !s.path.starts_with('/') {
                return Err(ConfigError::Protocol(format!("path {:?} must start with '/'", s.path)));
            }
            if specs[..i].iter().any(|o| o.name == s.name || route_key(&o.path) == route_key(&s.path)) {
                return Err(ConfigError::Protocol(format!("protocol {:?} ({}) is registered twice", s.name, s.path)));
            }
        }
        Ok(ProtocolTable { specs: specs.into_iter().map(Arc::new).collect() })
    }

    /// The protocol serving `path` (exact match, trailing slashes ignored), if any.
    pub fn route(&self, path: &str) -> Option<(ProtocolId, &Arc<ProtocolSpec>)> {
        // A trailing slash is the same route, as the Python router matched it.
        let path = route_key(path);
        self.specs.iter().enumerate().find(|(_, s)| route_key(&s.path) == path).map(|(i, s)| (i as ProtocolId, s))
    }

    /// The protocol with id `id`.
    pub fn get(&self, id: ProtocolId) -> Option<&Arc<ProtocolSpec>> {
        self.specs.get(usize::from(id))
    }

    /// How many protocols the table has.
    pub fn len(&self) -> usize {
        self.specs.len()
    }

    /// Whether the table has no protocol.
    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }
}

/// What the data plane takes of a validated request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedRequest {
    /// The `model` field, or `""` when the protocol does not have one.
    pub model: String,
    /// Whether the agent asked for an SSE stream (`"stream": true`).
    pub stream: bool,
    /// Byte range of each message (its JSON text) within the body, in order.
    pub messages: Vec<Range<usize>>,
    /// The tool fields the request has (of [`ProtocolSpec::tools`], `null`
    /// counting as absent) as one JSON object of their values as sent
    /// (`{"tools":[...]}`); `None` when it has none.  Not validated: the
    /// upstream judges them, and Python's `Protocol.tools` ignores what is
    /// not a list.
    pub tools: Option<String>,
    /// Each top-level key (decoded; the last of duplicates) with its value's
    /// byte range in the body, for splicing rewrites; filled only by
    /// [`ProtocolSpec::parse_keeping_spans`] (empty otherwise).
    pub spans: Vec<(String, Range<usize>)>,
}

/// A request refused with 400; the text names the problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadRequest(pub String);

impl std::fmt::Display for BadRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn bad<T>(reason: impl Into<String>) -> Result<T, BadRequest> {
    Err(BadRequest(reason.into()))
}

/// Whether `body` nests arrays and objects deeper than `max` levels (a
/// top-level object is one level).  Brackets inside strings do not count.
///
/// Strings are crossed with `memchr` to their next quote or backslash, not
/// byte by byte: a long history is mostly string, and the byte loop this
/// replaced was the plane's largest cost for a large request (37 % of its
/// CPU in a profile of sequential 1 MiB chat calls; the plane's added p50
/// fell from 7.2 to 4.3 ms with it, a bare forwarder's being 1.7-2.1 ms).
pub fn nests_deeper_than(body: &[u8], max: usize) -> bool {
    let mut depth = 0usize;
    let mut i = 0;
    while let Some(&b) = body.get(i) {
        match b {
            b'"' => match scan::string_end(body, i + 1) {
                Some(end) => i = end,
                None => return false, // unterminated: the parser names the error
            },
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    return true;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        i += 1;
    }
    false
}

/// A request's top-level keys (decoded; the last of duplicates, as
/// Python's `dict` keeps) with their values as sent.  foldhash, not std's
/// SipHash: the map is built for every call, and SipHash was the plane's
/// largest hasher in a profile of the latency bench (randomly seeded per
/// map, as std's is, so a body's keys cannot be chosen to collide).
type TopLevel<'a> = HashMap<Cow<'a, str>, &'a RawValue, foldhash::fast::RandomState>;

/// `null` is absent, as Python's `dict.get` reads it.
fn present<'a>(top: &TopLevel<'a>, key: &str) -> Option<&'a RawValue> {
    top.get(key).copied().filter(|v| v.get() != "null")
}

fn kind_ok(raw: &str, kind: FieldKind) -> bool {
    match kind {
        FieldKind::String => raw.starts_with('"'),
        FieldKind::PositiveInteger => serde_json::from_str::<u64>(raw).is_ok_and(|n| n >= 1),
        FieldKind::StringOrArray => raw.starts_with('"') || raw.starts_with('['),
    }
}

fn kind_name(kind: FieldKind) -> &'static str {
    match kind {
        FieldKind::String => "a string",
        FieldKind::PositiveInteger => "a positive integer",
        FieldKind::StringOrArray => "a string or a list",
    }
}

impl ProtocolSpec {
    /// Validate a request body and find its stream flag, model and messages.
    ///
    /// # Errors
    /// [`BadRequest`] naming the problem: malformed JSON (with line and
    /// column), nesting deeper than [`MAX_JSON_DEPTH`], a body that is not an
    /// object, a missing or mistyped field, an empty messages list, a message
    /// that is not an object or has a role the protocol does not know.
    pub fn parse(&self, body: &[u8]) -> Result<ParsedRequest, BadRequest> {
        self.parse_inner(body, false)
    }

    /// [`ProtocolSpec::parse`], also keeping [`ParsedRequest::spans`] (for
    /// a call whose body may be rewritten).
    ///
    /// # Errors
    /// As [`ProtocolSpec::parse`].
    pub fn parse_keeping_spans(&self, body: &[u8]) -> Result<ParsedRequest, BadRequest> {
        self.parse_inner(body, true)
    }

    fn parse_inner(&self, body: &[u8], keep_spans: bool) -> Result<ParsedRequest, BadRequest> {
        if nests_deeper_than(body, MAX_JSON_DEPTH) {
            return bad(format!("JSON nests deeper than {MAX_JSON_DEPTH} levels"));
        }
        let text = match std::str::from_utf8(body) {
            Ok(t) => t,
            Err(e) => return bad(format!("malformed JSON: invalid UTF-8 at byte {}", e.valid_up_to())),
        };
        let top: TopLevel<'_> = match serde_json::from_str(text) {
            Ok(top) => top,
            Err(e) if e.is_data() => return bad("request body must be a JSON object"),
            Err(e) => return bad(format!("malformed JSON: {e}")),
        };
        for rule in &self.fields {
            match present(&top, &rule.name) {
                None if rule.required => return bad(format!("missing field '{}'", rule.name)),
                Some(v) if !kind_ok(v.get(), rule.kind) => {
                    return bad(format!("field '{}' must be {}", rule.name, kind_name(rule.kind)))
                }
                _ => {}
            }
        }
        let stream = match present(&top, "stream").map(RawValue::get) {
            None | Some("false") => false,
            Some("true") => true,
            Some(_) => return bad("field 'stream' must be a boolean"),
        };
        let model = match present(&top, "model") {
            Some(v) => serde_json::from_str::<String>(v.get()).unwrap_or_default(),
            None => String::new(),
        };
        let tools = self.tool_fields(&top);
        let key = &self.messages.key;
        let offset = |raw: &RawValue| {
            let start = raw.get().as_ptr() as usize - text.as_ptr() as usize;
            start..start + raw.get().len()
        };
        let spans = if keep_spans { top.iter().map(|(k, v)| (k.to_string(), offset(v))).collect() } else { Vec::new() };
        let Some(list) = present(&top, key) else { return bad(format!("missing field '{key}'")) };
        let raw = list.get();
        if raw.starts_with('"') && self.messages.allow_string {
            return Ok(ParsedRequest { model, stream, messages: vec![offset(list)], tools, spans });
        }
        let shape = if self.messages.allow_string { "a string or a non-empty list" } else { "a non-empty list" };
        if !raw.starts_with('[') {
            return bad(format!("field '{key}' must be {shape} of objects"));
        }
        // The list was validated by the top-level parse: walked, not parsed again (src/scan.rs).
        let Some(items) = scan::array_items(raw) else {
            return bad(format!("field '{key}' must be {shape} of objects"));
        };
        if items.is_empty() {
            return bad(format!("field '{key}' must be {shape} of objects"));
        }
        let base = offset(list).start;
        let mut messages = Vec::with_capacity(items.len());
        for (i, span) in items.into_iter().enumerate() {
            let item = &raw[span.clone()];
            if !item.starts_with('{') {
                return bad(format!("{key}[{i}] must be an object"));
            }
            if !self.messages.roles.is_empty() {
                // A role that is absent, null, not a string or given twice is refused, as before.
                let role = scan::object_field(item, "role").ok().flatten().and_then(scan::decoded);
                if !role.is_some_and(|r| self.messages.roles.iter().any(|k| *k == r)) {
                    return bad(format!("{key}[{i}].role must be one of {}", self.messages.roles.join(", ")));
                }
            }
            messages.push(base + span.start..base + span.end);
        }
        Ok(ParsedRequest { model, stream, messages, tools, spans })
    }

    /// The request's tool fields as one JSON object (see [`ParsedRequest::tools`]).
    fn tool_fields(&self, top: &TopLevel<'_>) -> Option<String> {
        let mut out = String::new();
        for key in &self.tools {
            if let Some(v) = present(top, key) {
                out.push(if out.is_empty() { '{' } else { ',' });
                out.push_str(&serde_json::Value::from(key.as_str()).to_string());
                out.push(':');
                out.push_str(v.get());
            }
        }
        (!out.is_empty()).then(|| out + "}")
    }

    /// The JSON error body for `status` in this protocol's shape.
    pub fn error_body(&self, status: u16, reason: &str) -> Vec<u8> {
        error_body(self.flavour, status, reason)
    }

    /// An SSE event that makes the agent's SDK raise, sent before a stream is
    /// broken off (upstream cut, rollout closed).
    pub fn error_event(&self, reason: &str) -> Vec<u8> {
        error_event(self.flavour, reason)
    }
}

/// An SSE error event in `flavour`'s shape: `event: error` and the JSON data
/// the flavour's SDKs raise on.
pub fn error_event(flavour: ErrorFlavour, reason: &str) -> Vec<u8> {
    let data = match flavour {
        ErrorFlavour::Anthropic => {
            serde_json::json!({"type": "error", "error": {"type": "api_error", "message": reason}})
        }
        // The OpenAI SDKs raise on any event whose data has an "error" key.
        ErrorFlavour::OpenAi => {
            serde_json::json!({"type": "error", "error": {"message": reason, "type": "api_error", "code": null}})
        }
    };
    let mut out = b"event: error\ndata: ".to_vec();
    out.extend_from_slice(data.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
    out
}

/// The JSON error body for `status` in `flavour`'s shape: the error `type`
/// each flavour's SDK maps to its exception class (OpenAI's and Anthropic's
/// API references).  The one table: Python's `Protocol.error_body` calls this
/// through the binding.
pub fn error_body(flavour: ErrorFlavour, status: u16, reason: &str) -> Vec<u8> {
    let value = match flavour {
        ErrorFlavour::Anthropic => {
            let kind = match status {
                400 | 415 => "invalid_request_error",
                401 => "authentication_error",
                404 => "not_found_error",
                413 => "request_too_large",
                429 => "rate_limit_error",
                529 => "overloaded_error",
                _ => "api_error",
            };
            serde_json::json!({"type": "error", "error": {"type": kind, "message": reason}})
        }
        ErrorFlavour::OpenAi => {
            let kind = match status {
                400 | 413 | 415 => "invalid_request_error",
                401 => "authentication_error",
                404 => "not_found_error",
                409 | 410 => "conflict_error",
                429 => "rate_limit_error",
                _ => "api_error",
            };
            serde_json::json!({"error": {"message": reason, "type": kind, "param": null, "code": status}})
        }
    };
    value.to_string().into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(spec: &ProtocolSpec, body: &str) -> Result<ParsedRequest, String> {
        spec.parse(body.as_bytes()).map_err(|e| e.0)
    }

    #[test]
    fn builtin_routes() {
        let t = ProtocolTable::builtin();
        assert_eq!(t.len(), 3);
        assert_eq!(t.route("/v1/chat/completions").unwrap().1.name, "openai.chat");
        assert_eq!(t.route("/v1/messages").unwrap().1.name, "anthropic.messages");
        let (id, spec) = t.route("/v1/responses").unwrap();
        assert_eq!(t.get(id).unwrap().name, spec.name);
        assert_eq!(
            t.route("/v1/chat/completions/").unwrap().1.name,
            "openai.chat",
            "a trailing slash is the same route"
        );
        assert!(t.route("/v1/models").is_none());
    }

    #[test]
    fn duplicate_protocols_are_refused() {
        let a = ProtocolSpec::openai_chat();
        let mut b = ProtocolSpec::openai_responses();
        b.path = a.path.clone();
        assert!(matches!(ProtocolTable::new(vec![a.clone(), b]), Err(ConfigError::Protocol(_))));
        let mut c = a.clone();
        c.path = "v1/x".into();
        assert!(ProtocolTable::new(vec![c]).is_err());
    }

    #[test]
    fn chat_requests() {
        let chat = ProtocolSpec::openai_chat();
        let body = r#"{"model":"m","stream":true,"messages":[{"role":"user","content":"hi"}, {"role":"assistant","content":"yo"}]}"#;
        let p = parse(&chat, body).unwrap();
        assert!(p.stream);
        assert_eq!(p.model, "m");
        let texts: Vec<_> = p.messages.iter().map(|r| &body[r.clone()]).collect();
        assert_eq!(texts, [r#"{"role":"user","content":"hi"}"#, r#"{"role":"assistant","content":"yo"}"#]);
        let no_stream = parse(&chat, r#"{"model":"m","stream":null,"messages":[{"role":"user"}]}"#).unwrap();
        assert!(!no_stream.stream);
        for (body, why) in [
            ("{", "malformed JSON"),
            ("[1]", "must be a JSON object"),
            (r#"{"messages":[{"role":"user"}]}"#, "missing field 'model'"),
            (r#"{"model":1,"messages":[{"role":"user"}]}"#, "field 'model' must be a string"),
            (r#"{"model":"m"}"#, "missing field 'messages'"),
            (r#"{"model":"m","messages":[]}"#, "must be a non-empty list"),
            (r#"{"model":"m","messages":{}}"#, "must be a non-empty list"),
            (r#"{"model":"m","messages":[1]}"#, "messages[0] must be an object"),
            (r#"{"model":"m","messages":[{"role":"robot"}]}"#, "messages[0].role must be one of"),
            (r#"{"model":"m","stream":"yes","messages":[{"role":"user"}]}"#, "'stream' must be a boolean"),
        ] {
            let got = parse(&chat, body).unwrap_err();
            assert!(got.contains(why), "{body}: {got}");
        }
    }

    #[test]
    fn anthropic_and_responses_fields() {
        let a = ProtocolSpec::anthropic_messages();
        assert!(parse(&a, r#"{"model":"m","max_tokens":0,"messages":[{"role":"user"}]}"#)
            .unwrap_err()
            .contains("max_tokens"));
        assert!(parse(&a, r#"{"model":"m","max_tokens":5,"system":3,"messages":[{"role":"user"}]}"#)
            .unwrap_err()
            .contains("system"));
        assert!(parse(&a, r#"{"model":"m","max_tokens":5,"messages":[{"role":"system"}]}"#).is_err());
        assert!(parse(&a, r#"{"model":"m","max_tokens":5,"system":"s","messages":[{"role":"user"}]}"#).is_ok());
        let r = ProtocolSpec::openai_responses();
        let body = r#"{"model":"m","input":"hello"}"#;
        let p = parse(&r, body).unwrap();
        assert_eq!(&body[p.messages[0].clone()], "\"hello\"");
        assert_eq!(parse(&r, r#"{"model":"m","input":[{"type":"x"}]}"#).unwrap().messages.len(), 1);
        assert!(parse(&r, r#"{"model":"m","input":3}"#).unwrap_err().contains("a string or a non-empty list"));
    }

    #[test]
    fn tool_fields_are_kept_as_sent() {
        let chat = ProtocolSpec::openai_chat();
        let m = r#""messages":[{"role":"user"}]"#;
        let p = parse(&chat, &format!(r#"{{"model":"m",{m},"tools":[{{"type":"function"}}], "functions" : [1]}}"#));
        assert_eq!(p.unwrap().tools.as_deref(), Some(r#"{"tools":[{"type":"function"}],"functions":[1]}"#));
        assert_eq!(parse(&chat, &format!(r#"{{"model":"m",{m},"tools":null}}"#)).unwrap().tools, None);
        assert_eq!(parse(&chat, &format!(r#"{{"model":"m",{m}}}"#)).unwrap().tools, None);
        let a = ProtocolSpec::anthropic_messages();
        let body = format!(r#"{{"model":"m","max_tokens":5,{m},"functions":[1],"tools":[{{"name":"t"}}]}}"#);
        assert_eq!(parse(&a, &body).unwrap().tools.as_deref(), Some(r#"{"tools":[{"name":"t"}]}"#));
    }

    #[test]
    fn spans_are_kept_only_when_asked() {
        let chat = ProtocolSpec::openai_chat();
        let body = r#"{"model":"a", "x" : null,"model":"b","messages":[{"role":"user"}]}"#;
        assert!(chat.parse(body.as_bytes()).unwrap().spans.is_empty());
        let mut spans = chat.parse_keeping_spans(body.as_bytes()).unwrap().spans;
        spans.sort_by(|a, b| a.0.cmp(&b.0));
        let texts: Vec<_> = spans.iter().map(|(k, r)| (k.as_str(), &body[r.clone()])).collect();
        assert_eq!(texts, [("messages", r#"[{"role":"user"}]"#), ("model", r#""b""#), ("x", "null")]);
    }

    #[test]
    fn depth_limit() {
        let ok = format!("{}{}", "[".repeat(MAX_JSON_DEPTH), "]".repeat(MAX_JSON_DEPTH));
        assert!(!nests_deeper_than(ok.as_bytes(), MAX_JSON_DEPTH));
        let deep = format!("{{\"a\":{}{}}}", "[".repeat(MAX_JSON_DEPTH), "]".repeat(MAX_JSON_DEPTH));
        assert!(nests_deeper_than(deep.as_bytes(), MAX_JSON_DEPTH));
        assert!(!nests_deeper_than(br#"{"a":"[[[[[[\"[[[["}"#, 2), "brackets in strings do not count");
        let chat = ProtocolSpec::openai_chat();
        assert!(parse(&chat, &deep).unwrap_err().contains("deeper than 128"));
        // Escapes at the very end, unterminated strings: no panic, not deep.
        for cut in [&b"\"\\"[..], b"[\"\\", b"[\"", b"\"", b"[\"a\\\"", b"\\"] {
            assert!(!nests_deeper_than(cut, 1), "{cut:?}");
        }
    }

    /// The byte-by-byte scan `nests_deeper_than` replaced: the reference it
    /// must agree with on any input.
    fn nests_deeper_than_bytewise(body: &[u8], max: usize) -> bool {
        let (mut depth, mut in_string) = (0usize, false);
        let mut bytes = body.iter();
        while let Some(&b) = bytes.next() {
            if in_string {
                if b == b'\\' {
                    bytes.next(); // the escaped byte, whatever it is
                } else if b == b'"' {
                    in_string = false;
                }
            } else if b == b'"' {
                in_string = true;
            } else if b == b'[' || b == b'{' {
                depth += 1;
                if depth > max {
                    return true;
                }
            } else if b == b']' || b == b'}' {
                depth = depth.saturating_sub(1);
            }
        }
        false
    }

    proptest::proptest! {
        #[test]
        fn depth_check_agrees_with_the_bytewise_scan(
            // Mostly the bytes that matter, so strings, escapes and brackets mix.
            body in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::sample::select(b"[]{}\"\\a".to_vec()),
                    proptest::prelude::any::<u8>(),
                ],
                0..64,
            ),
            max in 0usize..6,
        ) {
            proptest::prop_assert_eq!(nests_deeper_than(&body, max), nests_deeper_than_bytewise(&body, max));
        }
    }

    #[test]
    fn error_shapes() {
        let v: serde_json::Value = serde_json::from_slice(&error_body(ErrorFlavour::OpenAi, 401, "no")).unwrap();
        assert_eq!(v["error"]["type"], "authentication_error");
        assert_eq!(v["error"]["code"], 401);
        let v: serde_json::Value = serde_json::from_slice(&error_body(ErrorFlavour::Anthropic, 413, "big")).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["error"]["type"], "request_too_large");
        let ev = ProtocolSpec::anthropic_messages().error_event("x\"y");
        assert!(ev.starts_with(b"event: error\ndata: {") && ev.ends_with(b"\n\n"));
    }

    proptest! {
        /// Routing is exact: each registered path routes to its own spec, and
        /// nothing else routes.
        #[test]
        fn routing_is_exact(paths in proptest::collection::hash_set("/[a-z/]{0,12}", 1..8), probe in "/[a-z/]{0,12}") {
            // Paths equal but for trailing slashes are one route (the table refuses the pair).
            let keys: std::collections::HashSet<_> = paths.iter().map(|p| route_key(p)).collect();
            prop_assume!(keys.len() == paths.len());
            let specs: Vec<_> = paths.iter().enumerate().map(|(i, p)| {
                let mut s = ProtocolSpec::openai_chat();
                s.name = format!("p{i}");
                s.path = p.clone();
                s
            }).collect();
            let t = ProtocolTable::new(specs).unwrap();
            for (i, p) in paths.iter().enumerate() {
                let (id, s) = t.route(p).unwrap();
                prop_assert_eq!(&s.name, &format!("p{i}"));
                prop_assert_eq!(usize::from(id), i);
            }
            prop_assert_eq!(t.route(&probe).is_some(), keys.contains(route_key(&probe)));
        }

        /// No input makes the parser panic; an accepted body's message ranges
        /// are valid JSON objects inside it.
        #[test]
        fn parse_never_panics(body in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = ProtocolSpec::openai_chat().parse(&body);
        }

        #[test]
        fn parsed_ranges_are_the_messages(contents in proptest::collection::vec("[a-z \"\\\\]{0,8}", 1..5)) {
            let msgs: Vec<_> = contents.iter().map(|c| serde_json::json!({"role": "user", "content": c})).collect();
            let body = serde_json::json!({"model": "m", "messages": msgs}).to_string();
            let p = ProtocolSpec::openai_chat().parse(body.as_bytes()).unwrap();
            prop_assert_eq!(p.messages.len(), msgs.len());
            for (r, m) in p.messages.iter().zip(&msgs) {
                let v: serde_json::Value = serde_json::from_str(&body[r.clone()]).unwrap();
                prop_assert_eq!(&v, m);
            }
        }
    }
}
