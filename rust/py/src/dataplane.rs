//! Python binding of the interception data plane (`lowwater-dataplane`).
//!
//! Conversion only: the Python arguments to a [`Config`], records to
//! [`TurnRecord`] objects, the crate's errors to named exceptions.  Every wait
//! (start, close's join) runs with the GIL released: the data plane's threads
//! never take the GIL, but the Trio loop that serves the control plane (and,
//! in tests, the upstream) must keep running meanwhile.

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};
use std::time::Duration;

use lowwater_core::InterceptTable as CoreTable;
use lowwater_dataplane::{
    AnswerError, Config, DataPlane as Plane, Intercept, ProtocolTable, RegisterError, Rewrites, RolloutOptions,
    StartError,
};
use pyo3::exceptions::{PyKeyError, PyOSError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyList, PyMapping, PyTuple};

use crate::errors::{guarded, DataPlaneClosed, DataPlaneConfigError, DuplicateRollout, DuplicateSecret};
use crate::intercept::InterceptTable;
use crate::protocols::{spec_dict, WireSpec};

/// How long `close()` waits for the runtime's threads to finish their
/// current task: tasks are cancelled at their next await, so this is reached
/// only by a bug; past it the threads are left to exit on their own.
const JOIN_TIMEOUT: Duration = Duration::from_secs(10);

fn secs(name: &str, value: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value)
        .map_err(|_| PyValueError::new_err(format!("{name} must be a finite number of seconds >= 0, got {value}")))
}

fn start_error(err: StartError) -> PyErr {
    match err {
        StartError::Config(e) => DataPlaneConfigError::new_err(e.to_string()),
        // OSError with the errno, so EADDRINUSE is an OSError subclass check away.
        StartError::Io(e) => PyErr::from(e),
    }
}

fn register_error(err: RegisterError) -> PyErr {
    let msg = err.to_string();
    match err {
        RegisterError::DuplicateRollout(_) => DuplicateRollout::new_err(msg),
        RegisterError::DuplicateSecret => DuplicateSecret::new_err(msg),
        RegisterError::Empty => PyValueError::new_err(msg),
        RegisterError::Config(_) => DataPlaneConfigError::new_err(msg),
    }
}

/// A mapping's items, in its order (rules apply in the order given).
fn items<'py>(what: &str, obj: &Bound<'py, PyAny>) -> PyResult<Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>)>> {
    let m = obj.cast::<PyMapping>().map_err(|_| PyTypeError::new_err(format!("{what} must be a mapping")))?;
    m.items()?.iter().map(|kv| kv.extract()).collect()
}

/// `{protocol: {"set": {key: json}, "defaults": {key: (json, aliases)},
/// "append": {key: json}}}` as the crate's rewrites.
fn rewrites(obj: Option<&Bound<'_, PyAny>>) -> PyResult<HashMap<String, Rewrites>> {
    let mut out = HashMap::new();
    let Some(obj) = obj else { return Ok(out) };
    for (name, sections) in items("rewrites", obj)? {
        let name: String = name.extract()?;
        let mut rules = Rewrites::new();
        for (section, entries) in items(&format!("rewrites[{name:?}]"), &sections)? {
            let section: String = section.extract()?;
            for (key, value) in items(&format!("rewrites[{name:?}][{section:?}]"), &entries)? {
                let key: String = key.extract()?;
                let added = match section.as_str() {
                    "set" => rules.set(&key, &value.extract::<String>()?).map(drop),
                    "append" => rules.append(&key, &value.extract::<String>()?).map(drop),
                    "defaults" => {
                        let (json, aliases): (String, Vec<String>) = value.extract()?;
                        let aliases: Vec<&str> = aliases.iter().map(String::as_str).collect();
                        rules.defaults(&key, &json, &aliases).map(drop)
                    }
                    other => {
                        let why = format!("rewrites[{name:?}]: unknown rule kind {other:?} (set, defaults, append)");
                        return Err(DataPlaneConfigError::new_err(why));
                    }
                };
                added.map_err(|e| DataPlaneConfigError::new_err(e.to_string()))?;
            }
        }
        out.insert(name, rules);
    }
    Ok(out)
}

/// One recorded model call, as drained from the data plane.
#[pyclass(frozen, get_all, module = "lowwater")]
pub struct TurnRecord {
    seq: u64,
    rollout_id: String,
    request_id: String,
    protocol: String,
    protocol_id: u16,
    model: String,
    streamed: bool,
    kept: usize,
    previous: usize,
    messages: Py<PyTuple>,
    tools: Option<Py<PyBytes>>,
    status: u16,
    response: Py<PyBytes>,
    error: Option<String>,
    started_s: f64,
    upstream_s: f64,
    duration_s: f64,
}

#[pymethods]
impl TurnRecord {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "TurnRecord(seq={}, rollout_id={:?}, protocol={:?}, status={}, streamed={}, kept={}, previous={}, \
             messages={})",
            self.seq,
            self.rollout_id,
            self.protocol,
            self.status,
            self.streamed,
            self.kept,
            self.previous,
            self.messages.bind(py).len()
        )
    }
}

fn answer_error(err: AnswerError) -> PyErr {
    PyValueError::new_err(err.to_string())
}

/// `intercept=`: a bool (every protocol or none) or protocol names.
fn intercept_of(value: &Bound<'_, PyAny>) -> PyResult<Intercept> {
    if let Ok(b) = value.cast::<PyBool>() {
        return Ok(if b.is_true() { Intercept::All } else { Intercept::Off });
    }
    if value.is_instance_of::<pyo3::types::PyString>() {
        return Err(PyTypeError::new_err("intercept must be a bool or a list of protocol names, not a str"));
    }
    let names: Vec<String> =
        value.extract().map_err(|_| PyTypeError::new_err("intercept must be a bool or a list of protocol names"))?;
    Ok(Intercept::Protocols(names))
}

/// One request the data plane hands to the control plane and waits on.
#[pyclass(frozen, get_all, module = "lowwater")]
pub struct Upcall {
    id: u64,
    kind: &'static str,
    rollout_id: Option<String>,
    request_id: Option<String>,
    protocol: Option<String>,
    method: String,
    path: String,
    headers: Py<PyList>,
    body: Py<PyBytes>,
}

#[pymethods]
impl Upcall {
    fn __repr__(&self) -> String {
        format!(
            "Upcall(id={}, kind={:?}, rollout_id={:?}, protocol={:?}, method={:?}, path={:?})",
            self.id, self.kind, self.rollout_id, self.protocol, self.method, self.path
        )
    }
}

/// The interception data plane: an HTTP server on its own tokio runtime.
#[pyclass(frozen, module = "lowwater")]
pub struct DataPlane {
    /// `None` once closed.  Methods hold the read lock only for the crate
    /// call (never while making Python objects); `close` takes the write lock
    /// with the GIL released, only to take the plane out.
    plane: RwLock<Option<Plane>>,
    address: String,
    /// The intercept table the plane holds bodies in (given or made at start).
    table: Py<InterceptTable>,
}

impl DataPlane {
    fn open(&self) -> PyResult<RwLockReadGuard<'_, Option<Plane>>> {
        let guard = self.plane.read().unwrap_or_else(PoisonError::into_inner);
        if guard.is_none() {
            return Err(DataPlaneClosed::new_err("the data plane is closed"));
        }
        Ok(guard)
    }

    fn with<T>(&self, f: impl FnOnce(&Plane) -> PyResult<T>) -> PyResult<T> {
        guarded(|| {
            let guard = self.open()?;
            match guard.as_ref() {
                Some(plane) => f(plane),
                None => Err(DataPlaneClosed::new_err("the data plane is closed")),
            }
        })
    }
}

#[pymethods]
impl DataPlane {
    #[new]
    #[pyo3(signature = (
        upstream,
        *,
        api_key = None,
        host = "127.0.0.1",
        port = 0,
        max_body_bytes = 64 << 20,
        max_response_bytes = 256 << 20,
        body_read_timeout_s = 60.0,
        upstream_timeout_s = 600.0,
        retries = 3,
        backoff_s = 0.5,
        max_backoff_s = 8.0,
        max_concurrency = 1024,
        pool_idle_timeout_s = 5.0,
        hold_for_ack = true,
        release_when_readable = false,
        worker_threads = None,
        table = None,
        protocols = None,
        rewrites = None,
        intercept = None,
        python_routes = Vec::new(),
        trim_when_idle = true,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        upstream: String,
        api_key: Option<String>,
        host: &str,
        port: u16,
        max_body_bytes: usize,
        max_response_bytes: usize,
        body_read_timeout_s: f64,
        upstream_timeout_s: f64,
        retries: u32,
        backoff_s: f64,
        max_backoff_s: f64,
        max_concurrency: usize,
        pool_idle_timeout_s: f64,
        hold_for_ack: bool,
        release_when_readable: bool,
        worker_threads: Option<usize>,
        table: Option<Py<InterceptTable>>,
        protocols: Option<Vec<WireSpec>>,
        rewrites: Option<&Bound<'_, PyAny>>,
        intercept: Option<&Bound<'_, PyAny>>,
        python_routes: Vec<String>,
        trim_when_idle: bool,
    ) -> PyResult<Self> {
        guarded(|| {
            let mut config = Config::new(upstream);
            config.rewrites = self::rewrites(rewrites)?;
            config.upstream_key = api_key;
            config.max_body_bytes = max_body_bytes;
            config.max_response_bytes = max_response_bytes;
            config.body_read_timeout = secs("body_read_timeout_s", body_read_timeout_s)?;
            config.upstream_timeout = secs("upstream_timeout_s", upstream_timeout_s)?;
            config.retries = retries;
            config.backoff = secs("backoff_s", backoff_s)?;
            config.max_backoff = secs("max_backoff_s", max_backoff_s)?;
            config.max_concurrency = max_concurrency;
            config.pool_idle_timeout = secs("pool_idle_timeout_s", pool_idle_timeout_s)?;
            config.hold_for_ack = hold_for_ack;
            config.release_when_readable = release_when_readable;
            if let Some(n) = worker_threads {
                config.worker_threads = n;
            }
            let table = match table {
                Some(t) => t,
                None => Py::new(py, InterceptTable { inner: Arc::new(CoreTable::new(None, 1 << 20)) })?,
            };
            config.table = Some(Arc::clone(&table.get().inner));
            if let Some(wires) = protocols {
                let specs = wires.into_iter().map(WireSpec::into_spec).collect::<PyResult<Vec<_>>>()?;
                config.protocols =
                    ProtocolTable::new(specs).map_err(|e| DataPlaneConfigError::new_err(e.to_string()))?;
            }
            config.intercept = intercept.map(intercept_of).transpose()?.unwrap_or_default();
            config.python_routes = python_routes;
            config.trim_when_idle = trim_when_idle;
            let host = host.to_owned();
            // Name resolution and the runtime's start can block: GIL released.
            let plane = py.detach(move || -> PyResult<Plane> {
                let listen: SocketAddr = (host.as_str(), port)
                    .to_socket_addrs()
                    .map_err(PyErr::from)?
                    .next()
                    .ok_or_else(|| PyOSError::new_err(format!("{host:?} resolves to no address")))?;
                Plane::start(config, listen).map_err(start_error)
            })?;
            let address = plane.local_addr().to_string();
            Ok(DataPlane { plane: RwLock::new(Some(plane)), address, table })
        })
    }

    /// `"host:port"` the server listens on (the port chosen when 0 was asked).
    #[getter]
    fn address(&self) -> &str {
        &self.address
    }

    /// The protocol table, in order (a record's `protocol_id` indexes it),
    /// each as `Protocol.data_plane_spec()` gives it.
    #[getter]
    fn protocols<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let specs: Vec<_> =
            self.with(|p| Ok((0..p.protocols().len()).filter_map(|i| p.protocols().get(i as u16).cloned()).collect()))?;
        specs.iter().map(|s| spec_dict(py, s)).collect()
    }

    /// The intercept table holding the in-flight calls' request bodies.
    #[getter]
    fn table(&self, py: Python<'_>) -> Py<InterceptTable> {
        self.table.clone_ref(py)
    }

    #[getter]
    fn closed(&self) -> bool {
        self.plane.read().unwrap_or_else(PoisonError::into_inner).is_none()
    }

    #[pyo3(signature = (rollout_id, secret, *, upstream = None, api_key = None, model = None))]
    fn register(
        &self,
        rollout_id: &str,
        secret: &str,
        upstream: Option<String>,
        api_key: Option<String>,
        model: Option<String>,
    ) -> PyResult<()> {
        let options = RolloutOptions { upstream, api_key, model };
        self.with(|p| p.register_with(rollout_id, secret, &options).map_err(register_error))
    }

    fn unregister(&self, rollout_id: &str) -> PyResult<usize> {
        self.with(|p| {
            p.unregister(rollout_id).ok_or_else(|| PyKeyError::new_err(format!("rollout {rollout_id:?} is not open")))
        })
    }

    fn wakeup_fd(&self) -> PyResult<i32> {
        self.with(|p| Ok(p.queue().wakeup_fd()))
    }

    fn drain(&self, py: Python<'_>) -> PyResult<Vec<TurnRecord>> {
        // Taken under the read lock, converted after it is dropped.
        let (records, names) = self.with(|p| {
            let names: Vec<String> = (0..p.protocols().len())
                .map(|i| p.protocols().get(i as u16).map(|s| s.name.clone()).unwrap_or_default())
                .collect();
            Ok((p.queue().drain(), names))
        })?;
        guarded(|| {
            records
                .into_iter()
                .map(|r| {
                    let messages = PyTuple::new(py, r.request.messages.iter().map(|m| PyBytes::new(py, m)))?;
                    Ok(TurnRecord {
                        seq: r.seq,
                        rollout_id: r.rollout_id.to_string(),
                        request_id: r.request_id.to_string(),
                        protocol: names.get(r.protocol as usize).cloned().unwrap_or_default(),
                        protocol_id: r.protocol,
                        model: r.model,
                        streamed: r.streamed,
                        kept: r.request.kept,
                        previous: r.request.previous,
                        messages: messages.unbind(),
                        tools: r.tools.map(|t| PyBytes::new(py, &t).unbind()),
                        status: r.status,
                        response: PyBytes::new(py, &r.response).unbind(),
                        error: r.error,
                        started_s: r.timings.started_s,
                        upstream_s: r.timings.upstream_s,
                        duration_s: r.timings.duration_s,
                    })
                })
                .collect()
        })
    }

    fn set_rewrites(&self, rewrites: &Bound<'_, PyAny>) -> PyResult<()> {
        let rules = self::rewrites(Some(rewrites))?;
        self.with(|p| p.set_rewrites(rules).map_err(|e| DataPlaneConfigError::new_err(e.to_string())))
    }

    fn set_intercept(&self, intercept: &Bound<'_, PyAny>) -> PyResult<()> {
        let intercept = intercept_of(intercept)?;
        self.with(|p| p.set_intercept(&intercept).map_err(|e| DataPlaneConfigError::new_err(e.to_string())))
    }

    fn ack(&self, seq: u64) -> PyResult<bool> {
        self.with(|p| Ok(p.queue().ack(seq)))
    }

    fn fail(&self, seq: u64, status: u16, reason: &str) -> PyResult<bool> {
        if !(400..=599).contains(&status) {
            return Err(PyValueError::new_err(format!("status must be 400-599, got {status}")));
        }
        self.with(|p| Ok(p.queue().fail(seq, status, reason)))
    }

    fn release_all(&self) -> PyResult<usize> {
        self.with(|p| Ok(p.queue().release_all()))
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with(|p| Ok(p.stats()))?;
        let d = PyDict::new(py);
        d.set_item("open_rollouts", s.open_rollouts)?;
        d.set_item("secrets", s.secrets)?;
        d.set_item("in_flight", s.in_flight)?;
        d.set_item("active_calls", s.active_calls)?;
        d.set_item("connections", s.connections)?;
        d.set_item("queued", s.queued)?;
        d.set_item("awaiting_ack", s.awaiting_ack)?;
        d.set_item("released", s.released)?;
        d.set_item("calls", s.calls)?;
        d.set_item("ok", s.ok)?;
        d.set_item("failed", s.failed)?;
        d.set_item("closed", s.closed)?;
        d.set_item("disconnected", s.disconnected)?;
        d.set_item("refused", s.refused)?;
        d.set_item("intercepts", s.intercepts)?;
        d.set_item("intercept_bytes", s.intercept_bytes)?;
        d.set_item("upstream_requests", s.upstream_requests)?;
        d.set_item("upstream_retried", s.upstream_retried)?;
        d.set_item("pending_upcalls", s.pending_upcalls)?;
        d.set_item("upcalls", s.upcalls)?;
        d.set_item("trims", s.trims)?;
        Ok(d)
    }

    fn upcall_fd(&self) -> PyResult<i32> {
        self.with(|p| Ok(p.upcalls().wakeup_fd()))
    }

    fn drain_upcalls(&self, py: Python<'_>) -> PyResult<Vec<Upcall>> {
        // Taken under the read lock, converted after it is dropped.
        let upcalls = self.with(|p| Ok(p.upcalls().drain()))?;
        guarded(|| {
            upcalls
                .into_iter()
                .map(|u| {
                    let headers = PyList::empty(py);
                    for (k, v) in &u.headers {
                        headers.append((PyBytes::new(py, k), PyBytes::new(py, v)))?;
                    }
                    Ok(Upcall {
                        id: u.id,
                        kind: u.kind.as_str(),
                        rollout_id: u.rollout_id.map(|r| r.to_string()),
                        request_id: u.request_id.map(|r| r.to_string()),
                        protocol: u.protocol,
                        method: u.method,
                        path: u.path,
                        headers: headers.unbind(),
                        body: PyBytes::new(py, &u.body).unbind(),
                    })
                })
                .collect()
        })
    }

    #[pyo3(signature = (id, body = None))]
    fn resume(&self, id: u64, body: Option<&[u8]>) -> PyResult<bool> {
        let body = body.map(lowwater_dataplane::Bytes::copy_from_slice);
        self.with(|p| p.upcalls().resume(id, body).map_err(answer_error))
    }

    fn reject(&self, id: u64, status: u16, message: &str) -> PyResult<bool> {
        self.with(|p| p.upcalls().reject(id, status, message).map_err(answer_error))
    }

    #[pyo3(signature = (id, status, headers, body = b"".as_slice()))]
    fn respond(&self, id: u64, status: u16, headers: Vec<(Vec<u8>, Vec<u8>)>, body: &[u8]) -> PyResult<bool> {
        let pairs: Vec<(&[u8], &[u8])> = headers.iter().map(|(k, v)| (k.as_slice(), v.as_slice())).collect();
        let body = lowwater_dataplane::Bytes::copy_from_slice(body);
        self.with(|p| p.upcalls().respond(id, status, &pairs, body).map_err(answer_error))
    }

    fn close(&self, py: Python<'_>) -> PyResult<()> {
        guarded(|| {
            py.detach(|| {
                // Taken out first, joined after the lock is dropped: a method
                // called meanwhile raises DataPlaneClosed at once instead of
                // waiting (with the GIL) for the join.
                let plane = self.plane.write().unwrap_or_else(PoisonError::into_inner).take();
                if let Some(plane) = plane {
                    plane.shutdown_and_join(JOIN_TIMEOUT);
                }
            });
            Ok(())
        })
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _exc_type: &Bound<'_, PyAny>,
        _exc: &Bound<'_, PyAny>,
        _tb: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    fn __repr__(&self) -> String {
        format!("DataPlane(address={:?}, closed={})", self.address, self.closed())
    }
}
