//! The pull requests a worker has open, and its byte budget: what is asked for and not yet
//! delivered, by messages and by bytes, and what each delivery holds until it is done
//! (`pull.rs` sends the requests and reads what comes).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// How long after its expiry a request that brought neither all its messages nor a 408 is given
/// up for lost (a restarted server, a lost connection), and its permits asked for again.
pub(super) const LOST_AFTER: Duration = Duration::from_secs(1);

/// Room for the two subjects the server counts against a request's `max_bytes` besides a
/// message's headers and payload (which `max_payload` bounds): the message's subject and its ack
/// reply subject, both carried on one control line (at most 4 KiB by default).
pub(super) const SUBJECTS_ROOM: usize = 8 << 10;

/// What a delivery holds while it waits and is served, released when it is done: its slot (none
/// for a last delivery that arrived while stopping), its bytes of the worker's budget and, with
/// prefetch, the permit to run it took once fetched. Held for their drop alone.
#[derive(Debug)]
pub(super) struct Held {
    /// One of the permits to fetch: the concurrency's, and the prefetch's when there is one.
    _slot: Option<OwnedSemaphorePermit>,
    /// The delivery's size, as the server counts it, from the byte budget.
    _bytes: Option<OwnedSemaphorePermit>,
    /// With prefetch, one of the concurrency's permits, taken when the message starts.
    _running: Option<OwnedSemaphorePermit>,
}

impl Held {
    /// A slot and bytes, held until this is dropped.
    pub(super) fn new(
        slot: Option<OwnedSemaphorePermit>,
        bytes: Option<OwnedSemaphorePermit>,
    ) -> Self {
        Held {
            _slot: slot,
            _bytes: bytes,
            _running: None,
        }
    }

    /// Also holds `running`, the permit a prefetched message waited for.
    pub(super) fn running(self, running: OwnedSemaphorePermit) -> Self {
        Held {
            _running: Some(running),
            ..self
        }
    }
}

/// The pull requests sent and not yet used up, oldest first: the server serves a client's
/// waiting requests in order.
#[derive(Debug, Default)]
pub(super) struct Open {
    pub(super) requests: VecDeque<Request>,
    /// Messages asked for and not yet delivered.
    pub(super) outstanding: usize,
}

#[derive(Debug)]
pub(super) struct Request {
    /// Messages it may still bring.
    remaining: usize,
    /// The bytes it may still bring, held from the budget: the server counts each message
    /// against them and ends the request when they are used up.
    bytes: OwnedSemaphorePermit,
    /// The bytes it asked for.
    pub(super) asked_bytes: usize,
    /// Whether it brought a message.
    pub(super) brought: bool,
    /// When the server expires it.
    expires: Instant,
}

impl Open {
    pub(super) fn sent(&mut self, batch: usize, bytes: OwnedSemaphorePermit, expires: Instant) {
        self.outstanding += batch;
        self.requests.push_back(Request {
            remaining: batch,
            asked_bytes: bytes.num_permits(),
            bytes,
            brought: false,
            expires,
        });
    }

    /// A message of `size` bytes arrived: it used up one message of the oldest request, and its
    /// size of that request's bytes, which it holds from then on.
    pub(super) fn delivered(&mut self, size: usize) -> Option<OwnedSemaphorePermit> {
        let front = self.requests.front_mut()?;
        front.remaining -= 1;
        self.outstanding -= 1;
        front.brought = true;
        let taken = front.bytes.split(size.min(front.bytes.num_permits()));
        // The server ends a request whose bytes ran out with the message that used the last.
        if front.remaining == 0 || front.bytes.num_permits() == 0 {
            self.ended();
        }
        taken
    }

    /// The oldest request ended (expired, or refused) with what it had not brought, which is
    /// released.
    pub(super) fn ended(&mut self) -> Option<Request> {
        let front = self.requests.pop_front()?;
        self.outstanding -= front.remaining;
        Some(front)
    }

    /// Forgets requests expired more than [`LOST_AFTER`] ago without a word from the server.
    pub(super) fn forget_lost(&mut self, now: Instant) -> bool {
        let mut lost = false;
        while self
            .requests
            .front()
            .is_some_and(|r| r.expires + LOST_AFTER <= now)
        {
            self.ended();
            lost = true;
        }
        lost
    }

    /// When the oldest request is given up for lost.
    pub(super) fn next_lost(&self) -> Option<Instant> {
        self.requests.front().map(|r| r.expires + LOST_AFTER)
    }

    /// When the last open request expires at the server.
    pub(super) fn last_expiry(&self) -> Option<Instant> {
        self.requests.back().map(|r| r.expires)
    }

    pub(super) fn clear(&mut self) {
        self.requests.clear();
        self.outstanding = 0;
    }
}

/// The worker's byte budget: the bytes of messages fetched and not yet finished, and those that
/// open pull requests may still bring, never exceed it.
pub(super) struct Budget {
    pub(super) bytes: Arc<Semaphore>,
    /// Its size: the setting, raised to one message of the largest size the server allows.
    pub(super) size: usize,
}

impl Budget {
    /// Makes sure a message of `biggest` bytes fits (the server's `max_payload` may have grown
    /// since the last session, on another server).
    pub(super) fn fit(&mut self, biggest: usize) {
        if biggest > self.size {
            self.bytes.add_permits(biggest - self.size);
            self.size = biggest;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(semaphore: &Arc<Semaphore>, n: u32) -> OwnedSemaphorePermit {
        semaphore.clone().try_acquire_many_owned(n).unwrap()
    }

    #[test]
    fn open_requests_are_used_up_oldest_first_and_lost_ones_forgotten() {
        let budget = Arc::new(Semaphore::new(1000));
        let t = Instant::now();
        let mut open = Open::default();
        open.sent(2, bytes(&budget, 100), t + Duration::from_secs(2));
        open.sent(3, bytes(&budget, 100), t + Duration::from_secs(4));
        assert_eq!(open.outstanding, 5);
        open.delivered(1);
        open.delivered(1);
        assert_eq!((open.outstanding, open.requests.len()), (3, 1));
        assert_eq!(open.last_expiry(), Some(t + Duration::from_secs(4)));
        assert!(!open.forget_lost(t + Duration::from_secs(4)));
        assert!(open.forget_lost(t + Duration::from_secs(5)));
        assert_eq!((open.outstanding, open.requests.len()), (0, 0));
        open.sent(4, bytes(&budget, 100), t);
        open.delivered(1);
        open.ended();
        assert_eq!(open.outstanding, 0);
        open.ended();
        assert!(open.delivered(1).is_none());
        assert_eq!(open.outstanding, 0);
    }

    #[test]
    fn messages_hold_their_bytes_and_ended_requests_give_back_the_rest() {
        let budget = Arc::new(Semaphore::new(1000));
        let mut open = Open::default();
        open.sent(3, bytes(&budget, 600), Instant::now());
        let first = open.delivered(250).unwrap();
        assert_eq!(first.num_permits(), 250);
        assert_eq!(budget.available_permits(), 400);
        // The server ends a request with the message that uses its last byte.
        let second = open.delivered(350).unwrap();
        assert_eq!((open.outstanding, open.requests.len()), (0, 0));
        drop((first, second));
        assert_eq!(budget.available_permits(), 1000);
        // A request that ends early (expired, or the next message too large) gives back what it
        // did not bring.
        open.sent(3, bytes(&budget, 600), Instant::now());
        let held = open.delivered(100).unwrap();
        let ended = open.ended().unwrap();
        assert!(ended.brought);
        assert_eq!(ended.asked_bytes, 600);
        drop(ended);
        assert_eq!(budget.available_permits(), 900);
        drop(held);
        assert_eq!(budget.available_permits(), 1000);
    }
}
