//! The batches being collected (batched mode): one for a handler without lanes; for a handler
//! with lanes ([`Handler::LANED`](crate::Handler::LANED)), one per batch slot, each lane hashed
//! onto a slot ([`Lane::slot`](crate::Lane::slot)) and each slot's batches run one after the
//! other, so that messages of one lane never sit in two running batches of the worker at once.
//!
//! A slot's batch is due `max_wait` after its first message; but while it could not start
//! anyway (a laned slot's previous batch still holds the turn; without lanes, every connection
//! of the worker is taken), it keeps collecting and goes as soon as that ends ([`Turns::freed`]
//! wakes the puller), or when it is full, or at the latest when its first message has waited
//! `longest` (it then waits for the turn or a connection with progress acks). So under load a slot's batches grow with the backlog, as in a
//! database's group commit, rather than queue up `max_wait`-sized behind each other: with
//! several processes on one consumer a slot gets a fraction of the messages, and fixed 10 ms
//! batches were one or two messages each.

use std::sync::Arc;
use tokio::sync::{Mutex, Notify, OwnedMutexGuard, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// The turns of a laned worker's batch slots, one per connection, and what wakes the puller
/// when one is given back, or a connection permit.
#[derive(Debug, Default)]
pub(super) struct Turns {
    pub(super) turns: Vec<Arc<Mutex<()>>>,
    /// Notified each time a batch gives its turn back, or a connection permit.
    pub(super) freed: Arc<Notify>,
}

impl Turns {
    /// `n` turns (none: a handler without lanes, or not batched).
    pub(super) fn new(n: usize) -> Turns {
        Turns {
            turns: (0..n).map(|_| Arc::new(Mutex::new(()))).collect(),
            freed: Arc::default(),
        }
    }
}

/// What a batch holds (its slot's turn, a connection permit), given back on drop, then the
/// puller is woken.
pub(super) struct Freeing<G> {
    guard: Option<G>,
    freed: Arc<Notify>,
}

/// A slot's turn, held by its running batch.
pub(super) type Turn = Freeing<OwnedMutexGuard<()>>;

impl Turn {
    /// Waits for `turn`; `freed` is notified when it is given back.
    pub(super) async fn take(turn: Arc<Mutex<()>>, freed: Arc<Notify>) -> Turn {
        Freeing {
            guard: Some(turn.lock_owned().await),
            freed,
        }
    }
}

/// A connection permit of a batched worker, held by a batch or a message served alone.
pub(super) type Connection = Freeing<OwnedSemaphorePermit>;

impl Connection {
    /// `permit`; `freed` is notified when it is given back.
    pub(super) fn new(permit: OwnedSemaphorePermit, freed: Arc<Notify>) -> Connection {
        Freeing {
            guard: Some(permit),
            freed,
        }
    }
}

impl<G> Drop for Freeing<G> {
    fn drop(&mut self) {
        // Given back first, so that the puller, woken, finds it free.
        self.guard.take();
        // A permit is stored when the puller is not waiting yet: it is not missed.
        self.freed.notify_one();
    }
}

/// A batch ready to run, and the turn of its slot it must take first (laned handlers).
pub(super) struct Ready<T> {
    pub(super) batch: Vec<T>,
    pub(super) turn: Option<Arc<Mutex<()>>>,
}

/// One slot's batch being collected.
struct Slot<T> {
    waiting: Vec<T>,
    /// `max_wait` after the first message.
    due: Option<Instant>,
    /// `longest` after the first message: due even while the turn is held.
    latest: Option<Instant>,
    /// Held by the slot's running batch (laned handlers).
    turn: Option<Arc<Mutex<()>>>,
    /// The worker's connection permits (a handler without lanes).
    connections: Option<Arc<Semaphore>>,
}

impl<T> Slot<T> {
    /// Whether a batch of the slot could not start now: its previous batch still holds the
    /// turn, or (without lanes) every connection is taken.
    fn busy(&self) -> bool {
        match (&self.turn, &self.connections) {
            (Some(turn), _) => turn.try_lock().is_err(),
            (None, Some(connections)) => connections.available_permits() == 0,
            (None, None) => false,
        }
    }

    /// When the batch being collected goes, as things stand at `now`.
    fn goes_at(&self, now: Instant) -> Option<Instant> {
        match self.due {
            Some(due) if due <= now && self.busy() => self.latest,
            due => due,
        }
    }
}

/// The batches being collected, one per slot.
pub(super) struct Slots<T> {
    slots: Vec<Slot<T>>,
    max_messages: usize,
    max_wait: std::time::Duration,
    longest: std::time::Duration,
}

impl<T> Slots<T> {
    /// A slot per turn of `turns` (the worker's, which outlive a pull session, so that batches
    /// of a session that ended still take turns with the next one's), or one slot without turns
    /// when there are none (a handler without lanes), which waits for one of `connections`;
    /// each flushes at `max_messages`, or `max_wait` after its first message once it could
    /// start, or `longest` after it (at least `max_wait`) in any case.
    pub(super) fn new(
        turns: &Turns,
        connections: &Arc<Semaphore>,
        max_messages: usize,
        max_wait: std::time::Duration,
        longest: std::time::Duration,
    ) -> Slots<T> {
        let slot = |turn: Option<Arc<Mutex<()>>>| Slot {
            waiting: Vec::new(),
            due: None,
            latest: None,
            connections: turn.is_none().then(|| connections.clone()),
            turn,
        };
        Slots {
            slots: match turns.turns.as_slice() {
                [] => vec![slot(None)],
                turns => turns.iter().map(|t| slot(Some(t.clone()))).collect(),
            },
            max_messages,
            max_wait,
            longest: longest.max(max_wait),
        }
    }

    /// How many slots there are.
    pub(super) fn len(&self) -> usize {
        self.slots.len()
    }

    /// Adds `waiting` to slot `slot` (taken modulo the slots); returns its batch when full.
    pub(super) fn push(&mut self, slot: usize, waiting: T) -> Option<Ready<T>> {
        let slot = slot % self.slots.len();
        let (max_wait, longest) = (self.max_wait, self.longest);
        let s = &mut self.slots[slot];
        s.waiting.push(waiting);
        if s.due.is_none() {
            let now = Instant::now();
            s.due = Some(now + max_wait);
            s.latest = Some(now + longest);
        }
        (s.waiting.len() >= self.max_messages).then(|| Self::take(s))
    }

    /// When the next batch goes, as things stand at `now`, if any is being collected. A busy
    /// slot goes when its turn or a connection is given back, which [`Turns::freed`] tells.
    pub(super) fn next_due(&self, now: Instant) -> Option<Instant> {
        self.slots.iter().filter_map(|s| s.goes_at(now)).min()
    }

    /// The batches that go at `now` (all of them with `now` = `None`).
    pub(super) fn take_due(&mut self, now: Option<Instant>) -> Vec<Ready<T>> {
        self.slots
            .iter_mut()
            .filter(|s| {
                !s.waiting.is_empty()
                    && now.is_none_or(|now| s.goes_at(now).is_some_and(|at| at <= now))
            })
            .map(Self::take)
            .collect()
    }

    fn take(slot: &mut Slot<T>) -> Ready<T> {
        slot.due = None;
        slot.latest = None;
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
        let turns = Turns::new(3);
        let ms = Duration::from_millis;
        let connections = Arc::new(Semaphore::new(3));
        let mut slots = Slots::new(&turns, &connections, 2, ms(10), ms(100));
        assert_eq!(slots.len(), 3);
        assert!(slots.push(4, 'a').is_none());
        assert!(slots.push(2, 'b').is_none());
        let full = slots.push(1, 'c').expect("slot 1 is full");
        assert_eq!(full.batch, vec!['a', 'c']);
        let turn = full.turn.expect("laned slots have turns");
        assert!(slots.next_due(Instant::now()).is_some());
        tokio::time::advance(ms(11)).await;
        let due = slots.take_due(Some(Instant::now()));
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].batch, vec!['b']);
        assert!(!Arc::ptr_eq(&turn, due[0].turn.as_ref().unwrap()));
        assert!(slots.next_due(Instant::now()).is_none() && slots.take_due(None).is_empty());
        // Without lanes: one slot, no turns.
        let mut one = Slots::new(&Turns::default(), &connections, 5, ms(10), ms(100));
        assert_eq!(one.len(), 1);
        assert!(one.push(7, 1).is_none());
        let all = one.take_due(None);
        assert!(all.len() == 1 && all[0].turn.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_slot_whose_turn_is_held_collects_until_it_is_given_back() {
        let turns = Turns::new(1);
        let ms = Duration::from_millis;
        let connections = Arc::new(Semaphore::new(1));
        let mut slots = Slots::new(&turns, &connections, 64, ms(10), ms(100));
        let running = Turn::take(turns.turns[0].clone(), turns.freed.clone()).await;
        assert!(slots.push(0, 1).is_none());
        tokio::time::advance(ms(11)).await;
        assert!(slots.push(0, 2).is_none());
        // Due, but the previous batch holds the turn: it keeps collecting, until `longest`.
        let now = Instant::now();
        assert!(slots.take_due(Some(now)).is_empty());
        assert_eq!(slots.next_due(now), Some(now + ms(89)));
        // Given back: the puller is told, and the batch goes with all it collected.
        drop(running);
        tokio::time::timeout(ms(1), turns.freed.notified())
            .await
            .expect("giving the turn back notifies");
        let ready = slots.take_due(Some(Instant::now()));
        assert_eq!(ready.len(), 1);
        assert_eq!(ready[0].batch, vec![1, 2]);
        // Held for longer than `longest`: the batch goes anyway, to wait for the turn.
        let _running = Turn::take(turns.turns[0].clone(), turns.freed.clone()).await;
        assert!(slots.push(0, 3).is_none());
        tokio::time::advance(ms(50)).await;
        assert!(slots.take_due(Some(Instant::now())).is_empty());
        tokio::time::advance(ms(50)).await;
        assert_eq!(slots.take_due(Some(Instant::now()))[0].batch, vec![3]);
    }

    #[tokio::test(start_paused = true)]
    async fn without_lanes_the_slot_collects_while_every_connection_is_taken() {
        let turns = Turns::default();
        let ms = Duration::from_millis;
        let connections = Arc::new(Semaphore::new(1));
        let mut slots = Slots::new(&turns, &connections, 64, ms(10), ms(100));
        let permit = connections.clone().try_acquire_owned().unwrap();
        let taken = Connection::new(permit, turns.freed.clone());
        assert!(slots.push(0, 1).is_none());
        tokio::time::advance(ms(11)).await;
        assert!(slots.push(0, 2).is_none());
        assert!(slots.take_due(Some(Instant::now())).is_empty());
        drop(taken);
        tokio::time::timeout(ms(1), turns.freed.notified())
            .await
            .expect("giving the connection back notifies");
        assert_eq!(slots.take_due(Some(Instant::now()))[0].batch, vec![1, 2]);
    }
}
