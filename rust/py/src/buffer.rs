//! Reading and exporting bytes through Python's buffer protocol.

use std::ffi::c_void;
use std::os::raw::c_int;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;

/// Copies of at least this many bytes run with the GIL released: below it the
/// release/re-acquire costs more than the copy (measured by benches/tables.py
/// on 1 KiB shards).
pub(crate) const DETACH_BYTES: usize = 64 * 1024;

/// A borrowed C-contiguous byte view of any buffer-protocol object.
///
/// Non-contiguous exporters (a strided numpy slice) are copied once into a
/// contiguous scratch vector; contiguous ones are read in place.
pub(crate) struct Borrowed {
    view: Box<ffi::Py_buffer>,
    scratch: Option<Vec<u8>>,
}

impl Borrowed {
    pub(crate) fn new(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Self> {
        // SAFETY: Py_buffer is plain C data; zeroed is its documented initial state.
        let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
        // SAFETY: obj is a live object (we hold the GIL through `Bound`); on
        // success the view is released exactly once, in Drop.
        let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, ffi::PyBUF_FULL_RO) };
        if rc != 0 {
            let cause = PyErr::take(obj.py());
            let err = PyTypeError::new_err(format!(
                "{what} must support the buffer protocol (bytes, bytearray, memoryview, numpy array), got {}",
                obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
            ));
            if let Some(cause) = cause {
                err.set_cause(obj.py(), Some(cause));
            }
            return Err(err);
        }
        let mut me = Borrowed { view, scratch: None };
        // SAFETY: the view was filled by a successful PyObject_GetBuffer.
        let contiguous = unsafe { ffi::PyBuffer_IsContiguous(&*me.view, b'C' as std::os::raw::c_char) } != 0;
        if !contiguous {
            let len = usize::try_from(me.view.len).map_err(|_| PyValueError::new_err("negative buffer length"))?;
            let mut scratch = Vec::new();
            scratch.try_reserve_exact(len).map_err(|e| {
                pyo3::exceptions::PyMemoryError::new_err(format!("could not allocate {len} bytes: {e}"))
            })?;
            scratch.resize(len, 0);
            // SAFETY: scratch holds exactly view.len bytes.
            let rc = unsafe {
                ffi::PyBuffer_ToContiguous(
                    scratch.as_mut_ptr() as *mut c_void,
                    &*me.view,
                    me.view.len,
                    b'C' as std::os::raw::c_char,
                )
            };
            if rc != 0 {
                return Err(PyErr::fetch(obj.py()));
            }
            me.scratch = Some(scratch);
        }
        Ok(me)
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        if let Some(s) = &self.scratch {
            return s;
        }
        if self.view.len <= 0 || self.view.buf.is_null() {
            return &[];
        }
        // SAFETY: a contiguous exporter guarantees `len` readable bytes at
        // `buf` while the view is held; the exporter cannot resize (bytearray
        // refuses while exported) until Drop releases it.
        unsafe { std::slice::from_raw_parts(self.view.buf as *const u8, self.view.len as usize) }
    }
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        // Borrowed values never leave a GIL-holding scope (they are !Send
        // through the raw pointers in Py_buffer), so the GIL is held here.
        // SAFETY: the view came from a successful PyObject_GetBuffer.
        unsafe { ffi::PyBuffer_Release(&mut *self.view) };
    }
}

/// `#[pymethods] impl $class` with what both read-only views (`ShardView`,
/// `InterceptView`) export alike, then `$methods`: `nbytes`, `len()` and the
/// buffer protocol over the payload in `self.$entry.payload`, an `Arc` the view
/// owns (so the bytes outlive the entry's removal from its table).
macro_rules! view_pymethods {
    ($class:ident, $entry:ident, $($methods:tt)*) => {
        #[::pyo3::pymethods]
        impl $class {
            #[getter]
            fn nbytes(&self) -> usize {
                self.$entry.payload.len()
            }

            fn __len__(&self) -> usize {
                self.$entry.payload.len()
            }

            unsafe fn __getbuffer__(
                slf: ::pyo3::Bound<'_, Self>,
                view: *mut ::pyo3::ffi::Py_buffer,
                flags: ::std::os::raw::c_int,
            ) -> ::pyo3::PyResult<()> {
                let bytes = slf.get().$entry.payload.as_slice();
                // SAFETY: the payload is immutable and owned (through the Arc) by
                // `slf`, which the filled view references until it is released.
                unsafe { $crate::buffer::export(slf.as_ptr(), bytes, view, flags, slf.py()) }
            }

            unsafe fn __releasebuffer__(&self, _view: *mut ::pyo3::ffi::Py_buffer) {}

            $($methods)*
        }
    };
}
pub(crate) use view_pymethods;

/// Fill `view` with a read-only, C-contiguous, unsigned-byte view of `bytes`
/// owned by `owner` (which the view keeps alive).
///
/// # Safety
/// `bytes` must stay valid and unchanged for as long as `owner` is alive;
/// `view` must be the pointer Python passed to `__getbuffer__`.
pub(crate) unsafe fn export(
    owner: *mut ffi::PyObject,
    bytes: &[u8],
    view: *mut ffi::Py_buffer,
    flags: c_int,
    py: Python<'_>,
) -> PyResult<()> {
    let rc =
        ffi::PyBuffer_FillInfo(view, owner, bytes.as_ptr() as *mut c_void, bytes.len() as ffi::Py_ssize_t, 1, flags);
    if rc != 0 {
        return Err(PyErr::fetch(py));
    }
    Ok(())
}
