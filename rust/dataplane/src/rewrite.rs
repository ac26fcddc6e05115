//! Request rewrites: the body forwarded upstream, made from the agent's by
//! splicing the top-level object's bytes.
//!
//! What the Python server does with `Protocol.upstream_body` and
//! `sampling.apply`, as data: a per-rollout model override, then per
//! protocol [`Rewrites`] (`set`, then `defaults`, then `append`).  A body
//! with nothing to change is forwarded as the agent's bytes (the same
//! [`Bytes`], no copy); a change costs one copy: each changed value's span is
//! replaced and each new `"key":value` pair is inserted before the closing
//! brace, every other byte kept as sent.  The message delta is taken from
//! the agent's body before this, so rewrites never show in it.

use std::ops::Range;

use bytes::Bytes;
use serde_json::Value;

use crate::error::ConfigError;

/// One value given as JSON text, checked and kept compact.
#[derive(Debug, Clone, PartialEq, Eq)]
struct JsonText {
    text: String,
    value: Value,
}

impl JsonText {
    fn parse(what: &str, key: &str, text: &str) -> Result<Self, ConfigError> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| ConfigError::Rewrite(format!("{what} {key:?}: not valid JSON ({e}): {text:?}")))?;
        Ok(JsonText { text: value.to_string(), value })
    }
}

/// A `defaults` rule: its key and value, and the keys that stand for it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct DefaultRule {
    key: String,
    value: JsonText,
    aliases: Vec<String>,
}

/// Declarative rewrites of one protocol's request bodies, applied in this
/// order (after the rollout's model override): every `set`, then every
/// `defaults`, then every `append`, each in the order given.
///
/// Values are JSON text, checked (and made compact) when the rule is added.
/// A key is "present" when the body has it at the top level, `null`
/// included (Python's `key in body`), or an earlier rule put it there.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rewrites {
    set: Vec<(String, JsonText)>,
    defaults: Vec<DefaultRule>,
    append: Vec<(String, JsonText)>,
}

impl Rewrites {
    /// No rules.
    pub fn new() -> Self {
        Self::default()
    }

    /// `key` always becomes `json` (replaced, or inserted when absent); a
    /// value whose text is already `json` (compact) is left as sent.
    ///
    /// # Errors
    /// [`ConfigError::Rewrite`] if `json` is not valid JSON.
    pub fn set(&mut self, key: &str, json: &str) -> Result<&mut Self, ConfigError> {
        self.set.push((key.into(), JsonText::parse("set", key, json)?));
        Ok(self)
    }

    /// `key` becomes `json` only when neither `key` nor any of `aliases` is
    /// present: the agent's own value wins (sampling arguments: Python gives
    /// the key as the protocol spells it, and every spelling as aliases).
    ///
    /// # Errors
    /// [`ConfigError::Rewrite`] if `json` is not valid JSON.
    pub fn defaults(&mut self, key: &str, json: &str, aliases: &[&str]) -> Result<&mut Self, ConfigError> {
        let value = JsonText::parse("defaults", key, json)?;
        let aliases = aliases.iter().map(|a| a.to_string()).collect();
        self.defaults.push(DefaultRule { key: key.into(), value, aliases });
        Ok(self)
    }

    /// `item` is added to the list `key`: absent or `null` becomes
    /// `[item]`, a list without an equal item (compared as JSON values) gets
    /// it appended, anything else is left alone (the responses API's
    /// `include` for logprobs).
    ///
    /// # Errors
    /// [`ConfigError::Rewrite`] if `item` is not valid JSON.
    pub fn append(&mut self, key: &str, item: &str) -> Result<&mut Self, ConfigError> {
        self.append.push((key.into(), JsonText::parse("append", key, item)?));
        Ok(self)
    }

    /// Whether there is no rule.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty() && self.defaults.is_empty() && self.append.is_empty()
    }
}

/// The new values, by key, in the order first touched.
struct Edits<'a> {
    body: &'a [u8],
    fields: &'a [(String, Range<usize>)],
    edits: Vec<(&'a str, String)>,
}

impl<'a> Edits<'a> {
    fn span(&self, key: &str) -> Option<&Range<usize>> {
        self.fields.iter().find(|(k, _)| k == key).map(|(_, r)| r)
    }

    /// The key's value as it stands (edited or sent), as JSON text.
    fn current(&self, key: &str) -> Option<&str> {
        if let Some((_, t)) = self.edits.iter().find(|(k, _)| *k == key) {
            return Some(t);
        }
        // The body was parsed as UTF-8 JSON, so every value span is UTF-8.
        self.span(key).and_then(|r| std::str::from_utf8(&self.body[r.clone()]).ok())
    }

    fn present(&self, key: &str) -> bool {
        self.current(key).is_some()
    }

    fn put(&mut self, key: &'a str, text: String) {
        if self.current(key) == Some(text.as_str()) {
            return; // as sent (or as set): no edit, so no copy
        }
        match self.edits.iter_mut().find(|(k, _)| *k == key) {
            Some((_, t)) => *t = text,
            None => self.edits.push((key, text)),
        }
    }
}

/// The list text `list` with `item` appended, keeping its bytes.
fn appended(list: &str, item: &str) -> Option<String> {
    let items: Vec<Value> = serde_json::from_str(list).ok()?;
    let want: Value = serde_json::from_str(item).ok()?;
    if items.contains(&want) {
        return None;
    }
    let head = list.trim_end().strip_suffix(']')?.trim_end();
    Some(if items.is_empty() { format!("{head}{item}]") } else { format!("{head},{item}]") })
}

/// The body to forward: `body` (a JSON object whose top-level keys and value
/// spans are `fields`, the last of duplicate keys, as a parser keeps it) with
/// `model` (if any) as its `model`, then `rules` applied.  `None`: nothing
/// changes, forward the agent's bytes.
pub(crate) fn rewrite(
    body: &[u8],
    fields: &[(String, Range<usize>)],
    model: Option<&str>,
    rules: Option<&Rewrites>,
) -> Option<Vec<u8>> {
    let mut e = Edits { body, fields, edits: Vec::new() };
    if let Some(m) = model {
        // Python's `body.get("model") == model`: equal as a string value.
        let same = e.current("model").and_then(|t| serde_json::from_str::<String>(t).ok()).is_some_and(|s| s == m);
        if !same {
            e.put("model", Value::from(m).to_string());
        }
    }
    if let Some(rules) = rules {
        for (k, v) in &rules.set {
            e.put(k, v.text.clone());
        }
        for d in &rules.defaults {
            if !e.present(&d.key) && !d.aliases.iter().any(|a| e.present(a)) {
                e.put(&d.key, d.value.text.clone());
            }
        }
        for (k, item) in &rules.append {
            let new = match e.current(k) {
                None | Some("null") => Some(format!("[{}]", item.text)),
                Some(t) if t.starts_with('[') => appended(t, &item.text),
                Some(_) => None,
            };
            if let Some(new) = new {
                e.put(k, new);
            }
        }
    }
    if e.edits.is_empty() {
        return None;
    }
    Some(splice(body, fields, &e.edits))
}

/// `body` with the values of `edits` whose key is in `fields` replaced in
/// place and the others inserted, in order, before the closing brace.
fn splice(body: &[u8], fields: &[(String, Range<usize>)], edits: &[(&str, String)]) -> Vec<u8> {
    let mut replace: Vec<(&Range<usize>, &str)> = Vec::new();
    let mut insert: Vec<(&str, &str)> = Vec::new();
    for (k, v) in edits {
        match fields.iter().find(|(f, _)| f == k) {
            Some((_, r)) => replace.push((r, v)),
            None => insert.push((k, v)),
        }
    }
    replace.sort_by_key(|(r, _)| r.start);
    let extra: usize = edits.iter().map(|(k, v)| k.len() + v.len() + 8).sum();
    let mut out = Vec::with_capacity(body.len() + extra);
    let close = body.iter().rposition(|&b| b == b'}').unwrap_or(body.len());
    let mut at = 0;
    for (r, v) in replace {
        out.extend_from_slice(&body[at..r.start]);
        out.extend_from_slice(v.as_bytes());
        at = r.end;
    }
    out.extend_from_slice(&body[at..close]);
    let mut first = fields.is_empty();
    for (k, v) in insert {
        if !first {
            out.push(b',');
        }
        first = false;
        out.extend_from_slice(Value::from(k).to_string().as_bytes());
        out.push(b':');
        out.extend_from_slice(v.as_bytes());
    }
    out.extend_from_slice(&body[close..]);
    out
}

/// [`rewrite`] on a [`Bytes`] body: the same `Bytes` when nothing changes.
pub(crate) fn forward(
    body: &Bytes,
    fields: &[(String, Range<usize>)],
    model: Option<&str>,
    rules: Option<&Rewrites>,
) -> Bytes {
    match rewrite(body, fields, model, rules) {
        Some(new) => Bytes::from(new),
        None => body.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::Map;
    use std::borrow::Cow;
    use std::collections::HashMap;

    /// The top-level fields as the protocol parser finds them.
    fn fields(body: &str) -> Vec<(String, Range<usize>)> {
        let top: HashMap<Cow<'_, str>, &serde_json::value::RawValue> = serde_json::from_str(body).unwrap();
        top.into_iter()
            .map(|(k, v)| {
                let start = v.get().as_ptr() as usize - body.as_ptr() as usize;
                (k.into_owned(), start..start + v.get().len())
            })
            .collect()
    }

    fn run(body: &str, model: Option<&str>, rules: &Rewrites) -> Option<String> {
        rewrite(body.as_bytes(), &fields(body), model, Some(rules)).map(|b| String::from_utf8(b).unwrap())
    }

    fn chat_logprobs() -> Rewrites {
        let mut r = Rewrites::new();
        r.set("logprobs", "true").unwrap().set("return_token_ids", "true").unwrap();
        r
    }

    #[test]
    fn set_replaces_in_place_and_inserts_before_the_brace() {
        let body = r#"{"model":"m", "logprobs" : false ,"messages":[]}"#;
        assert_eq!(
            run(body, None, &chat_logprobs()).unwrap(),
            r#"{"model":"m", "logprobs" : true ,"messages":[],"return_token_ids":true}"#
        );
        let both = r#"{"logprobs":true,"return_token_ids":true}"#;
        assert_eq!(run(both, None, &chat_logprobs()), None, "already as set: forwarded as sent");
        assert_eq!(run("{ }", None, &chat_logprobs()).unwrap(), r#"{ "logprobs":true,"return_token_ids":true}"#);
    }

    #[test]
    fn model_override_then_rules() {
        let body = r#"{"model":"agent","messages":[1]}"#;
        let none = Rewrites::new();
        assert_eq!(run(body, Some("served"), &none).unwrap(), r#"{"model":"served","messages":[1]}"#);
        assert_eq!(run(body, Some("agent"), &none), None);
        assert_eq!(run(r#"{"messages":[1]}"#, Some("x\"y"), &none).unwrap(), r#"{"messages":[1],"model":"x\"y"}"#);
        let mut r = Rewrites::new();
        r.set("model", r#""forced""#).unwrap();
        assert_eq!(run(body, Some("served"), &r).unwrap(), r#"{"model":"forced","messages":[1]}"#, "set runs after");
    }

    #[test]
    fn defaults_yield_to_any_alias() {
        let aliases = ["max_tokens", "max_completion_tokens", "max_output_tokens"];
        let mut r = Rewrites::new();
        r.defaults("max_output_tokens", "512", &aliases).unwrap();
        r.defaults("temperature", "0.7", &[]).unwrap();
        assert_eq!(run(r#"{"max_tokens":9,"temperature":null}"#, None, &r), None, "null counts as present");
        assert_eq!(run(r#"{"a":1}"#, None, &r).unwrap(), r#"{"a":1,"max_output_tokens":512,"temperature":0.7}"#);
    }

    #[test]
    fn append_adds_to_a_list_once() {
        let item = r#""message.output_text.logprobs""#;
        let mut r = Rewrites::new();
        r.append("include", item).unwrap();
        assert_eq!(run(r#"{"a":1}"#, None, &r).unwrap(), format!(r#"{{"a":1,"include":[{item}]}}"#));
        assert_eq!(run(r#"{"include":null}"#, None, &r).unwrap(), format!(r#"{{"include":[{item}]}}"#));
        assert_eq!(run(r#"{"include":[ ]}"#, None, &r).unwrap(), format!(r#"{{"include":[{item}]}}"#));
        assert_eq!(run(r#"{"include":["x" ]}"#, None, &r).unwrap(), format!(r#"{{"include":["x",{item}]}}"#));
        assert_eq!(run(&format!(r#"{{"include":["x",{item}]}}"#), None, &r), None);
        assert_eq!(run(r#"{"include":"x"}"#, None, &r), None, "not a list: left alone");
    }

    #[test]
    fn values_must_be_json() {
        let mut r = Rewrites::new();
        assert!(matches!(r.set("k", "tru"), Err(ConfigError::Rewrite(_))));
        assert!(matches!(r.defaults("k", "", &[]), Err(ConfigError::Rewrite(_))));
        assert!(matches!(r.append("k", "[1"), Err(ConfigError::Rewrite(_))));
        assert!(r.is_empty());
        r.set("k", " [1, 2] ").unwrap();
        assert_eq!(run("{}", None, &r).unwrap(), r#"{"k":[1,2]}"#, "kept compact");
    }

    #[test]
    fn duplicate_keys_rewrite_the_last_one() {
        let body = r#"{"model":"a","model":"b"}"#;
        let out = run(body, Some("c"), &Rewrites::new()).unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["model"], "c");
    }

    #[test]
    fn forward_keeps_the_same_bytes() {
        let body = Bytes::from_static(br#"{"model":"m"}"#);
        let out = forward(&body, &fields(r#"{"model":"m"}"#), Some("m"), None);
        assert_eq!(out.as_ptr(), body.as_ptr(), "no copy");
    }

    // --- against a model over serde_json values ------------------------------

    /// The expected object, by the rules, on parsed values.
    fn expected(mut obj: Map<String, Value>, model: Option<&str>, rules: &Rules) -> Map<String, Value> {
        if let Some(m) = model {
            obj.insert("model".into(), Value::from(m));
        }
        for (k, v) in &rules.set {
            obj.insert(k.clone(), v.clone());
        }
        for (k, v, aliases) in &rules.defaults {
            if !obj.contains_key(k) && !aliases.iter().any(|a| obj.contains_key(a)) {
                obj.insert(k.clone(), v.clone());
            }
        }
        for (k, item) in &rules.append {
            match obj.get_mut(k) {
                None | Some(Value::Null) => {
                    obj.insert(k.clone(), Value::Array(vec![item.clone()]));
                }
                Some(Value::Array(a)) if !a.contains(item) => a.push(item.clone()),
                _ => {}
            }
        }
        obj
    }

    #[derive(Debug, Clone)]
    struct Rules {
        set: Vec<(String, Value)>,
        defaults: Vec<(String, Value, Vec<String>)>,
        append: Vec<(String, Value)>,
    }

    impl Rules {
        fn build(&self, pretty: bool) -> Rewrites {
            let text = |v: &Value| if pretty { serde_json::to_string_pretty(v).unwrap() } else { v.to_string() };
            let mut r = Rewrites::new();
            for (k, v) in &self.set {
                r.set(k, &text(v)).unwrap();
            }
            for (k, v, a) in &self.defaults {
                let a: Vec<&str> = a.iter().map(String::as_str).collect();
                r.defaults(k, &text(v), &a).unwrap();
            }
            for (k, v) in &self.append {
                r.append(k, &text(v)).unwrap();
            }
            r
        }
    }

    fn key() -> impl Strategy<Value = String> {
        prop_oneof![Just("a".to_string()), Just("b".into()), Just("model".into()), Just("k\"é".into()), "[a-c]{1,2}"]
    }

    fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            "[a-z\"\\\\ é\u{1F600}]{0,6}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map(key(), inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn rules() -> impl Strategy<Value = Rules> {
        (
            proptest::collection::vec((key(), json()), 0..3),
            proptest::collection::vec((key(), json(), proptest::collection::vec(key(), 0..3)), 0..3),
            proptest::collection::vec((key(), json()), 0..3),
        )
            .prop_map(|(set, defaults, append)| Rules { set, defaults, append })
    }

    fn object() -> impl Strategy<Value = Map<String, Value>> {
        proptest::collection::btree_map(key(), json(), 0..6).prop_map(|m| m.into_iter().collect())
    }

    proptest! {
        /// Any object, any rules, compact or pretty: the result parses and
        /// equals the rules applied to the parsed object; nothing to change
        /// is `None` (the agent's bytes forwarded).
        #[test]
        fn splicing_matches_the_model(
            obj in object(),
            rules in rules(),
            model in proptest::option::of("[a-z\"]{0,4}"),
            pretty in any::<bool>(),
        ) {
            let v = Value::Object(obj.clone());
            let body = if pretty { serde_json::to_string_pretty(&v).unwrap() } else { v.to_string() };
            let want = expected(obj.clone(), model.as_deref(), &rules);
            let got = rewrite(body.as_bytes(), &fields(&body), model.as_deref(), Some(&rules.build(pretty)));
            match got {
                Some(bytes) => {
                    let parsed: Value = serde_json::from_slice(&bytes).unwrap();
                    prop_assert_eq!(parsed, Value::Object(want));
                }
                None => prop_assert_eq!(Value::Object(want), v),
            }
        }

        /// Rules that change nothing (defaults whose key is there, sets of the
        /// value already sent, appends of an item already listed, the model
        /// already asked for) leave the body as sent.
        #[test]
        fn nothing_to_change_is_none(obj in object(), pick in proptest::collection::vec(any::<prop::sample::Index>(), 1..4)) {
            prop_assume!(!obj.is_empty());
            let v = Value::Object(obj.clone());
            let body = v.to_string();
            let entries: Vec<(&String, &Value)> = obj.iter().collect();
            let mut r = Rewrites::new();
            for ix in &pick {
                let (k, val) = entries[ix.index(entries.len())];
                r.set(k, &val.to_string()).unwrap();
                r.defaults(k, "1", &[]).unwrap();
                if let Value::Array(items) = val {
                    if let Some(first) = items.first() {
                        r.append(k, &first.to_string()).unwrap();
                    }
                }
            }
            let model = obj.get("model").and_then(Value::as_str);
            prop_assert_eq!(rewrite(body.as_bytes(), &fields(&body), model, Some(&r)), None);
        }
    }
}
