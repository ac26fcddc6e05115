//! Request bodies in, response bodies out.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use lowwater_core::{InterceptTable, Payload, PayloadMut};
use tokio::sync::mpsc;
use tokio::time::{timeout_at, Instant};

/// Why a request body could not be read.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum BodyError {
    /// Over the limit (declared or read); the rest was drained: 413.
    TooLarge,
    /// Shorter than declared, or the client left mid-body: 400.
    Cut(String),
    /// Not all there within the read timeout (a client that stalls or
    /// trickles its body would otherwise hold the call and its buffer): 408.
    TimedOut,
    /// Read, but the memory it was read into could not be made the table's
    /// (its mapping could not be made read-only): 503, as for a body the
    /// table cannot hold.
    Unheld(String),
}

/// A request body as read: in a buffer of its own, or already in the
/// memory the intercept table will hold ([`read_limited`]).
pub(crate) enum ReadBody {
    /// Read into a buffer (a small body, one without `content-length`, or
    /// one read with no table to store it in).
    Buffered(Bytes),
    /// Read straight into a payload of the intercept table's
    /// ([`InterceptTable::receive_buffer`]), held by
    /// [`InterceptTable::insert_payload`] with no copy.
    Stored(Payload),
}

impl ReadBody {
    pub(crate) fn as_slice(&self) -> &[u8] {
        match self {
            ReadBody::Buffered(b) => b,
            ReadBody::Stored(p) => p.as_slice(),
        }
    }

    /// The body as [`Bytes`] (a stored one shares its payload, no copy).
    pub(crate) fn into_bytes(self) -> Bytes {
        match self {
            ReadBody::Buffered(b) => b,
            ReadBody::Stored(p) => Bytes::from_owner(p),
        }
    }
}

/// Read a request body of at most `limit` bytes, all of it within `timeout`
/// (a deadline for the whole body, not per chunk: a byte a minute would
/// pass a per-chunk one).
///
/// A body whose `content-length` is at least `store`'s `mmap_threshold` is
/// read straight into a payload of that intercept table
/// ([`ReadBody::Stored`]): a large body (an agent's whole history with its
/// images, resent every turn) is then written once, where the table holds it,
/// not into a buffer and then copied into the table's mapping (that copy,
/// with its fresh pages and the buffer's unmapping, was a quarter of the
/// plane's CPU for 1 MiB requests: docs/dataplane.md).  Any other body is
/// read into one buffer of its `content-length` when declared, so a large
/// body is not regrown.
pub(crate) async fn read_limited(
    mut body: Incoming,
    declared: Option<u64>,
    limit: usize,
    timeout: Duration,
    store: Option<&InterceptTable>,
) -> Result<ReadBody, BodyError> {
    let deadline = Instant::now() + timeout;
    if declared.is_some_and(|d| d > limit as u64) {
        drain(body, limit, deadline).await;
        return Err(BodyError::TooLarge);
    }
    let in_place = match (declared, store) {
        (Some(d), Some(table)) if d > 0 && d as usize >= table.mmap_threshold() => {
            // Refused memory: read into a buffer instead, whose own failure
            // (or the table's at the insert) answers as it always has.
            table.receive_buffer(d as usize).ok()
        }
        _ => None,
    };
    if let Some(payload) = in_place {
        return read_in_place(body, payload, deadline).await.map(ReadBody::Stored);
    }
    let mut buf = BytesMut::with_capacity(declared.map_or(0, |d| d as usize));
    loop {
        let Ok(frame) = timeout_at(deadline, body.frame()).await else { return Err(BodyError::TimedOut) };
        let Some(frame) = frame else { break };
        let frame = frame.map_err(cut)?;
        if let Ok(data) = frame.into_data() {
            if buf.len() + data.len() > limit {
                drop(buf);
                drain(body, limit, deadline).await;
                return Err(BodyError::TooLarge);
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(ReadBody::Buffered(buf.freeze()))
}

fn cut(e: hyper::Error) -> BodyError {
    BodyError::Cut(format!("the request body was cut short: {e}"))
}

/// How far ahead of the bytes received [`read_in_place`] faults in its
/// payload's pages (bytes).
const POPULATE_AHEAD: usize = 256 << 10;

/// Fill `payload` (the body's declared length) from `body`.  hyper frames a
/// body by its `content-length`, so neither more nor fewer bytes arrive
/// without an error first; both are refused here as well (400), never
/// written past the payload or held short.  A refused payload is dropped,
/// its memory freed and its bytes no longer counted.
async fn read_in_place(mut body: Incoming, mut payload: PayloadMut, deadline: Instant) -> Result<Payload, BodyError> {
    let (mut filled, mut populated) = (0, 0);
    loop {
        let Ok(frame) = timeout_at(deadline, body.frame()).await else { return Err(BodyError::TimedOut) };
        let Some(frame) = frame else { break };
        let frame = frame.map_err(cut)?;
        if let Ok(data) = frame.into_data() {
            let end = filled + data.len();
            if end > payload.len() {
                return Err(BodyError::Cut("the request body is longer than its content-length".into()));
            }
            if end > populated {
                // The pages in steps of POPULATE_AHEAD: a few calls per MiB,
                // not a fault per page, and no more committed ahead of the
                // bytes received than one step.
                let to = (populated + POPULATE_AHEAD).max(end).min(payload.len());
                payload.populate(populated, to - populated);
                populated = to;
            }
            payload.as_mut_slice()[filled..end].copy_from_slice(&data);
            filled = end;
        }
    }
    if filled != payload.len() {
        return Err(BodyError::Cut(format!("the request body was cut short: {filled} of its {} bytes", payload.len())));
    }
    payload.freeze().map_err(|e| BodyError::Unheld(format!("the request body cannot be held: {e}")))
}

/// Discard the rest of a refused body so the client gets to read the answer,
/// up to `4 * limit` bytes more or until `deadline` (past either the
/// connection is closed on it).
pub(crate) async fn drain(mut body: Incoming, limit: usize, deadline: Instant) {
    let mut left = limit.saturating_mul(4);
    while let Ok(Some(Ok(frame))) = timeout_at(deadline, body.frame()).await {
        let n = frame.data_ref().map_or(0, |d| d.len());
        if n > left {
            return;
        }
        left -= n;
    }
}

/// One step of a relayed stream.
#[derive(Debug)]
pub(crate) enum Relay {
    /// Bytes to send.
    Data(Bytes),
    /// End the response without its terminating chunk: hyper closes the
    /// connection mid-body, which every HTTP client reports as an error.  A
    /// stream that was cut (or whose rollout closed) must never end like a
    /// complete one: an agent reading raw SSE would take the partial answer
    /// for a whole one (the SDKs raise on the error event sent before).
    Break,
}

/// Why a relayed stream ended early (the body's error: hyper aborts the
/// connection on it).
#[derive(Debug)]
pub(crate) struct Broken;

impl std::fmt::Display for Broken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the relayed stream was broken off")
    }
}

impl std::error::Error for Broken {}

/// A response body: whole, or relayed from a channel as chunks arrive.
pub(crate) enum ResBody {
    /// A whole body (sent with its `content-length`).
    Full(Option<Bytes>),
    /// Chunks as the relay task sends them; the stream ends when it drops
    /// the sender, or is broken off by a [`Relay::Break`] (the flag: the
    /// break was seen and is due on the next poll).
    Stream(mpsc::Receiver<Relay>, bool),
}

impl ResBody {
    pub(crate) fn full(bytes: impl Into<Bytes>) -> Self {
        ResBody::Full(Some(bytes.into()))
    }
}

impl Body for ResBody {
    type Data = Bytes;
    type Error = Broken;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Broken>>> {
        match self.get_mut() {
            ResBody::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            ResBody::Stream(_, true) => Poll::Ready(Some(Err(Broken))),
            ResBody::Stream(rx, breaking) => match rx.poll_recv(cx) {
                Poll::Ready(Some(Relay::Data(b))) => Poll::Ready(Some(Ok(Frame::data(b)))),
                Poll::Ready(Some(Relay::Break)) => {
                    // Pending once first: hyper's connection loop then flushes
                    // what it has buffered (the error event just relayed)
                    // before it polls again and aborts on the error; an error
                    // in the same poll dropped the buffered event unsent.
                    *breaking = true;
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self, ResBody::Full(None))
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ResBody::Full(Some(b)) => SizeHint::with_exact(b.len() as u64),
            ResBody::Full(None) => SizeHint::with_exact(0),
            ResBody::Stream(..) => SizeHint::default(),
        }
    }
}
