//! Why an [`App`](super::App) did not start.

use crate::outbox::RelayError;
use crate::worker::WorkerError;

/// Why an [`App`](crate::App) did not start. Nothing was consumed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AppError {
    /// Two handlers registered with one `consumer` name: each would skip the other's messages
    /// as duplicates.
    #[error(
        "handlers {first} and {second} both use consumer name {consumer:?}: each would skip the other's messages as duplicates; give each handler a consumer name of its own"
    )]
    DuplicateConsumer {
        /// The consumer name (the handler's `CONSUMER`).
        consumer: &'static str,
        /// The handler registered first.
        first: &'static str,
        /// The handler registered second.
        second: &'static str,
    },
    /// Two handlers registered on one durable consumer: they would take each other's
    /// messages.
    #[error(
        "handlers {first} and {second} both pull from durable consumer {durable:?} of stream {stream:?}: each would get only part of the messages; give each handler a durable consumer of its own"
    )]
    DuplicateDurable {
        /// The stream.
        stream: String,
        /// The durable consumer.
        durable: String,
        /// The handler registered first.
        first: &'static str,
        /// The handler registered second.
        second: &'static str,
    },
    /// The concurrency the handlers ask for exceeds the pool: they would wait on each other for
    /// connections, and a slow one would starve the rest.
    #[error(
        "the handlers need {needed} database connections at once ({asked}), but the pool has {pool}: raise the pool's max_connections or lower their concurrency"
    )]
    PoolTooSmall {
        /// Connections needed, one per message in flight (a two-phase handler one more, for its
        /// lease renewals).
        needed: usize,
        /// The pool's `max_connections`.
        pool: usize,
        /// Each handler and what it asked for.
        asked: String,
    },
    /// No handler was registered.
    #[error("the app has no handlers: register one with App::handler")]
    NoHandlers,
    /// A stream, consumer or subject name NATS would refuse.
    #[error("{what} {name:?} is not a valid NATS name: {why}")]
    InvalidName {
        /// Which name: "stream", "durable consumer", "filter subject".
        what: &'static str,
        /// The name.
        name: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// Shutdown was asked for while the app was starting (waiting for JetStream); `run` and
    /// `run_until` return `Ok` with no counters instead.
    #[error("shut down while starting")]
    Cancelled,
    /// A stream or consumer could not be looked up or created.
    #[error("{what}: {source}")]
    Nats {
        /// What was being done.
        what: String,
        /// The error.
        source: async_nats::Error,
    },
    /// An outbox relay refused a stream it publishes to.
    #[error("outbox relay: {source}")]
    Relay {
        /// Why.
        source: RelayError,
    },
    /// A handler's worker refused its consumer.
    #[error("handler {handler}: {source}")]
    Worker {
        /// The handler.
        handler: &'static str,
        /// Why.
        source: WorkerError,
    },
}
