//! Two-phase claims, for side effects outside the database (an e-mail, a card charge, a partner's
//! HTTP API), which cannot join the marker's transaction.
//!
//! - Phase 1, in a transaction of its own that commits at once: claim the key with a lease
//!   (`lease_until = now + lease`) and a fence. A new key gets fence 1; a key whose claim is open
//!   and whose lease has run out (its owner died, or released it after a failure) is taken over
//!   with fence + 1 and attempt + 1; a done key is a duplicate (Skip); a live lease is another
//!   owner's, and the delivery is nak'd until it ends (never acked: that owner may still fail).
//! - The handler performs the side effect with a stable idempotency key (the same for every
//!   delivery, retry and takeover of the key) while the lease is renewed, fenced: an owner whose
//!   claim was taken over cannot extend it.
//! - Phase 2: the claim is marked done, in the transaction of the handler's own writes, only if
//!   the fence still holds it. A zombie (an owner frozen past its lease while another took over)
//!   is refused: [`ProcessError::FencedOut`], its writes rolled back.
//!
//! A failed side effect releases the lease at once, so that the redelivery (or the next try in
//! process) takes the claim over without waiting for the lease. Claims are open while
//! `processed_at` is NULL and `lease_until` is set; cleanup never deletes them, and
//! [`Inbox::open_claims`] lists those left open (the worker's sweeper logs them).

use crate::backend::sealed::Claim as Marker;
use crate::backend::{InboxBackend, TableName};
use crate::handler::{Handler, Outcome};
use crate::store::{Inbox, ProcessError, Stage};
use sha2::{Digest, Sha256};
use sqlx::{Pool, SqlStr, Transaction};
use std::fmt;
use std::time::Duration;
use tokio::time::Instant;

/// How long a two-phase claim's lease lasts by default: see [`Inbox::lease`].
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
    tx: Option<Transaction<'static, DB>>,
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

    /// The transaction that commits together with "done" (begun on first use): writes that must
    /// happen if and only if the claim completes. Begin it after the side effect: it holds a
    /// connection while open. Never commit or roll it back yourself.
    pub async fn tx(&mut self) -> Result<&mut Transaction<'static, DB>, sqlx::Error> {
        if self.tx.is_none() {
            self.tx = Some(DB::begin(&self.pool, self.begin.clone()).await?);
        }
        Ok(self.tx.as_mut().expect("begun above"))
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
/// still running. See [`Inbox::open_claims`].
#[derive(Debug, Clone, PartialEq, Eq)]
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

/// What phase 1 came to.
enum Acquired {
    /// The key is done: a duplicate.
    Done,
    /// Another owner's lease runs this much longer.
    Held(Duration),
    /// Ours: the marker's id, our fence and attempt.
    Owned { id: i64, fence: i64, attempt: i64 },
}

/// The lease of an owned claim, released (fenced) on a task of its own if dropped while armed:
/// when the try is dropped at its deadline, on shutdown, or while a panic unwinds.
struct Lease<DB: InboxBackend> {
    inbox: Inbox<DB>,
    id: i64,
    fence: i64,
    armed: bool,
}

impl<DB: InboxBackend> Drop for Lease<DB> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (inbox, id, fence) = (self.inbox.clone(), self.id, self.fence);
            runtime.spawn(async move {
                if let Err(e) = inbox.release(id, fence).await {
                    tracing::debug!(error = %e, "releasing an abandoned claim failed; its lease runs out");
                }
            });
        }
    }
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

fn ms(n: i64) -> Duration {
    Duration::from_millis(n.max(0) as u64)
}

impl<DB: InboxBackend> Inbox<DB> {
    /// Two-phase processing of `message` under `key` (see the module docs).
    pub(crate) async fn process_claimed<H: Handler<Db = DB>>(
        &self,
        handler: &H,
        state: &H::State,
        message: H::Message,
        delivery: &crate::Delivery,
        key: &str,
    ) -> Result<Outcome, ProcessError> {
        let lease = self.lease_duration();
        let (id, fence, attempt) = match self.acquire(H::CONSUMER, key, lease).await? {
            Acquired::Done => return Ok(Outcome::Skip),
            Acquired::Held(remaining) => return Err(ProcessError::ClaimHeld { remaining }),
            Acquired::Owned { id, fence, attempt } => (id, fence, attempt),
        };
        tracing::debug!(fence, attempt, "claim taken");
        let mut guard = Lease {
            inbox: self.clone(),
            id,
            fence,
            armed: true,
        };
        let mut claim = Claim {
            key: key.to_owned(),
            idempotency_key: idempotency_key(self.table(), H::CONSUMER, key),
            fence,
            attempt,
            pool: self.pool().clone(),
            begin: self.sql.begin.clone(),
            tx: None,
        };
        let renewal = self.keep_renewed(id, fence, lease);
        tokio::pin!(renewal);
        let body = handler.handle_claimed(message, delivery, &mut claim, state);
        let ran = tokio::select! {
            biased;
            done = body => Ok(done),
            lost = &mut renewal => Err(lost),
        };
        match ran {
            Err(Lost) => {
                guard.armed = false;
                Err(ProcessError::FencedOut { fence })
            }
            Ok(Err(e)) => {
                // Released at once, so that the next try takes the claim over without waiting
                // for the lease; the guard retries on a task of its own if this fails.
                if let Some(tx) = claim.tx.take() {
                    let _ = tx.rollback().await;
                }
                match self.release(id, fence).await {
                    Ok(()) => guard.armed = false,
                    Err(release) => {
                        tracing::warn!(error = %release, "releasing the claim after a failure failed")
                    }
                }
                Err(ProcessError::Handler(e))
            }
            Ok(Ok(())) => {
                let tx = claim.tx.take();
                // Renewed until phase 2 is over, however long its transaction waits: the fence
                // decides it, never a lease that ran out on the way.
                let complete = self.complete(tx, H::CONSUMER, key, id, fence);
                let done = tokio::select! {
                    biased;
                    done = complete => done,
                    _ = async { (&mut renewal).await; std::future::pending().await } => unreachable!(),
                };
                if !matches!(done, Err(ProcessError::Database { .. })) {
                    guard.armed = false;
                }
                done
            }
        }
    }

    /// Phase 1: claims `key` with a lease, in a transaction of its own.
    async fn acquire(
        &self,
        consumer: &str,
        key: &str,
        lease: Duration,
    ) -> Result<Acquired, ProcessError> {
        let claim_err = |source| ProcessError::Database {
            stage: Stage::Claim,
            source,
        };
        let mut tx = DB::begin(self.pool(), self.sql.begin.clone())
            .await
            .map_err(|source| ProcessError::Database {
                stage: Stage::Begin,
                source,
            })?;
        let sql = &self.sql.claims;
        let decided = async {
            let (id, fence, attempts) =
                match DB::claim(&mut tx, self.sql.claim.clone(), consumer, key).await? {
                    Marker::New(id) => (id, 0, 0),
                    Marker::Duplicate => {
                        let row = DB::fetch_claim_state(&mut *tx, sql.state.clone(), consumer, key)
                            .await?
                            .ok_or(sqlx::Error::RowNotFound)?;
                        let (id, done, remaining, fence, attempts) = row;
                        if done != 0 {
                            return Ok(Acquired::Done);
                        }
                        if remaining > 0 {
                            return Ok(Acquired::Held(ms(remaining)));
                        }
                        (id, fence, attempts)
                    }
                };
            let took = DB::execute_fenced(&mut *tx, sql.take.clone(), Some(secs(lease)), id, fence)
                .await?;
            Ok(match DB::rows_affected(&took) {
                // Its lease ends within the millisecond the state rounded away: come back.
                0 => Acquired::Held(Duration::from_millis(10)),
                _ => Acquired::Owned {
                    id,
                    fence: fence + 1,
                    attempt: attempts + 1,
                },
            })
        }
        .await;
        match decided {
            Ok(owned @ Acquired::Owned { .. }) => match tx.commit().await {
                Ok(()) => Ok(owned),
                // Unknown: if it committed, the lease is ours but we do not know it; the next
                // try finds it live and waits it out, or takes it over after a redelivery.
                Err(source) => Err(ProcessError::Database {
                    stage: Stage::Commit,
                    source,
                }),
            },
            other => {
                let _ = tx.rollback().await;
                other.map_err(claim_err)
            }
        }
    }

    /// Keeps the lease of claim `id` (held with `fence`) renewed, every quarter of it, for as
    /// long as it is polled. Resolves to [`Lost`] when a renewal finds the claim taken over, or
    /// when no renewal has succeeded for (nearly) a lease, the database being unreachable, say:
    /// the lease may have run out, and another owner may have taken it over. Never resolves
    /// otherwise. Polled beside the side effect (never in its way: a renewal that waits, for a
    /// connection or SQLite's write lock, does not hold up the body).
    async fn keep_renewed(&self, id: i64, fence: i64, lease: Duration) -> Lost {
        let every = (lease / 4).max(Duration::from_millis(10));
        // Counted from now, after phase 1 committed, the lease ends a little earlier in the
        // database: the margin covers that, and the round trip of a renewal.
        let margin = every / 2;
        let mut valid_until = Instant::now() + lease.saturating_sub(margin);
        loop {
            let next = (Instant::now() + every).min(valid_until);
            tokio::time::sleep_until(next).await;
            let started = Instant::now();
            if started >= valid_until {
                tracing::warn!(
                    fence,
                    "no renewal of the claim's lease succeeded for a lease; giving up, since another owner may have taken it over"
                );
                return Lost;
            }
            let renew =
                self.execute_fenced_on_pool(&self.sql.claims.renew, Some(secs(lease)), id, fence);
            match tokio::time::timeout(valid_until - started, renew).await {
                Ok(Ok(0)) => {
                    tracing::warn!(
                        fence,
                        "the claim was taken over while its side effect ran; giving up"
                    );
                    return Lost;
                }
                Ok(Ok(_)) => valid_until = started + lease.saturating_sub(margin),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "renewing the claim's lease failed; trying again")
                }
                Err(_) => tracing::warn!("renewing the claim's lease timed out; trying again"),
            }
        }
    }

    /// Phase 2: marks the claim done in `tx` (the handler's, or a new one) if `fence` holds it.
    async fn complete(
        &self,
        tx: Option<Transaction<'static, DB>>,
        consumer: &str,
        key: &str,
        id: i64,
        fence: i64,
    ) -> Result<Outcome, ProcessError> {
        let mut tx = match tx {
            Some(tx) => tx,
            None => DB::begin(self.pool(), self.sql.begin.clone())
                .await
                .map_err(|source| ProcessError::Database {
                    stage: Stage::Begin,
                    source,
                })?,
        };
        let done =
            DB::execute_fenced(&mut *tx, self.sql.claims.complete.clone(), None, id, fence).await;
        match done.map(|d| DB::rows_affected(&d)) {
            Ok(0) => {
                let _ = tx.rollback().await;
                tracing::warn!(
                    fence,
                    "completion refused: the claim was taken over by another owner"
                );
                Err(ProcessError::FencedOut { fence })
            }
            Ok(_) => match tx.commit().await {
                Ok(()) => Ok(Outcome::Ack),
                Err(source) => self.after_failed_commit(consumer, key, source).await,
            },
            Err(source) => {
                let _ = tx.rollback().await;
                Err(ProcessError::Database {
                    stage: Stage::Finish,
                    source,
                })
            }
        }
    }

    /// Ends the lease of claim `id` now, if `fence` still holds it.
    async fn release(&self, id: i64, fence: i64) -> Result<(), sqlx::Error> {
        self.execute_fenced_on_pool(&self.sql.claims.release, None, id, fence)
            .await
            .map(drop)
    }

    async fn execute_fenced_on_pool(
        &self,
        sql: &SqlStr,
        secs: Option<f64>,
        id: i64,
        fence: i64,
    ) -> Result<u64, sqlx::Error> {
        let mut conn = self.pool().acquire().await?;
        let done = DB::execute_fenced(&mut conn, sql.clone(), secs, id, fence).await?;
        Ok(DB::rows_affected(&done))
    }

    /// The claims of `consumer` still open (not done) that were first claimed at least
    /// `older_than` ago, oldest first, at most 1,000: owners that died (until a redelivery
    /// takes over), side effects that failed on their last delivery, and ones still running.
    pub async fn open_claims(
        &self,
        consumer: &str,
        older_than: Duration,
    ) -> Result<Vec<OpenClaim>, sqlx::Error> {
        let mut conn = self.pool().acquire().await?;
        let older = -i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        let rows =
            DB::fetch_open_claims(&mut conn, self.sql.claims.open.clone(), consumer, older).await?;
        Ok(rows
            .into_iter()
            .map(|(key, fence, attempts, age, left)| OpenClaim {
                key,
                fence,
                attempts,
                age: ms(age),
                lease_left: (left > 0).then(|| ms(left)),
            })
            .collect())
    }

    /// Ends the lease of `consumer`'s open claim on `key` now, so that the next delivery takes it
    /// over at once (and performs the side effect again, with the same idempotency key). `false`
    /// when there is no open claim on `key`. Release only a claim whose owner is gone: a live
    /// owner's completion is then refused if another takes over.
    pub async fn release_claim(&self, consumer: &str, key: &str) -> Result<bool, sqlx::Error> {
        self.execute_key(&self.sql.claims.release_key, consumer, key)
            .await
    }

    /// Deletes `consumer`'s open claim on `key`, as if the key had never been seen: the next
    /// delivery claims it afresh (fence 1; the idempotency key is the same). `false` when there
    /// is no open claim on `key`. A done claim is never deleted here.
    pub async fn forget_claim(&self, consumer: &str, key: &str) -> Result<bool, sqlx::Error> {
        self.execute_key(&self.sql.claims.forget_key, consumer, key)
            .await
    }

    async fn execute_key(
        &self,
        sql: &SqlStr,
        consumer: &str,
        key: &str,
    ) -> Result<bool, sqlx::Error> {
        let mut conn = self.pool().acquire().await?;
        let done = DB::execute_key(&mut conn, sql.clone(), consumer, key).await?;
        Ok(DB::rows_affected(&done) > 0)
    }
}

/// A renewal found the claim taken over.
struct Lost;

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
