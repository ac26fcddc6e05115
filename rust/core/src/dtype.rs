//! Element types of shards, by their numpy names.

use crate::error::TableError;

/// Supported dtype names and their item sizes in bytes.
pub const DTYPES: &[(&str, usize)] = &[
    ("bool", 1),
    ("int8", 1),
    ("uint8", 1),
    ("int16", 2),
    ("uint16", 2),
    ("float16", 2),
    ("bfloat16", 2),
    ("int32", 4),
    ("uint32", 4),
    ("float32", 4),
    ("int64", 8),
    ("uint64", 8),
    ("float64", 8),
    ("complex64", 8),
    ("complex128", 16),
];

/// The canonical (static) name and item size in bytes of `dtype`.
///
/// Errors: [`TableError::Invalid`] for a name not in [`DTYPES`].
pub fn lookup(dtype: &str) -> Result<(&'static str, usize), TableError> {
    DTYPES.iter().find(|(name, _)| *name == dtype).copied().ok_or_else(|| {
        let names: Vec<&str> = DTYPES.iter().map(|(n, _)| *n).collect();
        TableError::Invalid { reason: format!("unknown dtype {dtype:?}; expected one of {}", names.join(", ")) }
    })
}

/// Item size in bytes of `dtype`.
///
/// Errors: [`TableError::Invalid`] for a name not in [`DTYPES`].
pub fn itemsize(dtype: &str) -> Result<usize, TableError> {
    lookup(dtype).map(|(_, size)| size)
}

/// Bytes a shard of `dtype` and `shape` must hold (checked for overflow).
///
/// Errors: [`TableError::Invalid`] for an unknown dtype, or when the size
/// overflows `usize`.
pub fn expected_nbytes(dtype: &str, shape: &[usize]) -> Result<usize, TableError> {
    let mut n = itemsize(dtype)?;
    for &dim in shape {
        n = n.checked_mul(dim).ok_or_else(|| TableError::Invalid {
            reason: format!("shape {shape:?} of {dtype} overflows the address space"),
        })?;
    }
    Ok(n)
}
