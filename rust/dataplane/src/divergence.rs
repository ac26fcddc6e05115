//! Message divergence: which of a request's messages the rollout has not sent before.
//!
//! Agents resend their whole history on every call.  The data plane keeps,
//! per rollout, a key (a seeded 64-bit hash and the length) of each message
//! of the rollout's previous request, finds the first index where the new
//! request's messages differ, and hands the control plane only the messages
//! from there, with the count kept.  Python then parses the delta, never the
//! whole history.
//!
//! Messages are compared by their bytes, not as parsed JSON: a client that
//! re-serialises an old message differently (key order, spacing) makes it
//! count as new.  That errs on the safe side (more bytes handed over, never a
//! message lost).  The hash is seeded per process, so an agent cannot craft
//! two messages that collide; a collision needs equal lengths too.

use std::hash::BuildHasher;

/// A message's identity for divergence: a seeded hash of its bytes and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageKey {
    hash: u64,
    len: u64,
}

/// Hashes messages with one process-wide random seed.
#[derive(Debug, Clone, Default)]
pub struct MessageHasher {
    state: foldhash::quality::RandomState,
}

impl MessageHasher {
    /// A hasher with a fresh random seed.
    pub fn new() -> Self {
        MessageHasher::default()
    }

    /// The key of one message's JSON bytes.
    pub fn key(&self, message: &[u8]) -> MessageKey {
        MessageKey { hash: self.state.hash_one(message), len: message.len() as u64 }
    }
}

/// Where a request's messages stop matching the previous request's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Divergence {
    /// How many leading messages equal the previous request's (the delta starts here).
    pub kept: usize,
    /// How many messages the previous request had.  `kept < previous` means
    /// the agent rewrote its history (truncated, compacted, re-rendered).
    pub previous: usize,
}

/// The first index at which `new` differs from `previous` (or the shorter
/// length when one is a prefix of the other).
pub fn diverge(previous: &[MessageKey], new: &[MessageKey]) -> Divergence {
    let kept = previous.iter().zip(new).take_while(|(a, b)| a == b).count();
    Divergence { kept, previous: previous.len() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn keys(h: &MessageHasher, msgs: &[Vec<u8>]) -> Vec<MessageKey> {
        msgs.iter().map(|m| h.key(m)).collect()
    }

    #[test]
    fn appended_history_keeps_everything_before() {
        let h = MessageHasher::new();
        let a = keys(&h, &[b"{\"role\":\"user\",\"content\":\"hi\"}".to_vec()]);
        let b = keys(
            &h,
            &[
                b"{\"role\":\"user\",\"content\":\"hi\"}".to_vec(),
                b"{\"role\":\"assistant\",\"content\":\"yo\"}".to_vec(),
            ],
        );
        assert_eq!(diverge(&a, &b), Divergence { kept: 1, previous: 1 });
        assert_eq!(diverge(&[], &b), Divergence { kept: 0, previous: 0 });
    }

    proptest! {
        /// A request that appends to the previous one keeps all of it; one
        /// that changes message `i` keeps exactly the `i` before it.
        #[test]
        fn kept_is_the_common_prefix(
            prev in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..12), 0..8),
            extra in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..12), 0..4),
            cut in 0usize..8,
        ) {
            let h = MessageHasher::new();
            let mut new = prev.clone();
            new.extend(extra.iter().cloned());
            prop_assert_eq!(diverge(&keys(&h, &prev), &keys(&h, &new)).kept, prev.len());
            // Change one message (or truncate): the prefix before it is kept.
            if cut < prev.len() {
                let mut changed = new.clone();
                changed[cut].push(b'!');
                let d = diverge(&keys(&h, &prev), &keys(&h, &changed));
                prop_assert_eq!(d.kept, cut);
                prop_assert_eq!(d.previous, prev.len());
                let truncated = &new[..cut];
                prop_assert_eq!(diverge(&keys(&h, &prev), &keys(&h, truncated)).kept, cut);
            }
            // The model's answer: the delta replays exactly the new request.
            let d = diverge(&keys(&h, &prev), &keys(&h, &new));
            let rebuilt: Vec<_> = prev[..d.kept].iter().chain(&new[d.kept..]).cloned().collect();
            prop_assert_eq!(rebuilt, new);
        }
    }
}
