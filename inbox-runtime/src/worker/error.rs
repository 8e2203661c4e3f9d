//! Why a consumer cannot be served: the start-time check's and the builder's refusals.

use crate::store::RetentionFloor;
use async_nats::jetstream::consumer::AckPolicy;
use std::time::Duration;

/// A consumer that cannot be served.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// The consumer does not use explicit acks, so nothing ties an ack to a commit.
    #[error(
        "consumer {consumer:?} has ack policy {policy:?}; the inbox needs AckPolicy::Explicit so that every message is acked only after its effect is committed"
    )]
    AckPolicy {
        /// The consumer's name.
        consumer: String,
        /// Its ack policy.
        policy: AckPolicy,
    },
    /// The consumer is push-based (it has a deliver subject): the worker pulls.
    #[error(
        "consumer {consumer:?} is push-based (it has a deliver_subject); the worker needs a pull consumer"
    )]
    NotPull {
        /// The consumer's name.
        consumer: String,
    },
    /// A two-phase handler's lease is over two thirds of the consumer's `ack_wait`: progress
    /// acks go every third of it, so a crash can be redelivered after two thirds of `ack_wait`,
    /// and the redelivery would find the lease still running and wait it out, spending
    /// deliveries.
    #[error(
        "the inbox's claim lease {lease:?} is over two thirds of consumer {consumer:?}'s ack_wait {ack_wait:?}; use a shorter Inbox::lease or a longer ack_wait, so that a redelivery after a crash finds the lease run out"
    )]
    LeaseNotBelowAckWait {
        /// The consumer's name.
        consumer: String,
        /// The inbox's lease.
        lease: Duration,
        /// The consumer's `ack_wait`.
        ack_wait: Duration,
    },
    /// A builder of the runtime's own that has no consumer was built: a bug of this crate.
    #[error("internal error: a worker builder without a consumer was built")]
    NoConsumer,
    /// `concurrency(0)` was asked for.
    #[error("concurrency must be at least 1")]
    ZeroConcurrency,
    /// The consumer redelivers forever, so a message that always fails is never dead-lettered.
    #[error(
        "consumer {consumer:?} has no max_deliver limit (-1); set a finite max_deliver (for example 10) so that failing messages are dead-lettered"
    )]
    UnboundedMaxDeliver {
        /// The consumer's name.
        consumer: String,
    },
    /// Markers would be deleted while their message can still be redelivered.
    #[error(
        "retention {retention:?} is shorter than the minimum safe retention for this consumer: {floor}"
    )]
    RetentionTooShort {
        /// The configured retention.
        retention: Duration,
        /// The minimum and its figures.
        floor: RetentionFloor,
    },
    /// Another handler of this process already uses this consumer name on the same inbox table
    /// and kind of database: each would skip the other's messages as duplicates.
    #[error(
        "consumer name {consumer:?} is already used by handler {other} on inbox table {table:?}; handler {this} would skip its messages as duplicates (and it this one's): give each handler a consumer name of its own"
    )]
    ConsumerTaken {
        /// The consumer name.
        consumer: &'static str,
        /// The inbox table.
        table: String,
        /// The handler that has it.
        other: &'static str,
        /// The handler refused.
        this: &'static str,
    },
    /// The delivery deadline is not longer than the pool's acquire timeout: a try waiting for a
    /// connection during an outage would end as late, never as an outage.
    #[error(
        "the delivery deadline {deadline:?} is not longer than the pool's acquire timeout {acquire_timeout:?}: a try waiting for a connection while the database is away would be cut as late instead of waiting for it; raise WorkerBuilder::deadline or lower PoolOptions::acquire_timeout"
    )]
    DeadlineNotAboveAcquireTimeout {
        /// The deadline.
        deadline: Duration,
        /// The pool's acquire timeout.
        acquire_timeout: Duration,
    },
    /// The handler's consumer name cannot be a NATS subject token (dead letters go to
    /// `<prefix>.<consumer>`).
    #[error(
        "consumer name {name:?} is not a valid NATS subject token: use letters, digits, `-` and `_`, without spaces, `.`, `*` or `>`"
    )]
    ConsumerName {
        /// The rejected name.
        name: String,
    },
    /// A dead-letter stream, dead-letter subject prefix or advisory stream that JetStream would
    /// refuse: every letter (or the backstop) would fail, one at a time, at run time.
    #[error("{what} {name:?} is not valid: {why}")]
    InvalidName {
        /// What it names: "dead-letter stream", "dead-letter subject prefix", "advisory stream".
        what: &'static str,
        /// The rejected name.
        name: String,
        /// What is wrong with it.
        why: &'static str,
    },
}
