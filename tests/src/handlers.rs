//! Handlers the behaviour tests run, written with `#[idempotent]` as a user would.

use inbox_runtime::{Tx, idempotent};
use serde::{Deserialize, Serialize};
use sqlx::{PgPool, Postgres};
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::sync::Notify;

/// The message every test handler takes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// The dedup key (for handlers that use one).
    pub key: String,
    /// The account (or payment reference) written.
    pub account: i64,
    /// The amount.
    pub amount: i64,
}

impl Entry {
    /// A message as published.
    pub fn json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("serialize")
    }
}

/// Creates the business tables the test handlers write.
pub async fn create_tables(pool: &PgPool) {
    for sql in [
        "CREATE TABLE ledger (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL, account BIGINT NOT NULL, amount BIGINT NOT NULL)",
        "CREATE TABLE accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL CHECK (balance >= 0))",
        "CREATE TABLE payments (reference BIGINT NOT NULL UNIQUE)",
    ] {
        sqlx::query(sql).execute(pool).await.expect(sql);
    }
}

/// What a test can observe and steer in a handler: how often its body ran, and a gate at which it
/// holds its transaction open (after writing) until released.
#[derive(Debug, Default)]
pub struct Probe {
    runs: AtomicUsize,
    hold: bool,
    fail: bool,
    entered: Notify,
    release: Notify,
}

impl Probe {
    /// Runs through.
    pub fn open() -> Probe {
        Probe::default()
    }

    /// Holds at the gate; then succeeds, or fails when `fail`.
    pub fn held(fail: bool) -> Probe {
        Probe {
            hold: true,
            fail,
            ..Probe::default()
        }
    }

    /// How many times the handler body ran.
    pub fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    /// Waits until the body has written and holds at the gate.
    pub async fn entered(&self) {
        self.entered.notified().await
    }

    /// Lets the body go on past the gate.
    pub fn release(&self) {
        self.release.notify_one()
    }
}

/// A handler's own error.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The database failed.
    #[error(transparent)]
    Db(#[from] sqlx::Error),
    /// The probe asked for a failure.
    #[error("failure requested by the test")]
    Requested,
}

/// Appends a ledger row; keyed by `msg.key`; steered by the probe.
#[idempotent(consumer = "ledger", key = msg.key)]
pub async fn ledger(msg: Entry, tx: &mut Tx<Postgres>, probe: &Probe) -> Result<(), LedgerError> {
    probe.runs.fetch_add(1, Ordering::SeqCst);
    sqlx::query("INSERT INTO ledger (key, account, amount) VALUES ($1, $2, $3)")
        .bind(&msg.key)
        .bind(msg.account)
        .bind(msg.amount)
        .execute(&mut **tx)
        .await?;
    if probe.hold {
        probe.entered.notify_one();
        probe.release.notified().await;
    }
    if probe.fail {
        return Err(LedgerError::Requested);
    }
    Ok(())
}

/// Appends a ledger row; keyed by the transport id (no `key`).
#[idempotent(consumer = "ledger_by_transport_id")]
pub async fn ledger_by_transport_id(msg: Entry, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO ledger (key, account, amount) VALUES ($1, $2, $3)")
        .bind(&msg.key)
        .bind(msg.account)
        .bind(msg.amount)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Credits an account; a balance below zero violates a CHECK constraint.
#[idempotent(consumer = "credit", key = msg.key)]
pub async fn credit(msg: Entry, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
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

/// Records a payment whose reference (`msg.account`) is UNIQUE in the business table.
#[idempotent(consumer = "payment", key = msg.key)]
pub async fn payment(msg: Entry, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
    sqlx::query("INSERT INTO payments (reference) VALUES ($1)")
        .bind(msg.account)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
