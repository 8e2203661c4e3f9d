//! The `orders` example: two handlers in one process on one [`App`], sharing one database
//! pool, one NATS connection and one state.
//!
//! - `place_order` (consumer `orders`, subject `<prefix>.placed`): `{"order_id", "sku",
//!   "quantity"}`, keyed on the integer `order_id` from the payload; records the order and
//!   reserves its stock.
//! - `adjust_stock` (consumer `inventory`, subject `<prefix>.stock`): `{"sku", "delta"}`, keyed
//!   on the message's `Idempotency-Key` header (any producer's spelling of it: Go's
//!   `Idempotency-Key`, nats-py's `idempotency-key`); a message without one is dead-lettered.
//!
//! Both durable consumers, and the stream, are created at start with
//! [`inbox_runtime::recommended_consumer`]. SIGINT or SIGTERM drains both handlers.

use crate::startup::{
    Backends, DatabaseSpec, Example, NatsConnector, connect_nats, start_database, until_up,
};
use crate::{Error, Vars, redact};
use inbox_runtime::{App, AppStats, Durable, Handler, Inbox, Stats};
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// An order: `quantity` of `sku`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OrderPlaced {
    /// The order's number: its dedup key.
    pub order_id: i64,
    /// What was ordered.
    pub sku: String,
    /// How many.
    pub quantity: i64,
}

/// Stock of `sku` received (`delta` > 0) or written off (< 0).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StockAdjusted {
    /// The product.
    pub sku: String,
    /// The change in stock on hand.
    pub delta: i64,
}

/// What both handlers share: here, the table prefix would go, a price list, an HTTP client.
#[derive(Debug, Default)]
pub struct Shop {
    /// Test only (`ORDERS_TEST_HOLD_MS`): how long each handler waits inside its transaction,
    /// so that a test can stop the process with messages in flight.
    pub hold: Duration,
}

impl Shop {
    async fn hold(&self, consumer: &str, key: &str) {
        if !self.hold.is_zero() {
            tracing::info!(
                consumer,
                key,
                "holding the transaction (ORDERS_TEST_HOLD_MS)"
            );
            tokio::time::sleep(self.hold).await;
        }
    }
}

/// The two handlers and the table set-up for one database: only the SQL dialect differs.
macro_rules! orders_handlers {
    (
        $db:ty,
        insert_order = $insert_order:literal,
        reserve = $reserve:literal,
        adjust = $adjust:literal $(,)?
    ) => {
        use super::{OrderPlaced, Shop, StockAdjusted};
        use inbox_runtime::{Delivery, Tx, idempotent};
        use std::sync::Arc;

        /// Records the order and reserves its stock.
        #[idempotent(consumer = "orders", key = msg.order_id)]
        pub async fn place_order(
            msg: OrderPlaced,
            shop: &Arc<Shop>,
            tx: &mut Tx<$db>,
        ) -> Result<(), sqlx::Error> {
            sqlx::query($insert_order)
                .bind(msg.order_id)
                .bind(&msg.sku)
                .bind(msg.quantity)
                .execute(&mut **tx)
                .await?;
            reserve(tx, &msg.sku, msg.quantity).await?;
            shop.hold("orders", &msg.order_id.to_string()).await;
            Ok(())
        }

        /// A helper a handler calls with its transaction: `&mut Tx<'_, DB>` outside the macro.
        async fn reserve(
            tx: &mut Tx<'_, $db>,
            sku: &str,
            quantity: i64,
        ) -> Result<(), sqlx::Error> {
            sqlx::query($reserve)
                .bind(sku)
                .bind(quantity)
                .execute(&mut **tx)
                .await?;
            Ok(())
        }

        /// Changes the stock on hand, once per `Idempotency-Key`.
        #[idempotent(consumer = "inventory", key = delivery.header("Idempotency-Key"))]
        pub async fn adjust_stock(
            msg: StockAdjusted,
            delivery: &Delivery,
            shop: &Arc<Shop>,
            tx: &mut Tx<$db>,
        ) -> Result<(), sqlx::Error> {
            sqlx::query($adjust)
                .bind(&msg.sku)
                .bind(msg.delta)
                .execute(&mut **tx)
                .await?;
            let key = delivery.header("Idempotency-Key").unwrap_or_default();
            shop.hold("inventory", key).await;
            Ok(())
        }
    };
}

/// The handlers on PostgreSQL.
pub mod postgres {
    orders_handlers!(
        sqlx::Postgres,
        insert_order = "INSERT INTO orders (id, sku, quantity) VALUES ($1, $2, $3)",
        reserve = "INSERT INTO stock (sku, on_hand, reserved) VALUES ($1, 0, $2) \
                   ON CONFLICT (sku) DO UPDATE SET reserved = stock.reserved + EXCLUDED.reserved",
        adjust = "INSERT INTO stock (sku, on_hand, reserved) VALUES ($1, $2, 0) \
                  ON CONFLICT (sku) DO UPDATE SET on_hand = stock.on_hand + EXCLUDED.on_hand",
    );

    /// Creates `orders` and `stock` when missing (serialised by an advisory lock, as
    /// concurrent `CREATE TABLE IF NOT EXISTS` can collide in PostgreSQL's catalog).
    pub async fn create_tables(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('inbox-examples orders'))")
            .execute(&mut *tx)
            .await?;
        for ddl in [
            "CREATE TABLE IF NOT EXISTS orders (id BIGINT PRIMARY KEY, sku TEXT NOT NULL, quantity BIGINT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS stock (sku TEXT PRIMARY KEY, on_hand BIGINT NOT NULL, reserved BIGINT NOT NULL)",
        ] {
            sqlx::query(ddl).execute(&mut *tx).await?;
        }
        tx.commit().await
    }
}

/// The handlers on MySQL and MariaDB.
pub mod mysql {
    orders_handlers!(
        sqlx::MySql,
        insert_order = "INSERT INTO orders (id, sku, quantity) VALUES (?, ?, ?)",
        reserve = "INSERT INTO stock (sku, on_hand, reserved) VALUES (?, 0, ?) \
                   ON DUPLICATE KEY UPDATE reserved = reserved + VALUES(reserved)",
        adjust = "INSERT INTO stock (sku, on_hand, reserved) VALUES (?, ?, 0) \
                  ON DUPLICATE KEY UPDATE on_hand = on_hand + VALUES(on_hand)",
    );

    /// Creates `orders` and `stock` when missing.
    pub async fn create_tables(pool: &sqlx::MySqlPool) -> Result<(), sqlx::Error> {
        for ddl in [
            "CREATE TABLE IF NOT EXISTS orders (id BIGINT PRIMARY KEY, sku VARCHAR(64) NOT NULL, quantity BIGINT NOT NULL) ENGINE = InnoDB",
            "CREATE TABLE IF NOT EXISTS stock (sku VARCHAR(64) PRIMARY KEY, on_hand BIGINT NOT NULL, reserved BIGINT NOT NULL) ENGINE = InnoDB",
        ] {
            sqlx::query(ddl).execute(pool).await?;
        }
        Ok(())
    }
}

/// The handlers on SQLite.
pub mod sqlite {
    orders_handlers!(
        sqlx::Sqlite,
        insert_order = "INSERT INTO orders (id, sku, quantity) VALUES (?1, ?2, ?3)",
        reserve = "INSERT INTO stock (sku, on_hand, reserved) VALUES (?1, 0, ?2) \
                   ON CONFLICT (sku) DO UPDATE SET reserved = reserved + excluded.reserved",
        adjust = "INSERT INTO stock (sku, on_hand, reserved) VALUES (?1, ?2, 0) \
                  ON CONFLICT (sku) DO UPDATE SET on_hand = on_hand + excluded.on_hand",
    );

    /// Creates `orders` and `stock` when missing.
    pub async fn create_tables(pool: &sqlx::SqlitePool) -> Result<(), sqlx::Error> {
        for ddl in [
            "CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, sku TEXT NOT NULL, quantity INTEGER NOT NULL)",
            "CREATE TABLE IF NOT EXISTS stock (sku TEXT PRIMARY KEY, on_hand INTEGER NOT NULL, reserved INTEGER NOT NULL)",
        ] {
            sqlx::query(ddl).execute(pool).await?;
        }
        Ok(())
    }
}

/// The example's configuration, from the environment.
#[derive(Clone, PartialEq, Eq)]
pub struct OrdersConfig {
    /// `NATS_URL`, default `nats://127.0.0.1:4222`.
    pub nats_url: String,
    /// `NATS_CREDS` or `NATS_NKEY` (see [`crate::NatsAuth`]).
    pub nats_auth: crate::NatsAuth,
    /// `METRICS_ADDR`: where `/metrics` and `/healthz` are served (unset: not served).
    pub metrics: Option<std::net::SocketAddr>,
    /// `DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`; `postgres://`,
    /// `mysql://` (or `mariadb://`) or `sqlite://`.
    pub database_url: String,
    /// `ORDERS_STREAM`, default `ORDERS`.
    pub stream: String,
    /// `ORDERS_SUBJECT_PREFIX`, default `orders`: the handlers consume `<prefix>.placed` and
    /// `<prefix>.stock`.
    pub prefix: String,
    /// `ORDERS_POOL`: the pool's size, split between the handlers by the `App`; default 8.
    pub pool: u32,
    /// `ORDERS_TEST_HOLD_MS` (tests only): see [`Shop`].
    pub hold: Duration,
}

impl std::fmt::Debug for OrdersConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OrdersConfig")
            .field("nats_url", &redact::url_list(&self.nats_url))
            .field("nats_auth", &self.nats_auth)
            .field("metrics", &self.metrics)
            .field("database_url", &redact::url(&self.database_url))
            .field("stream", &self.stream)
            .field("prefix", &self.prefix)
            .field("pool", &self.pool)
            .field("hold", &self.hold)
            .finish()
    }
}

impl OrdersConfig {
    /// Reads the configuration; a variable that does not parse is an error naming it.
    pub fn from_env() -> Result<Self, String> {
        let env = Vars(|name: &str| std::env::var(name).ok());
        Ok(OrdersConfig {
            nats_url: env.var("NATS_URL", "nats://127.0.0.1:4222"),
            nats_auth: crate::NatsAuth::from_vars(&env)?,
            metrics: crate::observe::metrics_addr(&env)?,
            database_url: env.var("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test"),
            stream: env.var("ORDERS_STREAM", "ORDERS"),
            prefix: env.var("ORDERS_SUBJECT_PREFIX", "orders"),
            pool: env.number("ORDERS_POOL", "8", 2)? as u32,
            hold: Duration::from_millis(env.number("ORDERS_TEST_HOLD_MS", "0", 0)?),
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

/// Connects (waiting out NATS and the database being down at start, until `startup` is
/// cancelled), creates the tables, migrates the inbox, and runs both handlers on one [`App`]
/// until SIGINT or SIGTERM. Returns each handler's counters.
pub async fn run(config: &OrdersConfig, startup: CancellationToken) -> Result<AppStats, Error> {
    let connect = || connect_nats(&config.nats_url, &config.nats_auth);
    let Some(client) = until_up("NATS", &startup, connect).await? else {
        return Ok(AppStats::new());
    };
    let js = async_nats::jetstream::new(client);
    let database = DatabaseSpec {
        url: &config.database_url,
        server_pool: config.pool,
        // One writer at a time: a connection per handler is all SQLite can use.
        sqlite_pool: 2,
    };
    let parts = Backends {
        postgres: (
            postgres::create_tables,
            (postgres::place_order, postgres::adjust_stock),
        ),
        mysql: (
            mysql::create_tables,
            (mysql::place_order, mysql::adjust_stock),
        ),
        sqlite: (
            sqlite::create_tables,
            (sqlite::place_order, sqlite::adjust_stock),
        ),
    };
    let on = Serve { config, js };
    let stats = start_database(&database, &startup, on, parts).await?;
    Ok(stats.unwrap_or_default())
}

/// Where the app runs, once NATS is up.
struct Serve<'a> {
    config: &'a OrdersConfig,
    js: async_nats::jetstream::Context,
}

/// `Part`: the backend's `create_tables`, and its `place_order` and `adjust_stock`.
impl<C, O, I> Example<(C, (O, I))> for Serve<'_>
where
    C: AsyncFn(&sqlx::Pool<O::Db>) -> Result<(), sqlx::Error>,
    O: Handler<State = Arc<Shop>>,
    I: Handler<Db = O::Db, State = Arc<Shop>>,
{
    type Db = O::Db;
    type Output = AppStats;

    async fn create_tables(
        (create_tables, _): &(C, (O, I)),
        pool: &sqlx::Pool<O::Db>,
    ) -> Result<(), sqlx::Error> {
        create_tables(pool).await
    }

    /// Runs both handlers on one [`App`] until SIGINT or SIGTERM.
    async fn run(
        self,
        (_, (orders, inventory)): (C, (O, I)),
        inbox: Inbox<O::Db>,
    ) -> Result<AppStats, Error> {
        let config = self.config;
        let shop = Arc::new(Shop { hold: config.hold });
        let stream = async_nats::jetstream::stream::Config {
            subjects: vec![format!("{}.>", config.prefix)],
            max_age: crate::MAX_AGE,
            ..Default::default()
        };
        let durable = |name: &str, suffix: &str| {
            Durable::recommended(&config.stream, name, format!("{}.{suffix}", config.prefix))
                .with_stream(stream.clone())
        };
        let app = App::new(inbox, &self.js)
            .pull_connections(NatsConnector::new(&config.nats_url, &config.nats_auth).pulls())
            .handler_with_state(orders, shop.clone(), durable("orders", "placed"))
            .handler_with_state(inventory, shop, durable("inventory", "stock"));
        if let Some(addr) = config.metrics {
            crate::observe::serve(addr, app.health()).await?;
        }
        Ok(app.run().await?)
    }
}

/// The counters of every handler, added up.
pub fn total(stats: &AppStats) -> Stats {
    stats.values().fold(Stats::default(), |mut all, s| {
        all.acked += s.acked;
        all.skipped += s.skipped;
        all.nacked += s.nacked;
        all.terminated += s.terminated;
        all.open_claims += s.open_claims;
        all.held += s.held;
        all.key_reuses += s.key_reuses;
        all
    })
}
