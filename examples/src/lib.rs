//! The `credit` example: a consumer that credits accounts exactly once per message.
//!
//! The binary in `src/bin/credit.rs` is a thin `main` over [`run`], configured from the
//! environment (see [`Config::from_env`]).

use async_nats::jetstream::{self, consumer::pull, stream};
use inbox_runtime::{Inbox, Stats, Tx, WorkerBuilder, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::Postgres;
use sqlx::postgres::PgPoolOptions;
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

/// Adds `msg.amount` to the account's balance, creating the account when it is new.
///
/// A credit that would take a balance below zero violates the `accounts` CHECK constraint: a
/// genuine error that rolls back the marker too, never a duplicate.
#[idempotent(consumer = "credit", key = msg.id)]
pub async fn credit(msg: CreditRequested, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO accounts (id, balance) VALUES ($1, $2) \
         ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + EXCLUDED.balance",
    )
    .bind(msg.account)
    .bind(msg.amount)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Creates the `accounts` table when missing. Serialised by an advisory lock, since concurrent
/// `CREATE TABLE IF NOT EXISTS` can still collide in PostgreSQL's catalog.
pub async fn create_accounts(pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
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

/// The example's configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// `NATS_URL`, default `nats://127.0.0.1:4222`.
    pub nats_url: String,
    /// `DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`.
    pub database_url: String,
    /// `CREDIT_STREAM`, default `CREDITS`.
    pub stream: String,
    /// `CREDIT_SUBJECT`, default `credits.requested`.
    pub subject: String,
    /// `CREDIT_CONSUMER`: the durable consumer's name, default `credit`.
    pub durable: String,
}

impl Config {
    /// Reads the configuration from the environment, with the documented defaults.
    pub fn from_env() -> Self {
        let var =
            |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
        Config {
            nats_url: var("NATS_URL", "nats://127.0.0.1:4222"),
            database_url: var("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test"),
            stream: var("CREDIT_STREAM", "CREDITS"),
            subject: var("CREDIT_SUBJECT", "credits.requested"),
            durable: var("CREDIT_CONSUMER", "credit"),
        }
    }
}

/// Why the example could not start.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// Sets up the stream, the durable consumer, the inbox and the accounts table, then consumes until
/// `shutdown` is cancelled.
pub async fn run(config: &Config, shutdown: CancellationToken) -> Result<Stats, Error> {
    let client = async_nats::connect(&config.nats_url)
        .await
        .map_err(|e| format!("cannot connect to NATS at {}: {e}", config.nats_url))?;
    let js = jetstream::new(client);
    let stream = js
        .get_or_create_stream(stream::Config {
            name: config.stream.clone(),
            subjects: vec![config.subject.clone()],
            ..Default::default()
        })
        .await
        .map_err(|e| format!("cannot get or create stream {}: {e}", config.stream))?;
    let consumer = stream
        .get_or_create_consumer(
            &config.durable,
            pull::Config {
                durable_name: Some(config.durable.clone()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(30),
                filter_subject: config.subject.clone(),
                ..Default::default()
            },
        )
        .await
        .map_err(|e| format!("cannot get or create consumer {}: {e}", config.durable))?;

    let pool = PgPoolOptions::new()
        .max_connections(8)
        .connect(&config.database_url)
        .await
        .map_err(|e| format!("cannot connect to the database: {e}"))?;
    let inbox = Inbox::new(pool.clone());
    inbox.migrate().await?;
    create_accounts(&pool).await?;

    let worker = WorkerBuilder::new(inbox, consumer).build(credit)?;
    let stats = worker.run_until(shutdown).await;
    pool.close().await;
    Ok(stats)
}
