//! Python binding of the intercept table.

use std::sync::Arc;
use std::time::Duration;

use lowwater_core::{Intercept, InterceptTable as CoreTable};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::buffer::{view_pymethods, Borrowed, DETACH_BYTES};
use crate::errors::{guarded, to_py};
use crate::table::table_pymethods;

/// Read-only zero-copy view of one intercepted request body.
#[pyclass(frozen, module = "lowwater")]
pub struct InterceptView {
    intercept: Arc<Intercept>,
}

view_pymethods! {
    InterceptView, intercept,

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
    /// Seconds since the intercept was inserted.
    #[getter]
    fn age_s(&self) -> f64 {
        self.intercept.age().as_secs_f64()
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
}

/// The intercept table: `request_id -> intercept` for in-flight model calls.
#[pyclass(frozen, module = "lowwater")]
pub struct InterceptTable {
    /// Shared with a `DataPlane` given this table, which holds its calls'
    /// request bodies in it.
    pub(crate) inner: Arc<CoreTable>,
}

table_pymethods! {
    InterceptTable, CoreTable,
    stats: [entries, bytes, peak_bytes, live_bytes, open_rollouts, inserts, discards, swept, rejected],

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

    fn __repr__(&self) -> String {
        let s = self.inner.stats();
        format!("InterceptTable(entries={}, bytes={}, open_rollouts={})", s.entries, s.bytes, s.open_rollouts)
    }
}
