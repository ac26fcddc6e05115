//! Server-sent events: split an upstream stream into whole events and spot
//! the protocol's terminal event, which is held until the turn is recorded.
//!
//! Framing follows the WHATWG SSE specification as the Python parser
//! (`lowwater.interception.sse`) does: events end at a blank line, lines end
//! in `\n`, `\r\n` or `\r` (normalised to `\n`, a `\r\n` split across two
//! chunks included), `data:` lines of one event are joined with `\n`, lines
//! starting with `:` are comments.  Whole events are relayed as soon as they
//! complete; the bytes of an unfinished event wait for the rest.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;

use crate::protocol::Terminal;

/// What one [`SseSplitter::feed`] produced.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Fed {
    /// Whole events before the terminal one: relay them now.
    pub relay: Bytes,
    /// The terminal event and anything after it, once it has arrived: hold it.
    pub terminal: Option<Bytes>,
}

/// Incremental SSE splitter for one stream.
#[derive(Debug)]
pub struct SseSplitter {
    terminal: Terminal,
    buf: BytesMut,
    /// Where the next search for a blank line starts, so a large event
    /// arriving in many small chunks is scanned once.
    scan: usize,
    held_cr: bool,
    seen_terminal: bool,
    /// Every event so far, up to the terminal one, carried data the control
    /// plane can parse as JSON (or was the `[DONE]` marker).
    all_json: bool,
    /// Check each event's data (on by default; off, `all_json` stays true).
    check_json: bool,
}

#[derive(Deserialize)]
struct TypeOnly<'a> {
    #[serde(borrow, rename = "type")]
    kind: Option<std::borrow::Cow<'a, str>>,
}

impl SseSplitter {
    /// A splitter that watches for `terminal`.
    pub fn new(terminal: Terminal) -> Self {
        SseSplitter {
            terminal,
            buf: BytesMut::new(),
            scan: 0,
            held_cr: false,
            seen_terminal: false,
            all_json: true,
            check_json: true,
        }
    }

    /// Whether to check each event's data for [`SseSplitter::all_json`] (a
    /// parse per event: off where nothing reads the answer).
    #[must_use]
    pub fn with_json_check(mut self, on: bool) -> Self {
        self.check_json = on;
        self
    }

    /// Whether every event up to the terminal one (comment-only blocks
    /// aside) had JSON data, or was the terminal `data:` marker: then the
    /// Python protocols that read any JSON (`reads_any_json`) read the stream
    /// without an error, as `lowwater.interception.dataplane` feeds it (one
    /// `orjson.loads` per event, none after the terminal).  Stricter than
    /// orjson where they differ (serde_json nests at most 128 deep), never
    /// looser: a stream this calls readable is one Python can read.
    pub fn all_json(&self) -> bool {
        self.all_json
    }

    /// Whether the terminal event has arrived.
    pub fn seen_terminal(&self) -> bool {
        self.seen_terminal
    }

    /// Add `chunk`; returns the whole events it completed, split at the terminal one.
    pub fn feed(&mut self, chunk: &[u8]) -> Fed {
        let mut chunk = chunk;
        let mut normalised;
        if self.held_cr || chunk.contains(&b'\r') {
            normalised = Vec::with_capacity(chunk.len() + 1);
            if self.held_cr {
                normalised.push(b'\r');
                self.held_cr = false;
            }
            normalised.extend_from_slice(chunk);
            if normalised.last() == Some(&b'\r') {
                // A "\r\n" may straddle two chunks: decide on the next feed.
                normalised.pop();
                self.held_cr = true;
            }
            normalised = normalise(&normalised);
            chunk = &normalised;
        }
        if self.seen_terminal {
            return Fed { relay: Bytes::new(), terminal: Some(Bytes::copy_from_slice(chunk)) };
        }
        self.buf.extend_from_slice(chunk);
        let mut start = 0;
        let mut terminal_at = None;
        while let Some(end) = find_blank(&self.buf, start.max(self.scan.saturating_sub(1))) {
            let block = &self.buf[start..end + 2];
            start = end + 2;
            self.scan = start;
            let (terminal, json) = self.classify(block);
            self.all_json &= json;
            if terminal {
                terminal_at = Some(start - block.len());
                break;
            }
        }
        match terminal_at {
            Some(at) => {
                self.seen_terminal = true;
                let all = self.buf.split().freeze();
                self.scan = 0;
                Fed { relay: all.slice(..at), terminal: Some(all.slice(at..)) }
            }
            None => {
                let relay = self.buf.split_to(start).freeze();
                self.scan = self.buf.len();
                Fed { relay, terminal: None }
            }
        }
    }

    /// The stream ended: complete an event whose last line end was a held `\r`.
    pub fn finish(&mut self) -> Fed {
        if !self.held_cr {
            return Fed::default();
        }
        self.held_cr = false;
        self.feed(b"\n")
    }

    /// Bytes of an event not yet terminated (non-empty at the end: the stream was cut).
    pub fn pending(&self) -> &[u8] {
        &self.buf
    }

    /// Whether `block` is the terminal event, and whether the control plane
    /// can read it (JSON data, the terminal marker, or a comment-only block,
    /// which Python's parser drops).
    fn classify(&self, block: &[u8]) -> (bool, bool) {
        // Lossy as Python's parser decodes (errors="replace").
        let text = String::from_utf8_lossy(block);
        let mut name: Option<&str> = None;
        let mut data: Vec<&str> = Vec::new();
        for line in text.split('\n') {
            if line.is_empty() || line.starts_with(':') {
                continue;
            }
            let (field, value) = line.split_once(':').unwrap_or((line, ""));
            let value = value.strip_prefix(' ').unwrap_or(value);
            match field {
                "event" => name = Some(value),
                "data" => data.push(value),
                _ => {}
            }
        }
        if name.is_none() && data.is_empty() {
            return (false, true);
        }
        let joined = data.join("\n");
        let terminal = match &self.terminal {
            Terminal::Data(t) => {
                if !data.is_empty() && joined.trim() == t {
                    return (true, true);
                }
                false
            }
            Terminal::Types(types) => match name {
                Some(n) => types.iter().any(|t| t == n),
                None if !data.is_empty() => serde_json::from_str::<TypeOnly<'_>>(&joined)
                    .ok()
                    .and_then(|t| t.kind)
                    .is_some_and(|k| types.iter().any(|t| *t == k)),
                None => false,
            },
        };
        (terminal, !self.check_json || crate::readable::is_json(joined.as_bytes()))
    }
}

fn find_blank(buf: &[u8], from: usize) -> Option<usize> {
    buf.get(from..)?.windows(2).position(|w| w == b"\n\n").map(|p| p + from)
}

fn normalise(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\r' {
            out.push(b'\n');
            if bytes.get(i + 1) == Some(&b'\n') {
                i += 1;
            }
        } else {
            out.push(bytes[i]);
        }
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn chat() -> SseSplitter {
        SseSplitter::new(Terminal::Data("[DONE]".into()))
    }

    #[test]
    fn holds_done_and_relays_the_rest() {
        let mut s = chat();
        let f = s.feed(b"data: {\"a\":1}\n\ndata: {\"a\"");
        assert_eq!(&f.relay[..], b"data: {\"a\":1}\n\n");
        assert!(f.terminal.is_none());
        let f = s.feed(b":2}\n\ndata: [DONE]\n\n");
        assert_eq!(&f.relay[..], b"data: {\"a\":2}\n\n");
        assert_eq!(f.terminal.as_deref(), Some(&b"data: [DONE]\n\n"[..]));
        assert!(s.pending().is_empty());
    }

    #[test]
    fn types_match_by_name_or_json_type() {
        let mut s = SseSplitter::new(Terminal::Types(vec!["message_stop".into()]));
        let f = s.feed(b"event: message_delta\ndata: {}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
        assert_eq!(&f.relay[..], b"event: message_delta\ndata: {}\n\n");
        assert!(f.terminal.is_some());
        let mut s = SseSplitter::new(Terminal::Types(vec!["message_stop".into()]));
        let f = s.feed(b"data: {\"type\":\"message_stop\"}\n\n");
        assert!(f.relay.is_empty() && f.terminal.is_some());
    }

    #[test]
    fn all_json_until_the_terminal_event() {
        // Comments, JSON data, the [DONE] marker: readable; what follows the terminal is not read.
        let mut s = chat();
        s.feed(b": keep-alive\n\ndata: {\"a\":1}\n\ndata: [1, 2]\n\ndata: [DONE]\n\ndata: not json\n\n");
        assert!(s.seen_terminal() && s.all_json());
        // Data that is not JSON, an event with a name and no data, data split over lines that
        // does not join into JSON: each is unreadable (Python's orjson.loads raises on it).
        for bad in [&b"data: {\"a\"\n\n"[..], b"event: ping\n\n", b"data: {\"a\":\ndata: 1\n\n", b"data: \xff\n\n"] {
            let mut s = chat();
            s.feed(bad);
            s.feed(b"data: [DONE]\n\n");
            assert!(s.seen_terminal() && !s.all_json(), "{:?}", String::from_utf8_lossy(bad));
        }
        // Multi-line data joined with a newline is one JSON value.
        let mut s = chat();
        s.feed(b"data: {\"a\":\ndata: 1}\n\ndata: [DONE]\n\n");
        assert!(s.all_json());
        // A typed terminal event is read too: its data must be JSON.
        let mut s = SseSplitter::new(Terminal::Types(vec!["message_stop".into()]));
        s.feed(b"event: message_stop\ndata: stop\n\n");
        assert!(s.seen_terminal() && !s.all_json());
        let mut s = SseSplitter::new(Terminal::Types(vec!["message_stop".into()]));
        s.feed(b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
        assert!(s.seen_terminal() && s.all_json());
    }

    #[test]
    fn crlf_split_across_chunks() {
        let mut s = chat();
        assert!(s.feed(b"data: x\r").relay.is_empty());
        assert!(s.feed(b"\n\r").relay.is_empty());
        let f = s.feed(b"\ndata: [DONE]\r\n\r\n");
        assert_eq!(&f.relay[..], b"data: x\n\n");
        assert_eq!(f.terminal.as_deref(), Some(&b"data: [DONE]\n\n"[..]));
    }

    #[test]
    fn cut_stream_leaves_pending() {
        let mut s = chat();
        s.feed(b"data: {\"a\":1}\n\ndata: {\"b\"");
        assert!(s.finish().relay.is_empty());
        assert_eq!(s.pending(), b"data: {\"b\"");
        assert!(!s.seen_terminal());
    }

    proptest! {
        /// However the stream is cut into chunks, the relayed bytes are the
        /// events before the terminal one and the held bytes the rest.
        #[test]
        fn chunking_does_not_matter(n in 0usize..6, cuts in proptest::collection::vec(0usize..200, 0..8), crlf: bool) {
            let mut stream = String::new();
            for i in 0..n {
                stream.push_str(&format!(": keep-alive\ndata: {{\"i\":{i}}}\n\n"));
            }
            let before = stream.clone();
            stream.push_str("data: [DONE]\n\n");
            let wire = if crlf { stream.replace('\n', "\r\n") } else { stream.clone() };
            let wire = wire.as_bytes();
            let mut points: Vec<usize> = cuts.into_iter().map(|c| c.min(wire.len())).collect();
            points.sort_unstable();
            let mut s = chat();
            let (mut relay, mut held, mut last) = (Vec::new(), Vec::new(), 0);
            for p in points.into_iter().chain([wire.len()]) {
                let f = s.feed(&wire[last..p]);
                relay.extend_from_slice(&f.relay);
                if let Some(t) = f.terminal { held.extend_from_slice(&t); }
                last = p;
            }
            let f = s.finish();
            relay.extend_from_slice(&f.relay);
            if let Some(t) = f.terminal { held.extend_from_slice(&t); }
            prop_assert_eq!(String::from_utf8(relay).unwrap(), before);
            prop_assert_eq!(held, b"data: [DONE]\n\n".to_vec());
            prop_assert!(s.seen_terminal());
        }
    }
}
