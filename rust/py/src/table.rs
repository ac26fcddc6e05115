//! What the two table classes (`FetchBuffer`, `InterceptTable`) expose the
//! same way: construction with its argument checks, the two limits, keys,
//! length, membership and stats as a dict.
//!
//! pyo3 allows one `#[pymethods]` block per class (a second needs the
//! `multiple-pymethods` feature and its `inventory` dependency), so the shared
//! methods are emitted by [`table_pymethods!`] into the class's one block,
//! followed by the methods only that class has.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyString;

/// `value` as a u64, or `ValueError` naming the argument when it is negative.
pub(crate) fn non_negative(name: &str, value: i64) -> PyResult<u64> {
    u64::try_from(value).map_err(|_| PyValueError::new_err(format!("{name} must be >= 0, got {value}")))
}

/// The constructors' `capacity_bytes` (None: unbounded) and `mmap_threshold`
/// (bytes), checked; `ValueError` when either is negative.
pub(crate) fn limits(capacity_bytes: Option<i64>, mmap_threshold: i64) -> PyResult<(Option<u64>, usize)> {
    let capacity = capacity_bytes.map(|c| non_negative("capacity_bytes", c)).transpose()?;
    let threshold = non_negative("mmap_threshold", mmap_threshold)? as usize;
    Ok((capacity, threshold))
}

/// `key in table`: false for anything but a str (never a `TypeError`, as for
/// a dict of str keys), else what `contains` says.
pub(crate) fn contains_key(key: &Bound<'_, PyAny>, contains: impl FnOnce(&str) -> bool) -> bool {
    match key.cast::<PyString>() {
        Ok(s) => s.to_str().map(contains).unwrap_or(false),
        Err(_) => false,
    }
}

/// `#[pymethods] impl $class` with the shared methods, then `$methods`.
///
/// `$class` must hold its core table in a field `inner` of type `$core`;
/// `stats()` returns a dict of the named fields of `inner.stats()`, in order.
macro_rules! table_pymethods {
    ($class:ident, $core:ty, stats: [$($field:ident),+ $(,)?], $($methods:tt)*) => {
        #[::pyo3::pymethods]
        impl $class {
            #[new]
            #[pyo3(signature = (capacity_bytes = None, mmap_threshold = 1 << 20))]
            fn new(capacity_bytes: Option<i64>, mmap_threshold: i64) -> ::pyo3::PyResult<Self> {
                let (capacity, threshold) = $crate::table::limits(capacity_bytes, mmap_threshold)?;
                // `From`: the class holds its table by value or in an `Arc` (shared with Rust).
                Ok($class { inner: ::std::convert::From::from(<$core>::new(capacity, threshold)) })
            }

            #[getter]
            fn capacity_bytes(&self) -> Option<u64> {
                self.inner.capacity_bytes()
            }

            #[getter]
            fn mmap_threshold(&self) -> usize {
                self.inner.mmap_threshold()
            }

            fn stats<'py>(
                &self,
                py: ::pyo3::Python<'py>,
            ) -> ::pyo3::PyResult<::pyo3::Bound<'py, ::pyo3::types::PyDict>> {
                use ::pyo3::types::PyDictMethods;
                let s = self.inner.stats();
                let d = ::pyo3::types::PyDict::new(py);
                $(d.set_item(stringify!($field), s.$field)?;)+
                Ok(d)
            }

            fn keys(&self) -> Vec<String> {
                self.inner.keys().iter().map(|k| k.to_string()).collect()
            }

            fn __len__(&self) -> usize {
                self.inner.len()
            }

            fn __contains__(&self, key: &::pyo3::Bound<'_, ::pyo3::PyAny>) -> bool {
                $crate::table::contains_key(key, |k| self.inner.contains(k))
            }

            $($methods)*
        }
    };
}
pub(crate) use table_pymethods;
