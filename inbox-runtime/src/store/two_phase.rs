//! The two-phase claim protocol, for side effects outside the database (an e-mail, a card charge, a partner's
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

use super::Inbox;
use crate::backend::{ArmedTx, Beginning, Claimed, InboxBackend};
use crate::claim::{Claim, OpenClaim, idempotency_key};
use crate::delivery::Delivery;
use crate::error::{ProcessError, Stage};
use crate::handler::{Handler, Outcome};
use sqlx::SqlStr;
use std::time::Duration;
use tokio::time::Instant;

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
        delivery: &Delivery,
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
        let mut claim = Claim::new(
            key.to_owned(),
            idempotency_key(self.table(), H::CONSUMER, key),
            fence,
            attempt,
            self.pool().clone(),
            self.sql.begin.sql.clone(),
            self.facts.clone(),
        );
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
                if let Some(tx) = claim.take_tx() {
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
                let tx = claim.take_tx();
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
        let begin_err = |source| ProcessError::Database {
            stage: Stage::Begin,
            source,
        };
        let mut conn = InUtc::enter(self.pool()).await.map_err(begin_err)?;
        let acquired = self.acquire_on(conn.conn(), consumer, key, lease).await;
        conn.leave().await;
        acquired
    }

    /// [`Inbox::acquire`] on `conn`, in a transaction of its own.
    async fn acquire_on(
        &self,
        conn: &mut DB::Connection,
        consumer: &str,
        key: &str,
        lease: Duration,
    ) -> Result<Acquired, ProcessError> {
        use sqlx::Connection;
        let claim_err = |source| ProcessError::Database {
            stage: Stage::Claim,
            source,
        };
        let mut tx = conn
            .begin_with(self.sql.begin.sql.clone())
            .await
            .map_err(|source| ProcessError::Database {
                stage: Stage::Begin,
                source,
            })?;
        let sql = &self.sql.claims;
        let decided = async {
            let (id, fence, attempts) =
                match DB::claim(&mut tx, self.sql.claim.clone(), consumer, key).await? {
                    Claimed::New(id) => (id, 0, 0),
                    Claimed::Duplicate => {
                        let state =
                            DB::fetch_claim_state(&mut *tx, sql.state.clone(), consumer, key)
                                .await?
                                .ok_or(sqlx::Error::RowNotFound)?;
                        if state.done {
                            return Ok(Acquired::Done);
                        }
                        if state.lease_left_ms > 0 {
                            return Ok(Acquired::Held(ms(state.lease_left_ms)));
                        }
                        (state.id, state.fence, state.attempts)
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
        tx: Option<ArmedTx<DB>>,
        consumer: &str,
        key: &str,
        id: i64,
        fence: i64,
    ) -> Result<Outcome, ProcessError> {
        let begin_err = |source| ProcessError::Database {
            stage: Stage::Begin,
            source,
        };
        // Held apart from its transaction: closed if the BEGIN is cut at the deadline.
        let mut conn = None;
        let complete = self.sql.claims.complete.clone();
        let (tx, done) = match tx {
            Some(mut armed) => {
                // Still armed while "done" is written: a cut there kills the session too.
                let done = DB::execute_fenced(&mut **armed, complete, None, id, fence).await;
                (armed.into_inner(), done)
            }
            None => {
                let conn = conn.insert(Beginning::new(
                    self.pool().acquire().await.map_err(begin_err)?,
                ));
                let mut tx = conn.begin_with(&self.sql.begin).await.map_err(begin_err)?;
                let done = DB::execute_fenced(&mut *tx, complete, None, id, fence).await;
                (tx, done)
            }
        };
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
                Err(source) => {
                    // Back in the pool before the marker is looked up on another connection:
                    // with every connection in use, the lookup would wait for its own.
                    drop(conn);
                    self.after_failed_commit(consumer, key, source).await
                }
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
        let mut conn = InUtc::enter(self.pool()).await?;
        let done = DB::execute_fenced(conn.conn(), sql.clone(), secs, id, fence).await;
        conn.leave().await;
        Ok(DB::rows_affected(&done?))
    }

    /// The claims of `consumer` still open (not done) that were first claimed at least
    /// `older_than` ago, oldest first, at most 1,000: owners that died (until a redelivery
    /// takes over), side effects that failed on their last delivery, and ones still running.
    pub async fn open_claims(
        &self,
        consumer: &str,
        older_than: Duration,
    ) -> Result<Vec<OpenClaim>, sqlx::Error> {
        let older = -i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
        let mut conn = InUtc::enter(self.pool()).await?;
        let sql = self.sql.claims.open.clone();
        let rows = DB::fetch_open_claims(conn.conn(), sql, consumer, older).await;
        conn.leave().await;
        let rows = rows?;
        Ok(rows
            .into_iter()
            .map(|row| OpenClaim {
                key: row.key,
                fence: row.fence,
                attempts: row.attempts,
                age: ms(row.age_ms),
                lease_left: (row.lease_left_ms > 0).then(|| ms(row.lease_left_ms)),
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
        let mut conn = InUtc::enter(self.pool()).await?;
        let done = DB::execute_key(conn.conn(), sql.clone(), consumer, key).await;
        conn.leave().await;
        Ok(DB::rows_affected(&done?) > 0)
    }
}

/// Puts the session of `conn` in UTC (`utc`), or back in its own zone, where the dialect's lease
/// arithmetic follows the session's zone ([`Backend::UTC_SESSION`](crate::backend::Backend)):
/// then every instance computes leases alike, whatever zone its sessions run in, and none is an
/// hour off around a DST change.
async fn utc_session<DB: InboxBackend>(
    conn: &mut DB::Connection,
    utc: bool,
) -> Result<(), sqlx::Error> {
    if let Some((to_utc, back)) = DB::UTC_SESSION {
        let sql = if utc { to_utc } else { back };
        DB::execute_raw(conn, sqlx::SqlSafeStr::into_sql_str(sql)).await?;
    }
    Ok(())
}

/// A connection of the pool whose session is in UTC for lease statements ([`utc_session`]).
/// Put back in its own zone by [`InUtc::leave`]; dropped before that (a try cut at its deadline,
/// a renewal given up mid-statement) or when it cannot be put back, it is closed rather than
/// returned to the pool with a zone the application did not set.
struct InUtc<DB: InboxBackend> {
    conn: sqlx::pool::PoolConnection<DB>,
    back: bool,
}

impl<DB: InboxBackend> InUtc<DB> {
    /// A connection of `pool`, its session put in UTC.
    async fn enter(pool: &sqlx::Pool<DB>) -> Result<Self, sqlx::Error> {
        let mut conn = InUtc {
            conn: pool.acquire().await?,
            back: DB::UTC_SESSION.is_none(),
        };
        utc_session::<DB>(&mut conn.conn, true).await?;
        Ok(conn)
    }

    /// The connection.
    fn conn(&mut self) -> &mut DB::Connection {
        &mut self.conn
    }

    /// Puts the session back in its own zone.
    async fn leave(&mut self) {
        if !self.back && utc_session::<DB>(&mut self.conn, false).await.is_ok() {
            self.back = true;
        }
    }
}

impl<DB: InboxBackend> Drop for InUtc<DB> {
    fn drop(&mut self) {
        if !self.back {
            self.conn.close_on_drop();
        }
    }
}

/// A renewal found the claim taken over.
struct Lost;
