//! Options: [`WorkerBuilder`] collects what the user asks for; `check.rs` decides, from the
//! consumer's configuration, whether it can be served and with which settings.

use super::advisories::AdvisoryStream;
use super::check::{Batching, Options, Sweep, ack_wait_of, check};
use super::names::claim_consumer_name;
use super::{Worker, WorkerError};
use crate::backend::InboxBackend;
use crate::backoff::Backoff;
use crate::handler::Handler;
use crate::store::Inbox;
use async_nats::jetstream::consumer::{self, PullConsumer};
use async_nats::jetstream::{self, stream};
use std::time::Duration;

/// How a committed message is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
///
/// Plain is the default: the marker, committed before the ack is sent, already makes a lost ack
/// harmless (the redelivery finds it and is skipped), and waiting for the server's confirmation
/// cost nats-server about 20 us of CPU per message more (`cargo xtask bench`, PostgreSQL: 82-91
/// against 106-110 us) for nothing the marker does not give.
pub enum AckMode {
    /// Plain `ack`: fire and forget; a lost ack means a redelivery, which the marker skips
    /// (default).
    #[default]
    Plain,
    /// `double_ack`: waits for the server to confirm the ack, so that the worker's counters
    /// count only acks the server took.
    Double,
}

/// The state of a handler that takes none: `()`. What [`WorkerBuilder::build`] and
/// [`App::handler`](crate::App::handler) ask of a handler, so that a handler taking `&State`
/// passed to them is told to use the `_with_state` form.
#[diagnostic::on_unimplemented(
    message = "this handler takes state `&{Self}`: register it with its state",
    label = "the handler's state is `{Self}`",
    note = "use `build_with_state(handler, state)` (or `App::handler_with_state`), passing the `{Self}` every call borrows"
)]
pub trait NoState: Sized {
    /// The value: `()`.
    fn none() -> Self;
}

impl NoState for () {
    fn none() -> Self {}
}

/// Builds a [`Worker`]: `WorkerBuilder::new(inbox, &js, consumer).concurrency(8).build(handler)`.
#[derive(Debug)]
pub struct WorkerBuilder<DB: InboxBackend> {
    inbox: Inbox<DB>,
    jetstream: jetstream::Context,
    /// `None` only in the probe [`App`](crate::App) configures to read what a handler asks for
    /// before any consumer is resolved; never built.
    consumer: Option<PullConsumer>,
    options: Options,
    /// Where the backstop reads, when not on the pull connection.
    backstop_on: Option<jetstream::Context>,
}

impl<DB: InboxBackend> WorkerBuilder<DB> {
    /// A builder for a worker that processes `consumer`'s messages through `inbox`. `jetstream`
    /// is the context the consumer was looked up with: the worker pulls on its connection.
    pub fn new(inbox: Inbox<DB>, jetstream: &jetstream::Context, consumer: PullConsumer) -> Self {
        WorkerBuilder {
            inbox,
            jetstream: jetstream.clone(),
            consumer: Some(consumer),
            options: Options::default(),
            backstop_on: None,
        }
    }

    /// A builder without a consumer, for reading the options a configuration sets
    /// ([`WorkerBuilder::asked_concurrency`]); building it fails.
    pub(crate) fn probe(inbox: Inbox<DB>, jetstream: &jetstream::Context) -> Self {
        WorkerBuilder {
            inbox,
            jetstream: jetstream.clone(),
            consumer: None,
            options: Options::default(),
            backstop_on: None,
        }
    }

    /// The concurrency asked for with [`WorkerBuilder::concurrency`], if any.
    pub(crate) fn asked_concurrency(&self) -> Option<usize> {
        self.options.concurrency
    }

    /// At most `n` messages in flight. Capped at the pool's `max_connections` and the consumer's
    /// `max_ack_pending`; defaults to the pool size.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.options.concurrency = Some(n);
        self
    }

    /// Fetches up to `n` messages ahead of the concurrency: they wait in the worker, in
    /// delivery order, for a permit, with progress acks every third of `ack_wait` so that no
    /// delivery ends at the server while it waits. A permit that frees then starts the next
    /// message at once, where without prefetch it waits for a pull request's round trip to the
    /// server; and a pull request is sent only once half of `n` (at least one) can be asked
    /// for, so that one request brings several messages. 0 (the default) fetches no more than
    /// the free permits.
    ///
    /// Fetched and unacked messages are at most concurrency + `n`, capped by the consumer's
    /// `max_ack_pending`. On shutdown, a message still waiting is given back with a nak (served
    /// to the end on its last delivery), as one the pull brings after the shutdown began. Not
    /// for batched workers (ignored): a batch being collected is their margin.
    pub fn prefetch(mut self, n: usize) -> Self {
        self.options.prefetch = n;
        self
    }

    /// Commits up to `max_messages` messages in one transaction (one COMMIT, so one fsync, for
    /// all), waiting `max_wait` after a batch's first message for more. Off by default. A batch
    /// that could not start yet (with a lane, below: its slot's previous batch still runs;
    /// without: every connection of the worker is taken) goes on collecting until it could, or
    /// until it is full, or at the latest a third of `ack_wait` after its first message: under
    /// load batches grow with the backlog, as in a database's group commit, instead of queueing
    /// up small behind each other.
    ///
    /// A batch is sorted by lane, then key, and each message's claim and handler run in one
    /// transaction; two copies of a key in a batch make the second a Skip. When a message fails,
    /// the batch is rolled back and tried again with a SAVEPOINT per message: the failing one is
    /// rolled back to its savepoint and processed alone afterwards (its retries, nak or dead
    /// letter exactly as without batching) while the others commit. A conflict with another
    /// transaction (deadlock, serialization failure, lock timeout, busy) is no message's fault:
    /// the whole batch is tried again after a short jittered wait, up to 4 tries, and only then
    /// are its messages processed alone ([`Stats::conflicts`](crate::Stats::conflicts) counts
    /// such tries). A failed BEGIN or a COMMIT whose outcome is unknown sends every message of
    /// the batch alone, where the marker decides again. Acks follow the COMMIT. Concurrency then
    /// counts connections, each with a batch: messages in flight are at most concurrency ×
    /// `max_messages` (and the consumer's `max_ack_pending`). Handlers must not commit or roll
    /// back the transaction they are given, as always.
    ///
    /// **Several processes.** The server shares the consumer's `max_ack_pending` among all the
    /// processes pulling from it: give it room for all their batches (processes × concurrency
    /// × `max_messages`), or each process's batches stay smaller than the backlog would allow
    /// (with [`recommended_consumer`](crate::recommended_consumer)'s 1,000, three processes of
    /// 8 connections get about 40 messages per connection), and cost more per message.
    ///
    /// **Hot rows.** Batches that update the same rows (a popular account) in different orders
    /// deadlock. Name what the handler locks, `#[idempotent(.., lane = msg.account)]`: each
    /// lane is then kept in one of the worker's batch slots (one per connection, taking turns),
    /// and every batch of every process runs its messages in lane order, so that they take
    /// their row locks in one order and never deadlock. Without a lane, a batch waits at most
    /// 200 ms for a lock (a wait may be a deadlock's; PostgreSQL would detect it only after its
    /// `deadlock_timeout`, 1 s) and is tried again.
    ///
    /// `max_messages` is at least 1; 1 turns batching off. `max_wait` is at most a third of the
    /// consumer's `ack_wait`: a batch being collected gets no progress acks, so it must flush
    /// before its first message's delivery could end at the server.
    pub fn batch(mut self, max_messages: usize, max_wait: Duration) -> Self {
        self.options.batch = (max_messages > 1).then_some(Batching {
            max_messages,
            max_wait,
        });
        self
    }

    /// The bytes of messages the worker holds at most, fetched and not yet finished (default
    /// 64 MiB), counted as the server counts a pull request's `max_bytes`: subject, reply
    /// subject, headers and payload. Pull requests ask for no more than is free, so memory is
    /// bounded by this as well as by the concurrency (times the batch size when batched), whatever
    /// size producers publish. A budget below one message of the server's largest (its
    /// `max_payload` plus room for the subjects) is raised to that, so that every message can
    /// be fetched.
    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.options.max_bytes = Some(bytes);
        self
    }

    /// How committed messages are acked (default [`AckMode::Plain`]).
    pub fn ack_mode(mut self, mode: AckMode) -> Self {
        self.options.ack_mode = mode;
        self
    }

    /// How long one pull request waits for messages (default 2 s). Shutdown waits at most this long
    /// for a pull in progress, so that messages it brings are nak'd rather than left to `ack_wait`.
    pub fn fetch_expiry(mut self, expiry: Duration) -> Self {
        self.options.fetch_expiry = expiry;
        self
    }

    /// How long one try of a delivery may take, claim, handler and commit together (default
    /// 5 minutes). Progress acks keep a slow handler's message from being redelivered, so
    /// without a bound a handler that hangs, or a claim waiting behind a frozen peer, would hold
    /// its slot (and shutdown) indefinitely. Past the deadline the try is dropped, which rolls
    /// its transaction back, and the message is nak'd with a delay (dead-lettered at
    /// `max_deliver`). Keep the inbox's [lock timeout](crate::Inbox::lock_timeout) below it;
    /// it must be longer than the pool's acquire timeout (the build refuses it otherwise). A
    /// try cut by the deadline while the database does not answer is an outage: it waits, and
    /// spends no delivery.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.options.deadline = deadline.max(Duration::from_millis(1));
        self
    }

    /// Whether to pause the durable consumer on the server (nats-server 2.11+) while this worker
    /// finds the database unreachable, so that JetStream delivers nothing to any instance and
    /// redelivers nothing whose `ack_wait` ran out (default: no). A pause stops every instance of
    /// the consumer, also when only this one is cut off from the database: turn it on only
    /// where every instance reaches the database the same way (one instance, or one network
    /// path). Without it, the worker stops its own pulls and holds what it has (progress acks,
    /// no delivery spent), and the other instances go on.
    pub fn pause_on_server(mut self, pause: bool) -> Self {
        self.options.pause_on_server = pause;
        self
    }

    /// The delay of a nak after a failure: `base * 2^(delivered - 1)`, at most `max`
    /// (default 1 s and 30 s). Never zero: a nak without delay redelivers at once, a hot loop.
    /// A consumer with a `backoff` uses its steps instead.
    pub fn nak_delay(mut self, base: Duration, max: Duration) -> Self {
        self.options.nak_delay = Backoff::new(base.max(Duration::from_millis(1)), max);
        self
    }

    /// How many times a delivery is tried in-process while its failure is transient, each time
    /// in a fresh transaction (default 3); after that it is nak'd with a delay.
    pub fn attempts(mut self, attempts: u32) -> Self {
        self.options.attempts = attempts;
        self
    }

    /// Where rejected messages go: the stream (default `INBOX_DLQ`, created when missing) and the
    /// subject prefix (default `inbox.dlq`; the subject is `<prefix>.<consumer>`).
    pub fn dead_letters(
        mut self,
        stream: impl Into<String>,
        subject_prefix: impl Into<String>,
    ) -> Self {
        self.options.dead_letter_stream = stream.into();
        self.options.dead_letter_prefix = subject_prefix.into();
        self
    }

    /// Deletes this handler's finished markers once they are older than `retention`, every minute,
    /// in batches, one instance at a time. `stream` is the consumer's stream: `build` refuses a
    /// retention shorter than the [`retention_floor`](crate::retention_floor) of the consumer and
    /// stream, naming each figure.
    ///
    /// The cutoff follows the stream and the consumer, not the wall clock
    /// ([`Inbox::cleanup_behind`](crate::Inbox::cleanup_behind)): a marker is kept while it is
    /// younger than `retention` before the publish time of the oldest message still in the
    /// stream, or of the oldest message the consumer has not acked if that is older. So a marker
    /// lives as long as its message is stored, plus `retention`, however long the consumer was
    /// stopped or lagging. Any stream is accepted: one that keeps messages forever (no `max_age`,
    /// `max_msgs` or `max_bytes`, the defaults of `nats stream add`) keeps one marker per stored
    /// message; one with limits, a work queue or an interest stream lets markers go once their
    /// messages are gone and `retention` has passed.
    pub fn cleanup(mut self, retention: Duration, stream: &stream::Stream) -> Self {
        self.options.cleanup = Some((retention, stream.cached_info().config.clone()));
        self
    }

    /// Runs the delivery-limit backstop (on by default in an [`App`](crate::App)): a message
    /// whose last delivery ends without a verdict (the process holding it killed, a header the
    /// client cannot parse, `max_deliver` lowered under a running instance) is dead-lettered
    /// unless its marker is committed. The server's delivery-limit advisories of the consumer's
    /// stream are kept in a stream `INBOX_ADVISORIES_<stream>`
    /// ([`advisory_stream_name`](crate::advisory_stream_name); created at start when missing,
    /// kept 7 days, left in place so that advisories published while no instance runs are kept),
    /// and read with a durable consumer shared by every instance
    /// (`inbox_backstop_<stream>_<durable>`). See the README's "Delivery limit" for what it does
    /// not cover.
    pub fn backstop(mut self) -> Self {
        self.options.backstop = Some(AdvisoryStream::PerStream);
        self
    }

    /// [`WorkerBuilder::backstop`], keeping the advisories in `stream`: one that already takes
    /// `$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>` (a stream of every
    /// `$JS.EVENT.>` kept for monitoring, whose subjects a new stream could not overlap), or
    /// one created when missing.
    pub fn backstop_in(mut self, stream: impl Into<String>) -> Self {
        self.options.backstop = Some(AdvisoryStream::Named(stream.into()));
        self
    }

    /// The backstop reads advisories and stored messages, and publishes its letters, on
    /// `jetstream`'s connection rather than the one the worker pulls on: one that is never
    /// delivered a stored message, which a header the client cannot read would break.
    pub(crate) fn backstop_on(mut self, jetstream: &jetstream::Context) -> Self {
        self.backstop_on = Some(jetstream.clone());
        self
    }

    /// No delivery-limit backstop (see [`WorkerBuilder::backstop`]).
    pub fn without_backstop(mut self) -> Self {
        self.options.backstop = None;
        self
    }

    /// The operator's margin added to the retention floor (default 1 hour).
    pub fn cleanup_margin(mut self, margin: Duration) -> Self {
        self.options.cleanup_margin = margin;
        self
    }

    /// How often a two-phase handler's worker looks for claims left open (default every 60 s),
    /// and how long after its first claim an open claim is reported (default 5 × the consumer's
    /// `ack_wait`): a warning per claim with its key and age, and their number in
    /// [`Stats::open_claims`](super::Stats::open_claims). See
    /// [`Inbox::open_claims`](crate::Inbox::open_claims) to list them and
    /// [`Inbox::release_claim`](crate::Inbox::release_claim) to let the next delivery take one
    /// over.
    pub fn sweep(mut self, every: Duration, older_than: Duration) -> Self {
        self.options.sweep = (every.max(Duration::from_millis(10)), Some(older_than));
        self
    }

    /// For tests (feature `test-util`, not part of the stable API): how often the worker reads
    /// its consumer's `max_deliver` again besides at each pull session's start (default every
    /// 60 s, never less than 10 ms).
    #[cfg(feature = "test-util")]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    pub fn max_deliver_every(mut self, every: Duration) -> Self {
        self.options.max_deliver_every = every.max(Duration::from_millis(10));
        self
    }

    /// How often cleanup runs (default every 60 s).
    pub fn cleanup_every(mut self, every: Duration) -> Self {
        self.options.cleanup_every = every;
        self
    }

    /// A worker for `handler`, which takes no state (else
    /// [`build_with_state`](Self::build_with_state)).
    pub fn build<H>(self, handler: H) -> Result<Worker<H>, WorkerError>
    where
        H: Handler<Db = DB>,
        H::State: NoState,
    {
        self.build_with_state(handler, H::State::none())
    }

    /// A worker for `handler`, with the state passed to every call.
    pub fn build_with_state<H>(self, handler: H, state: H::State) -> Result<Worker<H>, WorkerError>
    where
        H: Handler<Db = DB>,
    {
        let Some(consumer) = &self.consumer else {
            return Err(WorkerError::NoConsumer);
        };
        claim_consumer_name::<H>(self.inbox.table())?;
        let info = consumer.cached_info();
        let pool_size = self.inbox.pool().options().get_max_connections() as usize;
        let mut options = self.options.clone();
        if H::TWO_PHASE {
            // A claim commits on its own and holds a lease per message: there is no batch to
            // share a transaction with.
            options.batch = None;
        }
        let mut settings = check(&options, &info.name, &info.config, H::CONSUMER, pool_size)?;
        let acquire_timeout = self.inbox.pool().options().get_acquire_timeout();
        if options.deadline <= acquire_timeout {
            return Err(WorkerError::DeadlineNotAboveAcquireTimeout {
                deadline: options.deadline,
                acquire_timeout,
            });
        }
        if H::TWO_PHASE {
            let ack_wait = ack_wait_of(&info.config);
            let lease = self.inbox.lease_duration();
            // Progress acks go every third of ack_wait, so a crash is redelivered after two
            // thirds of it at the earliest: the lease, renewed just before, must be over by then.
            if lease * 3 > ack_wait * 2 {
                return Err(WorkerError::LeaseNotBelowAckWait {
                    consumer: info.name.clone(),
                    lease,
                    ack_wait,
                });
            }
            // A try may hold a connection for its phase-2 transaction while its lease is
            // renewed on another: one connection is kept for renewals.
            if pool_size > 1 {
                settings.concurrency = settings.concurrency.min(pool_size - 1);
                settings.connections = settings.connections.min(pool_size - 1);
            }
            let (every, older_than) = options.sweep;
            settings.sweep = Some(Sweep {
                every,
                older_than: older_than.unwrap_or(ack_wait * 5),
            });
        }
        let Options {
            dead_letter_stream,
            dead_letter_prefix,
            ..
        } = self.options;
        // On `jetstream`'s connection, which the worker subscribes on: pull requests, acks and
        // consumer info all go the same way.
        use consumer::FromConsumer as _;
        let config = consumer::pull::Config::try_from_consumer_config(info.config.clone())
            .map_err(|_| WorkerError::NotPull {
                consumer: info.name.clone(),
            })?;
        let consumer = PullConsumer::new(config, info.clone(), self.jetstream.clone());
        let backstop_js = self.backstop_on.unwrap_or_else(|| self.jetstream.clone());
        // No statement outlives the try it belongs to by more than the deadline.
        // Connections are kept between tries (`store/kept.rs`) while at least one of the pool's
        // goes round through it.
        Ok(Worker::new(
            self.inbox
                .bounded_by(options.deadline)
                .keeping_connections(pool_size.saturating_sub(1)),
            (self.jetstream, backstop_js),
            consumer,
            handler,
            state,
            settings,
            (dead_letter_stream, dead_letter_prefix),
        ))
    }
}
