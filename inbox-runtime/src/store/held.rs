//! Outbox rows a worker's handler writes, held until the handler returns and then written with
//! the check of its marker, in one statement per chunk of rows: `INSERT INTO outbox .. SELECT
//! .. FROM inbox WHERE id = <the marker's> ..` (on MySQL, one row as `INSERT .. VALUES` whose
//! payload is read from the marker's row: see `Backend::insert_if_marked_sql`; on PostgreSQL,
//! several rows as arrays: `Backend::insert_held`). It inserts the rows if and only if the
//! marker is still there in the transaction, so that it both writes them and checks the
//! transaction in the round trip the marker's own lookup took (see `store/process.rs`). Where
//! the server can tell from the session alone that the transaction it began is still open
//! (MariaDB, `Backend::insert_if_open_sql`), the rows are first written with that check,
//! cheaper than reading the marker, which decides only when the check fails.
//!
//! Only rows written in the very transaction the store handed the handler are held: one written
//! in another transaction (the handler's own, or a savepoint it opened with `tx.begin()`, which
//! it may roll back) is inserted at once, as outside a worker.

use super::process::Inserted;
use crate::backend::{InboxBackend, NewOutboxRow, Server, TableName};
use std::cell::RefCell;
use std::future::Future;

tokio::task_local! {
    /// The rows held for the transaction at address `.0` (0: none is open).
    static HELD: RefCell<(usize, Vec<HeldRow>)>;
}

/// An outbox row held for its transaction.
#[derive(Debug)]
pub(crate) struct HeldRow {
    pub table: TableName,
    pub msg_id: String,
    pub subject: String,
    pub order_key: String,
    pub headers: String,
    pub payload: Vec<u8>,
}

impl HeldRow {
    /// The row as the insert binds it.
    pub(crate) fn new_row(&self) -> NewOutboxRow<'_> {
        NewOutboxRow {
            msg_id: &self.msg_id,
            subject: &self.subject,
            order_key: &self.order_key,
            headers: &self.headers,
            payload: &self.payload,
        }
    }
}

/// Runs `work` (a message's or a batch's processing) where rows can be held.
pub(crate) async fn scope<T>(work: impl Future<Output = T>) -> T {
    HELD.scope(RefCell::new((0, Vec::new())), work).await
}

/// From now on, rows written in `tx` are held, unless rows are held already (for a handler
/// around this one: `Inbox::process_in` called inside a handler, whose rows go with the outer
/// handler's). Outside a [`scope`], nothing is held.
pub(crate) fn open<T>(tx: &T) -> Holding {
    let at = std::ptr::from_ref(tx) as usize;
    let opened = HELD.try_with(|held| {
        let mut held = held.borrow_mut();
        let free = held.0 == 0;
        if free {
            *held = (at, Vec::new());
        }
        free
    });
    Holding(if opened == Ok(true) { at } else { 0 })
}

/// The rows [`open`] holds for one transaction, until taken; dropped untaken (the handler
/// failed, the transaction is rolled back), it drops them, and nothing is held any more.
#[derive(Debug)]
pub(crate) struct Holding(usize);

impl Holding {
    /// The rows held, in the order they were written; nothing is held after this.
    pub(crate) fn take(mut self) -> Vec<HeldRow> {
        let at = std::mem::take(&mut self.0);
        let taken = HELD.try_with(|held| {
            let mut held = held.borrow_mut();
            match at != 0 && held.0 == at {
                true => std::mem::take(&mut *held).1,
                false => Vec::new(),
            }
        });
        taken.unwrap_or_default()
    }
}

impl Drop for Holding {
    fn drop(&mut self) {
        let at = self.0;
        if at == 0 {
            return;
        }
        let _ = HELD.try_with(|held| {
            let mut held = held.borrow_mut();
            if held.0 == at {
                *held = (0, Vec::new());
            }
        });
    }
}

/// Holds `row` if it is written in the open transaction `tx`; else gives it back, to be
/// inserted at once.
pub(crate) fn hold<T>(tx: &T, row: HeldRow) -> Option<HeldRow> {
    let at = std::ptr::from_ref(tx) as usize;
    let mut row = Some(row);
    let _ = HELD.try_with(|held| {
        let mut held = held.borrow_mut();
        if held.0 != 0 && held.0 == at {
            held.1.extend(row.take());
        }
    });
    row
}

/// The most rows one statement inserts (8 parameters each).
const CHUNK: usize = 100;
/// The most bytes of payload and headers one statement carries (one row at least): well under
/// MariaDB's default `max_allowed_packet` (16 MiB), which a statement over it fails, and drops
/// the connection.
const CHUNK_BYTES: usize = 4 << 20;

/// How many of `rows` (at least one) go in one statement: the first's table, at most
/// [`CHUNK`] rows and [`CHUNK_BYTES`] bytes.
fn chunk_len(rows: &[HeldRow]) -> usize {
    let mut bytes = 0;
    let fits = rows.iter().take(CHUNK).take_while(|r| {
        bytes += r.payload.len() + r.headers.len();
        r.table == rows[0].table && bytes <= CHUNK_BYTES
    });
    fits.count().max(1)
}

/// Inserts `rows` on `conn` if the marker `(id, consumer, key)` is there, a statement per
/// table and per [`CHUNK`] rows or [`CHUNK_BYTES`] bytes, in their order. `Ok(false)`: the marker is not there (the
/// transaction ended under the handler), and no row was inserted by the statement that found it
/// so. A statement is first tried with the server's own check of the transaction, where it
/// has one (`server`: what the inbox knows of its server; `Backend::insert_if_open_sql`), and the
/// marker decides only when that check fails. That check cannot tell a BEGIN of the handler's
/// own, after its transaction ended, from the transaction the store began; so it stands for
/// one row (as it has since it came in), and for several only where the markers are `rechecked`
/// after the rows in the same transaction (a batch's finish, which rolls back whatever
/// transaction the session is in when a marker is gone). A marker the transaction's BEGIN
/// inserted has its id read when the marker's statement needs it.
pub(crate) async fn insert_if_marked<DB: InboxBackend>(
    conn: &mut DB::Connection,
    inbox: &TableName,
    rows: &[HeldRow],
    (inserted, consumer, key): (&Inserted, &str, &str),
    server: Server,
    rechecked: bool,
) -> Result<bool, sqlx::Error> {
    // A begun marker's id, once read.
    let mut read = None;
    let mut start = 0;
    while start < rows.len() {
        let table = &rows[start].table;
        let same = chunk_len(&rows[start..]);
        let chunk: Vec<NewOutboxRow<'_>> = rows[start..start + same]
            .iter()
            .map(HeldRow::new_row)
            .collect();
        let open = match same == 1 || rechecked {
            true => DB::insert_if_open_sql(table, server, same),
            false => None,
        };
        if let Some(sql) = open {
            match DB::outbox_insert(conn, sql, &chunk, None).await {
                Ok(done) if DB::rows_affected(&done) == same as u64 => {
                    start += same;
                    continue;
                }
                // Not in a transaction of its own (the statement failed whole): the marker
                // decides.
                Err(e) if DB::is_missing_marker(&e) => {}
                // Some rows and not others: never the marker's statement after it, which
                // would insert those again; the transaction is rolled back.
                Ok(done) => {
                    let n = DB::rows_affected(&done);
                    let what = format!("{n} of {same} held outbox rows inserted");
                    return Err(sqlx::Error::Protocol(what));
                }
                Err(e) => return Err(e),
            }
        }
        let marker = match (inserted, read) {
            (Inserted::Unfinished(id) | Inserted::Finished(id), _) => *id,
            (Inserted::Begun(_), Some(id)) => id,
            (Inserted::Begun(begun), None) => {
                match DB::fetch_id(conn, begun.clone(), consumer, key).await? {
                    Some(found) => *read.insert(found),
                    // Gone with the transaction that inserted it.
                    None => return Ok(false),
                }
            }
        };
        let done = DB::insert_held(conn, (table, inbox), &chunk, (marker, consumer, key)).await;
        match done {
            Ok(done) if DB::rows_affected(&done) == same as u64 => {}
            Ok(_) => return Ok(false),
            Err(e) if DB::is_missing_marker(&e) => return Ok(false),
            Err(e) => return Err(e),
        }
        start += same;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(table: &str, id: &str) -> HeldRow {
        HeldRow {
            table: TableName::new(table).unwrap(),
            msg_id: id.into(),
            subject: "s".into(),
            order_key: "k".into(),
            headers: "[]".into(),
            payload: Vec::new(),
        }
    }

    #[tokio::test]
    async fn only_the_open_transactions_rows_are_held() {
        let (ours, theirs) = (1u8, 2u8);
        scope(async {
            // Nothing open yet: given back.
            assert!(hold(&ours, row("outbox", "a")).is_some());
            let holding = open(&ours);
            assert!(hold(&ours, row("outbox", "b")).is_none());
            assert!(hold(&theirs, row("outbox", "c")).is_some());
            // A handler inside this one: its rows go with these.
            let inner = open(&theirs);
            assert!(hold(&theirs, row("outbox", "c")).is_some());
            assert!(hold(&ours, row("outbox", "d")).is_none());
            assert!(inner.take().is_empty());
            let held: Vec<String> = holding.take().into_iter().map(|r| r.msg_id).collect();
            assert_eq!(held, ["b", "d"]);
            // Taken: closed.
            assert!(hold(&ours, row("outbox", "e")).is_some());
            // Dropped untaken (a failed handler): its rows go, and nothing is held.
            let failed = open(&ours);
            assert!(hold(&ours, row("outbox", "f")).is_none());
            drop(failed);
            assert!(hold(&ours, row("outbox", "g")).is_some());
            assert!(open(&ours).take().is_empty());
        })
        .await;
        // Outside a scope nothing is held.
        let outside = open(&ours);
        assert!(hold(&ours, row("outbox", "h")).is_some());
        assert!(outside.take().is_empty());
    }

    #[test]
    fn a_statement_takes_one_table_and_a_bounded_size() {
        let sized = |table: &str, bytes: usize| HeldRow {
            payload: vec![0; bytes],
            ..row(table, "x")
        };
        let mb = 1 << 20;
        let rows = [sized("a", mb), sized("a", mb), sized("b", 1), sized("a", 1)];
        assert_eq!(chunk_len(&rows), 2);
        assert_eq!(chunk_len(&rows[2..]), 1);
        let big = [sized("a", 3 * mb), sized("a", 2 * mb)];
        assert_eq!(chunk_len(&big), 1);
        assert_eq!(chunk_len(&[sized("a", 9 * mb)]), 1, "one row at least");
        let many: Vec<HeldRow> = (0..250).map(|_| sized("a", 10)).collect();
        assert_eq!(chunk_len(&many), CHUNK);
    }

    #[cfg(feature = "postgres")]
    #[test]
    fn one_row_goes_where_the_marker_is() {
        use crate::backend::Backend;
        type Pg = sqlx::Postgres;
        let (o, i) = (
            TableName::new("outbox").unwrap(),
            TableName::new("inbox").unwrap(),
        );
        let one = Pg::insert_if_marked_sql(&o, &i, 1);
        assert_eq!(
            one.as_str(),
            "INSERT INTO outbox (msg_id, subject, order_key, headers, payload) SELECT $1, $2, $3, \
             $4, $5 FROM inbox WHERE id = $6 AND consumer = $7 AND message_key = $8"
        );
    }

    /// Several rows by default (SQLite; MySQL's fallback): an arm per row. PostgreSQL binds
    /// them as arrays instead (`Backend::insert_held`).
    #[cfg(feature = "sqlite")]
    #[test]
    fn several_rows_go_in_their_order_where_the_marker_is() {
        use crate::backend::Backend;
        let (o, i) = (
            TableName::new("outbox").unwrap(),
            TableName::new("inbox").unwrap(),
        );
        let two = sqlx::Sqlite::insert_if_marked_sql(&o, &i, 2);
        assert!(
            two.as_str()
                .ends_with("message_key = ?16) AS held ORDER BY n"),
            "{}",
            two.as_str()
        );
        assert!(
            two.as_str()
                .contains("UNION ALL SELECT 1 AS n, ?9 AS msg_id")
        );
    }
}
