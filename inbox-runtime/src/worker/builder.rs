//! Options and the start-time check: [`WorkerBuilder`] collects what the user asks for, and
//! [`check`] decides, from the consumer's configuration alone (pure, testable without a server),
//! whether it can be served and with which settings. A consumer that would break a guarantee
//! later is refused here, with an error naming the problem.

use super::Worker;
use super::dead_letter::{DEFAULT_DLQ_PREFIX, DEFAULT_DLQ_STREAM};
use super::verdict::Limits;
use crate::backend::InboxBackend;
use crate::backend::TableName;
use crate::backoff::Backoff;
use crate::cleanup::{RetentionFloor, Schedule, retention_floor};
use crate::handler::Handler;
use crate::store::Inbox;
use async_nats::jetstream::consumer::{self, AckPolicy, PullConsumer};
use async_nats::jetstream::{self, stream};
use std::any::TypeId;
use std::collections::BTreeMap;
use std::sync::Mutex;
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

/// A consumer that cannot be served.
#[derive(Debug, thiserror::Error)]
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
    /// Cleanup was asked for on a stream that keeps messages forever: any of them can be
    /// replayed (a consumer reset or a new consumer) after its marker is deleted.
    #[error(
        "stream {stream:?} keeps messages forever (max_age 0, retention policy Limits), so a replay of any stored message could come after cleanup deleted its marker; set a max_age on the stream (and a retention above it), or accept that replays older than the retention are applied again with WorkerBuilder::allow_unlimited_stream_age()"
    )]
    UnlimitedStreamAge {
        /// The stream's name.
        stream: String,
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
    /// The handler's consumer name cannot be a NATS subject token (dead letters go to
    /// `<prefix>.<consumer>`).
    #[error(
        "consumer name {name:?} is not a valid NATS subject token: use letters, digits, `-` and `_`, without spaces, `.`, `*` or `>`"
    )]
    ConsumerName {
        /// The rejected name.
        name: String,
    },
}

/// The sweeper of a two-phase handler's open claims: see [`WorkerBuilder::sweep`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sweep {
    /// How often it looks.
    pub every: Duration,
    /// A claim open (not done) this long after it was first taken is reported.
    pub older_than: Duration,
}

/// What the user asked for; defaults in [`Options::default`].
#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub concurrency: Option<usize>,
    pub batch: Option<Batching>,
    pub ack_mode: AckMode,
    pub fetch_expiry: Duration,
    pub deadline: Duration,
    pub nak_delay: Backoff,
    pub attempts: u32,
    pub dead_letter_stream: String,
    pub dead_letter_prefix: String,
    pub cleanup: Option<(Duration, stream::Config)>,
    pub unlimited_age_ok: bool,
    pub cleanup_margin: Duration,
    pub cleanup_every: Duration,
    /// The sweeper's period and threshold; the threshold defaults to 5 × `ack_wait`.
    pub sweep: (Duration, Option<Duration>),
}

impl Default for Options {
    fn default() -> Self {
        Options {
            concurrency: None,
            batch: None,
            ack_mode: AckMode::default(),
            fetch_expiry: Duration::from_secs(2),
            deadline: DEFAULT_DEADLINE,
            nak_delay: Backoff::new(Duration::from_secs(1), Duration::from_secs(30)),
            attempts: 3,
            dead_letter_stream: DEFAULT_DLQ_STREAM.to_owned(),
            dead_letter_prefix: DEFAULT_DLQ_PREFIX.to_owned(),
            cleanup: None,
            unlimited_age_ok: false,
            cleanup_margin: Duration::from_secs(3600),
            cleanup_every: Duration::from_secs(60),
            sweep: (Duration::from_secs(60), None),
        }
    }
}

/// The settings a worker runs with, once [`check`] accepted the consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Settings {
    /// Messages in flight at most.
    pub concurrency: usize,
    /// Database connections in use at most: the concurrency asked for (capped at the pool);
    /// batched, each batch (or message served alone) takes one, so `concurrency` is this times
    /// the batch size.
    pub connections: usize,
    pub ack_mode: AckMode,
    /// How long a pull request stays open: at most the consumer's `max_expires`.
    pub fetch_expiry: Duration,
    /// The most messages one pull request asks for: the consumer's `max_batch`, if it has one.
    pub max_batch: usize,
    /// Batched commits, when asked for.
    pub batch: Option<Batching>,
    /// How long one try of a delivery may take.
    pub deadline: Duration,
    /// Progress acks while a handler runs longer than this (a third of `ack_wait`).
    pub progress_every: Duration,
    pub limits: Limits,
    pub cleanup: Option<Schedule>,
    /// The sweeper of open claims (two-phase handlers only; set by `build`).
    pub sweep: Option<Sweep>,
}

/// Batched commits: see [`WorkerBuilder::batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Batching {
    /// The most messages in one transaction.
    pub max_messages: usize,
    /// How long a batch waits for more messages after its first.
    pub max_wait: Duration,
}

/// How long one try of a delivery may take by default: see [`WorkerBuilder::deadline`].
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(300);

/// The `ack_wait` the server applies when the consumer leaves it at zero.
const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);

/// Checks consumer `name` with `config` for `handler_consumer` (the handler's `CONSUMER`) on a
/// pool of `pool_size` connections, and derives the worker's settings.
pub(crate) fn check(
    options: &Options,
    name: &str,
    config: &consumer::Config,
    handler_consumer: &str,
    pool_size: usize,
) -> Result<Settings, WorkerError> {
    if config.ack_policy != AckPolicy::Explicit {
        return Err(WorkerError::AckPolicy {
            consumer: name.to_owned(),
            policy: config.ack_policy,
        });
    }
    if options.concurrency == Some(0) {
        return Err(WorkerError::ZeroConcurrency);
    }
    if config.max_deliver <= 0 {
        return Err(WorkerError::UnboundedMaxDeliver {
            consumer: name.to_owned(),
        });
    }
    if !is_subject_token(handler_consumer) {
        return Err(WorkerError::ConsumerName {
            name: handler_consumer.to_owned(),
        });
    }
    // Never more in flight than connections to process them on, nor than the server lets
    // wait for acks: prefetching more than can be processed within ack_wait turns into
    // redelivery storms.
    let mut concurrency = options.concurrency.unwrap_or(pool_size).min(pool_size);
    let connections = concurrency.max(1);
    // Batched, a connection serves a batch at a time.
    if let Some(batch) = options.batch {
        concurrency = concurrency.saturating_mul(batch.max_messages);
    }
    if config.max_ack_pending > 0 {
        concurrency = concurrency.min(config.max_ack_pending as usize);
    }
    let ack_wait = ack_wait_of(config);
    let limits = Limits {
        max_deliver: config.max_deliver,
        backoff: config.backoff.clone(),
        nak_delay: options.nak_delay,
        attempts: options.attempts.max(1),
        retry_wait: Backoff::new(Duration::from_millis(100), Duration::from_secs(2)).with_jitter(),
    };
    let cleanup = match &options.cleanup {
        None => None,
        Some((retention, stream)) => {
            let keeps_forever =
                stream.max_age.is_zero() && stream.retention == stream::RetentionPolicy::Limits;
            if keeps_forever && !options.unlimited_age_ok {
                return Err(WorkerError::UnlimitedStreamAge {
                    stream: stream.name.clone(),
                });
            }
            let floor =
                retention_floor(config, stream, limits.longest_nak(), options.cleanup_margin);
            if *retention < floor.total() {
                return Err(WorkerError::RetentionTooShort {
                    retention: *retention,
                    floor,
                });
            }
            Some(Schedule {
                retention: *retention,
                every: options.cleanup_every,
            })
        }
    };
    Ok(Settings {
        concurrency: concurrency.max(1),
        connections,
        ack_mode: options.ack_mode,
        fetch_expiry: match config.max_expires {
            d if d.is_zero() => options.fetch_expiry,
            d => options.fetch_expiry.min(d),
        },
        batch: options.batch,
        max_batch: match config.max_batch {
            n if n > 0 => n as usize,
            _ => usize::MAX,
        },
        deadline: options.deadline,
        progress_every: (ack_wait / 3).max(Duration::from_millis(100)),
        limits,
        cleanup,
        sweep: None,
    })
}

/// The `ack_wait` the server applies to `config`.
fn ack_wait_of(config: &consumer::Config) -> Duration {
    match config.ack_wait {
        d if d.is_zero() => DEFAULT_ACK_WAIT,
        d => d,
    }
}

/// Which handler (by type) uses each consumer name, per kind of database and inbox table, in
/// this process.
type ConsumerNames = BTreeMap<(TypeId, String, &'static str), (TypeId, &'static str)>;

static CONSUMER_NAMES: Mutex<ConsumerNames> = Mutex::new(BTreeMap::new());

/// Records that handler `H` uses its consumer name on `table`; refuses a second handler type
/// with the same name on the same table and kind of database. The same handler may have many
/// workers (instances, clones, restarts).
fn claim_consumer_name<H: Handler>(table: &TableName) -> Result<(), WorkerError> {
    let mut names = CONSUMER_NAMES.lock().unwrap_or_else(|e| e.into_inner());
    let key = (
        TypeId::of::<H::Db>(),
        table.as_str().to_owned(),
        H::CONSUMER,
    );
    let this = (TypeId::of::<H>(), std::any::type_name::<H>());
    match names.get(&key) {
        Some(&(other, name)) if other != this.0 => Err(WorkerError::ConsumerTaken {
            consumer: H::CONSUMER,
            table: table.as_str().to_owned(),
            other: name,
            this: this.1,
        }),
        Some(_) => Ok(()),
        None => {
            names.insert(key, this);
            Ok(())
        }
    }
}

/// Whether `name` can stand as one token of a NATS subject.
fn is_subject_token(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_graphic() && !matches!(b, b'.' | b'*' | b'>'))
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
    cleanup_stream: Option<stream::Stream>,
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
            cleanup_stream: None,
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
            cleanup_stream: None,
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

    /// Commits up to `max_messages` messages in one transaction (one COMMIT, so one fsync, for
    /// all), waiting at most `max_wait` after a batch's first message for more. Off by default.
    ///
    /// A batch is sorted by key, then each message's claim and handler run in one transaction;
    /// two copies of a key in a batch make the second a Skip. When a message fails, the batch is
    /// rolled back and tried again with a SAVEPOINT per message: the failing one is rolled back
    /// to its savepoint and processed alone afterwards (its retries, nak or dead letter exactly
    /// as without batching) while the others commit. A transient failure (deadlock,
    /// serialization failure, lock timeout), a failed BEGIN or a COMMIT whose outcome is unknown
    /// sends every message of the batch alone, where the marker decides again. Acks follow the
    /// COMMIT. Concurrency then counts connections, each with a batch: messages in flight are
    /// at most concurrency × `max_messages` (and the consumer's `max_ack_pending`). Handlers
    /// must not commit or roll back the transaction they are given, as always.
    ///
    /// `max_messages` is at least 1; 1 turns batching off.
    pub fn batch(mut self, max_messages: usize, max_wait: Duration) -> Self {
        self.options.batch = (max_messages > 1).then_some(Batching {
            max_messages,
            max_wait,
        });
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
    /// `max_deliver`). Keep the inbox's [lock timeout](crate::Inbox::lock_timeout) below it.
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.options.deadline = deadline.max(Duration::from_millis(1));
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
    /// stream, naming each figure, and a stream that keeps messages forever (see
    /// [`WorkerBuilder::allow_unlimited_stream_age`]).
    ///
    /// The cutoff follows the consumer, not the wall clock
    /// ([`Inbox::cleanup_behind`](crate::Inbox::cleanup_behind)): a marker is kept while it is
    /// younger than `retention` before the publish time of the oldest message the consumer has
    /// not acked, however long the consumer was stopped or lagging.
    pub fn cleanup(mut self, retention: Duration, stream: &stream::Stream) -> Self {
        self.options.cleanup = Some((retention, stream.cached_info().config.clone()));
        self.cleanup_stream = Some(stream.clone());
        self
    }

    /// Lets [`WorkerBuilder::cleanup`] run on a stream without `max_age` (keeping messages
    /// forever, with retention policy `Limits`), accepting that a replay of a message older than
    /// the retention (a consumer reset, a new consumer from the start) is applied again.
    /// Redeliveries stay covered: the cutoff follows the consumer.
    pub fn allow_unlimited_stream_age(mut self) -> Self {
        self.options.unlimited_age_ok = true;
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
        Ok(Worker::new(
            self.inbox,
            self.jetstream,
            consumer,
            handler,
            state,
            settings,
            (dead_letter_stream, dead_letter_prefix),
            self.cleanup_stream,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> consumer::Config {
        consumer::Config {
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            max_deliver: 5,
            ..Default::default()
        }
    }

    fn checked(options: &Options, config: &consumer::Config) -> Result<Settings, WorkerError> {
        check(options, "c", config, "credit", 8)
    }

    #[test]
    fn explicit_acks_and_a_finite_max_deliver_are_required() {
        let o = Options::default();
        let all = consumer::Config {
            ack_policy: AckPolicy::All,
            ..config()
        };
        assert!(matches!(
            checked(&o, &all),
            Err(WorkerError::AckPolicy { .. })
        ));
        let forever = consumer::Config {
            max_deliver: -1,
            ..config()
        };
        let err = checked(&o, &forever).unwrap_err();
        assert!(
            matches!(err, WorkerError::UnboundedMaxDeliver { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("max_deliver"), "{err}");
        assert!(checked(&o, &config()).is_ok());
    }

    #[test]
    fn the_consumer_name_must_be_a_subject_token() {
        let o = Options::default();
        for bad in ["", "a b", "a.b", "a*", ">", "tab\t"] {
            let err = check(&o, "c", &config(), bad, 8).unwrap_err();
            assert!(matches!(err, WorkerError::ConsumerName { .. }), "{bad:?}");
        }
        assert!(check(&o, "c", &config(), "credit-v2_x", 8).is_ok());
    }

    #[test]
    fn concurrency_is_capped_by_the_pool_and_max_ack_pending() {
        let mut o = Options::default();
        assert_eq!(checked(&o, &config()).unwrap().concurrency, 8);
        o.concurrency = Some(4);
        assert_eq!(checked(&o, &config()).unwrap().concurrency, 4);
        o.concurrency = Some(20);
        assert_eq!(checked(&o, &config()).unwrap().concurrency, 8);
        let few_pending = consumer::Config {
            max_ack_pending: 3,
            ..config()
        };
        assert_eq!(checked(&o, &few_pending).unwrap().concurrency, 3);
        o.concurrency = Some(0);
        assert!(matches!(
            checked(&o, &config()),
            Err(WorkerError::ZeroConcurrency)
        ));
    }

    #[test]
    fn progress_acks_every_third_of_ack_wait() {
        let s = checked(&Options::default(), &config()).unwrap();
        assert_eq!(s.progress_every, Duration::from_secs(10));
        let long = consumer::Config {
            ack_wait: Duration::from_secs(60),
            ..config()
        };
        let s = checked(&Options::default(), &long).unwrap();
        assert_eq!(s.progress_every, Duration::from_secs(20));
        let unset = consumer::Config {
            ack_wait: Duration::ZERO,
            ..config()
        };
        let s = checked(&Options::default(), &unset).unwrap();
        assert_eq!(s.progress_every, Duration::from_secs(10));
    }

    #[test]
    fn cleanup_on_a_stream_that_keeps_messages_forever_is_refused_unless_allowed() {
        let forever = stream::Config {
            name: "ORDERS".into(),
            ..Default::default()
        };
        let mut o = Options {
            cleanup: Some((Duration::from_secs(365 * 86400), forever.clone())),
            ..Options::default()
        };
        let err = checked(&o, &config()).unwrap_err();
        assert!(
            matches!(&err, WorkerError::UnlimitedStreamAge { stream } if stream == "ORDERS"),
            "{err}"
        );
        let text = err.to_string();
        assert!(text.contains("max_age"), "{text}");
        assert!(text.contains("allow_unlimited_stream_age"), "{text}");
        o.unlimited_age_ok = true;
        assert!(checked(&o, &config()).is_ok());
        // A work queue or interest stream removes what was acked: nothing old to replay.
        o.unlimited_age_ok = false;
        let work_queue = stream::Config {
            retention: stream::RetentionPolicy::WorkQueue,
            ..forever
        };
        o.cleanup = Some((Duration::from_secs(365 * 86400), work_queue));
        assert!(checked(&o, &config()).is_ok());
    }

    #[test]
    fn a_retention_below_the_floor_is_refused_naming_each_figure() {
        let stream = stream::Config {
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        };
        let mut o = Options {
            cleanup_margin: Duration::from_secs(60),
            unlimited_age_ok: true,
            ..Options::default()
        };
        // ack_wait 30 s × max_deliver 5 + duplicate window 120 s + margin 60 s = 330 s.
        o.cleanup = Some((Duration::from_secs(329), stream.clone()));
        let err = checked(&o, &config()).unwrap_err();
        let text = err.to_string();
        for figure in [
            "ack_wait 30s",
            "max_deliver 5",
            "duplicate window 120s",
            "= 330s",
        ] {
            assert!(text.contains(figure), "{figure:?} missing from: {text}");
        }
        o.cleanup = Some((Duration::from_secs(330), stream.clone()));
        let schedule = checked(&o, &config()).unwrap().cleanup.unwrap();
        assert_eq!(schedule.retention, Duration::from_secs(330));

        // A delivery can stay unacked for as long as the longest nak asks, when that exceeds
        // ack_wait: the consumer's backoff (60 s × 5 + backoff sum 65 s + 120 s + 60 s = 545 s).
        let backoff = consumer::Config {
            backoff: vec![Duration::from_secs(5), Duration::from_secs(60)],
            ..config()
        };
        o.cleanup = Some((Duration::from_secs(544), stream.clone()));
        let err = checked(&o, &backoff).unwrap_err().to_string();
        assert!(err.contains("= 545s"), "{err}");
        // Or our own nak delay, when the consumer has no backoff (90 s × 5 + 120 s + 60 s).
        o.nak_delay = Backoff::new(Duration::from_secs(1), Duration::from_secs(90));
        o.cleanup = Some((Duration::from_secs(629), stream));
        let err = checked(&o, &config()).unwrap_err().to_string();
        assert!(err.contains("= 630s"), "{err}");
    }
}
