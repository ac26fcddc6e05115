//! Python binding of the intercept table.

use std::os::raw::c_int;
use std::sync::Arc;
use std::time::Duration;

use lowwater_core::{Intercept, InterceptTable as CoreTable};
use pyo3::exceptions::PyValueError;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::buffer::{export, Borrowed, DETACH_BYTES};
use crate::errors::{guarded, to_py};
use crate::fetch_buffer::non_negative;

/// Read-only zero-copy view of one intercepted request body.
#[pyclass(frozen, module = "lowwater")]
pub struct InterceptView {
    intercept: Arc<Intercept>,
}

#[pymethods]
impl InterceptView {
    #[getter]
    fn request_id(&self) -> &str {
        &self.intercept.request_id
    }
    #[getter]
    fn rollout_id(&self) -> &str {
        &self.intercept.rollout_id
    }
    #[getter]
    fn protocol(&self) -> &str {
        &self.intercept.protocol
    }
    #[getter]
    fn stream(&self) -> bool {
        self.intercept.stream
    }
    #[getter]
    fn nbytes(&self) -> usize {
        self.intercept.payload.len()
    }
    /// Seconds since the intercept was inserted.
    #[getter]
    fn age_s(&self) -> f64 {
        self.intercept.age().as_secs_f64()
    }
    fn __len__(&self) -> usize {
        self.intercept.payload.len()
    }
    fn __repr__(&self) -> String {
        format!(
            "InterceptView(request_id={:?}, rollout_id={:?}, protocol={:?}, stream={}, nbytes={})",
            &*self.intercept.request_id,
            &*self.intercept.rollout_id,
            &*self.intercept.protocol,
            self.intercept.stream,
            self.intercept.payload.len()
        )
    }
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let bytes = slf.get().intercept.payload.as_slice();
        // SAFETY: the body is immutable and owned (through the Arc) by `slf`.
        unsafe { export(slf.as_ptr(), bytes, view, flags, slf.py()) }
    }
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// The intercept table: `request_id -> intercept` for in-flight model calls.
#[pyclass(frozen, module = "lowwater")]
pub struct InterceptTable {
    inner: CoreTable,
}

#[pymethods]
impl InterceptTable {
    #[new]
    #[pyo3(signature = (capacity_bytes = None, mmap_threshold = 1 << 20))]
    fn new(capacity_bytes: Option<i64>, mmap_threshold: i64) -> PyResult<Self> {
        let capacity = capacity_bytes.map(|c| non_negative("capacity_bytes", c)).transpose()?;
        let threshold = non_negative("mmap_threshold", mmap_threshold)? as usize;
        Ok(InterceptTable { inner: CoreTable::new(capacity, threshold) })
    }

    #[getter]
    fn capacity_bytes(&self) -> Option<u64> {
        self.inner.capacity_bytes()
    }

    #[getter]
    fn mmap_threshold(&self) -> usize {
        self.inner.mmap_threshold()
    }

    fn open_rollout(&self, rollout_id: &str) -> PyResult<()> {
        guarded(|| {
            self.inner.open_rollout(rollout_id);
            Ok(())
        })
    }

    fn close_rollout(&self, py: Python<'_>, rollout_id: &str) -> PyResult<Vec<String>> {
        guarded(|| Ok(py.detach(|| self.inner.close_rollout(rollout_id))))
    }

    fn is_open(&self, rollout_id: &str) -> bool {
        self.inner.is_open(rollout_id)
    }

    #[pyo3(signature = (request_id, rollout_id, body, *, protocol, stream))]
    fn insert(
        &self,
        py: Python<'_>,
        request_id: &str,
        rollout_id: &str,
        body: &Bound<'_, PyAny>,
        protocol: &str,
        stream: bool,
    ) -> PyResult<()> {
        guarded(|| {
            let src = Borrowed::new(body, "body")?;
            let bytes = src.as_slice();
            let insert = || self.inner.insert(request_id, rollout_id, bytes, protocol, stream);
            let result = if bytes.len() >= DETACH_BYTES { py.detach(insert) } else { insert() };
            result.map_err(to_py)
        })
    }

    fn get(&self, request_id: &str) -> PyResult<Option<InterceptView>> {
        guarded(|| Ok(self.inner.get(request_id).map(|intercept| InterceptView { intercept })))
    }

    fn discard(&self, request_id: &str) -> PyResult<bool> {
        guarded(|| Ok(self.inner.discard(request_id)))
    }

    fn stale(&self, older_than_s: f64) -> PyResult<Vec<String>> {
        if !older_than_s.is_finite() || older_than_s < 0.0 {
            return Err(PyValueError::new_err(format!(
                "older_than_s must be a finite number >= 0, got {older_than_s}"
            )));
        }
        guarded(|| Ok(self.inner.stale(Duration::from_secs_f64(older_than_s))))
    }

    fn rollout_requests(&self, rollout_id: &str) -> PyResult<Vec<String>> {
        guarded(|| Ok(self.inner.rollout_requests(rollout_id)))
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("entries", s.entries)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("peak_bytes", s.peak_bytes)?;
        d.set_item("live_bytes", s.live_bytes)?;
        d.set_item("open_rollouts", s.open_rollouts)?;
        d.set_item("inserts", s.inserts)?;
        d.set_item("discards", s.discards)?;
        d.set_item("swept", s.swept)?;
        d.set_item("rejected", s.rejected)?;
        Ok(d)
    }

    fn keys(&self) -> Vec<String> {
        self.inner.keys().iter().map(|k| k.to_string()).collect()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __contains__(&self, request_id: &Bound<'_, PyAny>) -> bool {
        match request_id.cast::<PyString>() {
            Ok(s) => s.to_str().map(|s| self.inner.contains(s)).unwrap_or(false),
            Err(_) => false,
        }
    }

    fn __repr__(&self) -> String {
        let s = self.inner.stats();
        format!("InterceptTable(entries={}, bytes={}, open_rollouts={})", s.entries, s.bytes, s.open_rollouts)
    }
}
