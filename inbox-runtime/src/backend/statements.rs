//! The SQL of one inbox table, written once per [`Inbox`](crate::Inbox) from the dialect's
//! pieces: what every dialect runs alike differs only in its placeholders and its clock.

use super::{Claimed, InboxBackend, KeyId, TableName};
use crate::layout::Layout;
use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};
use std::time::Duration;

/// The SQL statements of one inbox table, written once per [`Inbox`](crate::Inbox).
#[derive(Debug, Clone)]
pub(crate) struct InboxStatements {
    /// Binds consumer and key; see `Backend::claim`.
    pub claim: SqlStr,
    /// Binds consumer, key and the payload's hash: a one-phase message's claim, its marker
    /// inserted finished; see `Backend::claim_finished_sql`. `None`: `claim`, then `finish`.
    pub claim_finished: Option<SqlStr>,
    /// Binds the payload's hash and the marker's id (in that order: MySQL's placeholders are
    /// positional): sets `processed_at` (and the hash) on a marker `claim` inserted.
    pub finish: SqlStr,
    /// Binds consumer, key: the payload hash the key's marker keeps.
    pub hash: SqlStr,
    /// See `Backend::cleanup_sql`.
    pub cleanup: SqlStr,
    /// Binds consumer, key: the id of the key's finished marker, if one is committed (after a
    /// COMMIT whose reply was lost, whether the effect is done), or inserted finished by the
    /// transaction it runs in (after the handler, whether that transaction still holds it:
    /// see `Inbox::finish`).
    pub done: SqlStr,
    /// Binds consumer, key: the id of the marker the transaction's BEGIN inserted; see
    /// `Backend::begun_marker_sql`.
    pub begun: Option<SqlStr>,
    /// See `Backend::begin_sql`.
    pub begin: Begin,
    /// BEGIN for a batch of a handler without lanes, whose lock waits may be a deadlock's:
    /// waits at most [`UNLANED_LOCK_WAIT`] (or the inbox's lock timeout, when shorter), so that
    /// a deadlock ends in that time rather than PostgreSQL's `deadlock_timeout` (1 s), and the
    /// batch is tried again.
    pub begin_unlaned: Begin,
    /// Binds consumer, headers (JSON), payload: parks a dead letter in `<table>_dead_letters`.
    pub park: SqlStr,
    /// Binds consumer: the oldest parked letters (id, headers, payload).
    pub parked: SqlStr,
    /// Binds id: forgets a parked letter once the dead-letter stream has it.
    pub unpark: SqlStr,
    /// The statements of two-phase claims: see `store/two_phase.rs`.
    pub claims: ClaimStatements,
    /// A write that changes nothing: whether the database takes writes (a standby does not).
    pub writable: SqlStr,
    /// A write that changes nothing in the inbox, waiting briefly for its table lock: whether
    /// messages can be processed at all (see `Backend::inbox_probe_sql`).
    pub inbox_probe: SqlStr,
}

/// The statements of two-phase claims (`store/two_phase.rs`). A claim is open while `processed_at` is NULL
/// and `lease_until` is set; its owner holds it while `lease_until` is in the future and `fence`
/// is the one it took it with.
#[derive(Debug, Clone)]
pub(crate) struct ClaimStatements {
    /// Binds consumer, key: the marker's [`ClaimState`](super::ClaimState), locked for update.
    pub state: SqlStr,
    /// Binds lease seconds, id, fence: takes the claim over (fence + 1, attempts + 1, a new lease)
    /// if its lease has run out (or it has none yet).
    pub take: SqlStr,
    /// Binds lease seconds, id, fence: extends the lease of the claim still held with `fence`.
    pub renew: SqlStr,
    /// Binds id, fence: marks the claim done, if `fence` still holds it; `received_at` becomes
    /// the completion time, from which retention counts.
    pub complete: SqlStr,
    /// Binds id, fence: ends the lease now, if `fence` still holds it.
    pub release: SqlStr,
    /// Binds consumer, -age ms: the [`OpenClaimRow`](super::OpenClaimRow)s of claims received at
    /// least that long ago, oldest first.
    pub open: SqlStr,
    /// Binds consumer, key: ends the lease of an open claim now.
    pub release_key: SqlStr,
    /// Binds consumer, key: deletes an open claim.
    pub forget_key: SqlStr,
}

impl ClaimStatements {
    fn new<DB: InboxBackend>(table: &TableName) -> Self {
        let p = DB::param;
        let int = |expr: &str| format!("CAST({expr} AS {})", DB::INT64);
        let until = |col: &str| format!("COALESCE({}, -1)", DB::ms_until_sql(col));
        let open = "processed_at IS NULL AND lease_until IS NOT NULL";
        ClaimStatements {
            state: sql(format!(
                "SELECT id, {}, {}, fence, {} FROM {table} WHERE consumer = {} AND message_key = {}{}",
                int("CASE WHEN processed_at IS NULL THEN 0 ELSE 1 END"),
                until("lease_until"),
                int("attempts"),
                p(1),
                p(2),
                DB::FOR_UPDATE
            )),
            take: sql(format!(
                "UPDATE {table} SET fence = fence + 1, attempts = attempts + 1, lease_until = {} \
                 WHERE id = {} AND fence = {} AND processed_at IS NULL \
                 AND (lease_until IS NULL OR lease_until <= {})",
                DB::secs_from_now_sql(&p(1)),
                p(2),
                p(3),
                DB::NOW_SQL
            )),
            renew: sql(format!(
                "UPDATE {table} SET lease_until = {} WHERE id = {} AND fence = {} AND {open}",
                DB::secs_from_now_sql(&p(1)),
                p(2),
                p(3)
            )),
            // received_at moves to the completion too: retention and the cleanup cutoff, which
            // read received_at, then count from when the effect was done, as for a marker (a
            // claim can stay open for days before a replay completes it).
            complete: sql(format!(
                "UPDATE {table} SET processed_at = {now}, received_at = {now}, lease_until = NULL \
                 WHERE id = {} AND fence = {} AND {open}",
                p(1),
                p(2),
                now = DB::NOW_SQL,
            )),
            release: sql(format!(
                "UPDATE {table} SET lease_until = {} WHERE id = {} AND fence = {} AND {open}",
                DB::NOW_SQL,
                p(1),
                p(2)
            )),
            open: sql(format!(
                "SELECT {}, fence, {}, -{}, {} FROM {table} \
                 WHERE consumer = {} AND {open} AND {} <= {} ORDER BY id LIMIT 1000",
                DB::KEY_TEXT,
                int("attempts"),
                DB::ms_until_sql("received_at"),
                until("lease_until"),
                p(1),
                DB::ms_until_sql("received_at"),
                p(2)
            )),
            release_key: sql(format!(
                "UPDATE {table} SET lease_until = {} WHERE consumer = {} AND message_key = {} AND {open}",
                DB::NOW_SQL,
                p(1),
                p(2)
            )),
            forget_key: sql(format!(
                "DELETE FROM {table} WHERE consumer = {} AND message_key = {} AND {open}",
                p(1),
                p(2)
            )),
        }
    }
}

/// A transaction's BEGIN ([`Backend::begin_sql`](super::Backend::begin_sql)), and the shorter
/// one for a connection on which no transaction can be open
/// ([`Backend::begin_again_sql`](super::Backend::begin_again_sql)); see `Beginning::begin_with`.
#[derive(Debug, Clone)]
pub(crate) struct Begin {
    /// Begins on any connection.
    pub sql: SqlStr,
    /// Begins on a connection kept from a try that ended cleanly; `None`: `sql` there too.
    pub again: Option<SqlStr>,
    lock_timeout: Duration,
}

impl Begin {
    /// The BEGIN of transactions that wait at most `lock_timeout` for a lock, and, given a
    /// `statement_timeout`, run no statement longer where the dialect can bound them.
    pub(crate) fn new<DB: super::Backend>(
        lock_timeout: Duration,
        statement_timeout: Option<Duration>,
    ) -> Self {
        Begin {
            sql: DB::begin_sql(lock_timeout, statement_timeout),
            again: DB::begin_again_sql(lock_timeout, statement_timeout),
            lock_timeout,
        }
    }
}

/// The longest lock wait of a batch without lanes (see `InboxStatements::begin_unlaned`).
pub(crate) const UNLANED_LOCK_WAIT: Duration = Duration::from_millis(200);

/// Payload and header bytes of parked dead letters read at once at most (at least one letter).
const PARKED_BYTES: u64 = 16 * 1024 * 1024;

impl InboxStatements {
    /// Bounds every statement of a message's transaction by `timeout`, where the dialect can
    /// ([`Backend::begin_sql`](super::Backend::begin_sql)).
    pub(crate) fn bound_statements<DB: InboxBackend>(&mut self, timeout: Duration) {
        for begin in [&mut self.begin, &mut self.begin_unlaned] {
            *begin = Begin::new::<DB>(begin.lock_timeout, Some(timeout));
        }
    }

    pub(crate) fn new<DB: InboxBackend>(
        table: &TableName,
        layout: &Layout,
        lock_timeout: Duration,
    ) -> Self {
        InboxStatements {
            begin: Begin::new::<DB>(lock_timeout, None),
            begin_unlaned: Begin::new::<DB>(lock_timeout.min(UNLANED_LOCK_WAIT), None),
            park: sql(format!(
                "INSERT INTO {table}_dead_letters (consumer, headers, payload) VALUES ({}, {}, {})",
                DB::param(1),
                DB::param(2),
                DB::param(3)
            )),
            // The oldest 100 that fit in PARKED_BYTES (and always the first).
            parked: sql(format!(
                "SELECT id, headers, payload FROM (SELECT id, headers, payload, \
                 SUM({len}(payload) + {len}(headers)) OVER (ORDER BY id) AS upto, \
                 {len}(payload) + {len}(headers) AS size \
                 FROM {table}_dead_letters WHERE consumer = {}) letters \
                 WHERE upto - size < {PARKED_BYTES} ORDER BY id LIMIT 100",
                DB::param(1),
                len = DB::BYTE_LENGTH,
            )),
            unpark: sql(format!(
                "DELETE FROM {table}_dead_letters WHERE id = {}",
                DB::param(1)
            )),
            writable: sql(DB::writable_probe_sql(table)),
            inbox_probe: sql(DB::inbox_probe_sql(table)),
            claim: DB::claim_sql(table, layout),
            claim_finished: DB::claim_finished_sql(table, layout),
            begun: DB::begun_marker_sql(table),
            // The statement's own time (PostgreSQL: not now(), when the transaction began).
            finish: sql(format!(
                "UPDATE {table} SET processed_at = {}, payload_hash = {} WHERE id = {}",
                DB::NOW_SQL,
                DB::param(1),
                DB::param(2)
            )),
            hash: sql(format!(
                "SELECT payload_hash FROM {table} WHERE consumer = {} AND message_key = {}",
                DB::param(1),
                DB::param(2)
            )),
            cleanup: DB::cleanup_sql(table),
            done: sql(format!(
                "SELECT id FROM {table} WHERE consumer = {} AND message_key = {} \
                 AND processed_at IS NOT NULL",
                DB::param(1),
                DB::param(2)
            )),
            claims: ClaimStatements::new::<DB>(table),
        }
    }
}

/// A statement's text, built from checked identifiers and the dialect's own SQL.
pub(crate) fn sql(text: String) -> SqlStr {
    AssertSqlSafe(text).into_sql_str()
}

/// The claims of `keys`, in order, from the (key, id) rows one statement inserted: a key's first
/// copy with a row is new, every other copy a duplicate. (MySQL claims otherwise.)
#[cfg_attr(not(any(feature = "postgres", feature = "sqlite")), allow(dead_code))]
pub(crate) fn claims_of(keys: &[&str], rows: Vec<KeyId>) -> Vec<Claimed> {
    let mut new: std::collections::HashMap<String, i64> =
        rows.into_iter().map(|row| (row.key, row.id)).collect();
    keys.iter()
        .map(|key| match new.remove(*key) {
            Some(id) => Claimed::New(id),
            None => Claimed::Duplicate,
        })
        .collect()
}

/// `ids`, the database's own integers, as a list to write into a statement's text.
fn id_list(ids: &[i64]) -> String {
    let ids: Vec<String> = ids.iter().map(i64::to_string).collect();
    ids.join(", ")
}

/// A payload hash as the batch's finish writes it: hex digits only (a statement's text takes
/// it as a literal), else none.
pub(crate) fn hex_only(hash: Option<&str>) -> Option<&str> {
    hash.filter(|h| h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Sets `processed_at` on the markers `ids` of `table` (a batch's markers, in its transaction),
/// with each one's payload hash where `hashes` has one. The ids are the database's own integers
/// and the hashes hex digits, written into the statement (it runs unprepared, since its text
/// changes with every batch).
pub(crate) fn finish_many_sql<DB: InboxBackend>(
    table: &TableName,
    ids: &[i64],
    hashes: &[Option<&str>],
) -> SqlStr {
    let whens: String = ids
        .iter()
        .zip(hashes)
        .filter_map(|(id, &hash)| Some(format!(" WHEN {id} THEN '{}'", hex_only(hash)?)))
        .collect();
    if whens.is_empty() {
        return stamp_ids_sql::<DB>(table, "processed_at", ids);
    }
    sql(format!(
        "UPDATE {table} SET processed_at = {}, payload_hash = CASE id{whens} ELSE payload_hash END \
         WHERE id IN ({})",
        DB::NOW_SQL,
        id_list(ids)
    ))
}

/// Sets `column` to now on the rows `ids` of `table` (a batch's markers, the outbox rows a relay
/// sent). The ids are the database's own integers, written into the statement (it runs
/// unprepared, since its text changes with every batch).
pub(crate) fn stamp_ids_sql<DB: InboxBackend>(
    table: &TableName,
    column: &str,
    ids: &[i64],
) -> SqlStr {
    sql(format!(
        "UPDATE {table} SET {column} = {} WHERE id IN ({})",
        DB::NOW_SQL,
        id_list(ids)
    ))
}

/// Deletes the rows `ids` of `table` (a batch's markers of messages it left out), the ids
/// written into the statement as in [`stamp_ids_sql`].
pub(crate) fn delete_ids_sql(table: &TableName, ids: &[i64]) -> SqlStr {
    sql(format!(
        "DELETE FROM {table} WHERE id IN ({})",
        id_list(ids)
    ))
}

/// The outbox rows `ids` of `table` (which a relay's pass has locked), in id order, the ids
/// written into the statement as in [`stamp_ids_sql`].
pub(crate) fn outbox_rows_sql(table: &TableName, ids: &[i64]) -> SqlStr {
    sql(format!(
        "SELECT id, msg_id, subject, order_key, headers, payload FROM {table} \
         WHERE id IN ({}) ORDER BY id",
        id_list(ids)
    ))
}

#[cfg(test)]
mod claims_tests {
    use super::KeyId;
    use super::claims_of;
    use crate::backend::Claimed;

    #[test]
    fn the_first_copy_with_a_row_is_new_and_every_other_a_duplicate() {
        let keys = ["a", "a", "b", "c", "c"];
        let row = |key: &str, id| KeyId {
            key: key.to_owned(),
            id,
        };
        let rows = vec![row("a", 7), row("c", 9)];
        assert_eq!(
            claims_of(&keys, rows),
            [
                Claimed::New(7),
                Claimed::Duplicate,
                Claimed::Duplicate,
                Claimed::New(9),
                Claimed::Duplicate
            ]
        );
    }
}
