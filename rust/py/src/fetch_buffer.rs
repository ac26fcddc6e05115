//! Python binding of the shard fetch buffer.

use std::ffi::c_void;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};

use lowwater_core::{FetchBuffer as CoreBuffer, PendingShard as CorePending, Shard};
use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple};

use crate::buffer::{view_pymethods, Borrowed, DETACH_BYTES};
use crate::errors::{guarded, to_py};
use crate::table::table_pymethods;

fn shape_repr(shape: &[usize]) -> String {
    match shape {
        [one] => format!("({one},)"),
        dims => format!("({})", dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    }
}

/// Read-only zero-copy view of one shard (buffer protocol); keeps the
/// payload alive after its entry is removed.
#[pyclass(frozen, module = "lowwater")]
pub struct ShardView {
    shard: Arc<Shard>,
}

view_pymethods! {
    ShardView, shard,

    #[getter]
    fn shard_id(&self) -> &str {
        &self.shard.id
    }
    #[getter]
    fn dtype(&self) -> &'static str {
        self.shard.dtype
    }
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.shard.shape.iter().copied())
    }
    #[getter]
    fn owner(&self) -> &str {
        &self.shard.owner
    }
    fn __repr__(&self) -> String {
        format!(
            "ShardView(shard_id={:?}, dtype={:?}, shape={}, nbytes={}, owner={:?})",
            &*self.shard.id,
            self.shard.dtype,
            shape_repr(&self.shard.shape),
            self.shard.payload.len(),
            &*self.shard.owner
        )
    }
}

/// A put in progress on a `FetchBuffer`: a writable buffer (the payload
/// itself) that is committed into the buffer or abandoned.  The payload's
/// memory is never freed or made read-only while a view of it is exported
/// (`commit` refuses with `BufferError` until every view is released), so a
/// view can never outlive it.
#[pyclass(frozen, module = "lowwater")]
pub struct PendingShard {
    buffer: Py<FetchBuffer>,
    pending: Mutex<Option<CorePending>>,
    exports: AtomicUsize,
}

impl PendingShard {
    fn take(&self, what: &str) -> PyResult<CorePending> {
        let mut slot = self.pending.lock().map_err(|_| PyValueError::new_err("pending shard lock poisoned"))?;
        if slot.is_none() {
            return Err(PyValueError::new_err(format!(
                "cannot {what}: this pending shard was already committed or abandoned"
            )));
        }
        if self.exports.load(AtomicOrdering::Acquire) != 0 {
            return Err(PyBufferError::new_err(format!(
                "cannot {what}: a view of the pending payload is still held (release every memoryview first)"
            )));
        }
        Ok(slot.take().expect("checked above"))
    }
}

#[pymethods]
impl PendingShard {
    #[getter]
    fn shard_id(&self) -> PyResult<String> {
        let slot = self.pending.lock().map_err(|_| PyValueError::new_err("pending shard lock poisoned"))?;
        Ok(slot.as_ref().map(|p| p.id().to_string()).unwrap_or_default())
    }

    #[getter]
    fn nbytes(&self) -> PyResult<usize> {
        let slot = self.pending.lock().map_err(|_| PyValueError::new_err("pending shard lock poisoned"))?;
        Ok(slot.as_ref().map_or(0, |p| p.len()))
    }

    fn __len__(&self) -> PyResult<usize> {
        self.nbytes()
    }

    /// Insert the filled payload into its buffer (replacing any shard of
    /// that id).  Raises `BufferError` while a view is held, `ValueError`
    /// when already committed or abandoned.
    fn commit(&self, py: Python<'_>) -> PyResult<()> {
        guarded(|| {
            let pending = self.take("commit")?;
            let buffer = self.buffer.bind(py).get();
            // Making a large mapping read-only and inserting run without the GIL.
            py.detach(|| buffer.inner.commit(pending)).map_err(to_py)
        })
    }

    /// Give the reservation back without inserting (idempotent).
    fn abandon(&self, py: Python<'_>) -> PyResult<()> {
        guarded(|| match self.take("abandon") {
            Ok(pending) => {
                let buffer = self.buffer.bind(py).get();
                py.detach(|| buffer.inner.abandon(pending));
                Ok(())
            }
            Err(e) if e.is_instance_of::<PyBufferError>(py) => Err(e),
            Err(_) => Ok(()),
        })
    }

    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let me = slf.get();
        let mut slot = me.pending.lock().map_err(|_| PyValueError::new_err("pending shard lock poisoned"))?;
        let Some(pending) = slot.as_mut() else {
            return Err(PyBufferError::new_err("this pending shard was already committed or abandoned"));
        };
        let bytes = pending.as_mut_slice();
        // SAFETY: the payload's memory does not move or go away while it is in
        // `pending` (a heap box or a mapping), and it cannot leave `pending`
        // while `exports` is non-zero (commit/abandon refuse); the view keeps
        // `slf` alive until released.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                bytes.as_mut_ptr() as *mut c_void,
                bytes.len() as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        me.exports.fetch_add(1, AtomicOrdering::AcqRel);
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        self.exports.fetch_sub(1, AtomicOrdering::AcqRel);
    }

    fn __repr__(&self) -> String {
        match self.pending.lock() {
            Ok(slot) => match slot.as_ref() {
                Some(p) => format!("PendingShard(shard_id={:?}, nbytes={})", p.id(), p.len()),
                None => "PendingShard(done)".to_string(),
            },
            Err(_) => "PendingShard(poisoned)".to_string(),
        }
    }
}

impl Drop for PendingShard {
    fn drop(&mut self) {
        // Neither committed nor abandoned: give the reservation back.
        if let Ok(slot) = self.pending.get_mut() {
            if let Some(pending) = slot.take() {
                Python::attach(|py| self.buffer.bind(py).get().inner.abandon(pending));
            }
        }
    }
}

/// The shard fetch buffer: `shard_id -> shard` with explicit eviction only.
#[pyclass(frozen, module = "lowwater")]
pub struct FetchBuffer {
    inner: CoreBuffer,
}

table_pymethods! {
    FetchBuffer, CoreBuffer,
    stats: [entries, bytes, peak_bytes, live_bytes, inserts, hits, misses, removals, rejected],

    #[pyo3(signature = (shard_id, data, *, dtype, shape, owner = ""))]
    fn put(
        &self,
        py: Python<'_>,
        shard_id: &str,
        data: &Bound<'_, PyAny>,
        dtype: &str,
        shape: &Bound<'_, PyAny>,
        owner: &str,
    ) -> PyResult<()> {
        guarded(|| {
            let mut stack = [0usize; 8];
            let mut heap = Vec::new();
            let dims = parse_shape(shape, &mut stack, &mut heap)?;
            let src = Borrowed::new(data, "data")?;
            let bytes = src.as_slice();
            let put = || self.inner.put(shard_id, bytes, dtype, dims, owner);
            let result = if bytes.len() >= DETACH_BYTES { py.detach(put) } else { put() };
            result.map_err(to_py)
        })
    }

    /// Start a put whose payload is written in place (a socket reads
    /// straight into it): returns a `PendingShard`, a writable buffer of
    /// `prod(shape) * itemsize(dtype)` zero bytes, to `commit()` or `abandon()`.
    #[pyo3(signature = (shard_id, *, dtype, shape, owner = ""))]
    fn reserve(
        slf: &Bound<'_, Self>,
        shard_id: &str,
        dtype: &str,
        shape: &Bound<'_, PyAny>,
        owner: &str,
    ) -> PyResult<PendingShard> {
        guarded(|| {
            let mut stack = [0usize; 8];
            let mut heap = Vec::new();
            let dims = parse_shape(shape, &mut stack, &mut heap)?;
            let pending = slf.get().inner.reserve(shard_id, dtype, dims, owner).map_err(to_py)?;
            Ok(PendingShard {
                buffer: slf.clone().unbind(),
                pending: Mutex::new(Some(pending)),
                exports: AtomicUsize::new(0),
            })
        })
    }

    fn get(&self, shard_id: &str) -> PyResult<Option<ShardView>> {
        guarded(|| Ok(self.inner.get(shard_id).map(|shard| ShardView { shard })))
    }

    fn pop(&self, shard_id: &str) -> PyResult<Option<ShardView>> {
        guarded(|| Ok(self.inner.pop(shard_id).map(|shard| ShardView { shard })))
    }

    #[pyo3(signature = (shard_ids = None))]
    fn clear(&self, py: Python<'_>, shard_ids: Option<&Bound<'_, PyAny>>) -> PyResult<usize> {
        guarded(|| {
            // Releasing large payloads (munmap) runs with the GIL released.
            match shard_ids {
                None => Ok(py.detach(|| self.inner.clear_all())),
                Some(ids) => {
                    let ids = id_list(ids, "shard_ids")?;
                    Ok(py.detach(|| self.inner.clear(&ids)))
                }
            }
        })
    }

    fn __repr__(&self) -> String {
        let s = self.inner.stats();
        format!("FetchBuffer(entries={}, bytes={}, live_bytes={})", s.entries, s.bytes, s.live_bytes)
    }
}

/// Dimensions from a tuple or list of non-negative ints, on the stack for up
/// to 8 dimensions (a 1 KiB put is dominated by such small costs).
fn parse_shape<'a>(
    shape: &Bound<'_, PyAny>,
    stack: &'a mut [usize; 8],
    heap: &'a mut Vec<usize>,
) -> PyResult<&'a [usize]> {
    let dim = |item: Bound<'_, PyAny>| -> PyResult<usize> {
        let d: i64 =
            item.extract().map_err(|_| PyTypeError::new_err(format!("shape must contain ints, got {shape}")))?;
        usize::try_from(d).map_err(|_| PyValueError::new_err(format!("shape {shape} has a negative dimension")))
    };
    if let Ok(t) = shape.cast::<PyTuple>() {
        if t.len() <= stack.len() {
            for (i, item) in t.iter().enumerate() {
                stack[i] = dim(item)?;
            }
            return Ok(&stack[..t.len()]);
        }
    }
    if shape.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err("shape must be a tuple of ints, not a str"));
    }
    for item in
        shape.try_iter().map_err(|_| PyTypeError::new_err(format!("shape must be a tuple of ints, got {shape}")))?
    {
        heap.push(dim(item?)?);
    }
    Ok(heap)
}

/// A list of ids from any iterable of str; a bare str is refused (iterating
/// it would clear one-character ids).
pub(crate) fn id_list(ids: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<String>> {
    if ids.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(format!("{what} must be an iterable of str, not a str")));
    }
    let mut out = Vec::new();
    for item in ids.try_iter()? {
        let item = item?;
        let s = item.cast::<PyString>().map_err(|_| {
            PyTypeError::new_err(format!(
                "{what} must contain str, got {}",
                item.get_type().name().map(|n| n.to_string()).unwrap_or_default()
            ))
        })?;
        out.push(s.to_str()?.to_owned());
    }
    Ok(out)
}
