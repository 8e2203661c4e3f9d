//! The dialect trait: one database's inbox SQL and what behaves differently on it. Sealed (a
//! public trait in a private module): its SQL is an implementation detail, and a new backend is
//! added in this crate, where the conformance suite runs it (see CONTRIBUTING.md).

use super::begin::{Server, ServerFacts};
use super::held_sql::insert_if_marked_select;
use super::{Generic, GenericOutbox, TableName};
use crate::layout::{Layout, Partitions};
use sqlx::{Pool, SqlStr, Transaction};
use std::future::Future;
use std::time::Duration;

/// How relays side by side keep off each other's outbox rows: a capability of the backend, so
/// that the relay never asks which database it runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelayTurns {
    /// Each relay locks the rows it reads (`FOR UPDATE SKIP LOCKED`) for its transaction and
    /// passes over those another holds: relays work side by side.
    SkipLocked,
    /// The relay holding the lease in `<table>_relay` reads and publishes; the others wait
    /// their turn (a database whose writers hold one write lock, SQLite).
    Lease,
}

impl RelayTurns {
    /// What a relay's SELECT of pending rows ends with: locking them for its transaction and
    /// passing over those another relay holds, or nothing where the lease decides who reads
    /// (and the transaction holds the database's write lock).
    pub fn fetch_suffix(self) -> &'static str {
        match self {
            RelayTurns::SkipLocked => " FOR UPDATE SKIP LOCKED",
            RelayTurns::Lease => "",
        }
    }
}

/// The result of the claim statement (not the two-phase [`Claim`](crate::Claim) handle).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claimed {
    /// This transaction inserted the marker (row `id`): it owns the key until it commits or rolls
    /// back.
    New(i64),
    /// A committed marker for the key exists: the message is a duplicate.
    Duplicate,
}

/// One database's inbox SQL. Not public API: reachable only inside this crate.
pub trait Backend: sqlx::Database + Generic + GenericOutbox {
    /// The backend's name, for logs and errors.
    const NAME: &'static str;

    /// The current time as this dialect writes it into `processed_at`.
    const NOW_SQL: &'static str;

    /// The type an integer expression is CAST to so that it decodes as `i64`.
    const INT64: &'static str;

    /// What locks the rows a SELECT reads until the transaction ends (empty where the
    /// transaction holds the database's write lock already).
    const FOR_UPDATE: &'static str = " FOR UPDATE";

    /// The time `param` seconds (a float) from now, as the dialect stores timestamps.
    fn secs_from_now_sql(param: &str) -> String;

    /// The whole milliseconds from now until `column` (negative once it is past; NULL when
    /// it is NULL), as an integer expression.
    fn ms_until_sql(column: &str) -> String;

    /// `message_key` as text (MySQL stores it as bytes, compared exactly).
    const KEY_TEXT: &'static str = "message_key";

    /// The claim statement for `table` in `layout`. Binds: consumer, key. PostgreSQL and
    /// SQLite return the new row's id, or no row (or NULL) for a duplicate (the default
    /// [`Backend::claim`]). Only PostgreSQL is ever given [`Layout::Partitioned`].
    fn claim_sql(table: &TableName, layout: &Layout) -> SqlStr;

    /// The claim of a one-phase handler's message, whose marker is inserted finished
    /// (`processed_at` now, the payload's hash), so that no statement after the handler need
    /// write it: [`Backend::claim_sql`] binding the hash third, answering alike
    /// ([`Backend::claim_finished`]). `None` where the layout claims through a function that
    /// takes no hash (PostgreSQL's partitioned one): the claim, then `InboxStatements::finish`.
    fn claim_finished_sql(table: &TableName, layout: &Layout) -> Option<SqlStr>;

    /// The `n`th bind placeholder (from 1) in this dialect: `$1`, `?` or `?1`.
    fn param(n: usize) -> String;

    /// The migrations that create and evolve `table` in `layout`, in order.
    fn migration_sql(table: &TableName, layout: &Layout) -> Vec<String>;

    /// Deletes at most `?3` finished markers of consumer `?1` received more than `?2` seconds
    /// (a float) ago, oldest first. Never an open claim (`processed_at IS NULL`).
    fn cleanup_sql(table: &TableName) -> SqlStr;

    /// The rows a statement affected (sqlx has no generic accessor).
    fn rows_affected(done: &Self::QueryResult) -> u64;

    /// Whether a database error says the data itself is wrong (a value out of range, too
    /// long, not valid in its encoding): the same message fails the same way every time.
    fn is_data_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        let _ = err;
        false
    }

    /// Whether a database error says the connection or the server is gone (the server
    /// shutting down, the session killed, a connection failure): see
    /// `classify::is_outage`.
    fn is_connection_error(err: &dyn sqlx::error::DatabaseError) -> bool;

    /// A statement that changes nothing and fails, as a write would, where the database takes no
    /// writes (a standby, a read-only session), so that a probe tells read-only from up. By
    /// default a DELETE of no row of `table` (which waits behind a lock that excludes writers);
    /// PostgreSQL asks instead, and touches no table.
    fn writable_probe_sql(table: &TableName) -> String {
        format!("DELETE FROM {table} WHERE 1 = 0")
    }

    /// A write that changes nothing in `table` and waits at most about a second for a lock
    /// that excludes writers from it: fails where the database takes no writes, and fails
    /// (with a lock wait error) while a table lock keeps every message out of the inbox. What
    /// the circuit asks, unlike the health check's [`Backend::writable_probe_sql`]. By default
    /// the same statement.
    fn inbox_probe_sql(table: &TableName) -> String {
        Self::writable_probe_sql(table)
    }

    /// Where lease arithmetic follows the session's time zone (MySQL: `TIMESTAMP` values are
    /// converted to and from it, and a local time in the repeated hour of a DST change is
    /// ambiguous): the statements that put the session in UTC and back, run around every lease
    /// statement on a connection of the inbox's own.
    const UTC_SESSION: Option<(&'static str, &'static str)> = None;

    /// Whether a database error says the server takes no writes now (a standby during a
    /// failover, a server set read-only): every message would meet it, so it is an outage.
    fn is_read_only_error(err: &dyn sqlx::error::DatabaseError) -> bool;

    /// Whether a database error is transient (serialization failure, deadlock, lock timeout,
    /// busy, connection killed): the same message may succeed in a fresh transaction.
    fn is_transient_error(err: &dyn sqlx::error::DatabaseError) -> bool;

    /// Whether a database error is a conflict with another transaction (deadlock,
    /// serialization failure, lock wait timeout, busy): transient, and no statement's fault.
    fn is_conflict_error(err: &dyn sqlx::error::DatabaseError) -> bool;

    /// Whether a database error says a statement ran out of time: a lock wait that timed out
    /// (PostgreSQL 55P03, MySQL 1205), a statement cut by its bound, the worker's deadline
    /// (PostgreSQL 57014, MariaDB 1969). The lock may be a row's (a twin's claim, another
    /// transaction) or the whole table's (DDL, `LOCK TABLE`), which every message would meet;
    /// the worker then asks [`Backend::inbox_probe_sql`] which. `false` by default.
    fn is_timeout_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        let _ = err;
        false
    }

    /// Whether a BEGIN cut before its answer (its future dropped) may leave the server inside
    /// a transaction that sqlx does not track, so that the connection must be closed rather
    /// than put back (`backend::Beginning`): MySQL's driver (sqlx 0.9.1). PostgreSQL's rolls
    /// it back since 0.9.1, SQLite's always did. `true` by default.
    const CUT_BEGIN_LEAVES_TRANSACTION: bool = true;

    /// The statement that begins a message's transaction, waiting at most `lock_timeout`
    /// for any lock (a twin blocked behind a frozen peer's transaction must not wait for as
    /// long as TCP keepalive allows), and, given a `statement_timeout` (the worker's deadline),
    /// running no statement longer than that where the dialect can bound every statement: a
    /// try dropped at its deadline must not leave its statement running, holding its locks and
    /// its connection. SQLite runs in process; MySQL's `max_execution_time` bounds SELECTs
    /// only, so its statement bound is MariaDB's alone.
    fn begin_sql(lock_timeout: Duration, statement_timeout: Option<Duration>) -> SqlStr;

    /// The same BEGIN for a connection on which no transaction can be open: one kept from a try
    /// that ended cleanly, every BEGIN of it answered (`store/kept.rs`). It sets everything
    /// [`Backend::begin_sql`] sets, and leaves out only what guards against a transaction left
    /// open. `None` where [`Backend::begin_sql`] has nothing of the kind.
    fn begin_again_sql(
        _lock_timeout: Duration,
        _statement_timeout: Option<Duration>,
    ) -> Option<SqlStr> {
        None
    }

    /// Where [`Backend::begin_sql`] may not bound a server's statements (MySQL: the
    /// bound is MariaDB's alone), the id of `conn`'s session when the server `facts` tell of
    /// needs it killed should a try on `conn` be cut at its deadline (`backend::Beginning`,
    /// `backend::ArmedTx`); `None` where the statements end with their try. Asks the server
    /// which it is once, then records it in `facts` (with the [`Server`] the dialect's other
    /// statements are told). `None` by default, without a round trip.
    fn session_to_kill<'a>(
        conn: &'a mut Self::Connection,
        facts: &'a ServerFacts,
    ) -> impl Future<Output = Result<Option<u64>, sqlx::Error>> + Send + 'a {
        let _ = (conn, facts);
        std::future::ready(Ok(None))
    }

    /// Kills the session `id` (of a try cut at its deadline, [`Backend::session_to_kill`]),
    /// which ends its statement and rolls its transaction back, from a connection opened with
    /// `pool`'s options (the pool's own may all be taken). Only called where
    /// [`Backend::session_to_kill`] gave an id.
    fn kill_session(
        pool: Pool<Self>,
        id: u64,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'static {
        let _ = (pool, id);
        std::future::ready(Ok(()))
    }

    /// Begins the transaction a message is processed in with `sql` ([`Backend::begin_sql`]).
    fn begin(
        pool: &Pool<Self>,
        sql: SqlStr,
    ) -> impl Future<Output = Result<Transaction<'static, Self>, sqlx::Error>> + Send + '_ {
        pool.begin_with(sql)
    }

    /// Inserts the marker for (`consumer`, `key`) in `tx`, answering whether it was new. A
    /// concurrent transaction holding the same key makes this wait until that one finishes.
    fn claim<'a, 'c>(
        tx: &'a mut Transaction<'c, Self>,
        sql: SqlStr,
        consumer: &'a str,
        key: &'a str,
    ) -> impl Future<Output = Result<Claimed, sqlx::Error>> + Send + 'a {
        let row = Self::fetch_id(&mut **tx, sql, consumer, key);
        async move { Ok(row.await?.map_or(Claimed::Duplicate, Claimed::New)) }
    }

    /// [`Backend::claim`] with the statement of [`Backend::claim_finished_sql`], which binds
    /// the payload's `hash` after consumer and key.
    fn claim_finished<'a, 'c>(
        tx: &'a mut Transaction<'c, Self>,
        sql: SqlStr,
        consumer: &'a str,
        key: &'a str,
        hash: Option<&'a str>,
    ) -> impl Future<Output = Result<Claimed, sqlx::Error>> + Send + 'a {
        let row = Self::fetch_id_hashed(&mut **tx, sql, consumer, key, hash);
        async move { Ok(row.await?.map_or(Claimed::Duplicate, Claimed::New)) }
    }

    /// The marker's insert for `consumer`'s `key`, finished as [`Backend::claim_finished_sql`]
    /// inserts it, as statements sent after a message's BEGIN in the same round trip, where
    /// `server` takes them: the BEGIN claims the message. A duplicate fails that BEGIN
    /// ([`Backend::is_duplicate_claim`]) and leaves the server inside the transaction it began,
    /// which the caller ends; a new marker's id stays on the session, for
    /// [`Backend::begun_marker_sql`]. `None` (the default): the BEGIN, then the claim.
    fn claim_in_begin_sql(
        table: &TableName,
        server: Server,
        consumer: &str,
        key: &str,
        hash: Option<&str>,
    ) -> Option<String> {
        let _ = (table, server, consumer, key, hash);
        None
    }

    /// Binds consumer, key: the id of the marker the transaction's BEGIN inserted
    /// ([`Backend::claim_in_begin_sql`]), while the transaction holds it.
    fn begun_marker_sql(table: &TableName) -> Option<SqlStr> {
        let _ = table;
        None
    }

    /// Whether `err`, of a BEGIN that claims ([`Backend::claim_in_begin_sql`]), says the key
    /// has its marker already: a duplicate.
    fn is_duplicate_claim(err: &dyn sqlx::error::DatabaseError) -> bool {
        let _ = err;
        false
    }

    /// Claims every key of a batch (in the order given) in `tx`: per key, what
    /// [`Backend::claim`] would answer, a later copy of a key the batch claimed being a
    /// duplicate. By default a claim statement per key; a dialect that can tell new rows from
    /// duplicates in one statement overrides it (MySQL's only on a `server` known to be
    /// MariaDB 10.5 or later).
    fn claim_many<'a, 'c>(
        tx: &'a mut Transaction<'c, Self>,
        (table, layout, server): (&'a TableName, &'a Layout, Server),
        claim: SqlStr,
        consumer: &'a str,
        keys: &'a [&'a str],
    ) -> impl Future<Output = Result<Vec<Claimed>, sqlx::Error>> + Send + 'a {
        let _ = (table, layout, server);
        claim_each(tx, claim, consumer, keys)
    }

    /// Takes the fleet-wide lock `name` (a session lock: cleanups, migrations) on `conn`,
    /// waiting at most `wait` for another instance to release it (zero: not at all); `false`
    /// when another instance still holds it. The default suits a database with a single
    /// writer, whose cleanups and migrations serialise on its write lock anyway.
    fn fleet_lock<'a>(
        conn: &'a mut Self::Connection,
        name: &'a str,
        wait: Duration,
    ) -> impl Future<Output = Result<bool, sqlx::Error>> + Send + 'a {
        let _ = (conn, name, wait);
        std::future::ready(Ok(true))
    }

    /// Releases the lock taken by [`Backend::fleet_lock`].
    fn fleet_unlock<'a>(
        conn: &'a mut Self::Connection,
        name: &'a str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a {
        let _ = (conn, name);
        std::future::ready(Ok(()))
    }

    /// Partitioned layout: creates the partitions of `table` from the current one to
    /// `partitions.ahead` beyond it that do not exist yet, one instance at a time; returns
    /// how many it created. Only a dialect that has the layout overrides it.
    fn add_partitions<'a>(
        conn: &'a mut Self::Connection,
        table: &'a TableName,
        partitions: &'a Partitions,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a {
        let _ = (conn, table, partitions);
        std::future::ready(Ok(0))
    }

    /// Partitioned layout, on a connection holding the cleanup lock: removes `consumer`'s
    /// finished markers in the partitions whose whole range is more than `older_than_secs`
    /// old, by dropping the partition when nothing else is in it (no open claim, no other
    /// consumer's marker), else by deleting them in batches of `batch`. Returns how many
    /// markers went.
    fn drop_partitions<'a>(
        conn: &'a mut Self::Connection,
        table: &'a TableName,
        consumer: &'a str,
        older_than_secs: f64,
        batch: i64,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a {
        let _ = (conn, table, consumer, older_than_secs, batch);
        std::future::ready(Ok(0))
    }

    /// `err` as this backend's database error, when it is one: a handler's error that wraps
    /// a `sqlx::Error` transparently (`#[error(transparent)]`) shows, as its source, the
    /// database error inside it rather than the `sqlx::Error`.
    fn downcast_database_error<'e>(
        err: &'e (dyn std::error::Error + 'static),
    ) -> Option<&'e dyn sqlx::error::DatabaseError>;

    /// The outbox (`outbox.rs`): the migrations that create `table` and its indexes.
    fn outbox_migration_sql(table: &TableName) -> Vec<String>;

    /// The outbox: idempotent statements `Outbox::migrate` runs after the migrations, every
    /// time, for what must not be a migration step (an earlier version's instance refuses a
    /// database with a step it does not know). None by default.
    fn outbox_unversioned_sql(table: &TableName) -> Vec<String> {
        let _ = table;
        Vec::new()
    }

    /// The outbox: how relays side by side keep off each other's rows; also what a relay's
    /// SELECT of pending rows ends with ([`RelayTurns::fetch_suffix`]).
    const RELAY_TURNS: RelayTurns = RelayTurns::SkipLocked;

    /// The outbox, where relays lock rows ([`RelayTurns::SkipLocked`]): the statement that
    /// takes the relays' turn for the rest of a pass's transaction, waiting for it as long as
    /// the pass's BEGIN lets a lock wait. One relay at a time reads and publishes: side by side,
    /// half of what each locked waited behind the other relays' rows of the same keys, and every
    /// pass paid for its reads and the `heads` query all the same. `None`: relays do not take
    /// turns this way.
    fn relay_turn_sql(table: &TableName) -> Option<String> {
        let _ = table;
        None
    }

    /// What gives a pass's connection back the session setting [`Backend::relay_turn_sql`]
    /// changed for the pass (MariaDB's bound on a transaction left idle), run once its
    /// transaction has ended; a connection it did not run on is closed rather than put back in
    /// the pool (`Beginning::taint`). `None`: the turn changes nothing of the session.
    const RELAY_TURN_RESET: Option<&'static str> = None;

    /// Whether a database error says a table does not exist (MySQL: an outbox whose
    /// `Outbox::migrate` of this version has not run yet). Only where a failed statement leaves
    /// the transaction usable: `false` by default.
    fn is_undefined_table_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        let _ = err;
        false
    }

    /// What an INSERT into the outbox's table of failed rows ends with, so that a row recorded
    /// as failed already (by a relay whose SQLite lease ran out mid-pass, and the relay that
    /// took it over) is left as it is rather than failing the pass.
    const KEEP_FIRST_FAILURE: &'static str = " ON CONFLICT (id) DO NOTHING";

    /// The function that gives the length in bytes of a text or binary value.
    const BYTE_LENGTH: &'static str = "octet_length";

    /// The statement that reads the server's version, where [`Backend::relay_unsupported`]
    /// needs it.
    const VERSION_SQL: Option<&'static str> = None;

    /// Why a relay cannot run on a server of `version` (what [`Backend::VERSION_SQL`]
    /// answered), if it cannot: a server without `FOR UPDATE SKIP LOCKED`, where every pass
    /// would fail with a syntax error.
    fn relay_unsupported(_version: &str) -> Option<String> {
        None
    }

    /// The outbox: deletes at most `?2` rows of `table` sent more than `?1` seconds (a float)
    /// ago, oldest first.
    fn outbox_cleanup_sql(table: &TableName) -> SqlStr;

    /// `n` rows into `outbox`, each bound as (msg id, subject, order key, headers, payload, then
    /// the marker's id, consumer and key), inserted in their order if the marker is found in
    /// `inbox` (see `store/held.rs`); none otherwise, or the statement fails with an error
    /// [`Backend::is_missing_marker`] tells.
    fn insert_if_marked_sql(outbox: &TableName, inbox: &TableName, n: usize) -> SqlStr {
        insert_if_marked_select::<Self>(outbox, inbox, n)
    }

    /// Inserts `rows` (one statement, one outbox table) into `outbox`, in their order, if the
    /// marker `(id, consumer, key)` is in `inbox`; none otherwise (or the statement fails with
    /// an error [`Backend::is_missing_marker`] tells). By default the statement of
    /// [`Backend::insert_if_marked_sql`]; a dialect that binds a batch's rows as arrays
    /// overrides it, so that every batch runs one statement text, read and planned once, that
    /// looks the marker up once.
    fn insert_held<'a>(
        conn: &'a mut Self::Connection,
        (outbox, inbox): (&TableName, &TableName),
        rows: &'a [super::NewOutboxRow<'a>],
        marker: (i64, &'a str, &'a str),
    ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a {
        let sql = Self::insert_if_marked_sql(outbox, inbox, rows.len());
        Self::outbox_insert(conn, sql, rows, Some(marker))
    }

    /// Sets `processed_at` on a batch's markers `ids` of `table`, and each one's payload hash
    /// where `hashes` has one. By default the ids and hashes are written into the statement,
    /// run unprepared (its text changes with every batch); a dialect that binds arrays
    /// overrides this and the two below, so that one text is read and planned once.
    fn finish_many<'a>(
        conn: &'a mut Self::Connection,
        table: &TableName,
        ids: &'a [i64],
        hashes: &'a [Option<&'a str>],
    ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a {
        Self::execute_raw(conn, super::finish_many_sql::<Self>(table, ids, hashes))
    }

    /// The outbox: marks the rows `ids` of `table` sent.
    fn mark_sent<'a>(
        conn: &'a mut Self::Connection,
        table: &TableName,
        ids: &'a [i64],
    ) -> impl Future<Output = Result<Self::QueryResult, sqlx::Error>> + Send + 'a {
        Self::execute_raw(conn, super::stamp_ids_sql::<Self>(table, "sent_at", ids))
    }

    /// The outbox: the rows `ids` of `table` (which a pass has locked), in id order.
    fn outbox_rows_of<'a>(
        conn: &'a mut Self::Connection,
        table: &TableName,
        ids: &'a [i64],
    ) -> impl Future<Output = Result<Vec<super::OutboxRow>, sqlx::Error>> + Send + 'a {
        Self::outbox_rows(conn, super::outbox_rows_sql(table, ids))
    }

    /// `n` rows into `outbox`, each bound as (msg id, subject, order key, headers, payload),
    /// inserted in their order only while the session is still in a transaction it began
    /// itself, checked by the server from the session's state without reading the marker;
    /// else the statement fails with an error [`Backend::is_missing_marker`] tells, and
    /// [`Backend::insert_held`] decides. `None` where the `server`, as far as known, has no
    /// such check (the default). A marker's check costs its server a subquery's planning per
    /// message; this one, an expression.
    fn insert_if_open_sql(_outbox: &TableName, _server: Server, _n: usize) -> Option<SqlStr> {
        None
    }

    /// Whether `err`, of a [`Backend::insert_if_marked_sql`] or
    /// [`Backend::insert_if_open_sql`] statement, says the marker is missing (or, of the
    /// latter, that the session is not in a transaction of its own).
    fn is_missing_marker(_err: &sqlx::Error) -> bool {
        false
    }
}

/// The claims of a batch's `keys` in `tx`, in their order, with `claim` ([`Backend::claim`]'s
/// statement) per key: [`Backend::claim_many`]'s default, and MySQL's where the server cannot
/// claim them in one statement.
pub(crate) async fn claim_each<DB: Backend>(
    tx: &mut Transaction<'_, DB>,
    claim: SqlStr,
    consumer: &str,
    keys: &[&str],
) -> Result<Vec<Claimed>, sqlx::Error> {
    let mut claims = Vec::with_capacity(keys.len());
    for key in keys {
        claims.push(DB::claim(tx, claim.clone(), consumer, key).await?);
    }
    Ok(claims)
}
