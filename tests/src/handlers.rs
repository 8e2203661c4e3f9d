//! Handlers the behaviour tests run, written with `#[idempotent]` as a user would, once per
//! backend by [`backend_handlers!`](crate::backend_handlers) (only the SQL dialect differs).

use serde::{Deserialize, Serialize};
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

    /// Called by the handler as its body starts.
    pub fn on_run(&self) {
        self.runs.fetch_add(1, Ordering::SeqCst);
    }

    /// Called by the handler after its write: holds when asked, then fails when asked.
    pub async fn gate(&self) -> Result<(), LedgerError> {
        if self.hold {
            self.entered.notify_one();
            self.release.notified().await;
        }
        if self.fail {
            return Err(LedgerError::Requested);
        }
        Ok(())
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

/// Defines, for the database `$db`, the test handlers: `ledger` (keyed by `msg.key`, steered by a
/// [`Probe`]), `ledger_by_transport_id` (no `key`), `credit` (an upsert that a CHECK constraint can
/// reject) and `payment` (an insert that a business UNIQUE can reject). The SQL takes the dialect's
/// placeholders: ledger (key, account, amount), credit (account, amount), payment (account).
#[macro_export]
macro_rules! backend_handlers {
    ($db:ty, ledger = $ledger:literal, credit = $credit:literal, payment = $payment:literal $(,)?) => {
        use inbox_runtime::{Tx, idempotent};
        use $crate::handlers::{Entry, LedgerError, Probe};

        /// Appends a ledger row; keyed by `msg.key`; steered by the probe.
        #[idempotent(consumer = "ledger", key = msg.key)]
        pub async fn ledger(
            msg: Entry,
            tx: &mut Tx<$db>,
            probe: &Probe,
        ) -> Result<(), LedgerError> {
            probe.on_run();
            sqlx::query($ledger)
                .bind(&msg.key)
                .bind(msg.account)
                .bind(msg.amount)
                .execute(&mut **tx)
                .await?;
            probe.gate().await
        }

        /// Appends a ledger row; keyed by the transport id.
        #[idempotent(consumer = "ledger_by_transport_id")]
        pub async fn ledger_by_transport_id(
            msg: Entry,
            tx: &mut Tx<$db>,
        ) -> Result<(), sqlx::Error> {
            sqlx::query($ledger)
                .bind(&msg.key)
                .bind(msg.account)
                .bind(msg.amount)
                .execute(&mut **tx)
                .await?;
            Ok(())
        }

        /// Credits an account; a balance below zero violates a CHECK constraint.
        #[idempotent(consumer = "credit", key = msg.key)]
        pub async fn credit(msg: Entry, tx: &mut Tx<$db>) -> Result<(), sqlx::Error> {
            sqlx::query($credit)
                .bind(msg.account)
                .bind(msg.amount)
                .execute(&mut **tx)
                .await?;
            Ok(())
        }

        /// Records a payment whose reference (`msg.account`) is UNIQUE in the business table.
        #[idempotent(consumer = "payment", key = msg.key)]
        pub async fn payment(msg: Entry, tx: &mut Tx<$db>) -> Result<(), sqlx::Error> {
            sqlx::query($payment)
                .bind(msg.account)
                .execute(&mut **tx)
                .await?;
            Ok(())
        }
    };
}
