//! The rollout table: open rollouts by id and by secret.
//!
//! Two lock-free maps (papaya, as the core's tables use), so the per-call
//! secret lookup never contends with other calls or with register.  Each
//! rollout holds its in-flight calls ([`Calls`]) and the keys of its previous
//! request's messages (for divergence).  `unregister` removes both entries
//! and closes the rollout's calls: a call that found the rollout before the
//! removal sees it closed (410) or was cancelled by the close.

use std::sync::Arc;

use tokio::sync::oneshot;

use crate::divergence::{diverge, Divergence, MessageKey};
use crate::error::RegisterError;
use crate::lifecycle::Calls;
use crate::sync::{lock, Mutex};
use crate::upstream::Target;

type Map<K, V> = papaya::HashMap<K, V, foldhash::fast::RandomState>;

fn map<K, V>() -> Map<K, V> {
    // Blocking resize, as in rust/core: incremental resizing makes every
    // operation during a resize help copy, and a table of ids resizes rarely.
    papaya::HashMap::builder()
        .hasher(foldhash::fast::RandomState::default())
        .resize_mode(papaya::ResizeMode::Blocking)
        .build()
}

/// One open rollout: its id, its secret, its calls.
pub struct Rollout {
    /// The rollout's id, as registered.
    pub id: Arc<str>,
    secret: Box<str>,
    /// In-flight calls; dropping a call's sender cancels it.
    pub(crate) calls: Calls<oneshot::Sender<()>>,
    /// Keys of the previous request's messages.
    pub(crate) history: Mutex<Vec<MessageKey>>,
    /// The rollout's own upstream and key (`None`: the plane's).
    pub(crate) upstream: Option<Arc<Target>>,
    /// The model sent upstream in place of the agent's (`None`: the agent's).
    pub(crate) model: Option<Box<str>>,
}

impl std::fmt::Debug for Rollout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret: this may end up in a log.
        f.debug_struct("Rollout").field("id", &self.id).finish_non_exhaustive()
    }
}

impl Rollout {
    /// Compare `keys` (the new request's messages) with the previous
    /// request's and make them the history.
    pub(crate) fn advance(&self, keys: Vec<MessageKey>) -> Divergence {
        let mut history = lock(&self.history);
        let d = diverge(&history, &keys);
        *history = keys;
        d
    }

    /// Replace the history by `keys`, returning the previous one.
    pub(crate) fn swap_history(&self, keys: Vec<MessageKey>) -> Vec<MessageKey> {
        std::mem::replace(&mut *lock(&self.history), keys)
    }
}

/// Open rollouts by id and by secret.
pub struct RolloutTable {
    by_id: Map<Arc<str>, Arc<Rollout>>,
    by_secret: Map<Box<str>, Arc<Rollout>>,
}

impl Default for RolloutTable {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for RolloutTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RolloutTable").field("open", &self.len()).finish()
    }
}

impl RolloutTable {
    /// An empty table.
    pub fn new() -> Self {
        RolloutTable { by_id: map(), by_secret: map() }
    }

    /// Open rollout `rollout_id`, whose calls carry `secret`
    /// (`Authorization: Bearer <secret>` or `x-api-key: <secret>`).
    ///
    /// # Errors
    /// [`RegisterError::DuplicateRollout`] if the id is open,
    /// [`RegisterError::DuplicateSecret`] if another open rollout has the
    /// secret, [`RegisterError::Empty`] for an empty id or secret.
    pub fn register(&self, rollout_id: &str, secret: &str) -> Result<(), RegisterError> {
        self.register_with(rollout_id, secret, None, None)
    }

    /// [`RolloutTable::register`] with the rollout's own upstream target and
    /// model override.
    pub(crate) fn register_with(
        &self,
        rollout_id: &str,
        secret: &str,
        upstream: Option<Arc<Target>>,
        model: Option<&str>,
    ) -> Result<(), RegisterError> {
        if rollout_id.is_empty() || secret.is_empty() {
            return Err(RegisterError::Empty);
        }
        let rollout = Arc::new(Rollout {
            id: rollout_id.into(),
            secret: secret.into(),
            calls: Calls::new(),
            history: Mutex::new(Vec::new()),
            upstream,
            model: model.map(Into::into),
        });
        if self.by_id.pin().try_insert(Arc::clone(&rollout.id), Arc::clone(&rollout)).is_err() {
            return Err(RegisterError::DuplicateRollout(rollout_id.into()));
        }
        if self.by_secret.pin().try_insert(secret.into(), Arc::clone(&rollout)).is_err() {
            let _ = self.by_id.pin().remove_if(rollout_id, |_, v| Arc::ptr_eq(v, &rollout));
            return Err(RegisterError::DuplicateSecret);
        }
        Ok(())
    }

    /// Close rollout `rollout_id`: its secret stops working at once, a call
    /// not yet answered gets 410, a stream under way gets an error event.
    /// Returns how many in-flight calls were cancelled, or `None` if the
    /// rollout is not open (unregister is idempotent).
    ///
    /// Every call of the rollout that was not cancelled has its turn record
    /// in the completion queue when this returns.
    pub fn unregister(&self, rollout_id: &str) -> Option<usize> {
        let rollout = self.by_id.pin().remove(rollout_id).cloned()?;
        let _ = self.by_secret.pin().remove_if(&*rollout.secret, |_, v| Arc::ptr_eq(v, &rollout));
        let signals = rollout.calls.close()?;
        // papaya frees the removed entry only when its deferred reclamation
        // runs: release what the rollout holds now, leaving a small shell.
        drop(rollout.swap_history(Vec::new()));
        let n = signals.len();
        drop(signals); // each dropped sender wakes its call
        Some(n)
    }

    /// The open rollout whose secret is `secret`.
    pub fn by_secret(&self, secret: &str) -> Option<Arc<Rollout>> {
        self.by_secret.pin().get(secret).cloned()
    }

    /// The open rollout `rollout_id`.
    pub fn get(&self, rollout_id: &str) -> Option<Arc<Rollout>> {
        self.by_id.pin().get(rollout_id).cloned()
    }

    /// How many rollouts are open.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether no rollout is open.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// How many secrets are live (equals [`RolloutTable::len`] at rest).
    pub fn secrets(&self) -> usize {
        self.by_secret.len()
    }

    /// In-flight calls summed over the open rollouts.
    pub fn in_flight(&self) -> usize {
        self.by_id.pin().values().map(|r| r.calls.in_flight()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn register_unregister() {
        let t = RolloutTable::new();
        t.register("r1", "s1").unwrap();
        assert_eq!(t.register("r1", "s2"), Err(RegisterError::DuplicateRollout("r1".into())));
        assert_eq!(t.register("r2", "s1"), Err(RegisterError::DuplicateSecret));
        assert_eq!(t.register("", "x"), Err(RegisterError::Empty));
        assert_eq!(t.len(), 1);
        assert_eq!(t.secrets(), 1, "a refused duplicate leaves nothing behind");
        assert_eq!(&*t.by_secret("s1").unwrap().id, "r1");
        assert!(t.by_secret("s2").is_none());
        assert_eq!(t.unregister("r1"), Some(0));
        assert_eq!(t.unregister("r1"), None);
        assert!(t.by_secret("s1").is_none());
        assert!(t.is_empty() && t.secrets() == 0);
    }

    #[test]
    fn unregister_cancels_in_flight() {
        let t = RolloutTable::new();
        t.register("r", "s").unwrap();
        let r = t.by_secret("s").unwrap();
        let (tx, mut rx) = oneshot::channel();
        let id = r.calls.begin(tx).unwrap();
        assert_eq!(t.in_flight(), 1);
        assert_eq!(t.unregister("r"), Some(1));
        assert!(rx.try_recv().is_err(), "the sender was dropped: the call wakes");
        assert!(r.calls.commit(id, || ()).is_err());
        let (tx, _rx) = oneshot::channel();
        assert!(r.calls.begin(tx).is_err(), "a call that found the rollout before unregister gets 410");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Register(u8, u8),
        Unregister(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![(0u8..6, 0u8..6).prop_map(|(r, s)| Op::Register(r, s)), (0u8..6).prop_map(Op::Unregister)]
    }

    proptest! {
        /// Against a model (two std maps): every register/unregister answers
        /// alike, lookups agree, and both maps hold exactly the open rollouts.
        #[test]
        fn matches_a_model(ops in proptest::collection::vec(op(), 0..60)) {
            let t = RolloutTable::new();
            let mut model: std::collections::HashMap<String, String> = Default::default();
            for op in ops {
                match op {
                    Op::Register(r, s) => {
                        let (r, s) = (format!("r{r}"), format!("s{s}"));
                        let expect = if model.contains_key(&r) {
                            Err(RegisterError::DuplicateRollout(r.clone()))
                        } else if model.values().any(|v| *v == s) {
                            Err(RegisterError::DuplicateSecret)
                        } else {
                            model.insert(r.clone(), s.clone());
                            Ok(())
                        };
                        prop_assert_eq!(t.register(&r, &s), expect);
                    }
                    Op::Unregister(r) => {
                        let r = format!("r{r}");
                        prop_assert_eq!(t.unregister(&r).is_some(), model.remove(&r).is_some());
                    }
                }
                prop_assert_eq!(t.len(), model.len());
                prop_assert_eq!(t.secrets(), model.len());
                for s in 0..6 {
                    let s = format!("s{s}");
                    let found = t.by_secret(&s).map(|r| r.id.to_string());
                    let expect = model.iter().find(|(_, v)| **v == s).map(|(k, _)| k.clone());
                    prop_assert_eq!(found, expect);
                }
            }
        }
    }
}
