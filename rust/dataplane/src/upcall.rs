//! Upcalls: requests the data plane hands to the control plane and waits for
//! an answer to.
//!
//! Two kinds, one mechanism:
//!
//! * **intercept**: a model call on a protocol route with interception on
//!   ([`Intercept`]), after authentication, the body read and validation, and
//!   before it begins in its rollout.  The control plane answers with
//!   [`Upcalls::resume`] (forward the agent's bytes, or new bytes, which are
//!   validated again and are what the turn records) or [`Upcalls::reject`]
//!   (an error status of the protocol's flavour; nothing recorded).
//! * **route**: a request to a path under one of the plane's Python route
//!   prefixes (`lowwater proxy`'s admin endpoints, mounted apps), answered
//!   with [`Upcalls::respond`] (status, headers, body).
//!
//! Each waiting upcall is one entry in a table ([`Pending`]) that owns its
//! answer channel.  Whoever removes the entry (under the table's one lock)
//! answers the call, so exactly one answer reaches the agent: the control
//! plane's answer, the rollout's `unregister` (410), the plane's close (503),
//! or nobody when the client left first (the handler's guard removes it).
//! An answer to an upcall no longer in the table is a no-op returning
//! `false`.  tests/loom.rs checks this under every interleaving.
//!
//! Upcalls have their own queue and wakeup fd, apart from the turn records:
//! a record's ack must never wait behind a slow hook (each upcall is answered
//! by its own Trio task, in any order), and a plane with neither option set
//! never writes to it.

use std::collections::HashMap;

use crate::sync::{lock, Mutex};

/// Which of the two an upcall is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpcallKind {
    /// A model call handed over before forwarding.
    Intercept,
    /// A request to a Python route.
    Route,
}

impl UpcallKind {
    /// `"intercept"` or `"route"`.
    pub fn as_str(self) -> &'static str {
        match self {
            UpcallKind::Intercept => "intercept",
            UpcallKind::Route => "route",
        }
    }
}

/// The table of upcalls is closed (the plane is shutting down).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableClosed;

/// Why an answer was not taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AnswerError {
    /// `resume`/`reject` of a route upcall, or `respond` to an intercept upcall.
    WrongKind {
        /// The upcall's id.
        id: u64,
        /// What the upcall is.
        is: UpcallKind,
    },
    /// A status the answer cannot have (reject: 400-599; respond: 200-599).
    Status(u16),
    /// A response header name or value that is not valid HTTP.
    Header(String),
}

impl std::fmt::Display for AnswerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AnswerError::WrongKind { id, is } => write!(f, "upcall {id} is a {} upcall", is.as_str()),
            AnswerError::Status(s) => write!(f, "status {s} is not allowed here"),
            AnswerError::Header(why) => write!(f, "bad response header: {why}"),
        }
    }
}

impl std::error::Error for AnswerError {}

struct Entry<S> {
    owner: Option<usize>,
    kind: UpcallKind,
    sink: S,
}

struct State<S> {
    closed: bool,
    next_id: u64,
    entries: HashMap<u64, Entry<S>>,
}

/// The waiting upcalls, each with the sink its answer goes to.
///
/// `S` is the answer channel (a `tokio::sync::oneshot::Sender` in the
/// server; anything in the loom model).  `owner` ties an upcall to its
/// rollout (the address of the rollout's shared allocation, alive while the
/// handler waits) so `unregister` can take them all.
pub struct Pending<S> {
    state: Mutex<State<S>>,
}

impl<S> Default for Pending<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S> Pending<S> {
    /// An empty, open table.
    pub fn new() -> Self {
        Pending { state: Mutex::new(State { closed: false, next_id: 0, entries: HashMap::new() }) }
    }

    /// Add an upcall answered through `sink`; its id.
    ///
    /// # Errors
    /// [`TableClosed`] after [`Pending::close`] (the sink is dropped).
    pub fn insert(&self, owner: Option<usize>, kind: UpcallKind, sink: S) -> Result<u64, TableClosed> {
        let mut st = lock(&self.state);
        if st.closed {
            return Err(TableClosed);
        }
        let id = st.next_id;
        st.next_id += 1;
        st.entries.insert(id, Entry { owner, kind, sink });
        Ok(id)
    }

    /// Take upcall `id`'s sink to answer it as a `kind` upcall; `Ok(None)`
    /// if it is no longer waiting (answered, cancelled, its client left).
    ///
    /// # Errors
    /// [`AnswerError::WrongKind`] if it is the other kind (it stays waiting).
    pub fn take(&self, id: u64, kind: UpcallKind) -> Result<Option<S>, AnswerError> {
        let mut st = lock(&self.state);
        match st.entries.get(&id) {
            None => Ok(None),
            Some(e) if e.kind != kind => Err(AnswerError::WrongKind { id, is: e.kind }),
            Some(_) => Ok(st.entries.remove(&id).map(|e| e.sink)),
        }
    }

    /// Take the sinks of every upcall of `owner` (its rollout closed).
    pub fn take_owner(&self, owner: usize) -> Vec<S> {
        let mut st = lock(&self.state);
        let ids: Vec<u64> = st.entries.iter().filter(|(_, e)| e.owner == Some(owner)).map(|(id, _)| *id).collect();
        ids.into_iter().filter_map(|id| st.entries.remove(&id)).map(|e| e.sink).collect()
    }

    /// Refuse new upcalls and take every waiting one's sink.
    pub fn close(&self) -> Vec<S> {
        let mut st = lock(&self.state);
        st.closed = true;
        st.entries.drain().map(|(_, e)| e.sink).collect()
    }

    /// Remove upcall `id` without answering it (its handler is going away);
    /// `false` if someone took it first.
    pub fn forget(&self, id: u64) -> bool {
        let removed = lock(&self.state).entries.remove(&id);
        removed.is_some()
    }

    /// Whether upcall `id` still waits.
    pub fn contains(&self, id: u64) -> bool {
        lock(&self.state).entries.contains_key(&id)
    }

    /// How many upcalls wait.
    pub fn len(&self) -> usize {
        lock(&self.state).entries.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(not(loom))]
pub use plane_side::*;

#[cfg(not(loom))]
mod plane_side {
    use std::collections::VecDeque;
    use std::os::fd::RawFd;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;

    use bytes::Bytes;
    use http::header::{CONNECTION, CONTENT_TYPE};
    use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
    use hyper::body::Incoming;
    use tokio::sync::oneshot;

    use super::{AnswerError, Pending, UpcallKind};
    use crate::body::{read_limited, BodyError, ResBody};
    use crate::error::ConfigError;
    use crate::protocol::{
        error_body, BadRequest, ErrorFlavour, ParsedRequest, ProtocolId, ProtocolSpec, ProtocolTable,
    };
    use crate::rollouts::Rollout;
    use crate::server::Shared;
    use crate::sync::lock;

    /// Which protocol routes hand their calls to the control plane before
    /// forwarding ([`crate::Config::intercept`]).
    #[derive(Debug, Clone, Default, PartialEq, Eq)]
    pub enum Intercept {
        /// None (the default): no call enters the control plane before forwarding.
        #[default]
        Off,
        /// Every protocol's calls.
        All,
        /// The calls of these protocols (by [`ProtocolSpec::name`]).
        Protocols(Vec<String>),
    }

    /// One request handed to the control plane.
    #[derive(Debug, Clone)]
    pub struct Upcall {
        /// Answer with this.
        pub id: u64,
        /// Intercept or route.
        pub kind: UpcallKind,
        /// The rollout of an intercepted call (`None` for a route).
        pub rollout_id: Option<Arc<str>>,
        /// An intercepted call's id, the `request_id` of its record (`None`
        /// for a route): ties the hooks run before the call to its record.
        pub request_id: Option<Arc<str>>,
        /// The protocol's name of an intercepted call (`None` for a route).
        pub protocol: Option<String>,
        /// The request's method (`POST` for an intercepted call).
        pub method: String,
        /// The request's path with its query, as sent.
        pub path: String,
        /// The request's headers as sent (names lower-case); an intercepted
        /// call's without `authorization` and `x-api-key` (the rollout's secret).
        pub headers: Vec<(Bytes, Bytes)>,
        /// The request's body (an intercepted call's validated JSON).
        pub body: Bytes,
    }

    /// What a waiting handler receives.
    #[derive(Debug)]
    pub(crate) enum Answer {
        Resume(Option<Bytes>),
        Reject(u16, String),
        Respond(u16, HeaderMap, Bytes),
        /// The rollout was unregistered: 410.
        Gone,
        /// The plane is closing: 503.
        Closing,
    }

    type Sink = oneshot::Sender<Answer>;

    /// The upcall table, its queue and wakeup fd, and the options that say
    /// which requests become upcalls.
    pub struct Upcalls {
        pending: Pending<Sink>,
        queue: std::sync::Mutex<VecDeque<Upcall>>,
        wakeup: crate::queue::Wakeup,
        /// By protocol id: whether its calls are intercepted (switched at
        /// run time by [`Upcalls::set_intercept`]: a control plane whose
        /// plugins change while it serves).
        intercept: Vec<AtomicBool>,
        routes: Vec<String>,
        total: AtomicU64,
    }

    impl std::fmt::Debug for Upcalls {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Upcalls").field("pending", &self.pending.len()).finish_non_exhaustive()
        }
    }

    /// By protocol id: whether `intercept` covers its calls.
    fn intercept_mask(protocols: &ProtocolTable, intercept: &Intercept) -> Result<Vec<bool>, ConfigError> {
        let n = protocols.len();
        let names: Vec<String> =
            (0..n).map(|i| protocols.get(i as ProtocolId).map(|s| s.name.clone()).unwrap_or_default()).collect();
        Ok(match intercept {
            Intercept::Off => vec![false; n],
            Intercept::All => vec![true; n],
            Intercept::Protocols(want) => {
                let mut mask = vec![false; n];
                for w in want {
                    let i = names.iter().position(|name| name == w).ok_or_else(|| {
                        ConfigError::Upcall(format!("intercept names no protocol {w:?} (known: {names:?})"))
                    })?;
                    mask[i] = true;
                }
                mask
            }
        })
    }

    impl Upcalls {
        /// The table for `protocols` with the plane's options.
        pub(crate) fn new(
            protocols: &ProtocolTable,
            intercept: &Intercept,
            routes: &[String],
        ) -> Result<Self, crate::plane::StartError> {
            let mask = intercept_mask(protocols, intercept)?;
            for r in routes {
                if !r.starts_with('/') {
                    return Err(ConfigError::Upcall(format!("python route prefix {r:?} must start with '/'")).into());
                }
            }
            let wakeup = crate::queue::Wakeup::new()?;
            Ok(Upcalls {
                pending: Pending::new(),
                queue: std::sync::Mutex::new(VecDeque::new()),
                wakeup,
                intercept: mask.into_iter().map(AtomicBool::new).collect(),
                // Kept without the trailing slash ("" for "/": every path).
                routes: routes.iter().map(|r| r.trim_end_matches('/').to_owned()).collect(),
                total: AtomicU64::new(0),
            })
        }

        /// The fd that becomes readable when upcalls wait to be drained;
        /// owned by the plane, do not close it.
        pub fn wakeup_fd(&self) -> RawFd {
            self.wakeup.fd()
        }

        /// Every queued upcall still waiting, oldest first (clears the fd first).
        /// One whose client left or whose rollout closed meanwhile is skipped.
        pub fn drain(&self) -> Vec<Upcall> {
            self.wakeup.clear();
            let taken: Vec<Upcall> = lock(&self.queue).drain(..).collect();
            taken.into_iter().filter(|u| self.pending.contains(u.id)).collect()
        }

        /// Forward intercepted call `id`: the agent's bytes (`None`) or
        /// `body`, validated again by the protocol (400 naming the problem
        /// if it does not pass) and recorded as sent.  `Ok(false)` if the
        /// upcall no longer waits.
        ///
        /// # Errors
        /// [`AnswerError::WrongKind`] for a route upcall.
        pub fn resume(&self, id: u64, body: Option<Bytes>) -> Result<bool, AnswerError> {
            self.answer(id, UpcallKind::Intercept, Answer::Resume(body))
        }

        /// Refuse intercepted call `id` with `status` (400-599) and
        /// `message` in the protocol's error body; nothing is forwarded or
        /// recorded.  `Ok(false)` if the upcall no longer waits.
        ///
        /// # Errors
        /// [`AnswerError::Status`] outside 400-599, [`AnswerError::WrongKind`]
        /// for a route upcall.
        pub fn reject(&self, id: u64, status: u16, message: &str) -> Result<bool, AnswerError> {
            if !(400..=599).contains(&status) {
                return Err(AnswerError::Status(status));
            }
            self.answer(id, UpcallKind::Intercept, Answer::Reject(status, message.to_owned()))
        }

        /// Answer route upcall `id` with `status` (200-599), `headers` and
        /// `body`.  `content-length`, `transfer-encoding` and `connection`
        /// are dropped (the plane frames the body itself).  `Ok(false)` if
        /// the upcall no longer waits.
        ///
        /// # Errors
        /// [`AnswerError::Status`] outside 200-599, [`AnswerError::Header`]
        /// for an invalid name or value, [`AnswerError::WrongKind`] for an
        /// intercept upcall.
        pub fn respond(
            &self,
            id: u64,
            status: u16,
            headers: &[(&[u8], &[u8])],
            body: Bytes,
        ) -> Result<bool, AnswerError> {
            if !(200..=599).contains(&status) {
                return Err(AnswerError::Status(status));
            }
            let mut map = HeaderMap::new();
            for (name, value) in headers {
                let name = HeaderName::from_bytes(name)
                    .map_err(|_| AnswerError::Header(format!("name {:?}", String::from_utf8_lossy(name))))?;
                let value = HeaderValue::from_bytes(value).map_err(|_| {
                    AnswerError::Header(format!("value of {name}: {:?}", String::from_utf8_lossy(value)))
                })?;
                if name == http::header::CONTENT_LENGTH || name == http::header::TRANSFER_ENCODING || name == CONNECTION
                {
                    continue;
                }
                map.append(name, value);
            }
            self.answer(id, UpcallKind::Route, Answer::Respond(status, map, body))
        }

        /// How many upcalls wait for an answer.
        pub fn pending(&self) -> usize {
            self.pending.len()
        }

        /// Upcalls made since the start.
        pub fn total(&self) -> u64 {
            self.total.load(Ordering::Relaxed)
        }

        /// Answer every waiting upcall 503 and refuse new ones (503): the
        /// first step of the plane's shutdown.  How many were waiting.
        pub fn close(&self) -> usize {
            let sinks = self.pending.close();
            let n = sinks.len();
            for s in sinks {
                let _ = s.send(Answer::Closing);
            }
            lock(&self.queue).clear();
            n
        }

        /// Answer the waiting upcalls of `rollout` 410 (it was unregistered);
        /// how many.
        pub(crate) fn cancel_rollout(&self, rollout: &Arc<Rollout>) -> usize {
            let sinks = self.pending.take_owner(owner_of(rollout));
            let n = sinks.len();
            for s in sinks {
                let _ = s.send(Answer::Gone);
            }
            n
        }

        /// Whether calls of protocol `pid` are intercepted.
        pub(crate) fn intercepts(&self, pid: ProtocolId) -> bool {
            self.intercept.get(pid as usize).is_some_and(|b| b.load(Ordering::Relaxed))
        }

        /// Switch interception for the calls that start from now on (a call
        /// already past its intercept step is not affected).
        ///
        /// # Errors
        /// [`ConfigError::Upcall`] for a name no protocol has (nothing changed).
        pub fn set_intercept(&self, protocols: &ProtocolTable, intercept: &Intercept) -> Result<(), ConfigError> {
            let mask = intercept_mask(protocols, intercept)?;
            for (flag, on) in self.intercept.iter().zip(mask) {
                flag.store(on, Ordering::Relaxed);
            }
            Ok(())
        }

        /// Whether `path` is under a Python route prefix: the prefix itself
        /// or below it by whole segments (`/lowwater/` takes `/lowwater` and
        /// `/lowwater/stats`, not `/lowwaterx`), as the Python `Router`'s
        /// mounts match; `/` takes every path.
        pub(crate) fn routes_to_python(&self, path: &str) -> bool {
            self.routes.iter().any(|p| match path.strip_prefix(p.as_str()) {
                Some(rest) => p.is_empty() || rest.is_empty() || rest.starts_with('/'),
                None => false,
            })
        }

        fn answer(&self, id: u64, kind: UpcallKind, answer: Answer) -> Result<bool, AnswerError> {
            match self.pending.take(id, kind)? {
                // The handler may be gone meanwhile (its client left after
                // the take): the answer then goes nowhere, as it should.
                Some(sink) => {
                    let _ = sink.send(answer);
                    Ok(true)
                }
                None => Ok(false),
            }
        }

        /// Hand `upcall` (its id filled in here) to the control plane and
        /// wait for its answer.  Dropping the future (the client left)
        /// removes the upcall.
        async fn ask(&self, owner: Option<&Arc<Rollout>>, mut upcall: Upcall) -> Answer {
            let (tx, rx) = oneshot::channel();
            let Ok(id) = self.pending.insert(owner.map(owner_of), upcall.kind, tx) else {
                return Answer::Closing;
            };
            let _guard = Forget(&self.pending, id);
            // An unregister that ran between authentication and the insert
            // did not see this upcall: refuse it here rather than hand
            // Python an upcall whose rollout is gone.  (`unregister` closes
            // the rollout before it takes its upcalls, so one of the two
            // always sees the other.)
            if owner.is_some_and(|r| r.calls.is_closed()) {
                // Removed here, or taken by the unregister (which sent Gone).
                self.pending.forget(id);
                return rx.await.unwrap_or(Answer::Gone);
            }
            upcall.id = id;
            self.total.fetch_add(1, Ordering::Relaxed);
            let was_empty = {
                let mut q = lock(&self.queue);
                let was_empty = q.is_empty();
                q.push_back(upcall);
                was_empty
            };
            if was_empty {
                self.wakeup.wake();
            }
            // A dropped sender without an answer cannot happen (every taker
            // sends); count it as the plane closing.
            rx.await.unwrap_or(Answer::Closing)
        }
    }

    fn owner_of(rollout: &Arc<Rollout>) -> usize {
        Arc::as_ptr(rollout) as usize
    }

    /// Removes a waiting upcall when its handler goes away unanswered.
    struct Forget<'a>(&'a Pending<Sink>, u64);

    impl Drop for Forget<'_> {
        fn drop(&mut self) {
            self.0.forget(self.1);
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

    fn closing_plane(flavour: ErrorFlavour) -> Response<ResBody> {
        error(flavour, 503, "the data plane is closing")
    }

    /// What an intercept upcall carries of the call.
    pub(crate) struct Intercepted<'a> {
        /// The call's id (its record's `request_id`).
        pub(crate) request_id: &'a Arc<str>,
        /// Its headers, without the secret ([`crate::server::hook_headers`]).
        pub(crate) headers: Vec<(Bytes, Bytes)>,
        /// Its validated body.
        pub(crate) body: Bytes,
    }

    /// An intercepted call: hand its headers (without the secret) and body
    /// to the control plane, then the
    /// body to forward with its parse (`reparse`, the handler's own parse, of
    /// a changed body), or the response that ends the call.
    pub(crate) async fn intercept(
        sh: &Shared,
        rollout: &Arc<Rollout>,
        spec: &ProtocolSpec,
        call: Intercepted<'_>,
        parsed: ParsedRequest,
        reparse: impl Fn(&[u8]) -> Result<ParsedRequest, BadRequest>,
    ) -> Result<(Bytes, ParsedRequest), Response<ResBody>> {
        let upcall = Upcall {
            id: 0,
            kind: UpcallKind::Intercept,
            rollout_id: Some(Arc::clone(&rollout.id)),
            request_id: Some(Arc::clone(call.request_id)),
            protocol: Some(spec.name.clone()),
            method: "POST".into(),
            path: spec.path.clone(),
            headers: call.headers,
            body: call.body.clone(),
        };
        let body = call.body;
        let refused = || sh.counters.refused.fetch_add(1, Ordering::Relaxed);
        match sh.upcalls.ask(Some(rollout), upcall).await {
            Answer::Resume(None) => Ok((body, parsed)),
            Answer::Resume(Some(new)) => match reparse(&new) {
                Ok(p) => Ok((new, p)),
                Err(bad) => {
                    refused();
                    Err(error(spec.flavour, 400, &format!("the intercepted request: {}", bad.0)))
                }
            },
            Answer::Reject(status, message) => {
                refused();
                Err(error(spec.flavour, status, &message))
            }
            Answer::Gone => {
                sh.counters.closed.fetch_add(1, Ordering::Relaxed);
                Err(error(spec.flavour, 410, &format!("rollout {} was closed", rollout.id)))
            }
            Answer::Closing | Answer::Respond(..) => Err(closing_plane(spec.flavour)),
        }
    }

    /// A request to a Python route: read its body, hand it over, relay the answer.
    pub(crate) async fn route(sh: &Shared, req: Request<Incoming>) -> Response<ResBody> {
        let (head, incoming) = req.into_parts();
        let declared =
            head.headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.trim().parse().ok());
        let flavour = ErrorFlavour::OpenAi;
        let closing = |mut r: Response<ResBody>| {
            r.headers_mut().insert(CONNECTION, HeaderValue::from_static("close"));
            r
        };
        // No table to read into: a route's body is Python's, not a held call's.
        let body = match read_limited(incoming, declared, sh.max_body_bytes, sh.body_read_timeout, None).await {
            Ok(b) => b.into_bytes(),
            Err(BodyError::TooLarge) => {
                let why = format!("request body over the limit of {} bytes", sh.max_body_bytes);
                return closing(error(flavour, 413, &why));
            }
            Err(BodyError::Cut(why)) => return closing(error(flavour, 400, &why)),
            Err(BodyError::TimedOut) => {
                let why = format!("request body not received within {} s", sh.body_read_timeout.as_secs_f64());
                return closing(error(flavour, 408, &why));
            }
            Err(BodyError::Unheld(why)) => return error(flavour, 503, &why),
        };
        let headers = head
            .headers
            .iter()
            .map(|(k, v)| (Bytes::copy_from_slice(k.as_str().as_bytes()), Bytes::copy_from_slice(v.as_bytes())))
            .collect();
        let path = head.uri.path_and_query().map_or_else(|| head.uri.path().to_owned(), |pq| pq.as_str().to_owned());
        let upcall = Upcall {
            id: 0,
            kind: UpcallKind::Route,
            rollout_id: None,
            request_id: None,
            protocol: None,
            method: head.method.as_str().to_owned(),
            path,
            headers,
            body,
        };
        match sh.upcalls.ask(None, upcall).await {
            Answer::Respond(status, headers, body) => {
                let mut r = Response::new(ResBody::full(body));
                *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
                *r.headers_mut() = headers;
                r
            }
            _ => closing_plane(flavour),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn one_taker_per_entry() {
        let p: Pending<u8> = Pending::new();
        let a = p.insert(Some(1), UpcallKind::Intercept, 10).unwrap();
        let b = p.insert(Some(2), UpcallKind::Intercept, 20).unwrap();
        let c = p.insert(None, UpcallKind::Route, 30).unwrap();
        assert_eq!(p.take(c, UpcallKind::Intercept), Err(AnswerError::WrongKind { id: c, is: UpcallKind::Route }));
        assert_eq!(p.len(), 3, "a wrong-kind answer leaves the upcall waiting");
        assert_eq!(p.take(a, UpcallKind::Intercept), Ok(Some(10)));
        assert_eq!(p.take(a, UpcallKind::Intercept), Ok(None));
        assert_eq!(p.take_owner(2), vec![20]);
        assert_eq!(p.take(b, UpcallKind::Intercept), Ok(None));
        assert!(p.forget(c));
        assert!(!p.forget(c));
        assert!(p.is_empty());
        let d = p.insert(None, UpcallKind::Route, 40).unwrap();
        assert_eq!(p.close(), vec![40]);
        assert_eq!(p.take(d, UpcallKind::Route), Ok(None));
        assert_eq!(p.insert(None, UpcallKind::Route, 50), Err(TableClosed));
    }
}
