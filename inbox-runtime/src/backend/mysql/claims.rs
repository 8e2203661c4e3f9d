//! MySQL's claims: a marker's `INSERT .. ON DUPLICATE KEY UPDATE`, and on MariaDB a batch's
//! markers in one such statement, whose `RETURNING` tells the new ones.

use super::super::dialect::claim_each;
use super::super::{Claimed, Cut, TableName};
use sqlx::{AssertSqlSafe, MySql, Row, SqlStr, Transaction};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

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

/// Set once a MariaDB server refused `RETURNING` (before 10.5): from then on the process's
/// batches claim a key at a time, on every server (correct everywhere, slower on a newer one).
static NO_RETURNING: AtomicBool = AtomicBool::new(false);

/// The claims of a batch's `keys`, in order: in one statement on MariaDB (which `cut` tells)
/// from 10.5, else with `claim`, a marker's statement, per key.
pub(super) async fn claim_many(
    tx: &mut Transaction<'_, MySql>,
    (table, cut): (&TableName, Cut),
    claim: SqlStr,
    consumer: &str,
    keys: &[&str],
) -> Result<Vec<Claimed>, sqlx::Error> {
    if cut == Cut::Bounded && keys.len() > 1 && !NO_RETURNING.load(Relaxed) {
        match claim_many_mariadb(tx, table, consumer, keys).await? {
            Some(claims) => return Ok(claims),
            None => {
                NO_RETURNING.store(true, Relaxed);
                tracing::warn!(
                    "this MariaDB server refused INSERT .. RETURNING (before 10.5): batches \
                     claim their keys one statement each"
                );
            }
        }
    }
    claim_each(tx, claim, consumer, keys).await
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
///
/// `None`: the server refused the first statement's syntax (MariaDB before 10.5 has no
/// `RETURNING`); it changed nothing, and the transaction goes on.
async fn claim_many_mariadb(
    tx: &mut Transaction<'_, MySql>,
    table: &TableName,
    consumer: &str,
    keys: &[&str],
) -> Result<Option<Vec<Claimed>>, sqlx::Error> {
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
        let returned = match sqlx::raw_sql(sql).fetch_all(&mut **tx).await {
            Err(e) if claims.is_empty() && is_syntax_error(&e) => return Ok(None),
            returned => returned?,
        };
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
    Ok(Some(claims))
}

/// 1064: a statement the server cannot parse.
fn is_syntax_error(err: &sqlx::Error) -> bool {
    err.as_database_error()
        .and_then(|e| e.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>())
        .is_some_and(|e| e.number() == 1064)
}

/// A batch's claim statement returned what it cannot have: the batch is not trusted with it.
fn unexpected(what: String) -> sqlx::Error {
    sqlx::Error::Protocol(format!("the inbox's batch claim returned {what}"))
}
