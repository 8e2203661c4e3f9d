//! Batched commits: several messages in one transaction, one COMMIT (one fsync) for all.
//!
//! A batch is first tried lean: BEGIN, the claims of all its keys (in key order; one statement
//! on PostgreSQL and SQLite, which tell new rows from duplicates by what `RETURNING` returns, a
//! statement per key on MySQL), each new message's handler, then one UPDATE setting
//! `processed_at` on every marker it claimed, COMMIT. If any
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
use crate::backend::{self, Claimed, InboxBackend};
use crate::classify::{ErrorClass, classify};
use crate::delivery::Delivery;
use crate::error::{ProcessError, Stage};
use crate::handler::{Handler, Outcome};
use futures::FutureExt;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

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

/// Why a try of the batch ended without its COMMIT.
enum Failed {
    /// Some message failed (the one at this index, when known): try again with a savepoint per
    /// message, leaving that one out without running it again.
    OneMessage(Option<usize>),
    /// A conflict with another transaction ended the try: the batch may be tried again.
    Conflict,
    /// The transaction as a whole failed: every message goes alone.
    Whole,
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
        crate::wake::scope(Box::pin(async {
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
                        self.batch_with_savepoints(handler, state, keys, deliveries, at, &message)
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
                        match self
                            .batch_lean(handler, state, keys, deliveries, decoded)
                            .await
                        {
                            Err(Failed::OneMessage(at)) => {
                                culprit = Some(at);
                                self.batch_with_savepoints(
                                    handler, state, keys, deliveries, at, &message,
                                )
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
        }))
        .await
    }

    /// The lean try: no savepoints, one UPDATE of `processed_at` for the batch.
    async fn batch_lean<H>(
        &self,
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
        let mut tx = DB::begin(self.pool(), self.begin_batch::<H>())
            .await
            .map_err(|_| Failed::Whole)?;
        let mut done = Vec::with_capacity(keys.len());
        let mut claimed = Vec::with_capacity(keys.len());
        let claims = DB::claim_many(
            &mut tx,
            (self.table(), &self.layout()),
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
                return Err(transient_or_one::<DB>(
                    &ProcessError::Database {
                        stage: Stage::Claim,
                        source,
                    },
                    None,
                ));
            }
        };
        for (i, (claim, decoded)) in claims.into_iter().zip(decoded).enumerate() {
            let Claimed::New(id) = claim else {
                done.push(Batched::Done(Outcome::Skip));
                continue;
            };
            let handled = AssertUnwindSafe(handler.handle(decoded, deliveries[i], &mut tx, state))
                .catch_unwind()
                .await;
            match handled {
                Ok(Ok(())) => {
                    claimed.push(id);
                    done.push(Batched::Done(Outcome::Ack));
                }
                Ok(Err(e)) => {
                    let _ = tx.rollback().await;
                    return Err(transient_or_one::<DB>(
                        &ProcessError::Handler(e.into()),
                        Some(i),
                    ));
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
            let finish = backend::finish_many_sql::<DB>(self.table(), &claimed);
            match DB::execute_raw(&mut tx, finish).await {
                Ok(r) if DB::rows_affected(&r) == claimed.len() as u64 => {}
                _ => {
                    let _ = tx.rollback().await;
                    return Err(Failed::OneMessage(None));
                }
            }
        }
        tx.commit().await.map_err(|_| Failed::Whole)?;
        Ok(done)
    }

    /// The careful try: a savepoint per message; a failing one is left out, and so is `culprit`
    /// (the one that failed the lean try) without running again.
    async fn batch_with_savepoints<H>(
        &self,
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
        let mut tx = DB::begin(self.pool(), self.begin_batch::<H>())
            .await
            .map_err(|_| Failed::Whole)?;
        let mut done = Vec::with_capacity(keys.len());
        for (i, key) in keys.iter().enumerate() {
            if culprit == Some(i) {
                done.push(Batched::Alone);
                continue;
            }
            let Some(decoded) = message(i) else {
                return Err(Failed::Whole);
            };
            let mut savepoint = sqlx::Connection::begin(&mut *tx)
                .await
                .map_err(|_| Failed::Whole)?;
            let one = self.process_in(&mut savepoint, handler, state, decoded, deliveries[i], key);
            let processed = AssertUnwindSafe(one).catch_unwind().await;
            match processed {
                Ok(Ok(Outcome::Ack)) => {
                    savepoint.commit().await.map_err(|_| Failed::Whole)?;
                    done.push(Batched::Done(Outcome::Ack));
                }
                Ok(Ok(Outcome::Skip)) => {
                    savepoint.rollback().await.map_err(|_| Failed::Whole)?;
                    done.push(Batched::Done(Outcome::Skip));
                }
                Ok(Err(e)) => {
                    if let Failed::Conflict = transient_or_one::<DB>(&e, None) {
                        return Err(Failed::Conflict);
                    }
                    savepoint.rollback().await.map_err(|_| Failed::Whole)?;
                    done.push(Batched::Alone);
                }
                Err(_) => {
                    savepoint.rollback().await.map_err(|_| Failed::Whole)?;
                    done.push(Batched::Alone);
                }
            }
        }
        tx.commit().await.map_err(|_| Failed::Whole)?;
        Ok(done)
    }
}

impl<DB: InboxBackend> Inbox<DB> {
    /// A batch's BEGIN: with lanes, batches wait for each other's rows as long as the lock
    /// timeout allows (they cannot deadlock); without, briefly (a wait may be a deadlock's).
    fn begin_batch<H: Handler<Db = DB>>(&self) -> sqlx::SqlStr {
        match H::LANED {
            true => self.sql.begin.clone(),
            false => self.sql.begin_unlaned.clone(),
        }
    }
}

/// A transient failure (deadlock, serialization failure, lock timeout, busy, a lost connection)
/// may have ended the whole transaction (InnoDB rolls it back on a deadlock): the whole batch is
/// tried again (a lost connection fails that try's BEGIN, and the batch goes alone). Anything
/// else is one message's fault.
fn transient_or_one<DB: InboxBackend>(err: &ProcessError, at: Option<usize>) -> Failed {
    match classify::<DB>(err) {
        ErrorClass::Transient => Failed::Conflict,
        _ => Failed::OneMessage(at),
    }
}
