//! The JetStream adapter: a durable pull consumer whose messages go through the inbox, and whose
//! acks follow the verdict. The database decides; JetStream only hears the verdict.
//!
//! One concept per file: `builder` (the options), `check` (the pure start-time check of the
//! consumer), `names` (which handler has which consumer name in this process), `error` (why a
//! consumer cannot be served), `pull` (permits, pull requests, shutdown), `serve` (one message:
//! decode, key, process, retries, progress acks, carrying out the verdict), `serve_batch` (a
//! batch of messages in one transaction), `verdict` (the pure decision), `dead_letter` (the
//! dead-letter stream and what a letter says), `backstop` (dead letters for messages whose last
//! delivery ended without a verdict, from the server's advisories), `circuit` (pulling paused
//! while the database is unreachable), `max_deliver` (the consumer's limit as the worker acts on
//! it, read again while it runs), `upkeep` (the background tasks: cleanup, partitions, the sweep
//! of open claims, parked letters, the limit's periodic read). This file holds the [`Worker`]
//! handle, its counters and `run_until`.

mod advisories;
mod backstop;
mod builder;
mod check;
mod circuit;
mod dead_letter;
mod error;
mod keep_letter;
mod letter_fit;
mod letter_text;
mod max_deliver;
mod names;
mod prefetch;
mod pull;
mod requests;
mod serve;
mod serve_batch;
mod slots;
mod stream_names;
mod transport_id;
mod upkeep;
mod verdict;

pub use advisories::advisory_stream_name;
#[cfg(test)]
pub(crate) use advisories::create_stream_failed as create_advisory_stream_error;
pub(crate) use advisories::{AdvisoryStream, ensure_stream as ensure_advisory_stream};
pub use backstop::BACKSTOP_ERROR;
pub use builder::{AckMode, NoState, WorkerBuilder};
pub use check::DEFAULT_DEADLINE;
pub use dead_letter::{DEFAULT_DLQ_PREFIX, DEFAULT_DLQ_STREAM, UNREADABLE_HEADERS};
pub use error::WorkerError;
pub use serve::process_delivery;
pub use transport_id::transport_id;

use crate::handler::Handler;
use crate::store::Inbox;
use crate::supervise::supervised;
use async_nats::jetstream::consumer::PullConsumer;
use check::Settings;
use dead_letter::DeadLetters;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// An upkeep task's future, started again after a panic.
type Upkeep = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// What starts an upkeep task, from the worker and its shutdown token.
type StartUpkeep<H> = Box<dyn Fn(Arc<Inner<H>>, CancellationToken) -> Upkeep + Send + Sync>;

/// Runs upkeep task `name` on `tasks`, each start given the worker and `shutdown`: on a tokio
/// task of its own, started again after a panic (logged and counted) rather than gone for good.
fn keep<H: Handler>(
    tasks: &TaskTracker,
    inner: &Arc<Inner<H>>,
    shutdown: &CancellationToken,
    name: &'static str,
    start: StartUpkeep<H>,
) {
    let (inner, stop) = (inner.clone(), shutdown.clone());
    tasks.spawn(async move {
        let again = stop.clone();
        supervised(name, &stop, move || start(inner.clone(), again.clone())).await
    });
}

/// A snapshot of a worker's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Messages whose effect this worker committed.
    pub acked: u64,
    /// Duplicates this worker acked without running the handler.
    pub skipped: u64,
    /// Deliveries nak'd for redelivery (handler or database errors).
    pub nacked: u64,
    /// Poison messages terminated.
    pub terminated: u64,
    /// Two-phase handlers: claims found open past the sweeper's threshold at its last look.
    pub open_claims: u64,
    /// Two-phase handlers: tries that found the key's claim held by another owner's live lease
    /// (nak'd until it ends; on the last delivery, waited out).
    pub held: u64,
    /// Batched workers: tries of a batch ended by a conflict with another transaction
    /// (deadlock, serialization failure, lock timeout, busy). Lanes keep this at zero.
    pub conflicts: u64,
    /// Batched workers: tries of a whole batch again after such a conflict.
    pub batch_retries: u64,
    /// Duplicates found with another payload than the one their key was first processed with
    /// (by this worker's inbox and its clones: [`Inbox::key_reuses`](crate::Inbox::key_reuses)).
    pub key_reuses: u64,
}

/// Counters of what a worker did, by outcome.
#[derive(Debug, Default)]
struct Counters {
    acked: AtomicU64,
    skipped: AtomicU64,
    nacked: AtomicU64,
    terminated: AtomicU64,
    open_claims: AtomicU64,
    held: AtomicU64,
    conflicts: AtomicU64,
    batch_retries: AtomicU64,
}

/// A JetStream consumer processing messages through an [`Inbox`] with one handler. Cheap to
/// clone; clones share counters and state.
///
/// ```no_run
/// # use inbox_runtime::{Inbox, WorkerBuilder, idempotent, Tx};
/// # use sqlx::Postgres;
/// # #[derive(serde::Deserialize)] struct Credit { id: String }
/// # #[idempotent(consumer = "credit", key = msg.id)]
/// # async fn credit(msg: Credit, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> { Ok(()) }
/// # async fn demo(inbox: Inbox<Postgres>, js: async_nats::jetstream::Context, consumer: async_nats::jetstream::consumer::PullConsumer)
/// # -> Result<(), Box<dyn std::error::Error>> {
/// let shutdown = tokio_util::sync::CancellationToken::new();
/// let worker = WorkerBuilder::new(inbox, &js, consumer).concurrency(8).build(credit)?;
/// let stats = worker.run_until(shutdown).await;
/// # Ok(()) }
/// ```
pub struct Worker<H: Handler> {
    inner: Arc<Inner<H>>,
}

impl<H: Handler> Clone for Worker<H> {
    fn clone(&self) -> Self {
        Worker {
            inner: self.inner.clone(),
        }
    }
}

impl<H: Handler> std::fmt::Debug for Worker<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("consumer", &H::CONSUMER)
            .field("concurrency", &self.inner.settings.concurrency)
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

/// What every task of a worker shares.
struct Inner<H: Handler> {
    inbox: Inbox<H::Db>,
    consumer: PullConsumer,
    handler: H,
    state: H::State,
    settings: Settings,
    counters: Counters,
    dead_letters: DeadLetters,
    stream_created: transport_id::StreamCreated,
    circuit: circuit::Circuit,
    /// The consumer's `max_deliver` as the worker acts on it now.
    max_deliver: max_deliver::MaxDeliver,
    /// Batched workers: one permit per database connection the worker may use, taken by each
    /// batch and each message of a batch served alone, so that a worker never holds more
    /// connections than its share of the pool however small its batches.
    connections: Arc<tokio::sync::Semaphore>,
    /// Batched workers of a laned handler: the turns of its batch slots, one per connection
    /// (see `slots`); none otherwise.
    turns: slots::Turns,
    /// The metric handles, registered when the worker starts (after the application installed
    /// its recorder).
    metrics: std::sync::OnceLock<crate::metrics::Handles>,
    /// JetStream: the pull subscription's client, the context of every message.
    jetstream: async_nats::jetstream::Context,
    /// Where the backstop reads and writes (the app's connection in an `App`, which pulls no
    /// stored message; else `jetstream`).
    backstop_js: async_nats::jetstream::Context,
}

impl<H: Handler> Worker<H> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        inbox: Inbox<H::Db>,
        (jetstream, backstop_js): (
            async_nats::jetstream::Context,
            async_nats::jetstream::Context,
        ),
        consumer: PullConsumer,
        handler: H,
        state: H::State,
        settings: Settings,
        (dlq_stream, dlq_prefix): (String, String),
    ) -> Self {
        let source = consumer.cached_info().stream_name.clone();
        Worker {
            inner: Arc::new(Inner {
                inbox,
                consumer,
                handler,
                state,
                counters: Counters::default(),
                dead_letters: DeadLetters::new(dlq_stream, dlq_prefix, H::CONSUMER, source),
                stream_created: transport_id::StreamCreated::default(),
                circuit: circuit::Circuit::default(),
                max_deliver: max_deliver::MaxDeliver::new(settings.max_deliver),
                connections: Arc::new(tokio::sync::Semaphore::new(settings.connections)),
                turns: match (H::LANED, settings.batch) {
                    (true, Some(_)) => slots::Turns::new(settings.connections.max(1)),
                    _ => slots::Turns::default(),
                },
                metrics: std::sync::OnceLock::new(),
                settings,
                jetstream,
                backstop_js,
            }),
        }
    }

    /// How many messages this worker processes at once.
    pub fn concurrency(&self) -> usize {
        self.inner.settings.concurrency
    }

    /// The state handed to every call of the handler.
    pub fn state(&self) -> &H::State {
        &self.inner.state
    }

    /// For tests (feature `test-util`, not part of the stable API): the consumer's
    /// `max_deliver` as this worker acts on it now (the lower of its last two reads).
    #[cfg(feature = "test-util")]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    pub fn max_deliver(&self) -> i64 {
        self.inner.max_deliver.get()
    }

    /// For tests (feature `test-util`, not part of the stable API): opens the database circuit
    /// as a delivery that found the database unreachable would, with no delivery held, so that
    /// only the circuit's own probe can close it.
    #[cfg(feature = "test-util")]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    pub fn trip_circuit(&self) {
        self.inner.circuit.trip(&"tripped by a test");
    }

    /// Whether this worker finds the database unreachable now (its circuit is open: it pulls
    /// nothing, and the messages it holds wait for the database).
    pub fn database_unreachable(&self) -> bool {
        self.inner.circuit.is_open()
    }

    /// What this worker (and its clones) did so far.
    pub fn stats(&self) -> Stats {
        let c = &self.inner.counters;
        Stats {
            acked: c.acked.load(Ordering::Relaxed),
            skipped: c.skipped.load(Ordering::Relaxed),
            nacked: c.nacked.load(Ordering::Relaxed),
            terminated: c.terminated.load(Ordering::Relaxed),
            open_claims: c.open_claims.load(Ordering::Relaxed),
            held: c.held.load(Ordering::Relaxed),
            conflicts: c.conflicts.load(Ordering::Relaxed),
            batch_retries: c.batch_retries.load(Ordering::Relaxed),
            key_reuses: self.inner.inbox.key_reuses(),
        }
    }
}

impl<H> Worker<H>
where
    H: Handler,
{
    /// Pulls and processes messages until `shutdown` is cancelled, then stops pulling, naks what
    /// was fetched but not started, lets in-flight messages finish and ack, flushes, and returns
    /// what it did. Pull errors (NATS down, say) are retried with capped backoff.
    pub async fn run_until(&self, shutdown: CancellationToken) -> Stats {
        crate::metrics::describe();
        let _ = self
            .inner
            .metrics
            .set(crate::metrics::Handles::new(H::CONSUMER));
        tracing::info!(
            consumer = H::CONSUMER,
            durable = %self.inner.consumer.cached_info().name,
            concurrency = self.inner.settings.concurrency,
            "inbox worker started"
        );
        let tasks = TaskTracker::new();
        let keep = |name, task| keep(&tasks, &self.inner, &shutdown, name, task);
        if let Some(schedule) = self.inner.settings.cleanup {
            keep(
                "inbox cleanup",
                Box::new(move |inner, stop| {
                    let progress = (inner.jetstream.clone(), inner.consumer.clone());
                    Box::pin(upkeep::clean_up(
                        inner.inbox.clone(),
                        H::CONSUMER,
                        progress,
                        schedule,
                        stop,
                    ))
                }),
            );
        }
        if let Some(partitions) = self.inner.inbox.partitions() {
            keep(
                "inbox partitions",
                Box::new(move |inner, stop| {
                    Box::pin(upkeep::add_partitions(
                        inner.inbox.clone(),
                        partitions,
                        stop,
                    ))
                }),
            );
        }
        keep(
            "parked letters",
            Box::new(|inner, stop| Box::pin(upkeep::relay_parked_letters(inner, stop))),
        );
        keep(
            "circuit probe",
            Box::new(|inner, stop| {
                Box::pin(async move {
                    circuit::probe_while_open(&inner.circuit, &inner.inbox, &stop).await
                })
            }),
        );
        if self.inner.settings.pause_on_server {
            keep(
                "circuit mirror",
                Box::new(|inner, stop| {
                    Box::pin(async move {
                        let info = inner.consumer.cached_info();
                        let (stream, consumer) = (&info.stream_name, &info.name);
                        circuit::mirror_on_server(
                            &inner.circuit,
                            &inner.jetstream,
                            stream,
                            consumer,
                            &stop,
                        )
                        .await
                    })
                }),
            );
        }
        if let Some(advisories) = self.inner.settings.backstop.clone() {
            backstop::ready(&self.inner, &advisories, &shutdown).await;
            keep(
                "delivery-limit backstop",
                Box::new(move |inner, stop| {
                    Box::pin(backstop::run(inner, advisories.clone(), stop))
                }),
            );
        }
        keep(
            "kept connections release",
            Box::new(|inner, stop| {
                Box::pin(upkeep::release_kept_connections(inner.inbox.clone(), stop))
            }),
        );
        keep(
            "max_deliver refresh",
            Box::new(|inner, stop| Box::pin(upkeep::refresh_max_deliver(inner, stop))),
        );
        if let Some(sweep) = self.inner.settings.sweep {
            keep(
                "open claims sweep",
                Box::new(move |inner, stop| {
                    Box::pin(upkeep::sweep_open_claims(inner, sweep, stop))
                }),
            );
        }
        pull::run(&self.inner, &shutdown, &tasks).await;
        tasks.close();
        tasks.wait().await;
        // Nothing runs on the kept connections any more: back to the pool, which may be closed
        // next (it waits for every connection out of it).
        self.inner.inbox.release_kept_connections();
        if let Err(e) = self.inner.jetstream.client().flush().await {
            tracing::warn!(error = %e, "flushing acks on shutdown failed");
        }
        let stats = self.stats();
        tracing::info!(consumer = H::CONSUMER, ?stats, "inbox worker stopped");
        stats
    }
}
