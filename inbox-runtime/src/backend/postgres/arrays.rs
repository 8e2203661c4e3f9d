//! PostgreSQL's statements over a batch's rows, bound as arrays: one text whatever the batch's
//! size, parsed and planned once per connection (sqlx caches it), where a list written into the
//! text would be a new statement at every batch.

use crate::backend::TableName;
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

fn sql(text: String) -> SqlStr {
    AssertSqlSafe(text).into_sql_str()
}

/// Binds the markers' ids (`bigint[]`) and their payload hashes (`varchar[]`, NULL for none):
/// sets `processed_at`, and the hash where there is one.
pub(super) fn finish_many(table: &TableName) -> SqlStr {
    sql(format!(
        "UPDATE {table} SET processed_at = clock_timestamp(), payload_hash = \
         COALESCE(($2::varchar[])[array_position($1::bigint[], id)], payload_hash) \
         WHERE id = ANY($1::bigint[])"
    ))
}

/// Binds the rows' ids: marks them sent.
pub(super) fn mark_sent(table: &TableName) -> SqlStr {
    sql(format!(
        "UPDATE {table} SET sent_at = clock_timestamp() WHERE id = ANY($1::bigint[])"
    ))
}

/// Binds the rows' ids: the rows, in id order.
pub(super) fn rows_of(table: &TableName) -> SqlStr {
    sql(format!(
        "SELECT id, msg_id, subject, order_key, headers, payload FROM {table} \
         WHERE id = ANY($1::bigint[]) ORDER BY id"
    ))
}

/// Binds the rows' msg ids, subjects, order keys, headers (text arrays) and payloads
/// (`bytea[]`), then the marker's id, consumer and key: inserts the rows in their order
/// (`WITH ORDINALITY`) if the marker is there, none otherwise.
pub(super) fn insert_held(outbox: &TableName, inbox: &TableName) -> SqlStr {
    sql(format!(
        "INSERT INTO {outbox} (msg_id, subject, order_key, headers, payload) \
         SELECT msg_id, subject, order_key, headers, payload \
         FROM unnest($1::varchar[], $2::text[], $3::text[], $4::text[], $5::bytea[]) \
         WITH ORDINALITY AS t(msg_id, subject, order_key, headers, payload, n) \
         WHERE EXISTS (SELECT 1 FROM {inbox} \
         WHERE id = $6 AND consumer = $7 AND message_key = $8) ORDER BY n"
    ))
}
