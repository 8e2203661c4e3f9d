//! MySQL's claims: a marker's `INSERT .. ON DUPLICATE KEY UPDATE`, and on MariaDB 10.5+ a
//! batch's markers in one such statement, whose `RETURNING` tells the new ones.

use super::super::dialect::claim_each;
use super::super::{Claimed, Server, TableName};
use sqlx::{AssertSqlSafe, MySql, Row, SqlStr, Transaction};

/// The keys of one statement of a batch's claims, at most: 100 rows, as the batch's outbox
/// rows go.
const CHUNK: usize = 100;

/// What a claim's `INSERT .. ON DUPLICATE KEY UPDATE` answered: one row affected for a new
/// marker, two for a duplicate (whose `dup_count` it raised).
pub(super) fn claimed(done: &sqlx::mysql::MySqlQueryResult) -> Result<Claimed, sqlx::Error> {
    match done.rows_affected() {
        // A new row always has an AUTO_INCREMENT id; 0 would mark the wrong row processed.
        1 if done.last_insert_id() > 0 => Ok(Claimed::New(done.last_insert_id() as i64)),
        2 => Ok(Claimed::Duplicate),
        n => Err(sqlx::Error::Protocol(format!(
            "the inbox claim affected {n} rows (insert id {}); expected 1 (new) or 2 (duplicate)",
            done.last_insert_id()
        ))),
    }
}

/// A message's claim sent in its BEGIN's round trip (`Backend::claim_in_begin_sql`), on
/// MariaDB (where it was measured; Oracle MySQL keeps the BEGIN and the claim apart): a plain
/// `INSERT` of the marker, finished, whose duplicate key (1062) fails the BEGIN, then the new
/// row's id kept in `@inbox_marker` for `Backend::begun_marker_sql` (a handler's own inserts
/// change `LAST_INSERT_ID()`). The values are hex literals, as a batch's claims: the text is
/// new for every message and goes unprepared. Unlike `INSERT .. ON DUPLICATE KEY UPDATE`, a
/// plain insert waits for a shared lock on a row another transaction holds: should that one
/// roll back while two more wait, both may want the row and one fails with a deadlock, a
/// transient error its message is tried again for. A duplicate's `dup_count` is not raised,
/// as before: its transaction was rolled back.
pub(super) fn claim_in_begin(
    table: &TableName,
    server: Server,
    consumer: &str,
    key: &str,
    hash: Option<&str>,
) -> Option<String> {
    if !matches!(server, Server::MariaDb { .. }) {
        return None;
    }
    let hash = match hash {
        Some(hash) => format!("_utf8mb4 X'{}'", hex::encode(hash)),
        None => "NULL".to_owned(),
    };
    Some(format!(
        "INSERT INTO {table} (consumer, message_key, processed_at, payload_hash) \
         VALUES (_utf8mb4 X'{}', X'{}', CURRENT_TIMESTAMP(6), {hash}); \
         SET @inbox_marker = LAST_INSERT_ID()",
        hex::encode(consumer),
        hex::encode(key)
    ))
}

/// The claims of a batch's `keys`, in order: in one statement on MariaDB from 10.5 (as
/// `server` is known), else with `claim`, a marker's statement, per key.
pub(super) async fn claim_many(
    tx: &mut Transaction<'_, MySql>,
    (table, server): (&TableName, Server),
    claim: SqlStr,
    consumer: &str,
    keys: &[&str],
) -> Result<Vec<Claimed>, sqlx::Error> {
    match server {
        Server::MariaDb { returning: true } if keys.len() > 1 => {
            claim_many_mariadb(tx, table, consumer, keys).await
        }
        _ => claim_each(tx, claim, consumer, keys).await,
    }
}

/// The claims of a batch's `keys` (in order) on MariaDB: one multi-row insert per [`CHUNK`]
/// keys, whose `RETURNING` gives each row as the statement left it, in the order of its
/// `VALUES`. A new marker has `dup_count` 0; a duplicate's (a committed marker's, or an
/// earlier row's of the same statement) was just raised to 1 or more. As a marker's own claim,
/// a row another transaction holds makes the statement wait for that one.
///
/// The values are hex literals in the statement's text (the consumer's as UTF-8), sent
/// unprepared: each count of rows would be a statement of its own, for sqlx to prepare and
/// keep in its cache of 100 per connection, and a hex literal needs no escaping whatever the
/// session's `sql_mode`.
async fn claim_many_mariadb(
    tx: &mut Transaction<'_, MySql>,
    table: &TableName,
    consumer: &str,
    keys: &[&str],
) -> Result<Vec<Claimed>, sqlx::Error> {
    let consumer = hex::encode(consumer);
    let mut claims = Vec::with_capacity(keys.len());
    for chunk in keys.chunks(CHUNK) {
        let rows: Vec<String> = chunk
            .iter()
            .map(|key| format!("(_utf8mb4 X'{consumer}', X'{}')", hex::encode(key)))
            .collect();
        let sql = AssertSqlSafe(format!(
            "INSERT INTO {table} (consumer, message_key) VALUES {} \
             ON DUPLICATE KEY UPDATE dup_count = dup_count + 1 \
             RETURNING id, message_key, dup_count",
            rows.join(", ")
        ));
        let returned = sqlx::raw_sql(sql).fetch_all(&mut **tx).await?;
        if returned.len() != chunk.len() {
            return Err(unexpected(format!(
                "{} rows for {} keys",
                returned.len(),
                chunk.len()
            )));
        }
        for (row, key) in returned.iter().zip(chunk) {
            let (id, returned_key, dups): (i64, Vec<u8>, i64) =
                (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
            if returned_key != key.as_bytes() {
                return Err(unexpected(format!(
                    "a row of key {returned_key:?} for {key:?}"
                )));
            }
            claims.push(match dups {
                0 => Claimed::New(id),
                _ => Claimed::Duplicate,
            });
        }
    }
    Ok(claims)
}

/// A batch's claim statement returned what it cannot have: the batch is not trusted with it.
fn unexpected(what: String) -> sqlx::Error {
    sqlx::Error::Protocol(format!("the inbox's batch claim returned {what}"))
}
