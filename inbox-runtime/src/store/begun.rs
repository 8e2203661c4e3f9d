//! A message claimed by its BEGIN (`Backend::claim_in_begin_sql`, MariaDB): the claim goes in
//! the BEGIN's round trip, so the BEGIN either opens the transaction with the marker inserted,
//! or fails, a duplicate's failure included, after it may have begun a transaction that sqlx
//! does not count, which is rolled back here before the connection goes on.

use super::held::{self, Holding};
use super::process::Marker;
use super::{Inbox, TryConnection};
use crate::backend::InboxBackend;
use crate::delivery::Delivery;
use crate::error::{ProcessError, Stage};
use crate::handler::{Handler, Outcome};
use sqlx::{AssertSqlSafe, SqlSafeStr, Transaction};

impl<DB: InboxBackend> Inbox<DB> {
    /// Runs the handler in `tx`, whose BEGIN inserted `marker`; gives `tx` back with what
    /// [`Inbox::claim_and_handle`] would answer.
    pub(super) async fn handle<'c, H: Handler<Db = DB>>(
        &self,
        mut tx: Transaction<'c, DB>,
        handler: &H,
        state: &H::State,
        message: H::Message,
        delivery: &Delivery,
        marker: Marker,
    ) -> (
        Transaction<'c, DB>,
        Result<Option<(Marker, Holding)>, ProcessError>,
    ) {
        let held = held::open(&tx);
        let handled = handler
            .handle(message, delivery, &mut tx, state)
            .await
            .map_err(|e| ProcessError::Handler(e.into()));
        (tx, handled.map(|()| Some((marker, held))))
    }

    /// A BEGIN that claims the key (`Backend::claim_in_begin_sql`) failed with `source`, which
    /// may have left the server inside the transaction it began, unknown to sqlx: rolled back
    /// here, the connection closed should that not be answered. A duplicate is
    /// [`Outcome::Skip`] (or key reuse, as the claim tells it); anything else is the claim's
    /// failure. Also whether the ROLLBACK went through.
    pub(super) async fn claiming_begin_failed<H: Handler<Db = DB>>(
        &self,
        conn: &mut TryConnection<DB>,
        source: sqlx::Error,
        key: &str,
        delivery: &Delivery,
    ) -> (bool, Result<Outcome, ProcessError>) {
        // Tainted already by the refused BEGIN (`Beginning::begin_then`).
        let duplicate = source
            .as_database_error()
            .is_some_and(|e| DB::is_duplicate_claim(e));
        let reused = match duplicate {
            true => self.key_reused(conn, H::CONSUMER, key, delivery).await,
            false => None,
        };
        let rollback = AssertSqlSafe("ROLLBACK").into_sql_str();
        let ended = DB::execute_raw(conn, rollback).await;
        if ended.is_ok() {
            conn.untaint();
        }
        let outcome = match (duplicate, reused) {
            // A database's refusal is most likely the claim's (a lock wait behind the key, a
            // statement bound, a read-only server); the rest, the BEGIN's.
            (false, _) => Err(ProcessError::Database {
                stage: match source.as_database_error() {
                    Some(_) => Stage::Claim,
                    None => Stage::Begin,
                },
                source,
            }),
            (true, None) => Ok(Outcome::Skip),
            (true, Some(reused)) => {
                self.reported_key_reuse(H::CONSUMER, &reused);
                match H::REJECT_KEY_REUSE {
                    true => Err(reused),
                    false => Ok(Outcome::Skip),
                }
            }
        };
        (ended.is_ok(), outcome)
    }
}
