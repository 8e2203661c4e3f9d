//! SQL text for held outbox rows that every dialect can run (`store/held.rs`).

use super::{Backend, TableName};
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

/// [`Backend::insert_if_marked_sql`] as one `INSERT .. SELECT` (an arm per row, each reading
/// the marker's row).
pub(crate) fn insert_if_marked_select<DB: Backend>(
    outbox: &TableName,
    inbox: &TableName,
    n: usize,
) -> SqlStr {
    let cols = "msg_id, subject, order_key, headers, payload";
    let arm = |i: usize, named: bool| {
        let p = |k: usize| DB::param(i * 8 + k);
        let (msg_id, subject, order_key, headers, payload) = (p(1), p(2), p(3), p(4), p(5));
        let values = match named {
            true => format!(
                "{i} AS n, {msg_id} AS msg_id, {subject} AS subject, {order_key} AS \
                 order_key, {headers} AS headers, {payload} AS payload"
            ),
            false => format!("{msg_id}, {subject}, {order_key}, {headers}, {payload}"),
        };
        let (id, consumer, key) = (p(6), p(7), p(8));
        format!(
            "SELECT {values} FROM {inbox} \
             WHERE id = {id} AND consumer = {consumer} AND message_key = {key}"
        )
    };
    let sql = match n {
        1 => format!("INSERT INTO {outbox} ({cols}) {}", arm(0, false)),
        // Ordered, so that the ids follow the order the rows were written in.
        _ => format!(
            "INSERT INTO {outbox} ({cols}) SELECT {cols} FROM ({}) AS held ORDER BY n",
            (0..n)
                .map(|i| arm(i, true))
                .collect::<Vec<_>>()
                .join(" UNION ALL ")
        ),
    };
    AssertSqlSafe(sql).into_sql_str()
}
