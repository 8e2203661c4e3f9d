//! [`App`]: several handlers in one process, on one pool and one NATS connection, each with its
//! durable consumer; drained on SIGINT and SIGTERM.

use crate::backend::InboxBackend;
use crate::backoff::Backoff;
use crate::handler::Handler;
use crate::outbox::{Relay, RelayError};
use crate::store::Inbox;
use crate::worker::{NoState, Stats, WorkerBuilder, WorkerError};
use async_nats::jetstream::{self, consumer, consumer::pull, stream};
use futures::future::BoxFuture;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The consumer configuration this crate recommends for a handler's durable consumer `durable`
/// on `subject` (empty: every subject of the stream): explicit acks, at most 10 deliveries (then
/// the message is dead-lettered), `ack_wait` 30 s (progress acks keep a slow handler's message),
/// no server-side backoff (the worker's own nak delays, 1 s doubling to 30 s, apply), and at most
/// 1,000 messages awaiting an ack.
///
/// Its [retention floor](crate::retention_floor) is `ack_wait × max_deliver` (300 s) plus the
/// stream's duplicate window and `max_age`, plus a margin: the figure to keep markers above when
/// cleanup runs.
///
/// ```
/// let config = inbox_runtime::recommended_consumer("credit", "credits.requested");
/// assert_eq!(config.max_deliver, 10);
/// ```
pub fn recommended_consumer(durable: &str, subject: &str) -> pull::Config {
    pull::Config {
        durable_name: Some(durable.to_owned()),
        name: Some(durable.to_owned()),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: Duration::from_secs(30),
        max_deliver: 10,
        max_ack_pending: 1000,
        filter_subject: subject.to_owned(),
        ..Default::default()
    }
}

/// Which durable consumer a handler of an [`App`] serves, and whether the app creates it.
#[derive(Debug, Clone)]
pub struct Durable {
    stream: String,
    name: String,
    create: Option<pull::Config>,
    stream_config: Option<stream::Config>,
}

impl Durable {
    /// Consumer `name` of `stream`, which must exist when the app starts.
    pub fn existing(stream: impl Into<String>, name: impl Into<String>) -> Self {
        Durable {
            stream: stream.into(),
            name: name.into(),
            create: None,
            stream_config: None,
        }
    }

    /// Consumer `name` of `stream`, created at start, or updated to `config` if it exists
    /// (`config`'s `durable_name` and `name` are set to `name`).
    pub fn create_or_update(
        stream: impl Into<String>,
        name: impl Into<String>,
        config: pull::Config,
    ) -> Self {
        let name = name.into();
        let config = pull::Config {
            durable_name: Some(name.clone()),
            name: Some(name.clone()),
            ..config
        };
        Durable {
            create: Some(config),
            ..Durable::existing(stream, name)
        }
    }

    /// [`Durable::create_or_update`] with [`recommended_consumer`] on `subject`.
    pub fn recommended(
        stream: impl Into<String>,
        name: impl Into<String>,
        subject: impl Into<String>,
    ) -> Self {
        let name = name.into();
        let config = recommended_consumer(&name, &subject.into());
        Durable::create_or_update(stream, name, config)
    }

    /// Also creates the stream with `config` when it is missing (an existing stream is left as
    /// it is). `config.name` is set to the stream's name.
    pub fn with_stream(mut self, config: stream::Config) -> Self {
        self.stream_config = Some(stream::Config {
            name: self.stream.clone(),
            ..config
        });
        self
    }

    /// The consumer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Refuses names NATS would refuse (client side, where the error would look like a lost
    /// request and be retried forever): empty, with whitespace or control characters; a stream
    /// or durable name with `.`, `*` or `>`.
    fn check(&self) -> Result<(), AppError> {
        let name = |what: &'static str, name: &str, token: bool| {
            let why = if name.is_empty() {
                Some("it is empty")
            } else if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
                Some("it contains whitespace or a control character")
            } else if token && name.contains(['.', '*', '>']) {
                Some("it contains `.`, `*` or `>`")
            } else {
                None
            };
            match why {
                Some(why) => Err(AppError::InvalidName {
                    what,
                    name: name.to_owned(),
                    why,
                }),
                None => Ok(()),
            }
        };
        name("stream", &self.stream, true)?;
        name("durable consumer", &self.name, true)?;
        if let Some(config) = &self.create
            && !config.filter_subject.is_empty()
        {
            name("filter subject", &config.filter_subject, false)?;
        }
        Ok(())
    }

    /// The stream's name.
    pub fn stream(&self) -> &str {
        &self.stream
    }
}

/// Why an [`App`] did not start. Nothing was consumed.
#[derive(Debug, thiserror::Error)]
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

/// What each handler of an [`App`] did, by consumer name.
pub type AppStats = BTreeMap<&'static str, Stats>;

/// A registration, until the app starts.
struct Planned<DB: InboxBackend> {
    handler: &'static str,
    consumer: &'static str,
    durable: Durable,
    two_phase: bool,
    /// The concurrency its configuration asks for, read at registration.
    asked: Option<usize>,
    /// Configures the handler's builder on its consumer, once resolved, and builds the worker
    /// with the concurrency given.
    finish: Finish<DB>,
}

/// See [`Planned::finish`].
type Finish<DB> = Box<dyn FnOnce(WorkerBuilder<DB>, usize) -> Result<Run, AppError> + Send>;

/// A built worker's run until the token.
type Run = Box<dyn FnOnce(CancellationToken) -> BoxFuture<'static, Stats> + Send>;

/// An application: several handlers in one process, sharing one database pool (whose
/// connections are split among them so that it is never oversubscribed) and one NATS
/// connection. Each handler has its durable consumer ([`Durable`]), optionally created or
/// updated at start.
///
/// ```no_run
/// use inbox_runtime::{App, Durable, Inbox, Tx, idempotent};
/// use sqlx::Postgres;
///
/// #[derive(serde::Deserialize)]
/// struct OrderPlaced { order_id: i64, sku: String }
///
/// #[idempotent(consumer = "orders", key = msg.order_id)]
/// async fn orders(msg: OrderPlaced, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
///     sqlx::query("INSERT INTO orders (id, sku) VALUES ($1, $2)")
///         .bind(msg.order_id)
///         .bind(&msg.sku)
///         .execute(&mut **tx)
///         .await?;
///     Ok(())
/// }
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/test").await?;
/// let inbox = Inbox::new(pool);
/// inbox.migrate().await?;
/// let js = async_nats::jetstream::new(async_nats::connect("127.0.0.1:4222").await?);
/// let stats = App::new(inbox, &js)
///     .handler(orders, Durable::recommended("ORDERS", "orders", "orders.placed"))
///     .run() // until SIGINT or SIGTERM, then drains
///     .await?;
/// # Ok(()) }
/// ```
pub struct App<DB: InboxBackend> {
    inbox: Inbox<DB>,
    jetstream: jetstream::Context,
    planned: Vec<Planned<DB>>,
    relays: Vec<Relay<DB>>,
    health: Health,
}

/// Whether an [`App`] can do its work: NATS connected, the database answering, every handler's
/// worker running. Cheap to clone; take it with [`App::health`] before running the app, and
/// serve [`Health::check`] on a probe (`/healthz`), as the examples do.
#[derive(Clone)]
pub struct Health {
    inner: Arc<HealthInner>,
}

struct HealthInner {
    nats: async_nats::Client,
    database: Box<dyn Fn() -> BoxFuture<'static, bool> + Send + Sync>,
    /// Workers registered, and running now.
    workers: AtomicUsize,
    running: AtomicUsize,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("workers", &self.inner.workers.load(Ordering::Relaxed))
            .field("running", &self.inner.running.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// What [`Health::check`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct HealthReport {
    /// The NATS connection is up.
    pub nats: bool,
    /// The database answered a ping, on a connection of its own (the pool's may all be busy),
    /// within 5 s.
    pub database: bool,
    /// Handlers registered.
    pub workers: usize,
    /// Handlers whose worker is running.
    pub running: usize,
}

impl HealthReport {
    /// Everything is up and every worker runs.
    pub fn healthy(&self) -> bool {
        self.nats && self.database && self.workers > 0 && self.running == self.workers
    }
}

impl Health {
    /// Looks now: pings the database (at most 5 s) and reads the NATS connection's state.
    pub async fn check(&self) -> HealthReport {
        let nats = self.inner.nats.connection_state() == async_nats::connection::State::Connected;
        let database = (self.inner.database)().await;
        HealthReport {
            nats,
            database,
            workers: self.inner.workers.load(Ordering::Relaxed),
            running: self.inner.running.load(Ordering::Relaxed),
        }
    }
}

impl<DB: InboxBackend> std::fmt::Debug for App<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let handlers: Vec<_> = self.planned.iter().map(|p| p.consumer).collect();
        f.debug_struct("App")
            .field("handlers", &handlers)
            .finish_non_exhaustive()
    }
}

impl<DB: InboxBackend> App<DB> {
    /// An app over `inbox` (migrated already) and `jetstream`, whose connection every worker
    /// pulls on.
    pub fn new(inbox: Inbox<DB>, jetstream: &jetstream::Context) -> Self {
        let pinged = inbox.clone();
        let health = Health {
            inner: Arc::new(HealthInner {
                nats: jetstream.client(),
                database: Box::new(move || {
                    let inbox = pinged.clone();
                    Box::pin(async move { inbox.reachable().await })
                }),
                workers: AtomicUsize::new(0),
                running: AtomicUsize::new(0),
            }),
        };
        App {
            inbox,
            jetstream: jetstream.clone(),
            planned: Vec::new(),
            relays: Vec::new(),
            health,
        }
    }

    /// The app's health, to serve on a probe while it runs (see [`Health`]).
    pub fn health(&self) -> Health {
        self.health.clone()
    }

    /// Registers `handler`, which takes no state, on `durable`.
    pub fn handler<H>(self, handler: H, durable: Durable) -> Self
    where
        H: Handler<Db = DB>,
        H::State: NoState,
    {
        self.handler_with_state(handler, H::State::none(), durable)
    }

    /// Registers `handler` with the state every call borrows, on `durable`.
    pub fn handler_with_state<H>(self, handler: H, state: H::State, durable: Durable) -> Self
    where
        H: Handler<Db = DB>,
    {
        self.handler_configured(handler, state, durable, |b| b)
    }

    /// Registers `handler` with its state on `durable`, its worker configured by `configure`
    /// (`|w| w.concurrency(4).batch(50, Duration::from_millis(10))`). A concurrency asked for
    /// here is reserved from the pool; handlers that ask for none share what is left equally.
    /// `configure` runs twice: at registration, to read what it asks of the pool (so that an
    /// app the pool cannot serve is refused before any consumer is created or updated), and at
    /// start, on the worker's builder.
    pub fn handler_configured<H>(
        mut self,
        handler: H,
        state: H::State,
        durable: Durable,
        configure: impl Fn(WorkerBuilder<DB>) -> WorkerBuilder<DB> + Send + 'static,
    ) -> Self
    where
        H: Handler<Db = DB>,
    {
        let probe = WorkerBuilder::probe(self.inbox.clone(), &self.jetstream);
        let asked = configure(probe).asked_concurrency();
        let finish =
            move |builder: WorkerBuilder<DB>, concurrency: usize| -> Result<Run, AppError> {
                let worker = configure(builder)
                    .concurrency(concurrency)
                    .build_with_state(handler, state)
                    .map_err(|source| AppError::Worker {
                        handler: std::any::type_name::<H>(),
                        source,
                    })?;
                Ok(Box::new(move |token| {
                    Box::pin(async move { worker.run_until(token).await })
                }))
            };
        self.planned.push(Planned {
            handler: std::any::type_name::<H>(),
            consumer: H::CONSUMER,
            durable,
            two_phase: H::TWO_PHASE,
            asked,
            finish: Box::new(finish),
        });
        self
    }

    /// Runs `relay` next to the handlers: it publishes what their handlers write to its outbox,
    /// woken by their commits. Its streams are checked at start ([`Relay::check`]); it takes one
    /// connection of the pool (it holds a transaction while it publishes); and on shutdown it
    /// makes a last pass once the handlers have drained, so that what they committed last is
    /// published before `run` returns.
    pub fn relay(mut self, relay: Relay<DB>) -> Self {
        self.relays.push(relay);
        self
    }

    /// Starts every handler and runs until SIGINT or SIGTERM (Ctrl-C, `docker stop`, a
    /// Kubernetes pod's termination), then drains: no more pulls, fetched messages nak'd,
    /// messages in flight finished and acked, and those on their last delivery finished or
    /// dead-lettered. Further signals while draining do not cut it short: a message on its last
    /// delivery is never redelivered, so leaving it half done would lose it; a SIGKILL (what
    /// Kubernetes sends when the grace period ends) still stops the process at once.
    ///
    /// The signal handlers stay installed once it returns (tokio's are process-wide): a later
    /// Ctrl-C no longer ends the process by itself.
    pub async fn run(self) -> Result<AppStats, AppError> {
        let token = CancellationToken::new();
        let on_signal = token.clone();
        let signals = tokio::spawn(async move {
            shutdown_signal().await;
            tracing::info!("signal received; draining");
            on_signal.cancel();
            loop {
                shutdown_signal().await;
                tracing::warn!(
                    "signal received while draining; still draining (messages on their last delivery are finished or dead-lettered first); SIGKILL stops at once"
                );
            }
        });
        let ran = self.run_until(token).await;
        signals.abort();
        ran
    }

    /// Starts every handler and runs until `shutdown` is cancelled, then drains; for embedding
    /// in a process that handles signals itself.
    pub async fn run_until(self, shutdown: CancellationToken) -> Result<AppStats, AppError> {
        let health = self.health.clone();
        let jetstream = self.jetstream.clone();
        let (runs, relays) = match self.start(&shutdown).await {
            Ok(started) => started,
            // Stopped while waiting for JetStream: nothing consumed, nothing to report.
            Err(AppError::Cancelled) => return Ok(AppStats::new()),
            Err(e) => return Err(e),
        };
        let mut stats = AppStats::new();
        health.inner.workers.store(runs.len(), Ordering::Relaxed);
        let all = runs.into_iter().map(|(consumer, run)| {
            let token = shutdown.clone();
            let health = health.clone();
            async move {
                health.inner.running.fetch_add(1, Ordering::Relaxed);
                let stats = run(token).await;
                health.inner.running.fetch_sub(1, Ordering::Relaxed);
                (consumer, stats)
            }
        });
        // The relays outlive the workers' drain: cancelled once every worker has stopped, they
        // make a last pass for what the workers committed last.
        let relays_done = CancellationToken::new();
        let relaying = relays.into_iter().map(|relay| {
            let (js, done) = (jetstream.clone(), relays_done.clone());
            async move {
                let table = relay.outbox().table().to_string();
                let stats = relay.run_until(&js, done).await;
                tracing::info!(
                    outbox = %table,
                    published = stats.published,
                    republished = stats.republished,
                    "outbox relay stopped"
                );
            }
        });
        let relaying = futures::future::join_all(relaying);
        let workers = async {
            let done = futures::future::join_all(all).await;
            relays_done.cancel();
            done
        };
        let (done, _) = tokio::join!(workers, relaying);
        for (consumer, s) in done {
            stats.insert(consumer, s);
        }
        Ok(stats)
    }

    /// Checks the registrations, splits the pool, resolves every consumer and builds every
    /// worker. Waits out NATS timeouts and "no responders" (JetStream electing a leader) with
    /// capped backoff, until `shutdown`.
    async fn start(self, shutdown: &CancellationToken) -> Result<Started<DB>, AppError> {
        if self.planned.is_empty() {
            return Err(AppError::NoHandlers);
        }
        // Everything that needs no server first, so that a refused app changes nothing.
        check_unique(&self.planned)?;
        for plan in &self.planned {
            plan.durable.check()?;
        }
        let pool = self.inbox.pool().options().get_max_connections() as usize;
        let mut asks: Vec<Ask> = self
            .planned
            .iter()
            .map(|p| Ask {
                consumer: p.consumer,
                asked: p.asked,
                two_phase: p.two_phase,
            })
            .collect();
        // A relay holds one connection while it publishes.
        asks.extend(self.relays.iter().map(|_| Ask {
            consumer: "outbox relay",
            asked: Some(1),
            two_phase: false,
        }));
        let shares = split_pool(&asks, pool)?;
        let mut runs = Vec::with_capacity(self.planned.len());
        for (plan, concurrency) in self.planned.into_iter().zip(shares) {
            if shutdown.is_cancelled() {
                return Err(AppError::Cancelled);
            }
            let consumer = resolve(&self.jetstream, &plan.durable, shutdown).await?;
            let builder = WorkerBuilder::new(self.inbox.clone(), &self.jetstream, consumer);
            let run = (plan.finish)(builder, concurrency)?;
            tracing::info!(
                handler = plan.handler,
                consumer = plan.consumer,
                durable = plan.durable.name(),
                stream = plan.durable.stream(),
                concurrency,
                "handler registered"
            );
            runs.push((plan.consumer, run));
        }
        for relay in &self.relays {
            check_relay(&self.jetstream, relay, shutdown).await?;
        }
        Ok((runs, self.relays))
    }
}

/// What [`App::start`] hands to the run: each handler's worker, and the relays.
type Started<DB> = (Vec<(&'static str, Run)>, Vec<Relay<DB>>);

/// Checks `relay`'s streams, waiting out JetStream being unavailable (starting, or electing a
/// leader) with capped backoff, until `shutdown`.
async fn check_relay<DB: InboxBackend>(
    js: &jetstream::Context,
    relay: &Relay<DB>,
    shutdown: &CancellationToken,
) -> Result<(), AppError> {
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    loop {
        let checked = tokio::select! {
            checked = relay.check(js) => checked,
            _ = shutdown.cancelled() => return Err(AppError::Cancelled),
        };
        match checked {
            Ok(()) => return Ok(()),
            Err(RelayError::Nats {
                transient: true,
                what,
                source,
            }) => {
                let wait = backoff.next();
                tracing::warn!(error = %source, retry_in = ?wait, "{what}; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => return Err(AppError::Cancelled),
                    _ = tokio::time::sleep(wait) => {}
                }
            }
            Err(source) => return Err(AppError::Relay { source }),
        }
    }
}

/// What a handler asks of the pool.
#[derive(Debug, Clone, Copy)]
struct Ask {
    consumer: &'static str,
    /// The concurrency it was configured with, if any.
    asked: Option<usize>,
    /// A two-phase handler renews leases on a connection of its own.
    two_phase: bool,
}

/// Refuses two handlers with one consumer name, or on one durable consumer.
fn check_unique<DB: InboxBackend>(planned: &[Planned<DB>]) -> Result<(), AppError> {
    for (i, a) in planned.iter().enumerate() {
        for b in &planned[i + 1..] {
            if a.consumer == b.consumer {
                return Err(AppError::DuplicateConsumer {
                    consumer: a.consumer,
                    first: a.handler,
                    second: b.handler,
                });
            }
            if a.durable.stream == b.durable.stream && a.durable.name == b.durable.name {
                return Err(AppError::DuplicateDurable {
                    stream: a.durable.stream.clone(),
                    durable: a.durable.name.clone(),
                    first: a.handler,
                    second: b.handler,
                });
            }
        }
    }
    Ok(())
}

/// Each handler's concurrency: what it asked for, and the pool's remaining connections shared
/// equally among the others (at least one each). A two-phase handler needs one connection more
/// than its concurrency, for lease renewals.
fn split_pool(asks: &[Ask], pool: usize) -> Result<Vec<usize>, AppError> {
    let needed: usize = asks
        .iter()
        .map(|a| a.asked.unwrap_or(1) + usize::from(a.two_phase))
        .sum();
    if needed > pool {
        let asked = asks
            .iter()
            .map(|a| match a.asked {
                Some(n) => format!("{} {n}", a.consumer),
                None => format!("{} at least 1", a.consumer),
            })
            .collect::<Vec<_>>()
            .join(", ");
        return Err(AppError::PoolTooSmall {
            needed,
            pool,
            asked,
        });
    }
    let open = asks.iter().filter(|a| a.asked.is_none()).count();
    // Once every ask (and one connection for each open handler) is reserved, what is left is
    // shared among the open handlers, the first ones getting the remainder.
    let left = pool - needed;
    let (per, mut rest) = match open {
        0 => (0, 0),
        n => (left / n, left % n),
    };
    Ok(asks
        .iter()
        .map(|a| match a.asked {
            Some(n) => n,
            None => {
                let bonus = usize::from(rest > 0);
                rest = rest.saturating_sub(1);
                1 + per + bonus
            }
        })
        .collect())
}

/// Looks the durable consumer up (creating the stream and consumer when asked), waiting out
/// NATS being unavailable, until `shutdown`.
async fn resolve(
    js: &jetstream::Context,
    durable: &Durable,
    shutdown: &CancellationToken,
) -> Result<consumer::PullConsumer, AppError> {
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    let mut attempt = 1u32;
    loop {
        let once = tokio::select! {
            once = resolve_once(js, durable) => once,
            _ = shutdown.cancelled() => return Err(AppError::Cancelled),
        };
        match once {
            Ok(consumer) => return Ok(consumer),
            Err((what, source, true)) => {
                let wait = backoff.next();
                tracing::warn!(attempt, error = %source, retry_in = ?wait, "{what}; retrying");
                attempt += 1;
                tokio::select! {
                    _ = shutdown.cancelled() => return Err(AppError::Cancelled),
                    _ = tokio::time::sleep(wait) => {}
                }
            }
            Err((what, source, _)) => return Err(AppError::Nats { what, source }),
        }
    }
}

/// One try of [`resolve`]: the consumer, or what failed, its error, and whether it is worth
/// waiting out.
async fn resolve_once(
    js: &jetstream::Context,
    durable: &Durable,
) -> Result<consumer::PullConsumer, (String, async_nats::Error, bool)> {
    use async_nats::jetstream::context::{CreateStreamErrorKind, GetStreamErrorKind};
    use async_nats::jetstream::stream::ConsumerErrorKind;
    let stream = match &durable.stream_config {
        Some(config) => js.get_or_create_stream(config.clone()).await.map_err(|e| {
            let transient = match e.kind() {
                CreateStreamErrorKind::TimedOut | CreateStreamErrorKind::JetStreamUnavailable => {
                    true
                }
                CreateStreamErrorKind::JetStream(e) => unavailable(&e),
                _ => false,
            };
            let what = format!("cannot get or create stream {:?}", durable.stream);
            (what, e.into(), transient)
        })?,
        None => js.get_stream(&durable.stream).await.map_err(|e| {
            let transient = match e.kind() {
                GetStreamErrorKind::Request => true,
                GetStreamErrorKind::JetStream(e) => unavailable(&e),
                _ => false,
            };
            let what = format!("cannot get stream {:?}", durable.stream);
            (what, e.into(), transient)
        })?,
    };
    let what = |verb: &str| {
        format!(
            "cannot {verb} consumer {:?} of stream {:?}",
            durable.name, durable.stream
        )
    };
    let consumer = match &durable.create {
        Some(config) => stream.create_consumer(config.clone()).await.map_err(|e| {
            let transient = match e.kind() {
                ConsumerErrorKind::TimedOut | ConsumerErrorKind::Request => true,
                ConsumerErrorKind::JetStream(e) => unavailable(&e),
                _ => false,
            };
            (what("create or update"), e.into(), transient)
        })?,
        None => stream.get_consumer(&durable.name).await.map_err(|e| {
            // A missing consumer is the user's to create; a timeout, "no responders" or a 503
            // is JetStream not answering yet (starting, or a cluster electing a leader).
            use async_nats::jetstream::context::{ConsumerInfoError, ConsumerInfoErrorKind as K};
            let transient = e
                .downcast_ref::<ConsumerInfoError>()
                .is_some_and(|e| match e.kind() {
                    K::TimedOut | K::NoResponders | K::Request | K::Offline => true,
                    K::JetStream(e) => unavailable(&e),
                    _ => false,
                });
            (what("get"), e, transient)
        })?,
    };
    Ok(consumer)
}

/// Whether JetStream's answer says it cannot serve the request for now: 503 (JetStream
/// temporarily unavailable, a cluster without a meta or stream leader during an election) or
/// 408 (a request that timed out inside the cluster).
pub(crate) fn unavailable(e: &jetstream::Error) -> bool {
    matches!(e.code(), 503 | 408)
}

/// SIGINT or SIGTERM (Ctrl-C elsewhere than Unix).
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            _ => {
                tracing::error!("cannot install SIGTERM/SIGINT handlers; stopping only on Ctrl-C");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(consumer: &'static str, asked: Option<usize>, two_phase: bool) -> Ask {
        Ask {
            consumer,
            asked,
            two_phase,
        }
    }

    #[test]
    fn the_pool_is_shared_and_never_oversubscribed() {
        let two = [ask("a", None, false), ask("b", None, false)];
        assert_eq!(split_pool(&two, 8).unwrap(), vec![4, 4]);
        assert_eq!(split_pool(&two, 5).unwrap(), vec![3, 2]);
        let mixed = [ask("a", Some(5), false), ask("b", None, false)];
        assert_eq!(split_pool(&mixed, 8).unwrap(), vec![5, 3]);
        // A two-phase handler keeps a connection for renewals.
        let claim = [ask("a", None, true), ask("b", None, false)];
        let shares = split_pool(&claim, 8).unwrap();
        assert_eq!(shares.iter().sum::<usize>() + 1, 8, "{shares:?}");
        let err = split_pool(&[ask("a", Some(6), false), ask("b", Some(3), false)], 8)
            .unwrap_err()
            .to_string();
        assert!(err.contains("need 9 database connections"), "{err}");
        assert!(err.contains("a 6, b 3"), "{err}");
        assert!(split_pool(&two, 1).is_err());
    }
}
