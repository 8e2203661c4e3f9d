//! A pooled connection whose transaction a cut future cannot leave open: a future dropped while
//! its BEGIN is on the wire (a try cut at its deadline against a slow database) leaves the server
//! inside a transaction that the client does not know of. sqlx (MySQL's driver still; PostgreSQL's
//! until 0.9.1) counts the transaction only once the BEGIN's answer is read, so nothing rolls it
//! back, and the pool's check on release passes the connection on: the next statements on it (a
//! probe, a cleanup, a parked dead letter) run inside that transaction, keep their locks, and are
//! lost when the connection closes; on MySQL the next try's `SET TRANSACTION` is refused (1568)
//! for as long as the connection lives. [`Beginning::begin_with`] closes such a connection on
//! drop instead (the server then ends the transaction), where the driver needs it
//! (`Backend::CUT_BEGIN_LEAVES_TRANSACTION`: closing costs a new connection, and on SQLite a
//! second writer waiting for the lock).

use super::Backend;
use sqlx::pool::PoolConnection;
use sqlx::{SqlStr, Transaction};
use std::ops::{Deref, DerefMut};

/// A pooled connection that leaves the pool, closed, if it is dropped while a BEGIN on it had
/// not been answered.
#[derive(Debug)]
pub(crate) struct Beginning<DB: Backend> {
    conn: PoolConnection<DB>,
    /// Set from the BEGIN's sending to its answer.
    unanswered: bool,
}

impl<DB: Backend> Beginning<DB> {
    pub(crate) fn new(conn: PoolConnection<DB>) -> Self {
        Beginning {
            conn,
            unanswered: false,
        }
    }

    /// Begins a transaction on the connection with `sql`, as `sqlx::Connection::begin_with`.
    pub(crate) async fn begin_with(
        &mut self,
        sql: SqlStr,
    ) -> Result<Transaction<'_, DB>, sqlx::Error> {
        let Beginning { conn, unanswered } = self;
        *unanswered = DB::CUT_BEGIN_LEAVES_TRANSACTION;
        let tx = sqlx::Connection::begin_with(&mut **conn, sql).await;
        // Answered (begun or refused): sqlx knows the connection's state again.
        *unanswered = false;
        tx
    }

    /// Begins a transaction on the connection, as `sqlx::Connection::begin`.
    pub(crate) async fn begin(&mut self) -> Result<Transaction<'_, DB>, sqlx::Error> {
        let Beginning { conn, unanswered } = self;
        *unanswered = DB::CUT_BEGIN_LEAVES_TRANSACTION;
        let tx = sqlx::Connection::begin(&mut **conn).await;
        *unanswered = false;
        tx
    }
}

impl<DB: Backend> Deref for Beginning<DB> {
    type Target = PoolConnection<DB>;

    fn deref(&self) -> &PoolConnection<DB> {
        &self.conn
    }
}

impl<DB: Backend> DerefMut for Beginning<DB> {
    fn deref_mut(&mut self) -> &mut PoolConnection<DB> {
        &mut self.conn
    }
}

impl<DB: Backend> Drop for Beginning<DB> {
    fn drop(&mut self) {
        if self.unanswered {
            self.conn.close_on_drop();
        }
    }
}
