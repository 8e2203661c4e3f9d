//! MySQL and MariaDB: the claim is `INSERT .. ON DUPLICATE KEY UPDATE dup_count = dup_count + 1`.
//! sqlx sets CLIENT_FOUND_ROWS, so rows_affected is 1 for a new row and 2 for a duplicate (an
//! `id = id` update would report 1 for both). Never `INSERT IGNORE`: it turns NOT NULL and
//! truncation errors into warnings.
//!
//! Inbox transactions run at READ COMMITTED. Under REPEATABLE READ (InnoDB's default) the
//! business statements take gap and next-key locks on ranges they scan, so concurrent handlers
//! deadlock far more often; the inbox needs no repeatable reads, since the unique key decides
//! (the isolation level is set with `START TRANSACTION`: `mysql/session.rs`).

use super::TableName;
use super::{Backend, Claimed, Cut, Server, ServerFacts};
use crate::layout::Layout;
use sqlx::{AssertSqlSafe, MySql, Pool, SqlSafeStr, SqlStr, Transaction};
use std::time::Duration;

mod session;
use session::{RESET_STATEMENT_TIME, begin_again};

mod outbox;

mod claims;
use claims::claimed;

mod version;
use version::Version;

impl Backend for MySql {
    const NAME: &'static str = "MySQL";
    const NOW_SQL: &'static str = "CURRENT_TIMESTAMP(6)";
    const INT64: &'static str = "SIGNED";
    // VARBINARY: valid UTF-8 (keys are strings), converted for decoding as one.
    const KEY_TEXT: &'static str = "CONVERT(message_key USING utf8mb4)";

    const VERSION_SQL: Option<&'static str> = Some("SELECT VERSION()");
    const BYTE_LENGTH: &'static str = "LENGTH";

    // The COMMIT first, as in `begin_sql`: a pooled connection is never inside a transaction of
    // its own when taken for a lease statement, but one a cut BEGIN left (a two-phase claim's,
    // begun from the pool, where the driver does not count it) would keep the lease's renewal
    // or release uncommitted, and its row lock held, until that connection's next BEGIN.
    const UTC_SESSION: Option<(&'static str, &'static str)> = Some((
        "COMMIT; SET @inbox_time_zone = @@session.time_zone, @@session.time_zone = '+00:00'",
        "SET @@session.time_zone = @inbox_time_zone",
    ));

    fn relay_unsupported(version: &str) -> Option<String> {
        version::relay_unsupported(version)
    }

    fn secs_from_now_sql(param: &str) -> String {
        format!("CURRENT_TIMESTAMP(6) + INTERVAL CAST({param} * 1000000 AS SIGNED) MICROSECOND")
    }

    fn ms_until_sql(column: &str) -> String {
        format!(
            "CAST(TIMESTAMPDIFF(MICROSECOND, CURRENT_TIMESTAMP(6), {column}) DIV 1000 AS SIGNED)"
        )
    }

    fn claim_sql(table: &TableName, _layout: &Layout) -> SqlStr {
        AssertSqlSafe(format!(
            "INSERT INTO {table} (consumer, message_key) VALUES (?, ?) \
             ON DUPLICATE KEY UPDATE dup_count = dup_count + 1"
        ))
        .into_sql_str()
    }

    fn claim_finished_sql(table: &TableName, _layout: &Layout) -> Option<SqlStr> {
        Some(
            AssertSqlSafe(format!(
                "INSERT INTO {table} (consumer, message_key, processed_at, payload_hash) \
                 VALUES (?, ?, {}, ?) ON DUPLICATE KEY UPDATE dup_count = dup_count + 1",
                Self::NOW_SQL
            ))
            .into_sql_str(),
        )
    }

    fn claim_in_begin_sql(
        table: &TableName,
        server: Server,
        consumer: &str,
        key: &str,
        hash: Option<&str>,
    ) -> Option<String> {
        claims::claim_in_begin(table, server, consumer, key, hash)
    }

    fn begun_marker_sql(table: &TableName) -> Option<SqlStr> {
        Some(
            AssertSqlSafe(format!(
                "SELECT id FROM {table} WHERE consumer = ? AND message_key = ? \
                 AND id = @inbox_marker"
            ))
            .into_sql_str(),
        )
    }

    fn is_duplicate_claim(err: &dyn sqlx::error::DatabaseError) -> bool {
        // 1062 ER_DUP_ENTRY: the UNIQUE (consumer, message_key) has the key.
        err.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|e| e.number() == 1062)
    }

    fn rows_affected(done: &sqlx::mysql::MySqlQueryResult) -> u64 {
        done.rows_affected()
    }

    fn migration_sql(table: &TableName, _layout: &Layout) -> Vec<String> {
        // Binary collation: keys "A" and "a" are different messages.
        let create = format!(
            "CREATE TABLE IF NOT EXISTS {table} (
                id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
                consumer VARCHAR(200) NOT NULL,
                message_key VARCHAR(255) NOT NULL,
                received_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
                processed_at TIMESTAMP(6) NULL,
                lease_until TIMESTAMP(6) NULL,
                fence BIGINT NOT NULL DEFAULT 0,
                attempts INT NOT NULL DEFAULT 0,
                dup_count BIGINT NOT NULL DEFAULT 0,
                UNIQUE KEY {table}_consumer_key_uq (consumer, message_key),
                KEY {table}_received_at_idx (received_at)
            ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"
        );
        // Keys are exact bytes: `utf8mb4_bin` is a PAD SPACE collation, under which "k" and
        // "k " are one entry of the UNIQUE index, so the second message would be skipped as a
        // duplicate. VARBINARY compares bytes, on MySQL and MariaDB alike (MySQL has no
        // `utf8mb4_nopad_bin`). Idempotent, like every migration here: an interrupted run is
        // repaired by running it again.
        let exact_keys = format!("ALTER TABLE {table} MODIFY message_key VARBINARY(255) NOT NULL");
        // Dead letters that no stream would take on a message's last delivery, kept until the
        // worker can publish them.
        let dead_letters = format!(
            "CREATE TABLE IF NOT EXISTS {table}_dead_letters (
                id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
                consumer VARCHAR(200) NOT NULL,
                headers MEDIUMTEXT NOT NULL,
                payload LONGBLOB NOT NULL,
                stored_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
                KEY {table}_dl_idx (consumer, id)
            ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"
        );
        // A hash of each key's first payload (`delivery::payload_hash`), to tell key reuse.
        // Idempotent: MySQL has no ADD COLUMN IF NOT EXISTS.
        let name = table.to_string();
        let bare = name.rsplit('.').next().unwrap_or(&name);
        let payload_hash = format!(
            "SET @inbox_ddl = (SELECT IF(COUNT(*) = 0, \
                'ALTER TABLE {table} ADD COLUMN payload_hash VARCHAR(32) NULL', 'DO 0') \
                FROM information_schema.columns WHERE table_schema = DATABASE() \
                AND table_name = '{bare}' AND column_name = 'payload_hash'); \
             PREPARE inbox_ddl FROM @inbox_ddl; EXECUTE inbox_ddl; DEALLOCATE PREPARE inbox_ddl"
        );
        vec![create, exact_keys, dead_letters, payload_hash]
    }

    fn outbox_migration_sql(table: &TableName) -> Vec<String> {
        outbox::tables(table)
    }

    fn outbox_unversioned_sql(table: &TableName) -> Vec<String> {
        outbox::turn_table(table)
    }

    /// The turn row's lock, InnoDB's: let go with the transaction (or the session), so no path
    /// can leave it held, where `GET_LOCK`'s session lock outlives a transaction that ends
    /// without its `RELEASE_LOCK`. Without the row (deleted by hand) no lock is taken, and
    /// relays work side by side as they did before turns. On MariaDB (10.3+, the executable
    /// comment) the session's `idle_transaction_timeout` is a minute for the pass, as
    /// PostgreSQL's: a relay frozen or cut off mid-pass would hold the turn until TCP keepalive
    /// ended its session (hours); the server ends it once its transaction has been idle for a
    /// minute, and the next pass publishes its rows again, into the duplicate window.
    /// `RELAY_TURN_RESET` gives the setting back after the pass.
    fn relay_turn_sql(table: &TableName) -> Option<String> {
        Some(format!(
            "SET SESSION innodb_lock_wait_timeout = @@SESSION.innodb_lock_wait_timeout \
             /*M!100300 , idle_transaction_timeout = 60 */; \
             SELECT id FROM {table}_relay WHERE id = 1 FOR UPDATE"
        ))
    }

    const RELAY_TURN_RESET: Option<&'static str> = Some(
        "SET SESSION innodb_lock_wait_timeout = @@SESSION.innodb_lock_wait_timeout \
         /*M!100300 , idle_transaction_timeout = DEFAULT */",
    );

    fn is_undefined_table_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        // 1146 ER_NO_SUCH_TABLE.
        err.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|e| e.number() == 1146)
    }

    /// One row: `INSERT .. VALUES`, its payload read from the marker's row (NULL, refused by
    /// its NOT NULL, when there is none). An `INSERT .. SELECT` takes the table's AUTO-INC lock
    /// to the end of the statement (`innodb_autoinc_lock_mode` 1, MariaDB's default), which
    /// made concurrent transactions queue on it: `credit` with three processes fell from 0.90x
    /// to 0.64x and 0.72x of the hand-written consumer, MariaDB's CPU per message up by a third.
    fn insert_if_marked_sql(outbox: &TableName, inbox: &TableName, n: usize) -> SqlStr {
        if n != 1 {
            return super::held_sql::insert_if_marked_select::<MySql>(outbox, inbox, n);
        }
        AssertSqlSafe(format!(
            "INSERT INTO {outbox} (msg_id, subject, order_key, headers, payload) VALUES \
             (?, ?, ?, ?, (SELECT ? FROM {inbox} WHERE id = ? AND consumer = ? AND message_key = ?))"
        ))
        .into_sql_str()
    }

    /// MariaDB's (as `session_to_kill` learned the server): the payload is NULL unless `@@in_transaction` and `@@autocommit`. A
    /// deadlock or a lock wait's timeout that rolled the transaction back leaves the session
    /// out of any transaction (MariaDB 10.11: the handler's later statements commit on their
    /// own, and `@@in_transaction` stays 0), and with `autocommit` on only an explicit BEGIN
    /// opens one. With `autocommit` off (the handler's, or the server's setting), a statement
    /// after a rollback opens a transaction without one: the marker's lookup decides then. Not
    /// caught, where the lookup would be: a BEGIN of the handler's own after its transaction
    /// ended (raw transaction control in a handler, as its own COMMIT, voids the guarantee).
    /// Measured in turn against the subquery: MariaDB's CPU per message down by a tenth.
    /// Several rows (a batch's) go as one multi-row `VALUES`, strict for the statement:
    /// outside strict mode a NULL into a NOT NULL column of a multi-row insert is stored as
    /// `''` with a warning, where a one-row insert fails either way.
    fn insert_if_open_sql(outbox: &TableName, server: Server, n: usize) -> Option<SqlStr> {
        matches!(server, Server::MariaDb { .. }).then(|| {
            let row = "(?, ?, ?, ?, IF(@@in_transaction AND @@autocommit, ?, NULL))";
            let strict = match n {
                1 => "",
                _ => "SET STATEMENT sql_mode = 'STRICT_ALL_TABLES' FOR ",
            };
            AssertSqlSafe(format!(
                "{strict}INSERT INTO {outbox} (msg_id, subject, order_key, headers, payload) \
                 VALUES {}",
                vec![row; n.max(1)].join(", ")
            ))
            .into_sql_str()
        })
    }

    /// 1048: a row's payload was NULL (a one-row insert, or a strict multi-row one): no marker,
    /// or no transaction of the session's own.
    fn is_missing_marker(err: &sqlx::Error) -> bool {
        err.as_database_error()
            .and_then(|e| e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
            .is_some_and(|e| e.number() == 1048)
    }

    fn outbox_cleanup_sql(table: &TableName) -> SqlStr {
        AssertSqlSafe(format!(
            "DELETE FROM {table} WHERE sent_at IS NOT NULL \
             AND sent_at < CURRENT_TIMESTAMP(6) - INTERVAL CAST(? * 1000000 AS SIGNED) MICROSECOND \
             ORDER BY sent_at LIMIT ?"
        ))
        .into_sql_str()
    }

    // The failed row's id is its primary key; `id = id` changes nothing (never `INSERT
    // IGNORE`, which turns other errors into warnings).
    const KEEP_FIRST_FAILURE: &'static str = " ON DUPLICATE KEY UPDATE id = id";

    fn param(_: usize) -> String {
        "?".to_owned()
    }

    fn begin_sql(lock_timeout: Duration, statement_timeout: Option<Duration>) -> SqlStr {
        // The COMMIT first (a no-op outside a transaction) ends a transaction that a BEGIN cut
        // on the wire left on a pooled connection by a path that does not close such a
        // connection (`backend::Beginning`): whatever ran in it since meant to commit on its
        // own, and without it `SET TRANSACTION` would be refused (1568) for the connection's
        // life.
        let again = begin_again(lock_timeout, statement_timeout);
        AssertSqlSafe(format!("COMMIT; {again}")).into_sql_str()
    }

    fn begin_again_sql(
        lock_timeout: Duration,
        statement_timeout: Option<Duration>,
    ) -> Option<SqlStr> {
        Some(AssertSqlSafe(begin_again(lock_timeout, statement_timeout)).into_sql_str())
    }

    async fn session_to_kill<'a>(
        conn: &'a mut sqlx::MySqlConnection,
        facts: &'a ServerFacts,
    ) -> Result<Option<u64>, sqlx::Error> {
        // MariaDB bounds every statement by the deadline (`begin_sql`); MySQL has
        // no such bound, so a cut try's session is killed there, and each try first learns its
        // session's id (one round trip).
        match facts.cut() {
            Cut::NoDeadline | Cut::Bounded => Ok(None),
            Cut::Kill => {
                let id: i64 = sqlx::query_scalar("SELECT CAST(CONNECTION_ID() AS SIGNED)")
                    .fetch_one(conn)
                    .await?;
                Ok(Some(id as u64))
            }
            Cut::Unknown => {
                let (id, version): (i64, String) =
                    sqlx::query_as("SELECT CAST(CONNECTION_ID() AS SIGNED), VERSION()")
                        .fetch_one(conn)
                        .await?;
                facts.set(Version::parse(&version).server());
                match facts.cut() {
                    Cut::Kill => Ok(Some(id as u64)),
                    _ => Ok(None),
                }
            }
        }
    }

    async fn kill_session(pool: Pool<MySql>, id: u64) -> Result<(), sqlx::Error> {
        use sqlx::Connection;
        let mut conn = sqlx::MySqlConnection::connect_with(&pool.connect_options()).await?;
        // Only a session of the same user on the same database: after a server restart, the
        // id may have gone to another client's session.
        let ours: Option<i64> = sqlx::query_scalar(
            "SELECT CAST(ID AS SIGNED) FROM information_schema.PROCESSLIST \
             WHERE ID = ? AND USER = SUBSTRING_INDEX(USER(), '@', 1) AND DB <=> DATABASE()",
        )
        .bind(id)
        .fetch_optional(&mut conn)
        .await?;
        if ours.is_some() {
            let killed = sqlx::query(AssertSqlSafe(format!("KILL CONNECTION {id}")))
                .execute(&mut conn)
                .await;
            match killed {
                // 1094: no such session any more (it ended on its own meanwhile).
                Err(sqlx::Error::Database(e))
                    if e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
                        .is_some_and(|e| e.number() == 1094) => {}
                other => {
                    other?;
                }
            }
        }
        conn.close().await
    }

    fn is_timeout_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        // 1205 lock wait timeout (`innodb_lock_wait_timeout` for a row, `lock_wait_timeout`
        // for a table's metadata lock), 1969 `max_statement_time` exceeded (MariaDB), 3024
        // `max_execution_time` exceeded (MySQL).
        err.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|e| matches!(e.number(), 1205 | 1969 | 3024))
    }

    fn writable_probe_sql(table: &TableName) -> String {
        // The default DELETE of no row, waiting at most 1 s for the table's metadata lock (held
        // by `LOCK TABLES .. WRITE` or an `ALTER TABLE`): a timeout there (1205) is an answer,
        // since a read-only server or session refuses the DELETE before any lock wait. MariaDB
        // reads the executable comment, MySQL 8 the optimizer hint; each ignores the other's.
        format!(
            "/*M!100301 SET STATEMENT lock_wait_timeout = 1 FOR */ \
             DELETE /*+ SET_VAR(lock_wait_timeout = 1) */ FROM {table} WHERE 1 = 0"
        )
    }

    fn downcast_database_error<'e>(
        err: &'e (dyn std::error::Error + 'static),
    ) -> Option<&'e dyn sqlx::error::DatabaseError> {
        let err = err.downcast_ref::<sqlx::mysql::MySqlDatabaseError>()?;
        Some(err)
    }

    fn is_connection_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        // 1053 server shutdown, 1927 connection killed (MariaDB), 2006 gone away, 2013 lost
        // connection, 4031 idle timeout.
        err.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|e| matches!(e.number(), 1053 | 1927 | 2006 | 2013 | 4031))
    }

    fn is_read_only_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        // 1290 running with --read-only (or --super-read-only), 1792 a read-only transaction,
        // 1836 running in read-only mode.
        err.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|e| matches!(e.number(), 1290 | 1792 | 1836))
    }

    async fn claim<'a, 'c>(
        tx: &'a mut Transaction<'c, Self>,
        sql: SqlStr,
        consumer: &'a str,
        key: &'a str,
    ) -> Result<Claimed, sqlx::Error> {
        let done = sqlx::query(sql)
            .bind(consumer)
            .bind(key)
            .execute(&mut **tx)
            .await?;
        claimed(&done)
    }

    async fn claim_finished<'a, 'c>(
        tx: &'a mut Transaction<'c, Self>,
        sql: SqlStr,
        consumer: &'a str,
        key: &'a str,
        hash: Option<&'a str>,
    ) -> Result<Claimed, sqlx::Error> {
        let done = sqlx::query(sql)
            .bind(consumer)
            .bind(key)
            .bind(hash)
            .execute(&mut **tx)
            .await?;
        claimed(&done)
    }

    async fn claim_many<'a, 'c>(
        tx: &'a mut Transaction<'c, Self>,
        (table, _layout, server): (&'a TableName, &'a Layout, Server),
        claim: SqlStr,
        consumer: &'a str,
        keys: &'a [&'a str],
    ) -> Result<Vec<Claimed>, sqlx::Error> {
        claims::claim_many(tx, (table, server), claim, consumer, keys).await
    }

    fn is_data_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        // SQLSTATE class 22, data exception: invalid byte sequence or NUL in text (22021),
        // numeric value out of range (22003), string too long (22001), division by zero (22012).
        err.code().is_some_and(|c| c.starts_with("22"))
    }

    fn is_transient_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        // The error number, not the SQLSTATE (which is a coarse 40001 or HY000): 1213 deadlock,
        // 1205 lock wait timeout, 1040 too many connections, 1053 server shutdown, 1927
        // connection killed (MariaDB), 2006 gone away, 2013 lost connection, 4031 idle timeout.
        err.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|e| {
                matches!(
                    e.number(),
                    1213 | 1205 | 1040 | 1053 | 1927 | 2006 | 2013 | 4031
                )
            })
    }

    fn is_conflict_error(err: &dyn sqlx::error::DatabaseError) -> bool {
        // 1213 deadlock, 1205 lock wait timeout.
        err.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .is_some_and(|e| matches!(e.number(), 1213 | 1205))
    }

    fn cleanup_sql(table: &TableName) -> SqlStr {
        AssertSqlSafe(format!(
            "DELETE FROM {table} WHERE consumer = ? AND processed_at IS NOT NULL \
             AND received_at < CURRENT_TIMESTAMP(6) - INTERVAL CAST(? * 1000000 AS SIGNED) MICROSECOND \
             ORDER BY id LIMIT ?"
        ))
        .into_sql_str()
    }

    async fn fleet_lock<'a>(
        conn: &'a mut sqlx::MySqlConnection,
        name: &'a str,
        wait: Duration,
    ) -> Result<bool, sqlx::Error> {
        // MySQL refuses lock names over 64 characters (ours can reach 263): the SHA-256 in hex
        // is exactly 64, and the same for every instance. Lock names are server-wide, so the
        // database's name is part of it: inboxes of two databases on one server (two
        // applications, or two tests) must not take each other's lock. The wait is in seconds
        // (fractions allowed); never negative, which MariaDB takes for no wait at all.
        // The lock's wait, and the migrations or cleanup that follow on this connection, must
        // not be cut by a message's statement bound left on it (MariaDB).
        sqlx::query(RESET_STATEMENT_TIME)
            .execute(&mut *conn)
            .await?;
        let got: Option<i64> =
            sqlx::query_scalar("SELECT GET_LOCK(SHA2(CONCAT(DATABASE(), ?), 256), ?)")
                .bind(name)
                .bind(wait.as_secs_f64())
                .fetch_one(conn)
                .await?;
        Ok(got == Some(1))
    }

    async fn fleet_unlock<'a>(
        conn: &'a mut sqlx::MySqlConnection,
        name: &'a str,
    ) -> Result<(), sqlx::Error> {
        sqlx::query("DO RELEASE_LOCK(SHA2(CONCAT(DATABASE(), ?), 256))")
            .bind(name)
            .execute(conn)
            .await
            .map(|_| ())
    }
}
