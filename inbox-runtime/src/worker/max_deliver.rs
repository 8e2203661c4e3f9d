//! The consumer's `max_deliver` as the worker acts on it. Read once at start, it would go stale:
//! a rolling deploy that lowers it leaves old instances deciding "last delivery" on the old,
//! higher limit, so they nak a message on what the server takes for its last delivery, and the
//! message is neither redelivered nor dead-lettered. So the limit is read again when a pull
//! session starts and periodically (`upkeep.rs`), and the worker acts on the lower of the last
//! two reads: a lowered limit takes effect at once, a raised one once a second read confirms
//! it. Acting on a limit below the server's only dead-letters early; above it, a message is
//! lost. A failed read, or a consumer updated to no limit (which the start-time check refuses),
//! keeps the limit acted on.

use super::Inner;
use crate::handler::Handler;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

/// How often the limit is read again besides at each pull session's start.
pub(super) const REFRESH_EVERY: Duration = Duration::from_secs(60);

/// Failed reads in a row after which a warning says the limit may be stale.
const STALE_AFTER: u32 = 3;

/// The limit a worker acts on, shared by its tasks.
#[derive(Debug)]
pub(super) struct MaxDeliver {
    /// What the worker acts on: the lower of the last two finite reads. Read on every delivery.
    effective: AtomicI64,
    /// What the reads have seen, updated one read at a time.
    reads: Mutex<Reads>,
}

/// The reads so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Reads {
    /// The last finite limit read.
    last: i64,
    /// Whether the last read found no limit (warned once per spell).
    unlimited: bool,
    /// Failed reads in a row.
    failures: u32,
}

/// What one read changes: the limit acted on after it, and what to say about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Change {
    /// Nothing to say: the limit stands.
    Same,
    /// Lowered: acted on at once.
    Lowered { from: i64, to: i64 },
    /// Raised at the server: acted on once the next read confirms it.
    RaisePending { acting_on: i64, read: i64 },
    /// A raise confirmed by a second read: acted on from now.
    Raised { from: i64, to: i64 },
    /// The consumer has no limit any more (`max_deliver` ≤ 0): the last finite one is kept.
    Unlimited { keeping: i64 },
}

/// The next state after reading `read` (the server's `max_deliver`): the new last read, the limit
/// to act on, and the change. Pure: the rule is min(previous read, latest read), and a read of no
/// limit is not a read (the last finite one is kept).
fn after_read(reads: Reads, effective: i64, read: i64) -> (Reads, i64, Change) {
    if read <= 0 {
        let change = if reads.unlimited {
            Change::Same
        } else {
            Change::Unlimited { keeping: effective }
        };
        let reads = Reads {
            unlimited: true,
            failures: 0,
            ..reads
        };
        return (reads, effective, change);
    }
    let next = read.min(reads.last);
    let change = match next.cmp(&effective) {
        std::cmp::Ordering::Less => Change::Lowered {
            from: effective,
            to: next,
        },
        std::cmp::Ordering::Greater => Change::Raised {
            from: effective,
            to: next,
        },
        std::cmp::Ordering::Equal if read > next => Change::RaisePending {
            acting_on: next,
            read,
        },
        std::cmp::Ordering::Equal => Change::Same,
    };
    let reads = Reads {
        last: read,
        unlimited: false,
        failures: 0,
    };
    (reads, next, change)
}

impl MaxDeliver {
    /// The limit read at start (finite: the start-time check refuses any other).
    pub(super) fn new(start: i64) -> Self {
        MaxDeliver {
            effective: AtomicI64::new(start),
            reads: Mutex::new(Reads {
                last: start,
                unlimited: false,
                failures: 0,
            }),
        }
    }

    /// The limit to act on now.
    pub(super) fn get(&self) -> i64 {
        self.effective.load(Ordering::Relaxed)
    }

    /// Takes in a read of the consumer's `max_deliver`.
    fn read(&self, read: i64) -> Change {
        let mut reads = self.reads.lock().unwrap_or_else(|e| e.into_inner());
        let (next, effective, change) = after_read(*reads, self.get(), read);
        *reads = next;
        self.effective.store(effective, Ordering::Relaxed);
        change
    }

    /// Counts a failed read; `true` when it makes [`STALE_AFTER`] in a row.
    fn failed(&self) -> bool {
        let mut reads = self.reads.lock().unwrap_or_else(|e| e.into_inner());
        reads.failures = reads.failures.saturating_add(1);
        reads.failures == STALE_AFTER
    }
}

impl<H: Handler> Inner<H> {
    /// Whether delivery number `delivered` is the last the server makes, by the limit acted on
    /// now.
    pub(super) fn last_delivery(&self, delivered: i64) -> bool {
        delivered >= self.max_deliver.get()
    }

    /// Reads the consumer's `max_deliver` from the server and takes it in; a failed read keeps
    /// the limit acted on.
    pub(super) async fn refresh_max_deliver(&self) {
        let durable = &self.consumer.cached_info().name;
        let read = match self.consumer.get_info().await {
            Ok(info) => info.config.max_deliver,
            Err(e) => {
                let acting_on = self.max_deliver.get();
                if self.max_deliver.failed() {
                    tracing::warn!(consumer = H::CONSUMER, %durable, error = %e, max_deliver = acting_on, "the consumer's max_deliver could not be read {STALE_AFTER} times in a row; acting on the last one read");
                } else {
                    tracing::debug!(consumer = H::CONSUMER, %durable, error = %e, max_deliver = acting_on, "reading the consumer's max_deliver failed; keeping it");
                }
                return;
            }
        };
        match self.max_deliver.read(read) {
            Change::Same => {}
            Change::Lowered { from, to } => {
                tracing::info!(consumer = H::CONSUMER, %durable, from, to, "the consumer's max_deliver was lowered; acting on it now");
            }
            Change::RaisePending { acting_on, read } => {
                tracing::info!(consumer = H::CONSUMER, %durable, acting_on, read, "the consumer's max_deliver was raised; acting on it once the next read confirms it");
            }
            Change::Raised { from, to } => {
                tracing::info!(consumer = H::CONSUMER, %durable, from, to, "the consumer's max_deliver was raised; acting on it now");
            }
            Change::Unlimited { keeping } => {
                tracing::warn!(consumer = H::CONSUMER, %durable, max_deliver = read, keeping, "the consumer was updated to no max_deliver limit, which leaves failing messages redelivered forever and is refused at start; acting on the last finite limit");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Takes in each read in turn; the limit acted on after each.
    fn acted_on(start: i64, reads: &[i64]) -> Vec<i64> {
        let limit = MaxDeliver::new(start);
        reads
            .iter()
            .map(|&r| {
                limit.read(r);
                limit.get()
            })
            .collect()
    }

    #[test]
    fn a_lowered_limit_is_acted_on_at_once() {
        assert_eq!(acted_on(5, &[2]), [2]);
        assert_eq!(acted_on(5, &[5, 3, 3, 1]), [5, 3, 3, 1]);
        let limit = MaxDeliver::new(5);
        assert_eq!(limit.read(2), Change::Lowered { from: 5, to: 2 });
        assert_eq!(limit.read(2), Change::Same);
    }

    #[test]
    fn a_raised_limit_is_acted_on_once_a_second_read_confirms_it() {
        assert_eq!(acted_on(5, &[10, 10, 10]), [5, 10, 10]);
        let limit = MaxDeliver::new(5);
        assert_eq!(
            limit.read(10),
            Change::RaisePending {
                acting_on: 5,
                read: 10
            }
        );
        assert_eq!(limit.read(10), Change::Raised { from: 5, to: 10 });
        // A raise that is taken back before it is confirmed is never acted on.
        assert_eq!(acted_on(5, &[10, 5, 10]), [5, 5, 5]);
        // Up then down within two reads: the lower wins at once.
        assert_eq!(acted_on(5, &[10, 3, 10, 10]), [5, 3, 3, 10]);
    }

    #[test]
    fn no_limit_keeps_the_last_finite_one_and_is_reported_once() {
        let limit = MaxDeliver::new(5);
        assert_eq!(limit.read(-1), Change::Unlimited { keeping: 5 });
        assert_eq!(limit.read(-1), Change::Same);
        assert_eq!(limit.read(0), Change::Same);
        assert_eq!(limit.get(), 5);
        // Finite again: min of the last finite read and this one.
        assert_eq!(
            limit.read(8),
            Change::RaisePending {
                acting_on: 5,
                read: 8
            }
        );
        assert_eq!(limit.read(-1), Change::Unlimited { keeping: 5 });
        assert_eq!(limit.read(8), Change::Raised { from: 5, to: 8 });
        assert_eq!(acted_on(5, &[-1, 2]), [5, 2]);
    }

    #[test]
    fn failed_reads_keep_the_limit_and_warn_once_they_run_long() {
        let limit = MaxDeliver::new(5);
        assert!(!limit.failed());
        assert!(!limit.failed());
        assert!(limit.failed());
        assert!(!limit.failed(), "warned once per run of failures");
        assert_eq!(limit.get(), 5);
        limit.read(5);
        assert!(!limit.failed());
    }
}
