//! Proptest state machines: each table against a `HashMap` model.
#![cfg(not(loom))]

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use lowwater_core::{FetchBuffer, InterceptTable, Shard, TableError};
use proptest::prelude::*;

const THRESHOLD: usize = 64;
const CAPACITY: u64 = 600;

#[derive(Debug, Clone)]
enum BufOp {
    Put { id: u8, len: usize },
    Get { id: u8, keep: bool },
    Pop { id: u8, keep: bool },
    Clear { ids: Vec<u8> },
    ClearAll,
    DropViews,
}

fn buf_op() -> impl Strategy<Value = BufOp> {
    // Few ids so operations collide; sizes 0, small and above the threshold.
    let id = 0u8..6;
    let len = prop_oneof![Just(0usize), 1usize..16, (THRESHOLD..THRESHOLD * 4)];
    prop_oneof![
        4 => (id.clone(), len).prop_map(|(id, len)| BufOp::Put { id, len }),
        2 => (id.clone(), any::<bool>()).prop_map(|(id, keep)| BufOp::Get { id, keep }),
        2 => (id.clone(), any::<bool>()).prop_map(|(id, keep)| BufOp::Pop { id, keep }),
        1 => prop::collection::vec(id, 0..4).prop_map(|ids| BufOp::Clear { ids }),
        1 => Just(BufOp::ClearAll),
        1 => Just(BufOp::DropViews),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn fetch_buffer_matches_model(ops in prop::collection::vec(buf_op(), 1..60)) {
        let b = FetchBuffer::new(Some(CAPACITY), THRESHOLD);
        let mut model: HashMap<String, Vec<u8>> = HashMap::new();
        let mut views: Vec<Arc<Shard>> = Vec::new();
        let (mut inserts, mut hits, mut misses, mut removals, mut rejected, mut peak) = (0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
        for (step, op) in ops.into_iter().enumerate() {
            match op {
                BufOp::Put { id, len } => {
                    let key = format!("s{id}");
                    let data = vec![step as u8; len];
                    let used: u64 = model.values().map(|v| v.len() as u64).sum();
                    let old = model.get(&key).map_or(0, |v| v.len() as u64);
                    match b.put(&key, &data, "uint8", &[len], "o") {
                        Ok(()) => {
                            prop_assert!(used + len as u64 - old <= CAPACITY);
                            inserts += 1;
                            if model.insert(key, data).is_some() { removals += 1; }
                            peak = peak.max(used + len as u64 - old);
                        }
                        Err(TableError::Full { .. }) => {
                            prop_assert!(used + len as u64 - old > CAPACITY);
                            rejected += 1;
                        }
                        Err(e) => prop_assert!(false, "unexpected {}", e),
                    }
                }
                BufOp::Get { id, keep } => {
                    let key = format!("s{id}");
                    let got = b.get(&key);
                    prop_assert_eq!(got.as_ref().map(|s| s.payload.as_slice().to_vec()), model.get(&key).cloned());
                    if got.is_some() { hits += 1 } else { misses += 1 }
                    if keep { views.extend(got); }
                }
                BufOp::Pop { id, keep } => {
                    let key = format!("s{id}");
                    let got = b.pop(&key);
                    prop_assert_eq!(got.as_ref().map(|s| s.payload.as_slice().to_vec()), model.remove(&key));
                    if got.is_some() { hits += 1; removals += 1 } else { misses += 1 }
                    if keep { views.extend(got); }
                }
                BufOp::Clear { ids } => {
                    let keys: Vec<String> = ids.iter().map(|i| format!("s{i}")).collect();
                    let unique: HashSet<&String> = keys.iter().collect();
                    let expected = unique.iter().filter(|k| model.remove(**k).is_some()).count();
                    prop_assert_eq!(b.clear(&keys), expected);
                    removals += expected as u64;
                }
                BufOp::ClearAll => {
                    prop_assert_eq!(b.clear_all(), model.len());
                    removals += model.len() as u64;
                    model.clear();
                }
                BufOp::DropViews => views.clear(),
            }
            // Views keep their bytes; held-only payloads count in live_bytes.
            for v in &views {
                prop_assert!(v.payload.as_slice().iter().all(|&x| Some(&x) == v.payload.as_slice().first()));
            }
            let held: u64 = model.values().map(|v| v.len() as u64).sum();
            let mut distinct: Vec<*const Shard> = Vec::new();
            let mut viewed_only = 0u64;
            for v in &views {
                let p = Arc::as_ptr(v);
                if distinct.contains(&p) { continue; }
                distinct.push(p);
                let still_held = b.get(&v.id).is_some_and(|cur| Arc::ptr_eq(&cur, v));
                if !still_held { viewed_only += v.payload.len() as u64; }
            }
            // The probing gets above counted hits/misses; read stats first next time.
            let st = b.stats();
            prop_assert_eq!(st.entries, model.len() as u64);
            prop_assert_eq!(st.bytes, held);
            prop_assert_eq!(st.live_bytes, held + viewed_only);
            prop_assert_eq!(st.peak_bytes, peak);
            prop_assert_eq!((st.inserts, st.removals, st.rejected), (inserts, removals, rejected));
            prop_assert!(st.hits >= hits && st.misses >= misses);
            let mut keys: Vec<String> = b.keys().iter().map(|k| k.to_string()).collect();
            keys.sort();
            let mut mkeys: Vec<String> = model.keys().cloned().collect();
            mkeys.sort();
            prop_assert_eq!(keys, mkeys);
        }
    }
}

#[derive(Debug, Clone)]
enum TabOp {
    Open { r: u8 },
    Close { r: u8 },
    Insert { q: u8, r: u8, len: usize },
    Discard { q: u8 },
}

fn tab_op() -> impl Strategy<Value = TabOp> {
    let len = prop_oneof![Just(0usize), 1usize..16, (THRESHOLD..THRESHOLD * 3)];
    prop_oneof![
        2 => (0u8..3).prop_map(|r| TabOp::Open { r }),
        1 => (0u8..3).prop_map(|r| TabOp::Close { r }),
        5 => (0u8..8, 0u8..3, len).prop_map(|(q, r, len)| TabOp::Insert { q, r, len }),
        3 => (0u8..8).prop_map(|q| TabOp::Discard { q }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn intercept_table_matches_model(ops in prop::collection::vec(tab_op(), 1..60)) {
        let t = InterceptTable::new(Some(CAPACITY), THRESHOLD);
        let mut open: HashSet<String> = HashSet::new();
        let mut held: HashMap<String, (String, usize)> = HashMap::new();
        let (mut inserts, mut discards, mut swept, mut rejected, mut peak) = (0u64, 0u64, 0u64, 0u64, 0u64);
        for op in ops {
            match op {
                TabOp::Open { r } => { t.open_rollout(&format!("r{r}")); open.insert(format!("r{r}")); }
                TabOp::Close { r } => {
                    let rid = format!("r{r}");
                    let mut got = t.close_rollout(&rid);
                    got.sort();
                    let mut expected: Vec<String> = held.iter().filter(|(_, (owner, _))| *owner == rid).map(|(q, _)| q.clone()).collect();
                    expected.sort();
                    if !open.remove(&rid) { prop_assert!(got.is_empty()); }
                    for q in &expected { held.remove(q); }
                    swept += expected.len() as u64;
                    prop_assert_eq!(got, expected);
                }
                TabOp::Insert { q, r, len } => {
                    let (qid, rid) = (format!("q{q}"), format!("r{r}"));
                    let used: u64 = held.values().map(|(_, n)| *n as u64).sum();
                    let res = t.insert(&qid, &rid, &vec![q; len], "chat", q % 2 == 0);
                    if !open.contains(&rid) {
                        prop_assert!(matches!(res, Err(TableError::RolloutClosed { .. })), "{:?}", res);
                    } else {
                        match held.entry(qid) {
                            Entry::Occupied(_) => {
                                prop_assert!(matches!(res, Err(TableError::Duplicate { .. })), "{:?}", res);
                            }
                            Entry::Vacant(_) if used + len as u64 > CAPACITY => {
                                prop_assert!(matches!(res, Err(TableError::Full { .. })), "{:?}", res);
                                rejected += 1;
                            }
                            Entry::Vacant(slot) => {
                                prop_assert!(res.is_ok(), "{:?}", res);
                                slot.insert((rid, len));
                                inserts += 1;
                                peak = peak.max(used + len as u64);
                            }
                        }
                    }
                }
                TabOp::Discard { q } => {
                    let qid = format!("q{q}");
                    let expected = held.remove(&qid).is_some();
                    prop_assert_eq!(t.discard(&qid), expected);
                    prop_assert!(!t.discard(&qid));
                    if expected { discards += 1; }
                }
            }
            let st = t.stats();
            let bytes: u64 = held.values().map(|(_, n)| *n as u64).sum();
            prop_assert_eq!((st.entries, st.bytes, st.live_bytes), (held.len() as u64, bytes, bytes));
            prop_assert_eq!(st.open_rollouts, open.len() as u64);
            prop_assert_eq!((st.inserts, st.discards, st.swept, st.rejected, st.peak_bytes), (inserts, discards, swept, rejected, peak));
            for r in &open {
                let mut got = t.rollout_requests(r);
                got.sort();
                let mut expected: Vec<String> = held.iter().filter(|(_, (o, _))| o == r).map(|(q, _)| q.clone()).collect();
                expected.sort();
                prop_assert_eq!(got, expected);
            }
        }
    }
}
