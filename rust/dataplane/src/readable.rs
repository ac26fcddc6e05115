//! Whether the control plane can read an answer: JSON, as `orjson.loads`
//! takes it.
//!
//! A call whose answer the control plane may fail (a 2xx it cannot parse is
//! a 502 to the agent, not a good answer) waits for its verdict; one whose
//! answer is JSON needs none when its protocol reads any JSON
//! ([`crate::ProtocolSpec::reads_any_json`]).  So this check must never be
//! looser than orjson: every value it accepts, orjson parses.  It is
//! stricter where the two differ (serde_json nests at most 128 levels,
//! orjson 1024), which only holds a call that did not need holding.
//! serde_json's `IgnoredAny` only scans the syntax (it let `1e400` and a lone
//! `\ud800` escape through, which orjson refuses), so every value is
//! visited: numbers parsed, strings unescaped and checked.

use std::fmt;

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// Whether `bytes` is one JSON value (whitespace around it allowed) that
/// `orjson.loads` parses.
pub fn is_json(bytes: &[u8]) -> bool {
    serde_json::from_slice::<Valid>(bytes).is_ok()
}

/// A JSON value, checked and dropped as it is read.
struct Valid;

impl<'de> Deserialize<'de> for Valid {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Check)
    }
}

struct Check;

impl<'de> Visitor<'de> for Check {
    type Value = Valid;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Valid, E> {
        Ok(Valid)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Valid, E> {
        Ok(Valid)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Valid, E> {
        Ok(Valid)
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Valid, E> {
        // orjson: "number is infinity when parsed as double".
        if v.is_finite() {
            Ok(Valid)
        } else {
            Err(E::custom("number out of a double's range"))
        }
    }

    fn visit_str<E>(self, _: &str) -> Result<Valid, E> {
        Ok(Valid)
    }

    fn visit_unit<E>(self) -> Result<Valid, E> {
        Ok(Valid)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Valid, A::Error> {
        while seq.next_element::<Valid>()?.is_some() {}
        Ok(Valid)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Valid, A::Error> {
        while map.next_entry::<Valid, Valid>()?.is_some() {}
        Ok(Valid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each case and whether orjson 3 parses it (checked when written):
    /// what is refused here, orjson refuses too.
    const CASES: &[(&[u8], bool)] = &[
        (b"{}", true),
        (b" [1, \"x\", null, true, -2.5e3] ", true),
        (b"{\"a\": 123456789012345678901234567890}", true),
        (b"\"s\"", true),
        (b"{\"k\": \"\\ud83d\\ude00 \\n\"}", true),
        (b"", false),
        (b"{", false),
        (b"{\"a\": 1e400}", false),
        (b"{\"a\": \"\\ud800\"}", false),
        (b"\xef\xbb\xbf{}", false),
        (b"{} {}", false),
        (b"NaN", false),
        (b"{\"a\": \"\xff\"}", false),
        (b"[1,]", false),
    ];

    #[test]
    fn no_looser_than_orjson() {
        for (case, json) in CASES {
            assert_eq!(is_json(case), *json, "{:?}", String::from_utf8_lossy(case));
        }
    }
}
