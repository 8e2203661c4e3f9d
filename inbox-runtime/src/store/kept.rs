//! Connections a worker's tries keep from one message to the next, rather than giving each back
//! to the pool after its COMMIT: sqlx checks a released connection with a round trip of its own
//! (a `Sync` on PostgreSQL, `COM_PING` on MySQL, a call to SQLite's thread), on a task of its
//! own, before anyone may have it again: a round trip per message that a kept connection does not
//! pay.
//!
//! Only a try that ended cleanly (committed, or a duplicate rolled back) keeps its connection.
//! One unused for [`IDLE`] goes back to the pool (the worker's upkeep calls
//! [`Kept::release_idle`]), and every one when the worker stops, or when a try on a kept one
//! finds the database gone (the others are likely dead too). The worker's tries hold at most
//! `limit` connections at once, kept ones included: one fewer than the pool's size, so that at
//! least one goes round through the pool, where whoever else waits for a connection (the relay,
//! the cleanup, another worker, the handler's own queries) gets its turn.

use sqlx::Database;
use sqlx::pool::PoolConnection;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a kept connection may go unused before it goes back to the pool. Short: on
/// PostgreSQL it waits inside an empty transaction (no snapshot, no locks, but "idle in
/// transaction" to the server's `idle_in_transaction_session_timeout`).
pub(crate) const IDLE: Duration = Duration::from_secs(1);

/// The connections kept by one worker's tries, and how many they hold.
#[derive(Debug)]
pub(crate) struct Kept<DB: Database> {
    idle: Mutex<Vec<Idle<DB>>>,
    /// Connections held by the tries, kept ones included.
    held: Arc<AtomicUsize>,
    limit: usize,
}

/// A kept connection, unused since `since`.
#[derive(Debug)]
struct Idle<DB: Database> {
    conn: PoolConnection<DB>,
    /// Its session's id, where a cut try's session is killed (`Beginning::arm`).
    session: Option<u64>,
    since: Instant,
    /// Counted as held while kept.
    lease: Lease,
}

/// Counts a connection as held by the tries until dropped.
#[derive(Debug)]
pub(crate) struct Lease(Arc<AtomicUsize>);

impl Drop for Lease {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection for a try: a kept one, with its session's id, or none.
pub(crate) type Taken<DB> = (PoolConnection<DB>, Option<u64>, Lease);

impl<DB: Database> Kept<DB> {
    /// Keeps connections while the tries hold at most `limit`.
    pub(crate) fn new(limit: usize) -> Self {
        Kept {
            idle: Mutex::new(Vec::new()),
            held: Arc::new(AtomicUsize::new(0)),
            limit,
        }
    }

    /// The most recently kept connection, if any unused for less than [`IDLE`].
    pub(crate) fn take(&self) -> Option<Taken<DB>> {
        let mut stale = Vec::new();
        let taken = {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                match idle.pop() {
                    None => break None,
                    Some(i) if i.since.elapsed() >= IDLE => stale.push(i),
                    Some(i) => break Some((i.conn, i.session, i.lease)),
                }
            }
        };
        // Back to the pool outside the lock.
        drop(stale);
        taken
    }

    /// Counts a connection taken from the pool as held.
    pub(crate) fn lease(&self) -> Lease {
        self.held.fetch_add(1, Ordering::Relaxed);
        Lease(self.held.clone())
    }

    /// Keeps `conn` for the next try, unless the tries hold more than the limit: then it goes
    /// back to the pool.
    pub(crate) fn put(&self, conn: PoolConnection<DB>, session: Option<u64>, lease: Lease) {
        if self.held.load(Ordering::Relaxed) > self.limit {
            return;
        }
        let entry = Idle {
            conn,
            session,
            since: Instant::now(),
            lease,
        };
        self.idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(entry);
    }

    /// Gives back to the pool the connections unused for [`IDLE`] by `now`.
    pub(crate) fn release_idle(&self, now: Instant) {
        let stale: Vec<Idle<DB>> = {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            let (stale, fresh) = std::mem::take(&mut *idle)
                .into_iter()
                .partition(|i| now.saturating_duration_since(i.since) >= IDLE);
            *idle = fresh;
            stale
        };
        drop(stale);
    }

    /// Gives every kept connection back to the pool.
    pub(crate) fn release_all(&self) {
        let all = std::mem::take(&mut *self.idle.lock().unwrap_or_else(|e| e.into_inner()));
        drop(all);
    }

    /// How many connections are kept (unused) now.
    #[cfg(test)]
    pub(crate) fn kept(&self) -> usize {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// How many connections the tries hold, kept ones included.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;
    use sqlx::Sqlite;
    use sqlx::sqlite::SqlitePoolOptions;

    #[tokio::test]
    async fn kept_within_the_limit_and_given_back_once_idle() {
        let pool = SqlitePoolOptions::new()
            .max_connections(3)
            .connect("sqlite::memory:")
            .await
            .expect("an in-memory SQLite pool");
        let kept = Kept::<Sqlite>::new(2);
        // Three tries at once hold all three connections; the third back goes to the pool.
        let mut out = Vec::new();
        for _ in 0..3 {
            let lease = kept.lease();
            out.push((pool.acquire().await.unwrap(), lease));
        }
        assert_eq!(kept.held(), 3);
        for (conn, lease) in out {
            kept.put(conn, Some(7), lease);
        }
        assert_eq!((kept.kept(), kept.held()), (2, 2));
        // The tries take the kept ones, newest first, with their session's id.
        let (conn, session, lease) = kept.take().expect("a kept connection");
        assert_eq!((session, kept.kept(), kept.held()), (Some(7), 1, 2));
        kept.put(conn, session, lease);
        // Fresh ones stay; idle ones go back to the pool, where they are idle for everyone.
        kept.release_idle(Instant::now());
        assert_eq!(kept.kept(), 2);
        kept.release_idle(Instant::now() + IDLE);
        assert_eq!((kept.kept(), kept.held()), (0, 0));
        assert!(kept.take().is_none());
        // All of them go when the worker stops.
        let lease = kept.lease();
        kept.put(pool.acquire().await.unwrap(), None, lease);
        let lease = kept.lease();
        kept.put(pool.acquire().await.unwrap(), None, lease);
        kept.release_all();
        assert_eq!((kept.kept(), kept.held()), (0, 0));
        // Every connection is back: the pool closes.
        tokio::time::timeout(Duration::from_secs(30), pool.close())
            .await
            .expect("every connection back in the pool");
    }
}
