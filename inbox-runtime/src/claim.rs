//! What a two-phase handler (`#[idempotent(.., claim)]`) holds while its side effect runs: the
//! [`Claim`] handle, its idempotency key, and what an open claim looks like to an operator. The
//! protocol itself (phase 1, lease renewal, phase 2, release) is the store's:
//! `store/two_phase.rs`.

use crate::backend::{ArmedTx, InboxBackend, ServerFacts, TableName};
use sha2::{Digest, Sha256};
use sqlx::{Pool, SqlStr, Transaction};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// How long a two-phase claim's lease lasts by default: see [`Inbox::lease`](crate::Inbox::lease).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(10);

/// What a two-phase handler (`#[idempotent(.., claim)]`) is given: the key, the idempotency key
/// to pass to the remote side, the fence and the attempt, and the transaction that commits with
/// "done".
///
/// ```no_run
/// use inbox_runtime::{BoxError, Claim, idempotent};
/// use sqlx::Postgres;
///
/// #[derive(serde::Deserialize)]
/// struct SendEmail { id: String, to: String }
///
/// # async fn post(_: &str, _: &str) -> Result<(), BoxError> { Ok(()) }
/// #[idempotent(consumer = "email", key = msg.id, claim)]
/// async fn send(msg: SendEmail, claim: &mut Claim<Postgres>) -> Result<(), BoxError> {
///     // The remote side deduplicates on the idempotency key: a takeover calls again with it.
///     post(&msg.to, claim.idempotency_key()).await?;
///     // Writes that must commit together with "done" go in the claim's transaction.
///     let tx = claim.tx().await?;
///     sqlx::query("INSERT INTO sent (id) VALUES ($1)").bind(&msg.id).execute(&mut **tx).await?;
///     Ok(())
/// }
/// ```
pub struct Claim<DB: InboxBackend> {
    key: String,
    idempotency_key: String,
    fence: i64,
    attempt: i64,
    pool: Pool<DB>,
    begin: SqlStr,
    /// What the inbox learned of its server: whether the transaction's session is killed if
    /// the try is cut (MySQL).
    facts: Arc<ServerFacts>,
    tx: Option<ArmedTx<DB>>,
}

impl<DB: InboxBackend> fmt::Debug for Claim<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Claim")
            .field("key", &self.key)
            .field("idempotency_key", &self.idempotency_key)
            .field("fence", &self.fence)
            .field("attempt", &self.attempt)
            .field("tx_open", &self.tx.is_some())
            .finish()
    }
}

impl<DB: InboxBackend> Claim<DB> {
    /// The message's key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The key to pass to the remote side (an `Idempotency-Key` header, say): 64 hex digits of
    /// SHA-256 over the inbox table, the consumer and the key, so the same for every delivery,
    /// retry and takeover of the message, and different across consumers and tables.
    pub fn idempotency_key(&self) -> &str {
        &self.idempotency_key
    }

    /// The fence: 1 for the first owner, one more with each takeover. Only the owner holding
    /// the current fence can complete the claim.
    pub fn fence(&self) -> i64 {
        self.fence
    }

    /// Which attempt at the side effect this is, from 1 (every takeover, including the one after
    /// a failed attempt released the lease, is one more).
    pub fn attempt(&self) -> i64 {
        self.attempt
    }

    /// A claim owned with `fence` at `attempt`; its transaction begins on `pool` with `begin`,
    /// armed as `facts` say.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        key: String,
        idempotency_key: String,
        fence: i64,
        attempt: i64,
        pool: Pool<DB>,
        begin: SqlStr,
        facts: Arc<ServerFacts>,
    ) -> Self {
        Claim {
            key,
            idempotency_key,
            fence,
            attempt,
            pool,
            begin,
            facts,
            tx: None,
        }
    }

    /// The transaction the handler began, if it did, still armed: phase 2 commits "done" in it.
    pub(crate) fn take_tx(&mut self) -> Option<ArmedTx<DB>> {
        self.tx.take()
    }

    /// The transaction that commits together with "done" (begun on first use): writes that must
    /// happen if and only if the claim completes. Begin it after the side effect: it holds a
    /// connection while open. Never commit or roll it back yourself.
    pub async fn tx(&mut self) -> Result<&mut Transaction<'static, DB>, sqlx::Error> {
        if self.tx.is_none() {
            let begin = self.begin.clone();
            self.tx = Some(ArmedTx::begin(&self.pool, begin, &self.facts).await?);
        }
        Ok(self.tx.as_deref_mut().expect("begun above"))
    }
}

/// The idempotency key of `key` for `consumer` on `table`: see [`Claim::idempotency_key`].
pub fn idempotency_key(table: &TableName, consumer: &str, key: &str) -> String {
    let mut hash = Sha256::new();
    for part in [table.as_str(), consumer, key] {
        hash.update(part.as_bytes());
        hash.update([0u8]);
    }
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// A claim left open: its owner died, its side effect failed on the last delivery, or it is
/// still running. See [`Inbox::open_claims`](crate::Inbox::open_claims).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct OpenClaim {
    /// The message's key.
    pub key: String,
    /// The fence of its last owner.
    pub fence: i64,
    /// How many attempts were made.
    pub attempts: i64,
    /// How long ago it was first claimed.
    pub age: Duration,
    /// How long its lease still runs; `None` once it has run out (or was released).
    pub lease_left: Option<Duration>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_idempotency_key_is_stable_and_names_table_consumer_and_key() {
        let t = TableName::default();
        let k = idempotency_key(&t, "email", "m-1");
        assert_eq!(k.len(), 64);
        assert_eq!(k, idempotency_key(&t, "email", "m-1"));
        assert_ne!(k, idempotency_key(&t, "email", "m-2"));
        assert_ne!(k, idempotency_key(&t, "sms", "m-1"));
        assert_ne!(
            k,
            idempotency_key(&TableName::new("other").unwrap(), "email", "m-1")
        );
        // Parts are delimited: ("ab", "c") is not ("a", "bc").
        assert_ne!(
            idempotency_key(&t, "ab", "c"),
            idempotency_key(&t, "a", "bc")
        );
    }
}
