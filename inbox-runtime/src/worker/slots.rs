//! The batches being collected (batched mode): one for a handler without lanes; for a handler
//! with lanes ([`Handler::LANED`](crate::Handler::LANED)), one per batch slot, each lane hashed
//! onto a slot ([`Lane::slot`](crate::Lane::slot)) and each slot's batches run one after the
//! other, so that messages of one lane never sit in two running batches of the worker at once.

use std::sync::Arc;
use tokio::sync::Mutex;
use tokio::time::Instant;

/// A batch ready to run, and the turn of its slot it must take first (laned handlers).
pub(super) struct Ready<T> {
    pub(super) batch: Vec<T>,
    pub(super) turn: Option<Arc<Mutex<()>>>,
}

/// One slot's batch being collected.
struct Slot<T> {
    waiting: Vec<T>,
    due: Option<Instant>,
    /// Held by the slot's running batch (laned handlers).
    turn: Option<Arc<Mutex<()>>>,
}

/// The batches being collected, one per slot.
pub(super) struct Slots<T> {
    slots: Vec<Slot<T>>,
    max_messages: usize,
    max_wait: std::time::Duration,
}

impl<T> Slots<T> {
    /// A slot per turn of `turns` (the worker's, which outlive a pull session, so that batches
    /// of a session that ended still take turns with the next one's), or one slot without turns
    /// when there are none (a handler without lanes); each flushes at `max_messages` or
    /// `max_wait` after its first message.
    pub(super) fn new(
        turns: &[Arc<Mutex<()>>],
        max_messages: usize,
        max_wait: std::time::Duration,
    ) -> Slots<T> {
        let slot = |turn: Option<Arc<Mutex<()>>>| Slot {
            waiting: Vec::new(),
            due: None,
            turn,
        };
        Slots {
            slots: match turns {
                [] => vec![slot(None)],
                turns => turns.iter().map(|t| slot(Some(t.clone()))).collect(),
            },
            max_messages,
            max_wait,
        }
    }

    /// How many slots there are.
    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Adds `waiting` to slot `slot` (taken modulo the slots); returns its batch when full.
    pub(super) fn push(&mut self, slot: usize, waiting: T) -> Option<Ready<T>> {
        let slot = slot % self.slots.len();
        let max_wait = self.max_wait;
        let s = &mut self.slots[slot];
        s.waiting.push(waiting);
        s.due.get_or_insert_with(|| Instant::now() + max_wait);
        (s.waiting.len() >= self.max_messages).then(|| Self::take(s))
    }

    /// When the next batch is due, if any is being collected.
    pub(super) fn next_due(&self) -> Option<Instant> {
        self.slots.iter().filter_map(|s| s.due).min()
    }

    /// The batches due by `now` (all of them with `now` = `None`).
    pub(super) fn take_due(&mut self, now: Option<Instant>) -> Vec<Ready<T>> {
        self.slots
            .iter_mut()
            .filter(|s| !s.waiting.is_empty() && now.is_none_or(|now| s.due <= Some(now)))
            .map(Self::take)
            .collect()
    }

    fn take(slot: &mut Slot<T>) -> Ready<T> {
        slot.due = None;
        Ready {
            batch: std::mem::take(&mut slot.waiting),
            turn: slot.turn.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn slots_fill_and_fall_due_on_their_own() {
        let turns: Vec<_> = (0..3).map(|_| Arc::new(Mutex::new(()))).collect();
        let mut slots = Slots::new(&turns, 2, Duration::from_millis(10));
        assert_eq!(slots.len(), 3);
        assert!(slots.push(4, 'a').is_none());
        assert!(slots.push(2, 'b').is_none());
        let full = slots.push(1, 'c').expect("slot 1 is full");
        assert_eq!(full.batch, vec!['a', 'c']);
        let turn = full.turn.expect("laned slots have turns");
        assert!(slots.next_due().is_some());
        tokio::time::advance(Duration::from_millis(11)).await;
        let due = slots.take_due(Some(Instant::now()));
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].batch, vec!['b']);
        assert!(!Arc::ptr_eq(&turn, due[0].turn.as_ref().unwrap()));
        assert!(slots.next_due().is_none() && slots.take_due(None).is_empty());
        // Without lanes: one slot, no turns.
        let mut one = Slots::new(&[], 5, Duration::from_millis(10));
        assert_eq!(one.len(), 1);
        assert!(one.push(7, 1).is_none());
        let all = one.take_due(None);
        assert!(all.len() == 1 && all[0].turn.is_none());
    }
}
