//! Named Python exceptions, and the guard that keeps Rust panics out of Python.
//!
//! A Rust panic reaching Python becomes pyo3's `PanicException`, a
//! `BaseException` that `except Exception` does not catch: a trainer's error
//! handling would miss it and tear down the whole step.  Every entry point runs
//! inside [`guarded`], which turns a panic into `lowwater.InternalError`.

use std::panic::{catch_unwind, AssertUnwindSafe};

use lowwater_core::TableError;
use pyo3::exceptions::{PyException, PyKeyError, PyMemoryError, PyValueError};
use pyo3::prelude::*;

pyo3::create_exception!(
    lowwater,
    LowwaterError,
    PyException,
    "Base class of every error lowwater's extension raises on purpose."
);
pyo3::create_exception!(
    lowwater,
    BufferFull,
    LowwaterError,
    "An insert would exceed the table's capacity_bytes; nothing was evicted."
);
pyo3::create_exception!(
    lowwater,
    RolloutClosed,
    LowwaterError,
    "An intercept was inserted for a rollout that is not open."
);
pyo3::create_exception!(
    lowwater,
    DataPlaneConfigError,
    LowwaterError,
    "The data plane cannot start with this configuration (bad upstream URL, https without TLS, a zero limit)."
);
pyo3::create_exception!(lowwater, DataPlaneClosed, LowwaterError, "A method of a DataPlane was called after close().");
pyo3::create_exception!(lowwater, DuplicateRollout, LowwaterError, "register() of a rollout id that is open already.");
pyo3::create_exception!(lowwater, DuplicateSecret, LowwaterError, "register() with a secret another open rollout has.");
pyo3::create_exception!(lowwater, InternalError, LowwaterError, "A bug in lowwater's extension (a caught Rust panic).");

pub(crate) fn to_py(err: TableError) -> PyErr {
    let msg = err.to_string();
    match err {
        TableError::Full { .. } => BufferFull::new_err(msg),
        TableError::Duplicate { key } => PyKeyError::new_err(format!("{key:?} is already held")),
        TableError::RolloutClosed { .. } => RolloutClosed::new_err(msg),
        TableError::Invalid { .. } => PyValueError::new_err(msg),
        TableError::Alloc { .. } => PyMemoryError::new_err(msg),
    }
}

/// Run `f`, turning a panic into `InternalError` instead of letting it cross.
pub(crate) fn guarded<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(InternalError::new_err(format!("internal error in lowwater._native: {what}")))
        }
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("LowwaterError", py.get_type::<LowwaterError>())?;
    m.add("BufferFull", py.get_type::<BufferFull>())?;
    m.add("RolloutClosed", py.get_type::<RolloutClosed>())?;
    m.add("DataPlaneConfigError", py.get_type::<DataPlaneConfigError>())?;
    m.add("DataPlaneClosed", py.get_type::<DataPlaneClosed>())?;
    m.add("DuplicateRollout", py.get_type::<DuplicateRollout>())?;
    m.add("DuplicateSecret", py.get_type::<DuplicateSecret>())?;
    m.add("InternalError", py.get_type::<InternalError>())?;
    Ok(())
}
