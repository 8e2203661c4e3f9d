//! The `credit` example: credits accounts exactly once per message and announces each credit
//! through its transactional outbox.

use crate::balances::{MYSQL_BALANCES, POSTGRES_BALANCES, SQLITE_BALANCES};
use crate::startup::{
    Backends, ConsumerSpec, DatabaseSpec, Example, NatsConnector, StartError, jetstream_consumer,
    start_database, stream_start_error, until_up,
};
use crate::{Error, MAX_AGE, NatsAuth, RETENTION, Vars, observe, orders, redact};
use async_nats::jetstream::{self, stream};
use inbox_runtime::{
    AckMode, App, BoxError, Delivery, Durable, Handler, Inbox, InboxBackend, Outbox, OutboxMessage,
    Relay, Stats, Tx, WorkerBuilder, idempotent,
};
use serde::{Deserialize, Serialize};
use sqlx::{MySql, MySqlPool, PgPool, Pool, Postgres, Sqlite, SqlitePool};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A request to add `amount` to `account`'s balance; `id` identifies the request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreditRequested {
    /// The request's id: the dedup key.
    pub id: String,
    /// The account to credit.
    pub account: i64,
    /// The amount, possibly negative; a balance never goes below zero.
    pub amount: i64,
}

/// What `credit` announces for each credit it applies, on `CREDIT_EVENTS_SUBJECT`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CreditApplied {
    /// The request's id.
    pub id: String,
    /// The account credited.
    pub account: i64,
    /// The amount.
    pub amount: i64,
}

/// Where `credit` announces what it applied: its outbox, and the subject.
pub struct Announce<DB: InboxBackend> {
    /// The outbox, in the accounts' database.
    pub outbox: Outbox<DB>,
    /// `CREDIT_EVENTS_SUBJECT`.
    pub subject: String,
}

impl<DB: InboxBackend> Announce<DB> {
    /// Writes the [`CreditApplied`] of `msg` to the outbox in `tx`: published if and only if the
    /// credit commits. Per account, events leave in the order they were applied.
    pub async fn applied(
        &self,
        tx: &mut Tx<'_, DB>,
        msg: &CreditRequested,
    ) -> Result<(), sqlx::Error> {
        let event = CreditApplied {
            id: msg.id.clone(),
            account: msg.account,
            amount: msg.amount,
        };
        let message = OutboxMessage::json(&*self.subject, &event)
            .map_err(|e| sqlx::Error::Encode(Box::new(e)))?
            .order_key(msg.account.to_string());
        self.outbox.enqueue(tx, message).await.map(drop)
    }
}

/// What `credit`'s handler is handed besides the message: where it announces what it applied,
/// and the test-only hold on a last delivery.
pub struct CreditState<DB: InboxBackend> {
    /// Where applied credits are announced.
    pub events: Announce<DB>,
    /// `CREDIT_TEST_LAST_DELIVERY_HOLD_MS` (tests only).
    pub last_delivery_hold: LastDeliveryHold,
}

/// `CREDIT_TEST_LAST_DELIVERY_HOLD_MS` (tests only): on a message's last delivery (`delivered >=
/// max_deliver`), the handler waits this long before its first statement, its claim made and
/// nothing committed, so that a test can kill the process while it holds the message there.
///
/// It logs (at WARN, target `inbox_examples`) `last delivery held ... stream_seq=N` when the
/// hold begins and `last delivery let go ... stream_seq=N` when it ends (also when the try is
/// dropped): `inbox_testkit::LastDeliveryHolds` reads a process's log for them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LastDeliveryHold {
    /// How long; zero holds nothing.
    pub hold: Duration,
    /// The consumer's `max_deliver`, read once at start.
    pub max_deliver: i64,
}

impl LastDeliveryHold {
    /// Waits [`Self::hold`] when `delivery` is the message's last; returns at once otherwise.
    pub async fn on(&self, delivery: &Delivery) {
        if self.hold.is_zero() || self.max_deliver <= 0 || delivery.delivered() < self.max_deliver {
            return;
        }
        let stream_seq = delivery.stream_sequence();
        tracing::warn!(
            target: "inbox_examples",
            stream_seq,
            delivered = delivery.delivered(),
            hold = ?self.hold,
            "last delivery held (CREDIT_TEST_LAST_DELIVERY_HOLD_MS)"
        );
        /// Logs the end of the hold however it ends: slept out, or dropped with its try.
        struct LetGo(u64);
        impl Drop for LetGo {
            fn drop(&mut self) {
                let stream_seq = self.0;
                tracing::warn!(target: "inbox_examples", stream_seq, "last delivery let go");
            }
        }
        let _let_go = LetGo(stream_seq);
        tokio::time::sleep(self.hold).await;
    }
}

/// Adds `msg.amount` to the account's balance in PostgreSQL and announces it ([`CreditApplied`])
/// through the outbox. (`delivery` only serves the test-only [`LastDeliveryHold`].)
///
/// A credit creates the account when new; a debit the balance does not cover, or of an account
/// never credited, is refused and rolls back the marker (and the announcement) too: see
/// [`BalanceSql`](crate::BalanceSql).
#[idempotent(consumer = "credit", key = msg.id, lane = msg.account)]
pub async fn credit_postgres(
    msg: CreditRequested,
    tx: &mut Tx<Postgres>,
    state: &CreditState<Postgres>,
    delivery: &Delivery,
) -> Result<(), BoxError> {
    state.last_delivery_hold.on(delivery).await;
    let balances = POSTGRES_BALANCES;
    balances
        .apply::<Postgres>(tx, msg.account, msg.amount)
        .await?;
    Ok(state.events.applied(tx, &msg).await?)
}

/// [`credit_postgres`] for MySQL and MariaDB.
#[idempotent(consumer = "credit", key = msg.id, lane = msg.account)]
pub async fn credit_mysql(
    msg: CreditRequested,
    tx: &mut Tx<MySql>,
    state: &CreditState<MySql>,
    delivery: &Delivery,
) -> Result<(), BoxError> {
    state.last_delivery_hold.on(delivery).await;
    let balances = MYSQL_BALANCES;
    balances.apply::<MySql>(tx, msg.account, msg.amount).await?;
    Ok(state.events.applied(tx, &msg).await?)
}

/// [`credit_postgres`] for SQLite.
#[idempotent(consumer = "credit", key = msg.id, lane = msg.account)]
pub async fn credit_sqlite(
    msg: CreditRequested,
    tx: &mut Tx<Sqlite>,
    state: &CreditState<Sqlite>,
    delivery: &Delivery,
) -> Result<(), BoxError> {
    state.last_delivery_hold.on(delivery).await;
    let balances = SQLITE_BALANCES;
    balances
        .apply::<Sqlite>(tx, msg.account, msg.amount)
        .await?;
    Ok(state.events.applied(tx, &msg).await?)
}

/// Creates `accounts` in PostgreSQL when missing. Serialised by an advisory lock, since
/// concurrent `CREATE TABLE IF NOT EXISTS` can still collide in PostgreSQL's catalog.
pub async fn create_accounts_postgres(pool: &PgPool) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('inbox-examples accounts'))")
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS accounts (\
             id BIGINT PRIMARY KEY, \
             balance BIGINT NOT NULL CHECK (balance >= 0))",
    )
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

/// Creates `accounts` in MySQL or MariaDB when missing.
pub async fn create_accounts_mysql(pool: &MySqlPool) -> Result<(), sqlx::Error> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS accounts (\
             id BIGINT PRIMARY KEY, \
             balance BIGINT NOT NULL, \
             CHECK (balance >= 0)) ENGINE = InnoDB",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// Creates `accounts` in SQLite when missing.
pub async fn create_accounts_sqlite(pool: &SqlitePool) -> Result<(), sqlx::Error> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS accounts (\
             id INTEGER PRIMARY KEY, \
             balance INTEGER NOT NULL CHECK (balance >= 0))",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// The example's configuration. Its `Debug` shows the URLs with their credentials masked.
#[derive(Clone, PartialEq, Eq)]
pub struct Config {
    /// `NATS_URL`, default `nats://127.0.0.1:4222`.
    pub nats_url: String,
    /// `NATS_CREDS` or `NATS_NKEY`.
    pub nats_auth: NatsAuth,
    /// `DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`; `postgres://`,
    /// `mysql://` (or `mariadb://`) or `sqlite://`.
    pub database_url: String,
    /// `CREDIT_STREAM`, default `CREDITS`.
    pub stream: String,
    /// `CREDIT_SUBJECT`, default `credits.requested`.
    pub subject: String,
    /// `CREDIT_CONSUMER`: the durable consumer's name, default `credit`.
    pub durable: String,
    /// `CREDIT_EVENTS_STREAM`: the stream of [`CreditApplied`] events, default `CREDIT_EVENTS`
    /// (created when missing, with a duplicate window of two minutes).
    pub events_stream: String,
    /// `CREDIT_EVENTS_SUBJECT`: their subject, default `credits.applied`.
    pub events_subject: String,
    /// `CREDIT_CONCURRENCY`: how many messages are processed at once, and the size of the
    /// database pool (one connection more, for the outbox relay), default 8 (SQLite: always 1,
    /// its one writer, and the relay's connection).
    pub concurrency: u32,
    /// `CREDIT_ACK`: `plain` or `double` (see `inbox_runtime::AckMode`), default the runtime's.
    pub ack_mode: Option<AckMode>,
    /// `CREDIT_PREFETCH`: messages fetched ahead of the concurrency (see
    /// `WorkerBuilder::prefetch`; not when batched), default the concurrency: a permit that
    /// frees starts the next message at once, and a pull request brings several.
    pub prefetch: usize,
    /// `METRICS_ADDR`: where `/metrics` and `/healthz` are served (unset: not served).
    pub metrics: Option<std::net::SocketAddr>,
    /// `CREDIT_BATCH`: commit up to this many messages per transaction (see
    /// `WorkerBuilder::batch`), waiting at most 10 ms for a batch to fill; default 1, no batching.
    pub batch: usize,
    /// `CREDIT_TEST_RELAY_HOLD_MS` (tests only): how long the outbox relay waits between its
    /// PubAcks and marking the rows sent, so that a test can kill the process there.
    pub relay_hold: Duration,
    /// `CREDIT_TEST_LAST_DELIVERY_HOLD_MS` (tests only): how long the handler waits on a
    /// message's last delivery before its first statement (see [`LastDeliveryHold`]).
    pub last_delivery_hold: Duration,
}

impl Config {
    /// Reads the configuration from the environment, with the documented defaults; a variable
    /// that does not parse is an error that names it.
    pub fn from_env() -> Result<Self, String> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`Config::from_env`] over `get`, which looks a variable up.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let env = Vars(get);
        let var = |name: &str, default: &str| env.var(name, default);
        let count = |name: &str, default: &str| env.number(name, default, 1).map(|n| n as u32);
        let concurrency = count("CREDIT_CONCURRENCY", "8")?;
        Ok(Config {
            nats_url: var("NATS_URL", "nats://127.0.0.1:4222"),
            nats_auth: NatsAuth::from_vars(&env)?,
            database_url: var("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test"),
            stream: var("CREDIT_STREAM", "CREDITS"),
            subject: var("CREDIT_SUBJECT", "credits.requested"),
            durable: var("CREDIT_CONSUMER", "credit"),
            events_stream: var("CREDIT_EVENTS_STREAM", "CREDIT_EVENTS"),
            events_subject: var("CREDIT_EVENTS_SUBJECT", "credits.applied"),
            concurrency,
            ack_mode: match var("CREDIT_ACK", "").as_str() {
                "" => None,
                "plain" => Some(AckMode::Plain),
                "double" => Some(AckMode::Double),
                other => return Err(format!("CREDIT_ACK={other:?}: use plain or double")),
            },
            batch: count("CREDIT_BATCH", "1")? as usize,
            prefetch: env.number("CREDIT_PREFETCH", &concurrency.to_string(), 0)? as usize,
            relay_hold: Duration::from_millis(env.number("CREDIT_TEST_RELAY_HOLD_MS", "0", 0)?),
            last_delivery_hold: Duration::from_millis(env.number(
                "CREDIT_TEST_LAST_DELIVERY_HOLD_MS",
                "0",
                0,
            )?),
            metrics: observe::metrics_addr(&env)?,
        })
    }

    /// The credentials of both URLs, to scrub from whatever is printed.
    pub fn secrets(&self) -> redact::Secrets {
        let mut secrets = redact::Secrets::default();
        secrets.add_url_list(&self.nats_url);
        secrets.add_url(&self.database_url);
        secrets
    }
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("nats_url", &redact::url_list(&self.nats_url))
            .field("nats_auth", &self.nats_auth)
            .field("database_url", &redact::url(&self.database_url))
            .field("stream", &self.stream)
            .field("subject", &self.subject)
            .field("durable", &self.durable)
            .field("events_stream", &self.events_stream)
            .field("events_subject", &self.events_subject)
            .field("concurrency", &self.concurrency)
            .field("ack_mode", &self.ack_mode)
            .field("batch", &self.batch)
            .field("prefetch", &self.prefetch)
            .field("relay_hold", &self.relay_hold)
            .field("last_delivery_hold", &self.last_delivery_hold)
            .field("metrics", &self.metrics)
            .finish()
    }
}

impl Config {
    fn consumer_spec(&self) -> ConsumerSpec<'_> {
        ConsumerSpec {
            nats_url: &self.nats_url,
            nats_auth: &self.nats_auth,
            stream: &self.stream,
            subject: &self.subject,
            durable: &self.durable,
            ack_wait: Duration::from_secs(30),
            max_deliver: 10,
            max_ack_pending: self.max_ack_pending(),
        }
    }

    /// The durable consumer's `max_ack_pending` when `credit` creates it: JetStream's default
    /// (1,000) unbatched; batched, room for four processes' full batches (4 × concurrency ×
    /// `CREDIT_BATCH`) if that is more. The server shares it among the processes on the
    /// consumer, and a process left less than its batches could hold commits smaller ones,
    /// which cost more per message.
    pub fn max_ack_pending(&self) -> i64 {
        match self.batch {
            0 | 1 => 0,
            batch => (4 * i64::from(self.concurrency) * batch as i64).max(1000),
        }
    }
}

/// Sets up the stream, the durable consumer, the inbox and the accounts table, then consumes until
/// `shutdown` is cancelled. The database is chosen by `DATABASE_URL`'s scheme. NATS or the
/// database being down at start is waited out (capped backoff, one log line per attempt).
pub async fn run(config: &Config, shutdown: CancellationToken) -> Result<Stats, Error> {
    let spec = config.consumer_spec();
    let Some((jetstream, consumer, stream)) =
        until_up("NATS", &shutdown, || jetstream_consumer(&spec)).await?
    else {
        return Ok(Stats::default());
    };
    let last_delivery_hold = LastDeliveryHold {
        hold: config.last_delivery_hold,
        max_deliver: consumer.cached_info().config.max_deliver,
    };
    let replicas = stream.cached_info().config.num_replicas;
    let events = || events_stream(&jetstream, config, replicas);
    if until_up("NATS", &shutdown, events).await?.is_none() {
        return Ok(Stats::default());
    }
    let database = DatabaseSpec {
        url: &config.database_url,
        // One connection more, for the outbox relay.
        server_pool: config.concurrency + 1,
        // SQLite has one writer at a time: more connections would only queue for the lock.
        // One for the worker, one for the outbox relay (which reads and marks, and holds
        // no lock while it publishes). Processes opening a new file together race to switch
        // it to WAL, and the loser gets SQLITE_BUSY at once, without waiting out the busy
        // timeout: waited out like an outage.
        sqlite_pool: 2,
    };
    let on = Serve {
        batch: config.batch,
        prefetch: config.prefetch,
        ack_mode: config.ack_mode,
        jetstream,
        nats: NatsConnector::new(&config.nats_url, &config.nats_auth),
        durable: &config.durable,
        events: (&config.events_stream, &config.events_subject),
        relay_hold: config.relay_hold,
        last_delivery_hold,
        metrics: config.metrics,
        stream: &stream,
        shutdown: shutdown.clone(),
    };
    let parts = Backends {
        postgres: (create_accounts_postgres, credit_postgres),
        mysql: (create_accounts_mysql, credit_mysql),
        sqlite: (create_accounts_sqlite, credit_sqlite),
    };
    let stats = start_database(&database, &shutdown, on, parts).await?;
    Ok(stats.unwrap_or_default())
}

/// Gets or creates `config.events_stream` on `config.events_subject`, with `replicas` (those of
/// the requests' stream) and a duplicate window of two minutes: the outbox relay's re-publishes
/// after a crash land in it.
async fn events_stream(
    js: &jetstream::Context,
    config: &Config,
    replicas: usize,
) -> Result<(), StartError> {
    js.get_or_create_stream(stream::Config {
        name: config.events_stream.clone(),
        subjects: vec![config.events_subject.clone()],
        duplicate_window: Duration::from_secs(120),
        max_age: MAX_AGE,
        num_replicas: replicas,
        ..Default::default()
    })
    .await
    .map_err(|e| stream_start_error(&config.events_stream, e))?;
    Ok(())
}

/// Where the worker runs, once NATS is up.
struct Serve<'a> {
    batch: usize,
    prefetch: usize,
    ack_mode: Option<AckMode>,
    jetstream: jetstream::Context,
    /// Opens the handler's own connection to pull on.
    nats: NatsConnector,
    /// The durable consumer's name.
    durable: &'a str,
    /// `CREDIT_EVENTS_STREAM`, `CREDIT_EVENTS_SUBJECT`.
    events: (&'a str, &'a str),
    /// `CREDIT_TEST_RELAY_HOLD_MS`.
    relay_hold: Duration,
    /// `CREDIT_TEST_LAST_DELIVERY_HOLD_MS`, with the consumer's `max_deliver`.
    last_delivery_hold: LastDeliveryHold,
    /// `METRICS_ADDR`.
    metrics: Option<std::net::SocketAddr>,
    stream: &'a stream::Stream,
    shutdown: CancellationToken,
}

/// `Part`: the backend's `create_accounts_*` and `credit_*`.
impl<C, H> Example<(C, H)> for Serve<'_>
where
    C: AsyncFn(&Pool<H::Db>) -> Result<(), sqlx::Error>,
    H: Handler<State = CreditState<<H as Handler>::Db>>,
{
    type Db = H::Db;
    type Output = Stats;

    async fn create_tables(
        (create_accounts, _): &(C, H),
        pool: &Pool<H::Db>,
    ) -> Result<(), sqlx::Error> {
        create_accounts(pool).await
    }

    /// Migrates the outbox, and runs the worker and the outbox's relay until `shutdown`.
    async fn run(self, (_, handler): (C, H), inbox: Inbox<H::Db>) -> Result<Stats, Error> {
        let outbox = Outbox::new(inbox.pool().clone());
        outbox.migrate().await?;
        let (events_stream, events_subject) = self.events;
        let state = CreditState {
            events: Announce {
                outbox: outbox.clone(),
                subject: events_subject.to_owned(),
            },
            last_delivery_hold: self.last_delivery_hold,
        };
        let durable = Durable::existing(&self.stream.cached_info().config.name, self.durable);
        let (stream, batch, ack_mode) = (self.stream.clone(), self.batch, self.ack_mode);
        let prefetch = self.prefetch;
        let configure = move |w: WorkerBuilder<H::Db>| {
            let w = w
                .cleanup(RETENTION, &stream)
                .batch(batch, Duration::from_millis(10))
                .prefetch(prefetch);
            match ack_mode {
                Some(mode) => w.ack_mode(mode),
                None => w,
            }
        };
        let mut relay = Relay::new(outbox).stream(events_stream);
        let hold = self.relay_hold;
        if !hold.is_zero() {
            relay = relay.before_mark(std::sync::Arc::new(move || {
                Box::pin(async move {
                    // The crate's target, as before `credit` had a module of its own.
                    tracing::info!(
                        target: "inbox_examples",
                        ?hold,
                        "holding the relay before it marks rows sent (CREDIT_TEST_RELAY_HOLD_MS)"
                    );
                    tokio::time::sleep(hold).await;
                })
            }));
        }
        let app = App::new(inbox, &self.jetstream)
            .pull_connections(self.nats.pulls())
            .handler_configured(handler, state, durable, configure)
            .relay(relay);
        if let Some(addr) = self.metrics {
            observe::serve(addr, app.health()).await?;
        }
        let stats = app.run_until(self.shutdown).await?;
        Ok(orders::total(&stats))
    }
}

#[cfg(test)]
mod config_tests {
    use super::*;
    use std::collections::HashMap;

    fn config(vars: &[(&str, &str)]) -> Result<Config, String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Config::from_vars(|name| vars.get(name).cloned())
    }

    #[test]
    fn defaults_and_bad_values_named() {
        let c = config(&[]).unwrap();
        assert_eq!((c.concurrency, c.batch, c.ack_mode), (8, 1, None));
        // Prefetch follows the concurrency unless given.
        assert_eq!(c.prefetch, 8);
        let c = config(&[("CREDIT_CONCURRENCY", "3")]).unwrap();
        assert_eq!(c.prefetch, 3);
        let c = config(&[("CREDIT_CONCURRENCY", "3"), ("CREDIT_PREFETCH", "0")]).unwrap();
        assert_eq!(c.prefetch, 0);
        assert_eq!(c.last_delivery_hold, Duration::ZERO);
        let c = config(&[("CREDIT_TEST_LAST_DELIVERY_HOLD_MS", "2500")]).unwrap();
        assert_eq!(c.last_delivery_hold, Duration::from_millis(2500));
        let c = config(&[("CREDIT_BATCH", "64"), ("CREDIT_ACK", "double")]).unwrap();
        assert_eq!((c.batch, c.ack_mode), (64, Some(AckMode::Double)));
        // Room for four processes' full batches; JetStream's default unbatched or below it.
        assert_eq!(c.max_ack_pending(), 4 * 8 * 64);
        assert_eq!(config(&[]).unwrap().max_ack_pending(), 0);
        let small = config(&[("CREDIT_BATCH", "4"), ("CREDIT_CONCURRENCY", "2")]).unwrap();
        assert_eq!(small.max_ack_pending(), 1000);
        for (name, value) in [
            ("CREDIT_CONCURRENCY", "eight"),
            ("CREDIT_CONCURRENCY", "0"),
            ("CREDIT_BATCH", "-1"),
            ("CREDIT_ACK", "twice"),
            ("CREDIT_PREFETCH", "-2"),
            ("CREDIT_TEST_LAST_DELIVERY_HOLD_MS", "soon"),
        ] {
            let e = config(&[(name, value)]).unwrap_err();
            assert!(e.contains(name) && e.contains(value), "{e}");
        }
    }
}

#[cfg(test)]
mod hold_tests {
    use super::*;

    /// Whether `hold.on` for a delivery numbered `delivered` is still waiting after 50 ms.
    async fn holds(hold: LastDeliveryHold, delivered: i64) -> bool {
        let delivery = Delivery::new("s")
            .with_stream("S", 7)
            .with_delivered(delivered);
        tokio::time::timeout(Duration::from_millis(50), hold.on(&delivery))
            .await
            .is_err()
    }

    #[tokio::test]
    async fn only_a_last_delivery_is_held() {
        let hold = LastDeliveryHold {
            hold: Duration::from_secs(3600),
            max_deliver: 3,
        };
        assert!(!holds(hold, 1).await);
        assert!(!holds(hold, 2).await);
        assert!(holds(hold, 3).await);
        assert!(
            holds(hold, 4).await,
            "past max_deliver (lowered since) is last too"
        );
        let off = LastDeliveryHold {
            hold: Duration::ZERO,
            ..hold
        };
        assert!(!holds(off, 3).await);
    }
}
