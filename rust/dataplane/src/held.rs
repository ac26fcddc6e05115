//! A call's request body, held in the [`InterceptTable`] for the life of the call.
//!
//! The table is the one store of in-flight request bodies, for the data
//! plane as it was for the Python server: its counters say how many bodies
//! and bytes are held now, its capacity bound refuses a call (503) before a
//! burst of large bodies can exhaust memory, and closing a rollout sweeps
//! whatever of its calls is still held.  A peer kept every intercepted body
//! (the whole history with base64 images) until its rollout ended and ran
//! out of memory within a few training steps; here a body is discarded when
//! its call ends, on every path, because the discard is a `Drop`.
//!
//! The upstream request is sent from the table's copy ([`Held::bytes`]
//! shares it, zero-copy), so the agent's bytes live once while the call
//! waits on the upstream.

use std::sync::Arc;

use bytes::Bytes;
use lowwater_core::{Intercept, InterceptTable, Payload, TableError};

/// One held request body; dropping it discards the table entry.
pub(crate) struct Held {
    table: Arc<InterceptTable>,
    intercept: Arc<Intercept>,
}

/// The table's payload as the owner of a [`Bytes`].
struct Shared(Arc<Intercept>);

impl AsRef<[u8]> for Shared {
    fn as_ref(&self) -> &[u8] {
        self.0.payload.as_slice()
    }
}

impl Held {
    /// Copy `body` into `table` under `request_id` for `rollout_id`.
    ///
    /// # Errors
    /// As [`InterceptTable::insert`]: `Full` over the table's capacity,
    /// `RolloutClosed` when the rollout was closed under the call, `Alloc`.
    pub(crate) fn insert(
        table: &Arc<InterceptTable>,
        request_id: &str,
        rollout_id: &str,
        protocol: &str,
        stream: bool,
        body: &[u8],
    ) -> Result<Self, TableError> {
        table.insert(request_id, rollout_id, body, protocol, stream)?;
        Self::entry(table, request_id, rollout_id)
    }

    /// Hold `payload` (read straight into `table`'s memory:
    /// [`InterceptTable::receive_buffer`]) under `request_id`, no copy.
    ///
    /// # Errors
    /// As [`Held::insert`].
    pub(crate) fn insert_payload(
        table: &Arc<InterceptTable>,
        request_id: &str,
        rollout_id: &str,
        protocol: &str,
        stream: bool,
        payload: Payload,
    ) -> Result<Self, TableError> {
        table.insert_payload(request_id, rollout_id, payload, protocol, stream)?;
        Self::entry(table, request_id, rollout_id)
    }

    fn entry(table: &Arc<InterceptTable>, request_id: &str, rollout_id: &str) -> Result<Self, TableError> {
        match table.get(request_id) {
            Some(intercept) => Ok(Held { table: Arc::clone(table), intercept }),
            // Swept by a close between the insert and here: the rollout is gone.
            None => Err(TableError::RolloutClosed { rollout_id: rollout_id.to_owned() }),
        }
    }

    /// The call's id, its key in the table.
    pub(crate) fn request_id(&self) -> Arc<str> {
        Arc::clone(&self.intercept.request_id)
    }

    /// The held body, sharing the table's copy (its memory lives while the
    /// returned bytes do, even once the entry is discarded).
    pub(crate) fn bytes(&self) -> Bytes {
        Bytes::from_owner(Shared(Arc::clone(&self.intercept)))
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.table.discard(&self.intercept.request_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_for_its_life_and_shared_zero_copy() {
        let table = Arc::new(InterceptTable::new(None, 1 << 20));
        table.open_rollout("r");
        let held = Held::insert(&table, "q1", "r", "openai.chat", false, b"{\"a\":1}").unwrap();
        assert_eq!(table.len(), 1);
        let bytes = held.bytes();
        assert_eq!(&bytes[..], b"{\"a\":1}");
        drop(held);
        assert_eq!(table.len(), 0);
        assert_eq!(table.stats().bytes, 0);
        // The forwarded copy outlives the entry; its bytes are still counted live.
        assert!(table.stats().live_bytes > 0);
        drop(bytes);
        assert_eq!(table.stats().live_bytes, 0);
    }

    #[test]
    fn refused_when_closed_or_full() {
        let table = Arc::new(InterceptTable::new(Some(4), 1 << 20));
        assert!(matches!(Held::insert(&table, "q", "r", "p", false, b"{}"), Err(TableError::RolloutClosed { .. })));
        table.open_rollout("r");
        assert!(matches!(Held::insert(&table, "q", "r", "p", false, b"{\"a\":1}"), Err(TableError::Full { .. })));
        assert_eq!(table.len(), 0);
    }
}
