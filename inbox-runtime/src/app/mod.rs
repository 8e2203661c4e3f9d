//! [`App`]: several handlers in one process, on one pool and one NATS connection, each with its
//! durable consumer; drained on SIGINT and SIGTERM.
//!
//! One concept per file: this file holds the [`App`] and its run; `durable` (which consumer a
//! handler serves, resolved at start), `pool` (the registrations checked, the pool split),
//! `health` (the probe), `error` (why an app did not start), `start` (each start step, waited
//! out while NATS is not there yet).

mod durable;
mod error;
mod health;
mod pool;
mod start;

pub use durable::{Durable, recommended_consumer};
pub use error::AppError;
pub use health::{Health, HealthReport};

use crate::backend::InboxBackend;
use crate::handler::Handler;
use crate::outbox::Relay;
use crate::store::Inbox;
use crate::supervise::supervised;
use crate::worker::{AdvisoryStream, NoState, Stats, WorkerBuilder};
use async_nats::jetstream;
use durable::resolve;
use futures::future::BoxFuture;
use health::HealthInner;
use pool::{Ask, check_unique, split_pool};
use start::{check_backstop, check_relay, own_connection};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio_util::sync::CancellationToken;

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
    /// The delivery-limit backstop's advisory stream; `None`: no backstop.
    backstop: Option<AdvisoryStream>,
    /// Opens each handler's own NATS connection, when given.
    connect: Option<Connect>,
}

/// Opens a NATS connection (see [`App::pull_connections`]).
type Connect = Arc<
    dyn Fn() -> BoxFuture<'static, Result<jetstream::Context, async_nats::Error>> + Send + Sync,
>;

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
                pulls: std::sync::Mutex::new(Vec::new()),
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
            backstop: Some(AdvisoryStream::PerStream),
            connect: None,
        }
    }

    /// Each handler pulls on a NATS connection of its own, opened by `connect` at start (the
    /// same options as the app's own connection: `|| async { Ok(jetstream::new(options().connect(url).await?)) }`),
    /// so that what breaks one handler's connection does not interrupt the others. Without it,
    /// every handler pulls on the app's connection, and a message whose header block the Rust
    /// client cannot parse (sent by another client; the client drops its connection when one is
    /// delivered) interrupts every handler at each of its deliveries.
    ///
    /// Stream and consumer lookups, the backstop (see [`WorkerBuilder::backstop`]) and the
    /// relays stay on the app's connection, which is never delivered a stored message.
    pub fn pull_connections<F, Fut>(mut self, connect: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<jetstream::Context, async_nats::Error>>
            + Send
            + 'static,
    {
        self.connect = Some(Arc::new(move || Box::pin(connect())));
        self
    }

    /// Keeps every handler's delivery-limit advisories in `stream` instead of one
    /// `INBOX_ADVISORIES_<stream>` per stream: see [`WorkerBuilder::backstop_in`]. The backstop
    /// (see [`WorkerBuilder::backstop`]) runs by default.
    pub fn backstop_in(mut self, stream: impl Into<String>) -> Self {
        self.backstop = Some(AdvisoryStream::Named(stream.into()));
        self
    }

    /// Runs no delivery-limit backstop: a message whose last delivery ends without a verdict
    /// (its process killed while holding it, say) is then neither applied nor dead-lettered.
    pub fn without_backstop(mut self) -> Self {
        self.backstop = None;
        self
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
        // Each on a task of its own, started again after a panic: a relay's panic (a row it
        // cannot handle) must never reach the workers, which this future also joins.
        let relaying = relays.into_iter().map(|relay| {
            let (js, done) = (jetstream.clone(), relays_done.clone());
            async move {
                let table = relay.outbox().table().to_string();
                let stats = relay.stats_handle();
                let start = || {
                    let (relay, js, done) = (relay.clone(), js.clone(), done.clone());
                    async move { relay.run_until(&js, done).await }
                };
                supervised("outbox relay", &done, start).await;
                let stats = stats();
                tracing::info!(
                    outbox = %table,
                    published = stats.published,
                    republished = stats.republished,
                    failed = stats.failed,
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
            let pulls = match &self.connect {
                Some(connect) => {
                    let js = own_connection(connect, plan.consumer, shutdown).await?;
                    let mut watched = self.health.inner.pulls.lock().expect("the pulls lock");
                    watched.push(js.client());
                    js
                }
                None => self.jetstream.clone(),
            };
            let builder = WorkerBuilder::new(self.inbox.clone(), &pulls, consumer);
            let builder = match &self.backstop {
                Some(which) => {
                    check_backstop(&self.jetstream, which, &plan.durable, shutdown).await?;
                    let builder = builder.backstop_on(&self.jetstream);
                    match which {
                        AdvisoryStream::PerStream => builder.backstop(),
                        AdvisoryStream::Named(name) => builder.backstop_in(name.clone()),
                    }
                }
                None => builder,
            };
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

/// Fails to compile if an app's run cannot be spawned on a multi-threaded runtime.
#[cfg(test)]
#[allow(dead_code)]
fn run_is_send<DB: InboxBackend>(app: App<DB>) {
    fn send<T: Send>(_: &T) {}
    send(&app.run_until(CancellationToken::new()));
}
