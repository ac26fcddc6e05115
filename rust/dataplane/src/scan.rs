//! Walking JSON text that serde_json has already validated: the items of an
//! array and one key of an object, found without parsing them again.
//!
//! A long rollout's request is mostly message text.  serde_json scans every
//! string byte by byte each time a value is parsed, and the message list
//! was parsed three times per call (the body's top level, the list as
//! `Vec<&RawValue>`, each message for its role): in a profile of sequential
//! 1 MiB chat calls that scanning was a quarter of the data plane's CPU.
//! Here the top-level parse is the only full one; the list is walked with
//! `memchr` crossing strings to their next quote or backslash.
//!
//! Every function takes text that is one valid JSON value (the caller got it
//! from a `&RawValue`); on anything else it returns `None` rather than
//! panic, and the caller answers 400 as it would have.

use std::borrow::Cow;
use std::ops::Range;

/// The index of the quote that ends the string whose text starts at
/// `from` (just past its opening quote), or `None` when `text` ends first.
pub(crate) fn string_end(text: &[u8], mut from: usize) -> Option<usize> {
    loop {
        let at = from + memchr::memchr2(b'"', b'\\', text.get(from..)?)?;
        if text[at] == b'"' {
            return Some(at);
        }
        from = at + 2; // past the backslash and the character it escapes
    }
}

fn skip_ws(text: &[u8], mut i: usize) -> usize {
    while matches!(text.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// The index just past the value that starts at `i`.
fn value_end(text: &[u8], i: usize) -> Option<usize> {
    match *text.get(i)? {
        b'"' => Some(string_end(text, i + 1)? + 1),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match *text.get(j)? {
                    b'"' => j = string_end(text, j + 1)?,
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        // A number, true, false or null: up to the next delimiter.
        _ => {
            let rest = &text[i..];
            Some(
                i + rest
                    .iter()
                    .position(|b| matches!(b, b',' | b']' | b'}' | b' ' | b'\t' | b'\n' | b'\r'))
                    .unwrap_or(rest.len()),
            )
        }
    }
}

/// The byte range of each item of the array `text` (without surrounding
/// whitespace, as serde_json's `&RawValue` has them), or `None` if `text`
/// is not an array.
pub(crate) fn array_items(text: &str) -> Option<Vec<Range<usize>>> {
    let b = text.as_bytes();
    if b.first() != Some(&b'[') {
        return None;
    }
    let mut items = Vec::new();
    let mut i = skip_ws(b, 1);
    if b.get(i) == Some(&b']') {
        return Some(items);
    }
    loop {
        i = skip_ws(b, i);
        let end = value_end(b, i)?;
        items.push(i..end);
        i = skip_ws(b, end);
        match b.get(i)? {
            b',' => i += 1,
            b']' => return Some(items),
            _ => return None,
        }
    }
}

/// Where the object `text` has `key`: `Ok(Some(value's text))`, `Ok(None)`
/// when it has no such key, `Err(())` when it has it more than once (as
/// serde's derived `Deserialize` refuses a duplicate field) or `text` is not
/// an object.  Keys are compared decoded, so `"\u0072ole"` is `role`.
pub(crate) fn object_field<'a>(text: &'a str, key: &str) -> Result<Option<&'a str>, ()> {
    let b = text.as_bytes();
    if b.first() != Some(&b'{') {
        return Err(());
    }
    let mut found = None;
    let mut i = skip_ws(b, 1);
    if b.get(i) == Some(&b'}') {
        return Ok(None);
    }
    loop {
        i = skip_ws(b, i);
        if b.get(i) != Some(&b'"') {
            return Err(());
        }
        let key_end = string_end(b, i + 1).ok_or(())?;
        let same = decoded(&text[i..=key_end]).is_some_and(|k| k == key);
        i = skip_ws(b, key_end + 1);
        if b.get(i) != Some(&b':') {
            return Err(());
        }
        let start = skip_ws(b, i + 1);
        let end = value_end(b, start).ok_or(())?;
        if same {
            if found.is_some() {
                return Err(());
            }
            found = Some(&text[start..end]);
        }
        i = skip_ws(b, end);
        match b.get(i) {
            Some(b',') => i += 1,
            Some(b'}') => return Ok(found),
            _ => return Err(()),
        }
    }
}

/// The string a JSON string literal (quotes included) stands for, or `None`
/// if `literal` is not one.
pub(crate) fn decoded(literal: &str) -> Option<Cow<'_, str>> {
    let inner = literal.strip_prefix('"')?.strip_suffix('"')?;
    if inner.contains('\\') {
        serde_json::from_str::<String>(literal).ok().map(Cow::Owned)
    } else {
        Some(Cow::Borrowed(inner))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::value::RawValue;

    #[test]
    fn items_are_the_raw_values() {
        let text = r#"[ {"role":"user","content":"a \"quoted\" ]}"} ,1, "x\\" ,[[]], null,{} ]"#;
        let items: Vec<&str> = array_items(text).unwrap().into_iter().map(|r| &text[r]).collect();
        let raw: Vec<&RawValue> = serde_json::from_str(text).unwrap();
        assert_eq!(items, raw.iter().map(|r| r.get()).collect::<Vec<_>>());
        assert_eq!(array_items("[ ]"), Some(vec![]));
        assert_eq!(array_items(r#"{"a":1}"#), None);
    }

    #[test]
    fn fields_are_found_once_and_decoded() {
        assert_eq!(object_field(r#"{"content":"role","role" : "user"}"#, "role"), Ok(Some(r#""user""#)));
        assert_eq!(object_field(r#"{"\u0072ole":"user"}"#, "role"), Ok(Some(r#""user""#)));
        assert_eq!(object_field(r#"{"x":{"role":"user"}}"#, "role"), Ok(None));
        assert_eq!(object_field(r#"{"role":"user","role":"user"}"#, "role"), Err(()));
        assert_eq!(object_field("{ }", "role"), Ok(None));
        assert_eq!(object_field("[1]", "role"), Err(()));
        assert_eq!(decoded(r#""us\u0065r""#).as_deref(), Some("user"));
    }

    #[test]
    fn truncated_text_is_refused_not_a_panic() {
        for text in ["[", "[\"", "[\"\\", "[{", "[1,", "{", "{\"", "{\"a\"", "{\"a\":", "{\"a\":\"\\"] {
            let _ = array_items(text);
            let _ = object_field(text, "a");
        }
    }

    fn json_value() -> impl proptest::strategy::Strategy<Value = serde_json::Value> {
        use proptest::prelude::*;
        let text = || proptest::string::string_regex(r#"([a-z"\\\]\[{}, :]|\u00e9|\n){0,8}"#).unwrap();
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::from),
            any::<i32>().prop_map(serde_json::Value::from),
            text().prop_map(serde_json::Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, move |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(serde_json::Value::Array),
                proptest::collection::vec((prop_oneof![Just("role".to_string()), text()], inner), 0..4)
                    .prop_map(|kv| serde_json::Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        #[test]
        fn walks_agree_with_serde(items in proptest::collection::vec(json_value(), 0..5), pretty: bool) {
            let list = serde_json::Value::Array(items);
            let text = if pretty { serde_json::to_string_pretty(&list) } else { serde_json::to_string(&list) }.unwrap();
            let raw: Vec<&RawValue> = serde_json::from_str(&text).unwrap();
            let spans = array_items(&text).unwrap();
            proptest::prop_assert_eq!(spans.iter().map(|r| &text[r.clone()]).collect::<Vec<_>>(), raw.iter().map(|r| r.get()).collect::<Vec<_>>());
            for item in raw.iter().map(|r| r.get()) {
                if let Ok(serde_json::Value::Object(map)) = serde_json::from_str::<serde_json::Value>(item) {
                    let want = map.get("role").map(|v| serde_json::to_string(v).unwrap());
                    let got = object_field(item, "role").unwrap().map(|v| serde_json::to_string(&serde_json::from_str::<serde_json::Value>(v).unwrap()).unwrap());
                    proptest::prop_assert_eq!(got, want);
                }
            }
        }
    }
}
