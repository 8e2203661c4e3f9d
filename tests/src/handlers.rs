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
    /// The message with `key`, for `account` and `amount`.
    pub fn new(key: impl Into<String>, account: i64, amount: i64) -> Entry {
        Entry {
            key: key.into(),
            account,
            amount,
        }
    }

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
    /// When each run started.
    started: std::sync::Mutex<Vec<std::time::Instant>>,
    hold: bool,
    fail: bool,
    entered: Notify,
    release: Notify,
    failures_left: AtomicUsize,
    failure: Failure,
    /// While set, every run waits at the gate (after writing) until [`Probe::resume`].
    paused: std::sync::atomic::AtomicBool,
    resumed: Notify,
}

/// How a [`Probe::failing`] handler fails.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// A plain error of the handler's own: neither marked nor recognised.
    #[default]
    Plain,
    /// Marked [`inbox_runtime::Transient`].
    Transient,
    /// Marked [`inbox_runtime::Permanent`].
    Permanent,
    /// A panic.
    Panic,
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

    /// Fails the first `times` runs (after writing) with `failure`, then succeeds.
    pub fn failing(times: usize, failure: Failure) -> Probe {
        Probe {
            failures_left: AtomicUsize::new(times),
            failure,
            ..Probe::default()
        }
    }

    /// How many times the handler body ran.
    pub fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    /// When each run of the body started, in order.
    pub fn run_times(&self) -> Vec<std::time::Instant> {
        self.started.lock().unwrap().clone()
    }

    /// Waits until the body has written and holds at the gate.
    pub async fn entered(&self) {
        self.entered.notified().await
    }

    /// Lets the body go on past the gate.
    pub fn release(&self) {
        self.release.notify_one()
    }

    /// From now on every run waits at the gate, after writing, with its transaction open, until
    /// [`Probe::resume`]: progress stops where the test wants it stopped, whatever the speed.
    pub fn pause(&self) {
        self.paused.store(true, Ordering::SeqCst);
    }

    /// Lets every paused run, and every later one, through the gate.
    pub fn resume(&self) {
        self.paused.store(false, Ordering::SeqCst);
        self.resumed.notify_waiters();
    }

    /// Called by the handler as its body starts.
    pub fn on_run(&self) {
        self.started.lock().unwrap().push(std::time::Instant::now());
        self.runs.fetch_add(1, Ordering::SeqCst);
    }

    /// Called by the handler after its write: holds when asked, then fails when asked.
    pub async fn gate(&self) -> Result<(), LedgerError> {
        loop {
            // Registered before the flag is read, so that a resume in between is not missed.
            let resumed = self.resumed.notified();
            tokio::pin!(resumed);
            resumed.as_mut().enable();
            if !self.paused.load(Ordering::SeqCst) {
                break;
            }
            resumed.await;
        }
        if self.hold {
            self.entered.notify_one();
            self.release.notified().await;
        }
        if self.fail {
            return Err(LedgerError::Requested);
        }
        let left = self
            .failures_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if left.is_ok() {
            return Err(match self.failure {
                Failure::Plain => LedgerError::Requested,
                Failure::Transient => {
                    LedgerError::Marked(inbox_runtime::Transient::new("flaky downstream").into())
                }
                Failure::Panic => panic!("the handler panicked on purpose"),
                Failure::Permanent => {
                    LedgerError::Marked(inbox_runtime::Permanent::new("account is closed").into())
                }
            });
        }
        Ok(())
    }
}

/// The state of the `announce` handler: the outbox it publishes to, and the subject.
pub struct Announcer<DB: inbox_runtime::InboxBackend> {
    /// The outbox.
    pub outbox: inbox_runtime::Outbox<DB>,
    /// The subject of the announcements.
    pub subject: String,
}

/// A fake remote side (an e-mail API, a payment provider) that a two-phase handler calls: it
/// records every call with the idempotency key, fence and attempt it carried, can hold calls at a
/// gate, and can answer with an error status. Clones share it.
#[derive(Debug, Clone, Default)]
pub struct Remote(std::sync::Arc<RemoteInner>);

#[derive(Debug, Default)]
struct RemoteInner {
    calls: std::sync::Mutex<Vec<Call>>,
    hold: std::sync::atomic::AtomicBool,
    status: std::sync::atomic::AtomicU16,
    entered: Notify,
    release: Notify,
}

/// One call the [`Remote`] received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// The message's key.
    pub key: String,
    /// The idempotency key it carried.
    pub idempotency_key: String,
    /// The caller's fence.
    pub fence: i64,
    /// The caller's attempt.
    pub attempt: i64,
}

/// The remote's answer when it fails: its status, as a client library would report it. A 5xx is
/// marked transient, any other status permanent.
#[derive(Debug, thiserror::Error)]
#[error("remote answered {0}")]
pub struct Status(pub u16);

impl Remote {
    /// Holds every call at the gate until [`Remote::release`].
    pub fn hold(&self) {
        self.0.hold.store(true, Ordering::SeqCst);
    }

    /// Answers every call with `status` (0: success).
    pub fn answer(&self, status: u16) {
        self.0.status.store(status, Ordering::SeqCst);
    }

    /// Waits until a call is held at the gate.
    pub async fn entered(&self) {
        self.0.entered.notified().await
    }

    /// Lets held calls go on, and stops holding.
    pub fn release(&self) {
        self.0.hold.store(false, Ordering::SeqCst);
        self.0.release.notify_waiters();
        self.0.release.notify_one();
    }

    /// The calls so far.
    pub fn calls(&self) -> Vec<Call> {
        self.0.calls.lock().unwrap().clone()
    }

    /// Called by the handler: records the call, holds when asked, answers as told.
    pub async fn call<DB: inbox_runtime::InboxBackend>(
        &self,
        claim: &inbox_runtime::Claim<DB>,
    ) -> Result<(), inbox_runtime::BoxError> {
        self.0.calls.lock().unwrap().push(Call {
            key: claim.key().to_owned(),
            idempotency_key: claim.idempotency_key().to_owned(),
            fence: claim.fence(),
            attempt: claim.attempt(),
        });
        if self.0.hold.load(Ordering::SeqCst) {
            let released = self.0.release.notified();
            self.0.entered.notify_one();
            released.await;
        }
        match self.0.status.load(Ordering::SeqCst) {
            0 => Ok(()),
            s if s >= 500 => Err(inbox_runtime::Transient::new(Status(s)).into()),
            s => Err(inbox_runtime::Permanent::new(Status(s)).into()),
        }
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
    /// The probe asked for a failure marked transient or permanent (carried as the source, so
    /// that the runtime sees the mark).
    #[error("marked failure")]
    Marked(#[source] inbox_runtime::BoxError),
}

/// Defines, for the database `$db`, the test handlers: `ledger` (keyed by `msg.key`, steered by a
/// [`Probe`]), `ledger_by_transport_id` (no `key`), `probed_by_transport_id` (no `key`, steered by
/// a [`Probe`]), `credit` (an upsert that a CHECK constraint can
/// reject) and `payment` (an insert that a business UNIQUE can reject). The SQL takes the dialect's
/// placeholders: ledger (key, account, amount), credit (account, amount), payment (account).
#[macro_export]
macro_rules! backend_handlers {
    ($db:ty, ledger = $ledger:literal, credit = $credit:literal, payment = $payment:literal $(,)?) => {
        use inbox_runtime::{Tx, idempotent};
        use $crate::handlers::{Entry, LedgerError, Probe, Remote};

        /// Appends `msg` to the ledger.
        async fn append(msg: &Entry, tx: &mut Tx<'_, $db>) -> Result<(), sqlx::Error> {
            let insert = sqlx::query($ledger).bind(&msg.key).bind(msg.account);
            insert.bind(msg.amount).execute(&mut **tx).await.map(drop)
        }

        /// Appends `msg` to the ledger as the probe steers: counted, then held or failed.
        async fn append_probed(
            msg: &Entry,
            tx: &mut Tx<'_, $db>,
            probe: &Probe,
        ) -> Result<(), LedgerError> {
            probe.on_run();
            append(msg, tx).await?;
            probe.gate().await
        }

        /// Appends a ledger row; keyed by `msg.key`; steered by the probe.
        #[idempotent(consumer = "ledger", key = msg.key)]
        pub async fn ledger(
            msg: Entry,
            tx: &mut Tx<$db>,
            probe: &Probe,
        ) -> Result<(), LedgerError> {
            append_probed(&msg, tx, probe).await
        }

        /// [`ledger`], rejecting a key reused with another payload.
        #[idempotent(consumer = "ledger_strict", key = msg.key, on_key_reuse = reject)]
        pub async fn ledger_strict(
            msg: Entry,
            tx: &mut Tx<$db>,
            probe: &Probe,
        ) -> Result<(), LedgerError> {
            append_probed(&msg, tx, probe).await
        }

        /// [`ledger`], laned by the account: a batch runs its messages by account, then key.
        #[idempotent(consumer = "ledger_laned", key = msg.key, lane = msg.account)]
        pub async fn ledger_laned(
            msg: Entry,
            tx: &mut Tx<$db>,
            probe: &Probe,
        ) -> Result<(), LedgerError> {
            append_probed(&msg, tx, probe).await
        }

        /// Appends a ledger row; keyed by the transport id.
        #[idempotent(consumer = "ledger_by_transport_id")]
        pub async fn ledger_by_transport_id(
            msg: Entry,
            tx: &mut Tx<$db>,
        ) -> Result<(), sqlx::Error> {
            append(&msg, tx).await
        }

        /// Appends a ledger row; keyed by the transport id; steered by the probe.
        #[idempotent(consumer = "probed_by_transport_id")]
        pub async fn probed_by_transport_id(
            msg: Entry,
            tx: &mut Tx<$db>,
            probe: &Probe,
        ) -> Result<(), LedgerError> {
            append_probed(&msg, tx, probe).await
        }

        /// Credits an account; a balance below zero violates a CHECK constraint.
        #[idempotent(consumer = "credit", key = msg.key)]
        pub async fn credit(msg: Entry, tx: &mut Tx<$db>) -> Result<(), sqlx::Error> {
            let upsert = sqlx::query($credit).bind(msg.account).bind(msg.amount);
            upsert.execute(&mut **tx).await.map(drop)
        }

        /// [`credit`], laned by the account it locks: batches take accounts in one order.
        #[idempotent(consumer = "credit_laned", key = msg.key, lane = msg.account)]
        pub async fn credit_laned(msg: Entry, tx: &mut Tx<$db>) -> Result<(), sqlx::Error> {
            let upsert = sqlx::query($credit).bind(msg.account).bind(msg.amount);
            upsert.execute(&mut **tx).await.map(drop)
        }

        /// Two-phase: calls the [`Remote`] with the claim's idempotency key, then appends a
        /// ledger row that commits with "done".
        #[idempotent(consumer = "remote", key = msg.key, claim)]
        pub async fn remote(
            msg: Entry,
            claim: &mut inbox_runtime::Claim<$db>,
            api: &Remote,
        ) -> Result<(), inbox_runtime::BoxError> {
            api.call(claim).await?;
            append(&msg, claim.tx().await?).await?;
            Ok(())
        }

        /// Appends a ledger row, announces it through the outbox of [`Announcer`] (the entry
        /// as JSON), and only then credits the account: an overdraw fails (a CHECK violation,
        /// permanent) after the publish. Its error wraps sqlx's transparently, as many
        /// applications' error types do.
        #[idempotent(consumer = "announce", key = msg.key)]
        pub async fn announce(
            msg: Entry,
            tx: &mut Tx<$db>,
            to: &$crate::handlers::Announcer<$db>,
        ) -> Result<(), LedgerError> {
            append(&msg, tx).await?;
            to.outbox.publish(tx, &to.subject, &msg).await?;
            let upsert = sqlx::query($credit).bind(msg.account).bind(msg.amount);
            upsert.execute(&mut **tx).await?;
            Ok(())
        }

        /// Records a payment whose reference (`msg.account`) is UNIQUE in the business table.
        #[idempotent(consumer = "payment", key = msg.key)]
        pub async fn payment(msg: Entry, tx: &mut Tx<$db>) -> Result<(), sqlx::Error> {
            let insert = sqlx::query($payment).bind(msg.account);
            insert.execute(&mut **tx).await.map(drop)
        }
    };
}
