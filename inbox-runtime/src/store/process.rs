//! Where a duplicate is decided: one transaction per message (BEGIN, the claim inserting the
//! marker finished, the handler's statements, the check that the marker is still there, COMMIT),
//! and the marker lookup after a COMMIT whose reply was lost. The check is the insert of the
//! handler's outbox rows, held until it returns (`store/held.rs`), when it wrote any. Where the
//! dialect can (MariaDB, in a worker), the claim goes in the BEGIN's round trip (`begun.rs`).

use super::Inbox;
use super::held::{self, HeldRow, Holding};
use crate::backend::{Claimed, InboxBackend};
use crate::classify::{is_outage, is_read_only};
use crate::delivery::Delivery;
use crate::error::{ProcessError, Stage};
use crate::handler::{Handler, Outcome, message_key};
use sqlx::{SqlStr, Transaction};
use tracing::Instrument;

impl<DB: InboxBackend> Inbox<DB> {
    /// Processes `message` exactly once: in a fresh transaction, claims its key and, when the claim
    /// is new, runs the handler and commits both. Returns [`Outcome::Skip`] for a duplicate, in
    /// which case the handler did not run.
    ///
    /// `delivery` is what the handler and its `key` expression see of the message's transport:
    /// in a test, [`Delivery::new`](crate::Delivery::new) with the headers the case needs. Its
    /// `Nats-Msg-Id` is the key when the handler has no `key` expression.
    pub async fn process<H: Handler<Db = DB>>(
        &self,
        handler: &H,
        state: &H::State,
        message: H::Message,
        delivery: &Delivery,
    ) -> Result<Outcome, ProcessError> {
        let key = message_key(handler, state, &message, delivery)?;
        let span = tracing::debug_span!("inbox.tx", consumer = H::CONSUMER, key = %key);
        self.process_keyed(handler, state, message, delivery, &key)
            .instrument(span)
            .await
    }

    /// [`Inbox::process`] with the key already computed and validated.
    pub(crate) async fn process_keyed<H: Handler<Db = DB>>(
        &self,
        handler: &H,
        state: &H::State,
        message: H::Message,
        delivery: &Delivery,
        key: &str,
    ) -> Result<Outcome, ProcessError> {
        // Whatever the handler wrote for a background task (an outbox row, for its relay) wakes
        // that task once this ends.
        // Boxed: the processing future is large (sqlx's pool acquire alone is about 13 KiB),
        // and moving it through the scope's layers by value overflowed a worker thread's stack
        // in debug builds. The two paths apart: a future's layout is fixed before `TWO_PHASE`
        // is known, so a two-phase claim's path inline would make every message's future as
        // large as both.
        if H::TWO_PHASE {
            let work = Box::pin(self.process_claimed(handler, state, message, delivery, key));
            crate::wake::scope(held::scope(work)).await
        } else {
            let work = Box::pin(self.process_keyed_now(handler, state, message, delivery, key));
            crate::wake::scope(held::scope(work)).await
        }
    }

    async fn process_keyed_now<H: Handler<Db = DB>>(
        &self,
        handler: &H,
        state: &H::State,
        message: H::Message,
        delivery: &Delivery,
        key: &str,
    ) -> Result<Outcome, ProcessError> {
        let begin = |source| ProcessError::Database {
            stage: Stage::Begin,
            source,
        };
        // The connection is held apart from its transaction: one that answers "read-only" (to
        // a standby, after a failover) leaves the pool, since a new one may reach the primary.
        let mut conn = self.try_connection().await.map_err(begin)?;
        // Whether a duplicate's ROLLBACK went through: one that failed leaves the connection
        // for the pool's check, not for the next try.
        let mut rolled_back = true;
        let done = async {
            // Where the dialect can, the BEGIN claims the key in its round trip.
            let hash = delivery.payload_hash.as_deref();
            let server = self.facts.server();
            // Only a dialect that reads the begun marker back claims there.
            let claiming = self
                .sql
                .begun
                .as_ref()
                .filter(|_| self.sql.claim_finished.is_some())
                .and_then(|begun| {
                    let claim =
                        DB::claim_in_begin_sql(self.table(), server, H::CONSUMER, key, hash)?;
                    Some((claim, begun.clone()))
                });
            if let Some((claim, begun)) = claiming {
                let source = match conn.begin_then(&self.sql.begin, &claim).await {
                    Ok(tx) => {
                        let marker = Marker {
                            inserted: Inserted::Begun(begun),
                            consumer: H::CONSUMER,
                        };
                        let (tx, handled) = self
                            .handle(tx, handler, state, message, delivery, marker)
                            .await;
                        let (ended, done) = self.end(tx, handled, key, delivery).await;
                        rolled_back = ended;
                        return done;
                    }
                    Err(source) => source,
                };
                let failed = self.claiming_begin_failed::<H>(&mut conn, source, key, delivery);
                let (ended, outcome) = Box::pin(failed).await;
                rolled_back = ended;
                return outcome.map(Ok);
            }
            let mut tx = conn.begin_with(&self.sql.begin).await.map_err(begin)?;
            let handled = self
                .claim_and_handle(&mut tx, handler, state, message, delivery, key)
                .await;
            let (ended, done) = self.end(tx, handled, key, delivery).await;
            rolled_back = ended;
            done
        }
        .await;
        conn.settle();
        // Back in the pool (unless kept) before a failed COMMIT's marker is looked up on another
        // connection: with every connection in use, the lookup would wait for its own.
        match &done {
            // Ended cleanly: committed, or a duplicate rolled back.
            Ok(Ok(_)) if rolled_back => self.keep_connection(conn),
            // The connections kept are likely to reach the same standby, or to be dead too.
            Err(e) if is_read_only::<DB>(e) => {
                conn.close_on_drop();
                drop(conn);
                self.release_kept_connections();
            }
            Err(e) if is_outage::<DB>(e) => {
                drop(conn);
                self.release_kept_connections();
            }
            _ => drop(conn),
        }
        match done? {
            Ok(outcome) => Ok(outcome),
            // Boxed: a cold path, about as large as the rest of the message's future.
            Err(source) => Box::pin(self.after_failed_commit(H::CONSUMER, key, source)).await,
        }
    }

    /// Ends `tx` as `handled` says: the marker finished and committed, or rolled back (a
    /// duplicate wrote nothing and a failure must leave nothing). Also whether a ROLLBACK went
    /// through.
    async fn end(
        &self,
        tx: Transaction<'_, DB>,
        handled: Result<Option<(Marker, Holding)>, ProcessError>,
        key: &str,
        delivery: &Delivery,
    ) -> (bool, Result<Result<Outcome, sqlx::Error>, ProcessError>) {
        match handled {
            Ok(Some((marker, held))) => {
                let done = self.finish_and_commit(tx, marker, held.take(), key, delivery);
                (true, done.await)
            }
            other => (roll_back(tx).await, other.map(|_| Ok(Outcome::Skip))),
        }
    }

    /// Finishes `marker` (a prepared statement), then commits `tx`. `Ok(Err(_))`: COMMIT
    /// failed, and whether it committed is unknown.
    ///
    /// Two round trips, not one: the finish and COMMIT sent as one simple query (PostgreSQL,
    /// until the commit that brought this back) saved a round trip but cost the server more
    /// CPU than it saved, the statement parsed and planned afresh for every message and an
    /// empty transaction begun after it for the ROLLBACK sqlx queues (README, Performance).
    async fn finish_and_commit(
        &self,
        mut tx: Transaction<'_, DB>,
        marker: Marker,
        held: Vec<HeldRow>,
        key: &str,
        delivery: &Delivery,
    ) -> Result<Result<Outcome, sqlx::Error>, ProcessError> {
        if let Err(e) = self.finish(&mut tx, marker, held, key, delivery).await {
            roll_back(tx).await;
            return Err(e);
        }
        Ok(tx.commit().await.map(|()| Outcome::Ack))
    }

    /// COMMIT failed with `source`, and its outcome is unknown: the connection may have been
    /// lost after the server committed, on the reply's way back. The marker, looked up on
    /// another connection, decides: committed, the message is done ([`Outcome::Ack`]; its effect
    /// is committed once, by this transaction or a twin's); absent, or not to be looked up, the
    /// failure stands and is retried (where the claim decides again).
    pub(crate) async fn after_failed_commit(
        &self,
        consumer: &str,
        key: &str,
        source: sqlx::Error,
    ) -> Result<Outcome, ProcessError> {
        match self.is_done(consumer, key).await {
            Ok(true) => {
                tracing::info!(error = %source, "COMMIT reported an error, but the marker is committed");
                Ok(Outcome::Ack)
            }
            Ok(false) => Err(ProcessError::Database {
                stage: Stage::Commit,
                source,
            }),
            Err(lookup) => {
                tracing::debug!(error = %lookup, "looking the marker up after a failed COMMIT failed");
                Err(ProcessError::Database {
                    stage: Stage::Commit,
                    source,
                })
            }
        }
    }

    /// Whether `consumer`'s marker of `key` is committed and finished (a two-phase claim still
    /// open is not), looked up on a connection of its own.
    pub(crate) async fn is_done(&self, consumer: &str, key: &str) -> Result<bool, sqlx::Error> {
        let mut conn = self.pool.acquire().await?;
        let id = DB::fetch_id(&mut conn, self.sql.done.clone(), consumer, key).await?;
        Ok(id.is_some())
    }

    /// Claims `key` and runs the handler inside `tx`, a transaction (or savepoint) the caller owns
    /// and commits. On [`Outcome::Skip`] or an error the caller must roll `tx` back. A two-phase
    /// handler cannot run in a caller's transaction (its claim commits first):
    /// [`ProcessError::TwoPhaseInTransaction`].
    pub async fn process_in<'c, H: Handler<Db = DB>>(
        &self,
        tx: &mut Transaction<'c, DB>,
        handler: &H,
        state: &H::State,
        message: H::Message,
        delivery: &Delivery,
        key: &str,
    ) -> Result<Outcome, ProcessError> {
        let Some((marker, held)) = self
            .claim_and_handle(tx, handler, state, message, delivery, key)
            .await?
        else {
            return Ok(Outcome::Skip);
        };
        self.finish(tx, marker, held.take(), key, delivery).await?;
        Ok(Outcome::Ack)
    }

    /// [`Inbox::process_in`] up to the finish: the claimed marker once the handler ran, with
    /// the outbox rows it wrote in `tx` (held), `None` for a duplicate.
    async fn claim_and_handle<'c, H: Handler<Db = DB>>(
        &self,
        tx: &mut Transaction<'c, DB>,
        handler: &H,
        state: &H::State,
        message: H::Message,
        delivery: &Delivery,
        key: &str,
    ) -> Result<Option<(Marker, Holding)>, ProcessError> {
        if H::TWO_PHASE {
            return Err(ProcessError::TwoPhaseInTransaction(H::CONSUMER));
        }
        let hash = delivery.payload_hash.as_deref();
        let (claim, finished) = match &self.sql.claim_finished {
            Some(sql) => (
                DB::claim_finished(tx, sql.clone(), H::CONSUMER, key, hash).await,
                true,
            ),
            None => (
                DB::claim(tx, self.sql.claim.clone(), H::CONSUMER, key).await,
                false,
            ),
        };
        let claim = claim.map_err(|source| ProcessError::Database {
            stage: Stage::Claim,
            source,
        })?;
        let Claimed::New(id) = claim else {
            // A duplicate; one with another payload than the key's first is key reuse.
            if let Some(reused) = self.key_reused(tx, H::CONSUMER, key, delivery).await {
                self.reported_key_reuse(H::CONSUMER, &reused);
                if H::REJECT_KEY_REUSE {
                    return Err(reused);
                }
            }
            return Ok(None);
        };
        // The outbox rows the handler writes in `tx` are held, for `finish` to write.
        let held = held::open(&*tx);
        handler
            .handle(message, delivery, tx, state)
            .await
            .map_err(|e| ProcessError::Handler(e.into()))?;
        let marker = Marker {
            inserted: match finished {
                true => Inserted::Finished(id),
                false => Inserted::Unfinished(id),
            },
            consumer: H::CONSUMER,
        };
        Ok(Some((marker, held)))
    }

    /// Whether the duplicate `key` of `delivery` came with another payload than the one the key
    /// was first processed with: [`ProcessError::KeyReused`], naming both hashes. `None` when
    /// it came with the same, or when either hash is unknown (a delivery from elsewhere than
    /// JetStream, a marker of an earlier version or of a two-phase claim, a failed lookup).
    pub(crate) async fn key_reused(
        &self,
        conn: &mut DB::Connection,
        consumer: &str,
        key: &str,
        delivery: &Delivery,
    ) -> Option<ProcessError> {
        let this = delivery.payload_hash.as_deref()?;
        let original = match DB::fetch_hash(conn, self.sql.hash.clone(), consumer, key).await {
            Ok(hash) => hash.flatten()?,
            Err(e) => {
                tracing::debug!(error = %e, "looking up the key's payload hash failed");
                return None;
            }
        };
        (original != this).then(|| ProcessError::KeyReused {
            key: key.to_owned(),
            original,
            this: this.to_owned(),
        })
    }

    /// Counts and logs key reuse found by [`Inbox::key_reused`].
    pub(crate) fn reported_key_reuse(&self, consumer: &'static str, reused: &ProcessError) {
        self.key_reuses
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        crate::metrics::key_reused(consumer);
        if let ProcessError::KeyReused {
            key,
            original,
            this,
        } = reused
        {
            tracing::warn!(
                consumer,
                key,
                original,
                this,
                "key reused with another payload"
            );
        }
    }

    /// Ends the handler's part of `marker`'s transaction: the outbox rows the handler wrote
    /// are inserted where the marker is (all or none); a marker the claim inserted finished
    /// is otherwise looked up by its key (the id found must be its own); any other gets its
    /// `processed_at` (and the payload's hash). Either
    /// way the marker must still be there: a handler that swallowed an error of an aborted
    /// transaction (PostgreSQL), or a transaction a swallowed deadlock rolled back (MySQL),
    /// fails here, and is never committed as if it were done. The aborted transaction is a
    /// database error, redelivered; the rolled-back one is [`ProcessError::TransactionEnded`],
    /// permanent, since the statements the handler ran after the rollback committed on their
    /// own.
    pub(crate) async fn finish(
        &self,
        conn: &mut DB::Connection,
        marker: Marker,
        held: Vec<HeldRow>,
        key: &str,
        delivery: &Delivery,
    ) -> Result<(), ProcessError> {
        let failed = |source| ProcessError::Database {
            stage: Stage::Finish,
            source,
        };
        // The marker, inserted by this transaction and seen by no other, can only be gone
        // with the transaction itself.
        // The handler's outbox rows, written where the marker is: whether it was found.
        let found = match held.is_empty() {
            true => None,
            false => {
                let marked = (&marker.inserted, marker.consumer, key);
                // Nothing checks the marker after the rows: they go by it (or, one row, by
                // the server's check of the transaction).
                let server = self.facts.server();
                let insert =
                    held::insert_if_marked::<DB>(conn, self.table(), &held, marked, server, false);
                Some(insert.await.map_err(failed)?)
            }
        };
        let gone = match (found, marker.inserted) {
            (Some(false), _) => true,
            // Found by the rows' insert: the lookup's answer already.
            (Some(true), Inserted::Finished(_) | Inserted::Begun(_)) => false,
            // The key's finished marker as this transaction sees it: its own while it holds
            // it; after a rollback, none, or a twin's committed since (another id, unless
            // SQLite gave it the rolled-back row's).
            (None, Inserted::Finished(id)) => {
                let done = DB::fetch_id(conn, self.sql.done.clone(), marker.consumer, key);
                done.await.map_err(failed)? != Some(id)
            }
            // Inserted by the BEGIN: whether the transaction still holds it.
            (None, Inserted::Begun(begun)) => {
                let ours = DB::fetch_id(conn, begun, marker.consumer, key);
                ours.await.map_err(failed)?.is_none()
            }
            (_, Inserted::Unfinished(id)) => {
                let hash = delivery.payload_hash.as_deref();
                let finish = DB::execute_finish(conn, self.sql.finish.clone(), id, hash);
                DB::rows_affected(&finish.await.map_err(failed)?) == 0
            }
        };
        match gone {
            true => Err(ProcessError::TransactionEnded {
                key: key.to_owned(),
            }),
            false => Ok(()),
        }
    }
}

/// A marker the message's transaction inserted, and its consumer.
#[derive(Debug, Clone)]
pub(crate) struct Marker {
    pub inserted: Inserted,
    pub consumer: &'static str,
}

/// How a marker was inserted, and so how `Inbox::finish` checks it and where its id comes from.
#[derive(Debug, Clone)]
pub(crate) enum Inserted {
    /// By the claim (row id), its `processed_at` left for `Inbox::finish` to set.
    Unfinished(i64),
    /// By the claim (row id), finished (`InboxStatements::claim_finished`).
    Finished(i64),
    /// By the transaction's BEGIN (`Backend::claim_in_begin_sql`), finished; its id read, where
    /// a statement needs it, by this statement (`InboxStatements::begun`, binding consumer and
    /// key).
    Begun(SqlStr),
}

/// Rolls `tx` back now rather than on drop, so that the connection returns to the pool clean.
/// `false`: it failed, and the connection is left to the pool's check.
async fn roll_back<DB: InboxBackend>(tx: Transaction<'_, DB>) -> bool {
    match tx.rollback().await {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!(error = %e, "rollback failed; the connection is left to the pool's check");
            false
        }
    }
}
