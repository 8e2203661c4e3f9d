//! One instance at a time across the fleet: a lock that is a *session* lock of the database
//! (PostgreSQL's advisory lock, MySQL's `GET_LOCK`; SQLite's single writer needs none), taken
//! without waiting by cleanups (the inbox's and the outbox relay's, which then delete in the
//! bounded batches here) and with a bounded wait by migrations (`migrate.rs`).

use super::{DeleteBatch, InboxBackend};
use sqlx::pool::PoolConnection;
use sqlx::{Pool, SqlStr};
use std::time::Duration;

/// A fleet lock held on a connection of its own. A connection returned to the pool while still
/// holding the lock (a cleanup cancelled half-way, an unlock that failed) would keep every
/// instance from cleaning up for as long as it lives, so a connection that may still hold it is
/// closed when dropped, which makes the server release it.
pub(crate) struct FleetLock<DB: InboxBackend> {
    conn: PoolConnection<DB>,
    name: String,
    locked: bool,
}

impl<DB: InboxBackend> FleetLock<DB> {
    /// Takes lock `name` on a connection of `pool` without waiting; `None` when another instance
    /// holds it.
    pub(crate) async fn try_take(
        pool: &Pool<DB>,
        name: String,
    ) -> Result<Option<Self>, sqlx::Error> {
        Self::take(pool, name, Duration::ZERO).await
    }

    /// Takes lock `name` on a connection of `pool`, waiting at most `wait` (in the database,
    /// where the wait shows as a session waiting for a lock) for another instance to release
    /// it; `None` when it still holds it then.
    ///
    /// An idle connection of the pool may have been lost while idle (a pool that tests none on
    /// acquire, its sessions ended by a failover or an operator, a process starting while it
    /// happens): one that fails is closed, not pooled, and the lock is asked for again on
    /// another. As many tries as there were idle connections, and one more on a new connection:
    /// a database that is down fails once, not once per pool timeout.
    pub(crate) async fn take(
        pool: &Pool<DB>,
        name: String,
        wait: Duration,
    ) -> Result<Option<Self>, sqlx::Error> {
        let mut idle = pool.num_idle();
        loop {
            match Self::take_once(pool, name.clone(), wait).await {
                Err(e) if idle > 0 && super::is_transient::<DB>(&e) => {
                    tracing::debug!(lock = %name, error = %e, "a pooled connection was lost; taking the lock on another");
                    idle -= 1;
                }
                taken => return taken,
            }
        }
    }

    /// [`FleetLock::take`] on the connection the pool hands out.
    async fn take_once(
        pool: &Pool<DB>,
        name: String,
        wait: Duration,
    ) -> Result<Option<Self>, sqlx::Error> {
        // Counted as held from before it is asked for: cancelled while the server grants it,
        // the connection must not go back to the pool holding it.
        let mut lock = FleetLock {
            conn: pool.acquire().await?,
            name,
            locked: true,
        };
        if DB::fleet_lock(&mut lock.conn, &lock.name, wait).await? {
            Ok(Some(lock))
        } else {
            lock.locked = false;
            Ok(None)
        }
    }

    /// The connection holding the lock: the work it guards runs on it, so that it takes one
    /// connection of the pool, as the pool split counts it (and a pool of one is enough).
    pub(crate) fn conn(&mut self) -> &mut PoolConnection<DB> {
        &mut self.conn
    }

    /// Releases the lock; when that fails, the connection is closed rather than pooled.
    pub(crate) async fn release(mut self) {
        match DB::fleet_unlock(&mut self.conn, &self.name).await {
            Ok(()) => self.locked = false,
            Err(e) => tracing::warn!(
                lock = %self.name,
                error = %e,
                "releasing the fleet lock failed; closing the connection"
            ),
        }
    }
}

impl<DB: InboxBackend> Drop for FleetLock<DB> {
    fn drop(&mut self) {
        if self.locked {
            self.conn.close_on_drop();
        }
    }
}

/// Runs the delete `sql` with `batch` on `conn` until a batch deletes nothing: short statements
/// that never hold up the hot path for long. Returns how many rows went.
pub(crate) async fn delete_in_batches<DB: InboxBackend>(
    conn: &mut DB::Connection,
    sql: SqlStr,
    batch: DeleteBatch<'_>,
) -> Result<u64, sqlx::Error> {
    let mut deleted = 0;
    loop {
        let done = DB::delete_batch(&mut *conn, sql.clone(), batch).await?;
        match DB::rows_affected(&done) {
            0 => return Ok(deleted),
            n => deleted += n,
        }
    }
}
