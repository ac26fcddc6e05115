//! Python binding of the shard fetch buffer.

use std::os::raw::c_int;
use std::sync::Arc;

use lowwater_core::{FetchBuffer as CoreBuffer, Shard};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};

use crate::buffer::{export, Borrowed, DETACH_BYTES};
use crate::errors::{guarded, to_py};

pub(crate) fn non_negative(name: &str, value: i64) -> PyResult<u64> {
    u64::try_from(value).map_err(|_| PyValueError::new_err(format!("{name} must be >= 0, got {value}")))
}

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

#[pymethods]
impl ShardView {
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
    fn nbytes(&self) -> usize {
        self.shard.payload.len()
    }
    #[getter]
    fn owner(&self) -> &str {
        &self.shard.owner
    }
    fn __len__(&self) -> usize {
        self.shard.payload.len()
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
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        let bytes = slf.get().shard.payload.as_slice();
        // SAFETY: the payload is immutable and owned (through the Arc) by `slf`,
        // which the filled view references until it is released.
        unsafe { export(slf.as_ptr(), bytes, view, flags, slf.py()) }
    }
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}
}

/// The shard fetch buffer: `shard_id -> shard` with explicit eviction only.
#[pyclass(frozen, module = "lowwater")]
pub struct FetchBuffer {
    inner: CoreBuffer,
}

#[pymethods]
impl FetchBuffer {
    #[new]
    #[pyo3(signature = (capacity_bytes = None, mmap_threshold = 1 << 20))]
    fn new(capacity_bytes: Option<i64>, mmap_threshold: i64) -> PyResult<Self> {
        let capacity = capacity_bytes.map(|c| non_negative("capacity_bytes", c)).transpose()?;
        let threshold = non_negative("mmap_threshold", mmap_threshold)? as usize;
        Ok(FetchBuffer { inner: CoreBuffer::new(capacity, threshold) })
    }

    #[getter]
    fn capacity_bytes(&self) -> Option<u64> {
        self.inner.capacity_bytes()
    }

    #[getter]
    fn mmap_threshold(&self) -> usize {
        self.inner.mmap_threshold()
    }

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

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("entries", s.entries)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("peak_bytes", s.peak_bytes)?;
        d.set_item("live_bytes", s.live_bytes)?;
        d.set_item("inserts", s.inserts)?;
        d.set_item("hits", s.hits)?;
        d.set_item("misses", s.misses)?;
        d.set_item("removals", s.removals)?;
        d.set_item("rejected", s.rejected)?;
        Ok(d)
    }

    fn keys(&self) -> Vec<String> {
        self.inner.keys().iter().map(|k| k.to_string()).collect()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __contains__(&self, shard_id: &Bound<'_, PyAny>) -> bool {
        match shard_id.cast::<PyString>() {
            Ok(s) => s.to_str().map(|s| self.inner.contains(s)).unwrap_or(false),
            Err(_) => false,
        }
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
