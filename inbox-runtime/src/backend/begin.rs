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
//!
//! A try cut at its deadline while a statement runs leaves that statement running on the server,
//! holding its locks, unless a bound ends it there (`Backend::begin_sql`). Where no
//! bound exists (MySQL; MariaDB has one), the try's connection is [armed](Beginning::arm) with its
//! session's id, and dropping it before [`Beginning::settle`] kills that session from a connection
//! of its own (`Backend::kill_session`) before the connection is let go. A two-phase claim's
//! transaction, begun from the pool and held by the handler between its calls, is an
//! [`ArmedTx`], killed the same way if dropped before it is ended.

use super::{Backend, Begin};
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, Pool, SqlSafeStr, SqlStr, Transaction};
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

/// How long killing a cut try's session may take (connecting included) before it is given up.
const KILL_WAIT: Duration = Duration::from_secs(10);

/// A pooled connection that leaves the pool, closed, if it is dropped while a BEGIN on it had
/// not been answered, or, [armed](Beginning::arm), before its try [settled](Beginning::settle).
#[derive(Debug)]
pub(crate) struct Beginning<DB: Backend> {
    /// `None` only once dropped.
    conn: Option<PoolConnection<DB>>,
    /// Set from the BEGIN's sending to its answer.
    unanswered: bool,
    /// The session to kill if the try is cut: the pool to connect with and the session's id.
    kill: Option<(Pool<DB>, u64)>,
    /// The session's id it was armed with, kept once settled: a connection kept for another try
    /// is armed again with it, without asking the server.
    session: Option<u64>,
    /// A connection kept from a try that ended cleanly, every BEGIN of it answered: no
    /// transaction is open on it, and its first BEGIN may leave out what guards against one
    /// (`Begin::again`).
    kept: bool,
    /// Its session carries a setting the pool must not hand on ([`Beginning::taint`]).
    tainted: bool,
}

/// What the tries of one worker's inbox know of their server: whether a try cut at its deadline
/// must have its session killed, and which server it is where a backend's statements differ
/// (MariaDB's from MySQL's). Not known until a backend that needs it (MySQL's) has asked its
/// server, at the first try. Shared by the tries of one worker's inbox. One value for both, so
/// that no try reads one fact without the other: on MySQL the cut follows from the server.
#[derive(Debug, Default)]
pub struct ServerFacts(AtomicU8);

/// Whether a try cut at its deadline ends its statements ([`ServerFacts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// No deadline cuts the tries (an inbox used without a worker).
    NoDeadline,
    /// A deadline cuts them; whether their statements end with them is not known yet.
    Unknown,
    /// Their statements end with them (the server bounds every statement).
    Bounded,
    /// Their sessions must be killed.
    Kill,
}

/// Which server the tries talk to ([`ServerFacts`]), told apart only where a backend's
/// statements differ; `Unknown` on PostgreSQL and SQLite, and on MySQL until asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    /// Not asked (or nothing to tell): statements every server of the backend takes.
    Unknown,
    /// Oracle MySQL (or a server whose tries are forced to be killed, `kill_cut_sessions`:
    /// treated as MySQL).
    MySql,
    /// MariaDB; `returning`: 10.5 or later, with `INSERT .. RETURNING`.
    MariaDb {
        /// Whether the server has `INSERT .. RETURNING` (MariaDB 10.5 on).
        returning: bool,
    },
}

/// The values of [`ServerFacts`]: before the server answered, then what it answered.
const NO_DEADLINE: u8 = 0;
const UNKNOWN: u8 = 1;
const MYSQL: u8 = 2;
const MARIADB: u8 = 3;
const MARIADB_RETURNING: u8 = 4;

impl ServerFacts {
    /// Tries that a deadline cuts, on a server not asked yet.
    pub(crate) fn deadline() -> Self {
        ServerFacts(AtomicU8::new(UNKNOWN))
    }

    /// Whether a cut try ends its statements, as far as known: MariaDB bounds every statement,
    /// MySQL's sessions are killed.
    pub(crate) fn cut(&self) -> Cut {
        match self.0.load(Ordering::Relaxed) {
            NO_DEADLINE => Cut::NoDeadline,
            UNKNOWN => Cut::Unknown,
            MYSQL => Cut::Kill,
            _ => Cut::Bounded,
        }
    }

    /// Which server it is, as far as known.
    pub(crate) fn server(&self) -> Server {
        match self.0.load(Ordering::Relaxed) {
            NO_DEADLINE | UNKNOWN => Server::Unknown,
            MYSQL => Server::MySql,
            MARIADB => Server::MariaDb { returning: false },
            _ => Server::MariaDb { returning: true },
        }
    }

    /// Records the server's answer (or what a test forces: `Server::MySql`, its sessions
    /// killed).
    #[cfg_attr(
        not(any(feature = "mysql", feature = "test-util")),
        allow(dead_code, reason = "only MySQL's server and tests tell")
    )]
    pub(crate) fn set(&self, server: Server) {
        let value = match server {
            Server::Unknown => UNKNOWN,
            Server::MySql => MYSQL,
            Server::MariaDb { returning: false } => MARIADB,
            Server::MariaDb { returning: true } => MARIADB_RETURNING,
        };
        self.0.store(value, Ordering::Relaxed);
    }
}

impl<DB: Backend> Beginning<DB> {
    pub(crate) fn new(conn: PoolConnection<DB>) -> Self {
        Beginning {
            conn: Some(conn),
            unanswered: false,
            kill: None,
            session: None,
            kept: false,
            tainted: false,
        }
    }

    /// Its session is about to carry a setting of its own (a relay pass's bound on an idle
    /// transaction), or may be inside a transaction sqlx does not count (a claiming BEGIN
    /// refused, [`Beginning::begin_then`]): closed rather than put back in the pool if dropped
    /// before [`Beginning::untaint`], once the setting was given back or the transaction ended.
    pub(crate) fn taint(&mut self) {
        self.tainted = true;
    }

    /// Its session's setting was given back ([`Beginning::taint`]).
    pub(crate) fn untaint(&mut self) {
        self.tainted = false;
    }

    /// A connection kept from a try that ended cleanly, [settled](Beginning::into_settled): its
    /// first BEGIN is `Begin::again` (see [`Beginning::begin_with`]).
    pub(crate) fn kept(conn: PoolConnection<DB>) -> Self {
        let mut conn = Self::new(conn);
        conn.kept = true;
        conn
    }

    /// Kills the session `id` (this connection's, on the server) from a connection of `pool`'s
    /// options if this is dropped before [`Beginning::settle`].
    pub(crate) fn arm(&mut self, pool: &Pool<DB>, id: u64) {
        self.kill = Some((pool.clone(), id));
        self.session = Some(id);
    }

    /// The try on this connection ended (whichever way) rather than being cut: nothing of it
    /// runs on the server any more.
    pub(crate) fn settle(&mut self) {
        self.kill = None;
    }

    /// The connection and the session id it was [armed](Beginning::arm) with, if nothing of a
    /// try on it can still run on the server: every BEGIN answered, and the try
    /// [settled](Beginning::settle). `None`: it is let go as on drop.
    pub(crate) fn into_settled(mut self) -> Option<(PoolConnection<DB>, Option<u64>)> {
        if self.unanswered || self.tainted || self.kill.is_some() {
            return None;
        }
        self.conn.take().map(|conn| (conn, self.session))
    }

    /// Begins a transaction on the connection with `begin`, as `sqlx::Connection::begin_with`:
    /// the first BEGIN on a [kept](Beginning::kept) connection with its shorter form
    /// (`Begin::again`, where the dialect has one), every other with the whole.
    pub(crate) async fn begin_with(
        &mut self,
        begin: &Begin,
    ) -> Result<Transaction<'_, DB>, sqlx::Error> {
        let sql = self.begin_sql(begin).clone();
        let Beginning {
            conn, unanswered, ..
        } = self;
        Self::begin_on(conn, unanswered, Some(sql)).await
    }

    /// [`Beginning::begin_with`], with `then` (statements of the dialect's,
    /// `Backend::claim_in_begin_sql`) sent after the BEGIN in its round trip. An error may
    /// come from `then`, after the BEGIN began a transaction that sqlx does not count: the
    /// connection is then [tainted](Beginning::taint), and the caller ends that transaction
    /// (and [untaints](Beginning::untaint) it once ended).
    pub(crate) async fn begin_then(
        &mut self,
        begin: &Begin,
        then: &str,
    ) -> Result<Transaction<'_, DB>, sqlx::Error> {
        let sql = format!("{}; {then}", self.begin_sql(begin).as_str());
        let Beginning {
            conn,
            unanswered,
            tainted,
            ..
        } = self;
        let begun = Self::begin_on(conn, unanswered, Some(AssertSqlSafe(sql).into_sql_str())).await;
        // Refused after the BEGIN may have begun: tainted until the caller ended that.
        *tainted |= begun.is_err();
        begun
    }

    /// `begin`'s statement for this connection: the shorter on a [kept](Beginning::kept) one,
    /// the first time.
    fn begin_sql<'b>(&mut self, begin: &'b Begin) -> &'b SqlStr {
        match (std::mem::take(&mut self.kept), &begin.again) {
            (true, Some(again)) => again,
            _ => &begin.sql,
        }
    }

    /// Begins a transaction on the connection, as `sqlx::Connection::begin`.
    pub(crate) async fn begin(&mut self) -> Result<Transaction<'_, DB>, sqlx::Error> {
        self.kept = false;
        let Beginning {
            conn, unanswered, ..
        } = self;
        Self::begin_on(conn, unanswered, None).await
    }

    /// Begins with `sql`, or sqlx's own BEGIN, marked unanswered until the answer is read.
    async fn begin_on<'c>(
        conn: &'c mut Option<PoolConnection<DB>>,
        unanswered: &mut bool,
        sql: Option<SqlStr>,
    ) -> Result<Transaction<'c, DB>, sqlx::Error> {
        let conn = conn
            .as_mut()
            .expect("a Beginning's connection until it is dropped");
        *unanswered = DB::CUT_BEGIN_LEAVES_TRANSACTION;
        let tx = match sql {
            Some(sql) => sqlx::Connection::begin_with(&mut **conn, sql).await,
            None => sqlx::Connection::begin(&mut **conn).await,
        };
        // Answered (begun or refused): sqlx knows the connection's state again, but for a
        // refusal of statements sent after the BEGIN (`begin_then`, which taints it).
        *unanswered = false;
        tx
    }
}

impl<DB: Backend> Deref for Beginning<DB> {
    type Target = PoolConnection<DB>;

    fn deref(&self) -> &PoolConnection<DB> {
        self.conn
            .as_ref()
            .expect("a Beginning's connection until it is dropped")
    }
}

impl<DB: Backend> DerefMut for Beginning<DB> {
    fn deref_mut(&mut self) -> &mut PoolConnection<DB> {
        self.conn
            .as_mut()
            .expect("a Beginning's connection until it is dropped")
    }
}

impl<DB: Backend> Drop for Beginning<DB> {
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        if self.unanswered || self.tainted {
            conn.close_on_drop();
        }
        let Some(kill) = self.kill.take() else {
            return;
        };
        // Cut: the session may still run a statement (a lock wait, a long write), holding its
        // locks. Killed (which rolls its transaction back) before its connection is let go,
        // closed: the pool must not hand it out while the kill is on its way.
        conn.close_on_drop();
        kill_then_drop(kill, conn);
    }
}

/// A transaction begun from the pool (a two-phase claim's, which the handler holds between its
/// calls) whose session is killed, like an [armed](Beginning::arm) [`Beginning`]'s, if it is
/// dropped before it is ended ([`ArmedTx::into_inner`], [`ArmedTx::rollback`]): a try cut at its
/// deadline, or abandoned by a panic or a lost lease, where the server bounds no statement by the
/// deadline (MySQL).
///
/// Unlike a [`Beginning`]'s, its connection cannot be marked to close: it goes back to the pool
/// dead once the kill is done, and is closed there; should the kill fail (or time out), it goes
/// back as it is once its statement ends, its transaction rolled back.
#[derive(Debug)]
pub(crate) struct ArmedTx<DB: Backend> {
    /// `None` only once dropped.
    tx: Option<Transaction<'static, DB>>,
    /// The session to kill if the try is cut.
    kill: Option<(Pool<DB>, u64)>,
}

impl<DB: Backend> ArmedTx<DB> {
    /// Begins a transaction on `pool` with `sql`, armed if `facts` say that a cut try's
    /// session must be killed (asking the server the first time).
    pub(crate) async fn begin(
        pool: &Pool<DB>,
        sql: SqlStr,
        facts: &ServerFacts,
    ) -> Result<Self, sqlx::Error> {
        let mut tx = DB::begin(pool, sql).await?;
        let id = DB::session_to_kill(&mut *tx, facts).await?;
        Ok(ArmedTx {
            tx: Some(tx),
            kill: id.map(|id| (pool.clone(), id)),
        })
    }

    /// The transaction, to commit: the try settled (ended rather than cut), its session is no
    /// longer killed. A COMMIT cut on its way is not killed either: whether it committed is for
    /// the marker to tell.
    pub(crate) fn into_inner(mut self) -> Transaction<'static, DB> {
        self.kill = None;
        self.tx
            .take()
            .expect("an ArmedTx's transaction until it is dropped")
    }

    /// Rolls the transaction back, still killing its session if this is cut before the ROLLBACK
    /// is answered: a handler that returned an error may have left a statement of its own running
    /// (one it stopped waiting for), which the ROLLBACK waits behind.
    pub(crate) async fn rollback(mut self) -> Result<(), sqlx::Error> {
        let tx = self
            .tx
            .take()
            .expect("an ArmedTx's transaction until it is dropped");
        let mut pending = KillOnDrop(self.kill.take());
        let rolled_back = tx.rollback().await;
        pending.0 = None;
        rolled_back
    }
}

/// Kills a session if dropped while it holds one, holding nothing itself: what was cut goes back
/// to the pool meanwhile, and is closed there once the kill lands.
struct KillOnDrop<DB: Backend>(Option<(Pool<DB>, u64)>);

impl<DB: Backend> Drop for KillOnDrop<DB> {
    fn drop(&mut self) {
        if let Some(kill) = self.0.take() {
            kill_then_drop(kill, ());
        }
    }
}

impl<DB: Backend> Deref for ArmedTx<DB> {
    type Target = Transaction<'static, DB>;

    fn deref(&self) -> &Transaction<'static, DB> {
        self.tx
            .as_ref()
            .expect("an ArmedTx's transaction until it is dropped")
    }
}

impl<DB: Backend> DerefMut for ArmedTx<DB> {
    fn deref_mut(&mut self) -> &mut Transaction<'static, DB> {
        self.tx
            .as_mut()
            .expect("an ArmedTx's transaction until it is dropped")
    }
}

impl<DB: Backend> Drop for ArmedTx<DB> {
    fn drop(&mut self) {
        let (Some(tx), Some(kill)) = (self.tx.take(), self.kill.take()) else {
            return;
        };
        // The transaction (and so its connection) is held until the kill is done: its
        // connection goes back to the pool dead, and is closed there.
        kill_then_drop(kill, tx);
    }
}

/// Kills session `id` from a connection of `pool`'s options, on a task of its own, and only then
/// drops `held` (the cut try's connection or transaction). A kill that times out after its
/// request was sent may still land later, on whoever holds that session then: a lost connection
/// to them, which they retry.
fn kill_then_drop<DB: Backend, T: Send + 'static>((pool, id): (Pool<DB>, u64), held: T) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        match tokio::time::timeout(KILL_WAIT, DB::kill_session(pool, id)).await {
            Ok(Ok(())) => tracing::debug!(session = id, "killed the session of a cut try"),
            Ok(Err(e)) => tracing::warn!(
                session = id,
                error = %e,
                "could not kill the session of a try cut at its deadline; its statement runs until the server ends it"
            ),
            Err(_) => tracing::warn!(
                session = id,
                "killing the session of a try cut at its deadline took longer than {KILL_WAIT:?}; its statement runs until the server ends it"
            ),
        }
        drop(held);
    });
}
