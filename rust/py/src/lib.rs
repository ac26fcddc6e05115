//! `lowwater._native`: the thin pyo3 binding of `lowwater-core` and `lowwater-dataplane`.
//!
//! Only conversion lives here: buffer-protocol reads and exports, argument
//! validation, error mapping to named exceptions, and panic containment.

use pyo3::prelude::*;

mod buffer;
mod dataplane;
mod errors;
mod fetch_buffer;
mod intercept;
mod protocols;
mod table;

// Off by default (rust/py/Cargo.toml, docs/dataplane.md#the-allocator).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOC: lowwater_dataplane::Allocator = lowwater_dataplane::Allocator;

// glibc's malloc for everything but hyper's 8 KiB connection buffers, which
// go on pages of their own and back to the OS when freed: an open rollout's
// untouched buffers were resident on glibc's heap (docs/dataplane.md#per-open-rollout).
#[cfg(not(feature = "mimalloc"))]
#[global_allocator]
static ALLOC: lowwater_dataplane::BufferAlloc<std::alloc::System> =
    lowwater_dataplane::BufferAlloc::new(std::alloc::System);

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<fetch_buffer::FetchBuffer>()?;
    m.add_class::<fetch_buffer::ShardView>()?;
    m.add_class::<fetch_buffer::PendingShard>()?;
    m.add_class::<intercept::InterceptTable>()?;
    m.add_class::<intercept::InterceptView>()?;
    m.add_class::<dataplane::DataPlane>()?;
    m.add_class::<dataplane::TurnRecord>()?;
    m.add_class::<dataplane::Upcall>()?;
    m.add_function(wrap_pyfunction!(protocols::error_body, m)?)?;
    m.add_function(wrap_pyfunction!(protocols::error_event, m)?)?;
    // dtype name -> item size in bytes, the table `put` validates against.
    let dtypes = pyo3::types::PyDict::new(m.py());
    for (name, size) in lowwater_core::dtype::DTYPES {
        dtypes.set_item(*name, *size)?;
    }
    m.add("DTYPES", dtypes)?;
    Ok(())
}
