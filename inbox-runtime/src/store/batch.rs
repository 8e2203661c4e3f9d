//! Batched commits: several messages in one transaction, one COMMIT (one fsync) for all.
//!
//! A batch is first tried lean: BEGIN, the claims of all its keys (in key order; one statement
//! on PostgreSQL, SQLite and MariaDB 10.5+, which tell new rows from duplicates by what
//! `RETURNING` returns, a statement per key on MySQL and older MariaDB), each new message's
//! handler, then one UPDATE setting `processed_at` on every marker it claimed, COMMIT. If any
//! message fails there, the whole transaction is rolled back and the batch is tried again with a
//! SAVEPOINT per message (`process_in` inside a nested transaction): a failing message is rolled
//! back to its savepoint and left out, to be handled alone by the caller (its retries, nak or
//! dead letter exactly as one message), while the others commit together.
//!
//! A conflict with another transaction (deadlock, serialization failure, lock timeout, busy:
//! a transient error, which may have ended the whole transaction) is no message's fault: the
//! whole batch is tried again after a short jittered wait, up to [`CONFLICT_TRIES`] tries, and
//! only then goes alone. A savepoint that cannot be rolled back to, a failed BEGIN or a COMMIT
//! whose outcome is unknown leaves every message of the batch to be handled alone, where the
//! marker decides again: nothing is acked on a guess.
//!
//! Two copies of one key in a batch: the second claim sees the first's marker, in the same
//! transaction, and is a Skip.

use super::Inbox;
use super::held;
use super::process::{Inserted, Marker};
use crate::backend::{self, Begin, Beginning, Claimed, InboxBackend};
use crate::delivery::Delivery;
use crate::error::{ProcessError, Stage};
use crate::handler::{Handler, Outcome};
use futures::FutureExt;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

mod failed;
use failed::{Failed, failed_by};

/// How many times a batch is tried when conflicts with other transactions end its tries.
pub(crate) const CONFLICT_TRIES: u32 = 4;

/// How one message of a batch ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Batched {
    /// Committed with the batch: its effect ([`Outcome::Ack`]) or nothing, a duplicate
    /// ([`Outcome::Skip`]).
    Done(Outcome),
    /// Not committed: to be processed alone.
    Alone,
    /// The batch's transaction ended while this message's handler, or one before it, ran
    /// ([`ProcessError::TransactionEnded`]): what the handler ran after that committed on its
    /// own, so it is dead-lettered rather than tried again.
    TransactionEnded,
}

/// How a batch ended: each message's end, in order, and what it met on the way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BatchEnd {
    /// How each message ended, in the batch's order.
    pub ended: Vec<Batched>,
    /// Tries ended by a conflict with another transaction (deadlock, serialization failure,
    /// lock timeout, busy).
    pub conflicts: u32,
    /// Tries of the whole batch after such a conflict.
    pub retries: u32,
}

impl<DB: InboxBackend> Inbox<DB> {
    /// Processes a batch in one transaction: `decoded[i]` is the message keyed `keys[i]`,
    /// delivered as `deliveries[i]`, and
    /// `message(i)` decodes it again for a second try (only after a failure). Keys must be in
    /// the order the claims are to take (sorted, so that batches of several instances lock
    /// markers in one order). Returns how each message ended, in order.
    pub(crate) async fn process_batch<H>(
        &self,
        handler: &H,
        state: &H::State,
        keys: &[&str],
        deliveries: &[&Delivery],
        decoded: Vec<H::Message>,
        message: impl Fn(usize) -> Option<H::Message>,
    ) -> BatchEnd
    where
        H: Handler<Db = DB>,
    {
        let mut end = BatchEnd {
            ended: vec![Batched::Alone; keys.len()],
            conflicts: 0,
            retries: 0,
        };
        if deliveries.len() != keys.len() {
            return end;
        }
        // The relay of every outbox the handlers wrote to is woken once the batch commits.
        // Boxed, as in `process_keyed`: a large future, kept off the stack.
        crate::wake::scope(held::scope(Box::pin(async {
            let backoff =
                crate::backoff::Backoff::new(Duration::from_millis(5), Duration::from_millis(100))
                    .with_jitter();
            let mut decoded = Some(decoded);
            // The message that failed a lean try (`Some(None)`: one, not known which): later
            // tries go with savepoints, leaving it out.
            let mut culprit: Option<Option<usize>> = None;
            for attempt in 0..CONFLICT_TRIES {
                if attempt > 0 {
                    end.retries += 1;
                    tokio::time::sleep(backoff.delay(attempt - 1)).await;
                }
                let tried = match culprit {
                    Some(at) => {
                        self.on_try_connection(async |conn| {
                            self.batch_with_savepoints(
                                conn, handler, state, keys, deliveries, at, &message,
                            )
                            .await
                        })
                        .await
                    }
                    None => {
                        // Decoded once; again only for a try after a conflict.
                        let decoded = match decoded.take() {
                            Some(decoded) => decoded,
                            None => match (0..keys.len()).map(&message).collect() {
                                Some(decoded) => decoded,
                                None => return end,
                            },
                        };
                        let lean = async |conn: &mut Beginning<DB>| {
                            self.batch_lean(conn, handler, state, keys, deliveries, decoded)
                                .await
                        };
                        match self.on_try_connection(lean).await {
                            Err(Failed::OneMessage(at)) => {
                                culprit = Some(at);
                                self.on_try_connection(async |conn| {
                                    self.batch_with_savepoints(
                                        conn, handler, state, keys, deliveries, at, &message,
                                    )
                                    .await
                                })
                                .await
                            }
                            tried => tried,
                        }
                    }
                };
                match tried {
                    Ok(done) => {
                        end.ended = done;
                        return end;
                    }
                    Err(Failed::Conflict) => end.conflicts += 1,
                    Err(Failed::OneMessage(_) | Failed::Whole) => return end,
                }
            }
            end
        })))
        .await
    }

    /// The lean try, on `conn`: no savepoints, one UPDATE of `processed_at` for the batch.
    async fn batch_lean<H>(
        &self,
        conn: &mut Beginning<DB>,
        handler: &H,
        state: &H::State,
        keys: &[&str],
        deliveries: &[&Delivery],
        decoded: Vec<H::Message>,
    ) -> Result<Vec<Batched>, Failed>
    where
        H: Handler<Db = DB>,
    {
        if decoded.len() != keys.len() {
            return Err(Failed::Whole);
        }
        let mut tx = conn
            .begin_with(self.begin_batch::<H>())
            .await
            .map_err(|_| Failed::Whole)?;
        let mut done = Vec::with_capacity(keys.len());
        let mut claimed = Vec::with_capacity(keys.len());
        // The index of each claimed marker's message.
        let mut claimed_at = Vec::with_capacity(keys.len());
        let claims = DB::claim_many(
            &mut tx,
            (self.table(), &self.layout(), self.facts.server()),
            self.sql.claim.clone(),
            H::CONSUMER,
            keys,
        )
        .await;
        let claims = match claims {
            Ok(claims) if claims.len() == keys.len() => claims,
            Ok(_) => {
                let _ = tx.rollback().await;
                return Err(Failed::Whole);
            }
            Err(source) => {
                let _ = tx.rollback().await;
                return Err(failed_by::<DB>(
                    &ProcessError::Database {
                        stage: Stage::Claim,
                        source,
                    },
                    None,
                ));
            }
        };
        // The message of each key this batch claimed.
        let first_of: std::collections::HashMap<&str, usize> = claims
            .iter()
            .enumerate()
            .filter(|(_, c)| matches!(c, Claimed::New(_)))
            .map(|(i, _)| (keys[i], i))
            .collect();
        // The handlers' outbox rows are held, and written below where the first marker is.
        let held = held::open(&tx);
        for (i, (claim, decoded)) in claims.into_iter().zip(decoded).enumerate() {
            let Claimed::New(id) = claim else {
                // A copy of a key this batch claims itself is compared with that message.
                let earlier = first_of.get(keys[i]).map(|&j| deliveries[j]);
                if self
                    .batch_duplicate::<H>(&mut tx, keys[i], deliveries[i], earlier)
                    .await
                {
                    // Rejected for key reuse: tried alone, where it is dead-lettered.
                    let _ = tx.rollback().await;
                    return Err(Failed::OneMessage(Some(i)));
                }
                done.push(Batched::Done(Outcome::Skip));
                continue;
            };
            let handled = AssertUnwindSafe(handler.handle(decoded, deliveries[i], &mut tx, state))
                .catch_unwind()
                .await;
            match handled {
                Ok(Ok(())) => {
                    claimed.push(id);
                    claimed_at.push(i);
                    done.push(Batched::Done(Outcome::Ack));
                }
                Ok(Err(e)) => {
                    let _ = tx.rollback().await;
                    return Err(failed_by::<DB>(&ProcessError::Handler(e.into()), Some(i)));
                }
                Err(_) => {
                    let _ = tx.rollback().await;
                    return Err(Failed::OneMessage(Some(i)));
                }
            }
        }
        if !claimed.is_empty() {
            // Also what catches a handler that swallowed an error of an aborted transaction
            // (PostgreSQL), or a transaction a swallowed deadlock rolled back (MySQL): the
            // markers are not all there to be updated.
            let hashes: Vec<Option<&str>> = claimed_at
                .iter()
                .map(|&i| deliveries[i].payload_hash.as_deref())
                .collect();
            let first = Inserted::Unfinished(claimed[0]);
            let first = (&first, H::CONSUMER, keys[claimed_at[0]]);
            let held = held.take();
            // The finish below finds every marker or rolls back: it checks them after the rows.
            let (table, server) = (self.table(), self.facts.server());
            let written = held::insert_if_marked::<DB>(&mut tx, table, &held, first, server, true);
            let finished = match written.await {
                Ok(true) => DB::finish_many(&mut tx, self.table(), &claimed, &hashes).await,
                Ok(false) => Ok(Default::default()),
                Err(e) => Err(e),
            };
            match finished {
                Ok(r) if DB::rows_affected(&r) == claimed.len() as u64 => {}
                // The markers, inserted by this transaction and seen by no other, are gone:
                // the transaction ended under one of the handlers, not known which, and the
                // handlers that ran after it committed their statements on their own. Every
                // message whose handler ran is dead-lettered: none is applied twice.
                Ok(_) => {
                    let _ = tx.rollback().await;
                    let ended = done.into_iter().map(|d| match d {
                        Batched::Done(Outcome::Ack) => Batched::TransactionEnded,
                        other => other,
                    });
                    return Ok(ended.collect());
                }
                Err(_) => {
                    let _ = tx.rollback().await;
                    return Err(Failed::OneMessage(None));
                }
            }
        }
        tx.commit().await.map_err(|_| Failed::Whole)?;
        Ok(done)
    }

    /// A duplicate in a batch: counts and logs key reuse, and says whether the handler rejects
    /// it (the message must then go alone, to be dead-lettered there, where it is counted).
    /// `earlier` is the message of the batch that claimed `key`, whose hash is not written yet.
    async fn batch_duplicate<H: Handler<Db = DB>>(
        &self,
        conn: &mut DB::Connection,
        key: &str,
        delivery: &Delivery,
        earlier: Option<&Delivery>,
    ) -> bool {
        let reused = match earlier {
            Some(earlier) => match (&earlier.payload_hash, &delivery.payload_hash) {
                (Some(original), Some(this)) if original != this => Some(ProcessError::KeyReused {
                    key: key.to_owned(),
                    original: original.clone(),
                    this: this.clone(),
                }),
                _ => None,
            },
            None => self.key_reused(conn, H::CONSUMER, key, delivery).await,
        };
        let Some(reused) = reused else {
            return false;
        };
        if H::REJECT_KEY_REUSE {
            return true;
        }
        self.reported_key_reuse(H::CONSUMER, &reused);
        false
    }

    /// The careful try, on `conn`: a savepoint per message; a failing one is left out, and so is `culprit`
    /// (the one that failed the lean try) without running again. As in the lean try, every
    /// claim is made first and the handlers then run in the batch's order, so that the batch
    /// takes its locks in the order every batch does (markers, then the lanes' rows); a message
    /// left out gets its savepoint rolled back and its marker deleted.
    #[allow(clippy::too_many_arguments)]
    async fn batch_with_savepoints<H>(
        &self,
        conn: &mut Beginning<DB>,
        handler: &H,
        state: &H::State,
        keys: &[&str],
        deliveries: &[&Delivery],
        culprit: Option<usize>,
        message: &impl Fn(usize) -> Option<H::Message>,
    ) -> Result<Vec<Batched>, Failed>
    where
        H: Handler<Db = DB>,
    {
        let mut tx = conn
            .begin_with(self.begin_batch::<H>())
            .await
            .map_err(|_| Failed::Whole)?;
        // Ends the try: the transaction rolled back, awaited, so that a try again does not wait
        // for this one's locks.
        async fn end<DB: InboxBackend>(
            tx: sqlx::Transaction<'_, DB>,
            failed: Failed,
        ) -> Result<Vec<Batched>, Failed> {
            let _ = tx.rollback().await;
            Err(failed)
        }
        let claimed_keys: Vec<&str> = (0..keys.len())
            .filter(|&i| culprit != Some(i))
            .map(|i| keys[i])
            .collect();
        let claims = DB::claim_many(
            &mut tx,
            (self.table(), &self.layout(), self.facts.server()),
            self.sql.claim.clone(),
            H::CONSUMER,
            &claimed_keys,
        )
        .await;
        let mut claims = match claims {
            Ok(claims) if claims.len() == claimed_keys.len() => claims.into_iter(),
            Ok(_) => return end(tx, Failed::Whole).await,
            Err(source) => {
                let error = ProcessError::Database {
                    stage: Stage::Claim,
                    source,
                };
                let failed = match failed_by::<DB>(&error, None) {
                    Failed::Conflict => Failed::Conflict,
                    _ => Failed::Whole,
                };
                return end(tx, failed).await;
            }
        };
        let mut done = Vec::with_capacity(keys.len());
        let mut left_out = Vec::new();
        for (i, delivery) in deliveries.iter().enumerate() {
            if culprit == Some(i) {
                done.push(Batched::Alone);
                continue;
            }
            let Some(Claimed::New(id)) = claims.next() else {
                // Key reuse rejected: the message goes alone, where it is dead-lettered.
                match self
                    .batch_duplicate::<H>(&mut tx, keys[i], delivery, None)
                    .await
                {
                    true => done.push(Batched::Alone),
                    false => done.push(Batched::Done(Outcome::Skip)),
                }
                continue;
            };
            let Some(decoded) = message(i) else {
                return end(tx, Failed::Whole).await;
            };
            let Ok(mut savepoint) = sqlx::Connection::begin(&mut *tx).await else {
                return end(tx, Failed::Whole).await;
            };
            let one = async {
                handler
                    .handle(decoded, delivery, &mut savepoint, state)
                    .await
                    .map_err(|e| ProcessError::Handler(e.into()))?;
                // As for one message: the marker must still be there to be finished.
                let marker = Marker {
                    inserted: Inserted::Unfinished(id),
                    consumer: H::CONSUMER,
                };
                self.finish(&mut savepoint, marker, Vec::new(), keys[i], delivery)
                    .await
            };
            let processed = AssertUnwindSafe(one).catch_unwind().await;
            let kept = match processed {
                Ok(Ok(())) => savepoint.commit().await.is_ok(),
                Ok(Err(ProcessError::TransactionEnded { .. })) => {
                    // Ended under this message's handler (its finish comes right after it):
                    // what the messages before it did went with the transaction, and they go
                    // alone; this one's later statements committed on their own.
                    drop(savepoint);
                    let _ = tx.rollback().await;
                    let mut ended = vec![Batched::Alone; keys.len()];
                    ended[i] = Batched::TransactionEnded;
                    return Ok(ended);
                }
                Ok(Err(e)) => {
                    if let Failed::Conflict = failed_by::<DB>(&e, None) {
                        drop(savepoint);
                        return end(tx, Failed::Conflict).await;
                    }
                    if savepoint.rollback().await.is_err() {
                        return end(tx, Failed::Whole).await;
                    }
                    false
                }
                Err(_) => {
                    if savepoint.rollback().await.is_err() {
                        return end(tx, Failed::Whole).await;
                    }
                    false
                }
            };
            if kept {
                done.push(Batched::Done(Outcome::Ack));
            } else {
                left_out.push(id);
                done.push(Batched::Alone);
            }
        }
        if !left_out.is_empty() {
            // The markers of the messages left out, which they will claim again alone.
            let delete = backend::delete_ids_sql(self.table(), &left_out);
            match DB::execute_raw(&mut tx, delete).await {
                Ok(r) if DB::rows_affected(&r) == left_out.len() as u64 => {}
                _ => return end(tx, Failed::Whole).await,
            }
        }
        tx.commit().await.map_err(|_| Failed::Whole)?;
        Ok(done)
    }
}

impl<DB: InboxBackend> Inbox<DB> {
    /// Runs one try of a batch on a connection of its own ([`Inbox::try_connection`]), settled
    /// once the try has ended rather than been cut.
    async fn on_try_connection<T>(
        &self,
        try_on: impl AsyncFnOnce(&mut Beginning<DB>) -> Result<T, Failed>,
    ) -> Result<T, Failed> {
        let mut conn = self.try_connection().await.map_err(|_| Failed::Whole)?;
        let tried = try_on(&mut conn).await;
        conn.settle();
        if tried.is_ok() {
            self.keep_connection(conn);
        }
        tried
    }

    /// A batch's BEGIN: with lanes, batches wait for each other's rows as long as the lock
    /// timeout allows (they cannot deadlock); without, briefly (a wait may be a deadlock's).
    fn begin_batch<H: Handler<Db = DB>>(&self) -> &Begin {
        match H::LANED {
            true => &self.sql.begin,
            false => &self.sql.begin_unlaned,
        }
    }
}
