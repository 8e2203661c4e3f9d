//! One pass of a relay:
//! 1. PostgreSQL, MySQL 8, MariaDB 10.6+: in a transaction, the relays' turn (a transaction
//!    lock: one relay's pass at a time, the others wait for it), then the oldest pending rows
//!    (at most `batch`), locked `FOR UPDATE SKIP LOCKED`, so that relays without turns (an older
//!    version's, during a rolling upgrade) take different rows and none is sent by two at once.
//!    SQLite (`RelayTurns::Lease`): the relay that holds the lease in `<table>_relay` reads
//!    them; the others wait their turn.
//! 2. Per order key, a row goes only when no older pending row of its key is left outside this
//!    pass (held by another relay, or committed late): a key's messages leave in id order.
//! 3. Rows are published with `Nats-Msg-Id` = their id and `Nats-Expected-Stream` = the stream
//!    checked for their subject; a key's rows one after the other (each waits for its PubAck),
//!    different keys side by side.
//! 4. The rows whose PubAck came are marked sent, and the transaction commits. A relay that dies
//!    before that leaves them pending: the next pass publishes them again, and the stream drops
//!    the copy (its PubAck says `duplicate`, counted as re-published).
//!
//! Then the cleanup of sent rows, under the fleet lock.

use super::error::RelayError;
use super::message::{header_value_ok, publish_subject};
use super::relay::Relay;
use super::statements::TURN_WAIT;
use super::streams::Checks;
use super::taken::{heads, within};
use crate::backend::fleet::{FleetLock, delete_in_batches};
use crate::backend::{Beginning, DeleteBatch, InboxBackend, OutboxRow, RelayTurns};
use crate::classify::close_if_read_only;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::{self, message::PublishMessage};
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use sqlx::pool::PoolConnection;
use sqlx::{AssertSqlSafe, SqlSafeStr};
use std::collections::{BTreeMap, HashMap};
use std::str::FromStr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A pass starts no publish after this long, so that the rows it holds (and a relay's lease) are
/// let go within a bounded time even when JetStream is slow to answer.
pub(super) const PASS_BUDGET: Duration = Duration::from_secs(10);

/// Rows one cleanup statement deletes at most.
const CLEANUP_BATCH: i64 = 1_000;

impl<DB: InboxBackend> Relay<DB> {
    /// One pass; `Ok(true)` when it took a whole batch (more may be waiting).
    pub(super) async fn pass(
        &self,
        js: &jetstream::Context,
        checks: &mut Checks,
    ) -> Result<bool, RelayError> {
        let sql = self.outbox.statements();
        let pool = self.outbox.pool();
        let limit = i64::from(self.batch);
        // Subjects without a stream to take them (or with one the relay refuses) are left out
        // until their check is made again: their rows would otherwise fill every pass.
        let blocked = checks.blocked();
        let fetch = sql.fetch_without::<DB>(blocked.len());
        // Every connection is held apart from its work: one that answers "read-only" (to a
        // standby, after a failover) leaves the pool rather than refusing every later pass.
        if DB::RELAY_TURNS == RelayTurns::Lease {
            // The lease decides which relay reads; reading and publishing hold no lock,
            // marking is a short write of its own.
            let mut conn = pool.acquire().await?;
            let read = async {
                let held = DB::take_relay_lease(
                    &mut *conn,
                    sql.lease.clone(),
                    &self.owner,
                    self.lease.as_secs_f64(),
                )
                .await?;
                if DB::rows_affected(&held) == 0 {
                    return Ok(None);
                }
                let sizes = DB::outbox_sizes(&mut *conn, fetch, &blocked, limit).await?;
                if sizes.is_empty() {
                    return Ok(None);
                }
                let ids = within(&sizes, self.max_bytes);
                let rows = DB::outbox_rows_of(&mut *conn, &sql.table, &ids).await?;
                let heads = heads::<DB>(&mut *conn, sql, &rows).await?;
                Ok::<_, RelayError>(Some((sizes, rows, heads)))
            }
            .await;
            let Some((sizes, rows, heads)) = closing_read_only(&mut conn, read)? else {
                return Ok(false);
            };
            drop(conn);
            let taken = rows.len();
            let done = self.publish(js, checks, rows, &heads).await;
            // More may wait only when a whole batch (or as many rows as the byte budget let in)
            // went: a row held back or failing waits for the next wake-up or poll, rather than
            // being tried again at once.
            let more = sizes.len() as i64 >= limit || taken < sizes.len();
            let full = more && done.sent.len() == taken;
            self.hook().await;
            if !done.sent.is_empty() || !done.failed.is_empty() {
                let mut conn = pool.acquire().await?;
                let recorded = self.record(&mut *conn, &done).await;
                closing_read_only(&mut conn, recorded)?;
            }
            return Ok(full);
        }
        let mut conn = Beginning::new(pool.acquire().await?);
        // The turn may set the session up for the pass (`Backend::relay_turn_sql`): given
        // back below, else the connection is closed rather than pooled.
        let reset = DB::RELAY_TURN_RESET.filter(|_| self.turns);
        if reset.is_some() {
            conn.taint();
        }
        let passed = async {
            let mut tx = conn.begin_with(&sql.begin).await?;
            if !self.take_turn(&mut tx).await? {
                tx.rollback().await?;
                return Ok(false);
            }
            let sizes = DB::outbox_sizes(&mut *tx, fetch, &blocked, limit).await?;
            if sizes.is_empty() {
                tx.commit().await?;
                return Ok(false);
            }
            // Locked are all of `sizes`; loaded, the oldest that fit the byte budget.
            let ids = within(&sizes, self.max_bytes);
            let rows = DB::outbox_rows_of(&mut *tx, &sql.table, &ids).await?;
            let taken = rows.len();
            let heads = heads::<DB>(&mut *tx, sql, &rows).await?;
            let done = self.publish(js, checks, rows, &heads).await;
            let more = sizes.len() as i64 >= limit || taken < sizes.len();
            let full = more && done.sent.len() == taken;
            self.hook().await;
            self.record(&mut *tx, &done).await?;
            tx.commit().await?;
            self.count_recorded(&done);
            Ok::<_, RelayError>(full)
        }
        .await;
        if let Some(reset) = reset
            && DB::execute_raw(&mut **conn, AssertSqlSafe(reset).into_sql_str())
                .await
                .is_ok()
        {
            conn.untaint();
        }
        closing_read_only(&mut conn, passed)
    }

    /// Takes the relays' turn for the rest of the transaction on `conn` (PostgreSQL, MySQL:
    /// `Backend::relay_turn_sql`); `false` when another relay held it for all of
    /// [`TURN_WAIT`]. Relays of an older version take no turn: they still lock their rows, and
    /// keep off this pass's as before.
    async fn take_turn(&self, conn: &mut DB::Connection) -> Result<bool, RelayError> {
        let Some(turn) = self
            .outbox
            .statements()
            .turn
            .as_ref()
            .filter(|_| self.turns)
        else {
            return Ok(true);
        };
        let table = self.outbox.table();
        match DB::execute_raw(conn, turn.clone()).await {
            Ok(_) => Ok(true),
            Err(sqlx::Error::Database(e)) if DB::is_timeout_error(e.as_ref()) => {
                tracing::debug!(outbox = %table, wait = ?TURN_WAIT, "another relay held the turn all along; this pass is let go");
                Ok(false)
            }
            // MySQL, where the failed statement leaves the transaction as it was.
            Err(sqlx::Error::Database(e)) if DB::is_undefined_table_error(e.as_ref()) => {
                if !self.counters.turnless.swap(true, Ordering::Relaxed) {
                    tracing::warn!(outbox = %table, error = %e, "the outbox has no turn table yet (run Outbox::migrate): its relays work side by side, each waiting behind the others' rows");
                }
                Ok(true)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Marks `done`'s rows sent, and records its failed rows, on `conn`. On the lease path
    /// (no transaction) each write is counted as it lands, so that a failure further on leaves
    /// what was written counted; in a transaction the caller counts after COMMIT.
    async fn record(&self, conn: &mut DB::Connection, done: &Published) -> Result<(), RelayError> {
        let sql = self.outbox.statements();
        let written = DB::RELAY_TURNS == RelayTurns::Lease;
        if !done.sent.is_empty() {
            DB::mark_sent(&mut *conn, &sql.table, &done.sent).await?;
            if written {
                self.count_marked(done.sent.len());
            }
        }
        for failed in &done.failed {
            DB::outbox_fail(
                &mut *conn,
                sql.fail.clone(),
                failed.id,
                &failed.order_key,
                &failed.error,
            )
            .await?;
            if written {
                self.count_failed(std::slice::from_ref(failed));
            }
        }
        Ok(())
    }

    /// Counts and logs what [`Relay::record`] wrote, once it is committed.
    fn count_recorded(&self, done: &Published) {
        self.count_marked(done.sent.len());
        self.count_failed(&done.failed);
    }

    /// Counts `n` rows marked sent.
    fn count_marked(&self, n: usize) {
        self.counters.marked.fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Counts and logs rows recorded as failed.
    fn count_failed(&self, failed: &[FailedSend]) {
        let table = self.outbox.table().as_str();
        for failed in failed {
            tracing::error!(
                outbox = table,
                id = failed.id,
                msg_id = %failed.msg_id,
                subject = %failed.subject,
                order_key = %failed.order_key,
                error = %failed.error,
                "NATS refuses outbox row for good: it is kept as failed, and its order key's later rows wait (Outbox::retry_failed or Outbox::discard_failed)"
            );
        }
        if !failed.is_empty() {
            self.counters
                .failed
                .fetch_add(failed.len() as u64, Ordering::Relaxed);
            crate::metrics::outbox_failed(table, failed.len() as u64);
        }
    }

    /// Publishes `rows` (in id order) whose key is not held back by an older pending row outside
    /// them (`heads`: each key's smallest pending id), a key's rows one after the other, keys
    /// side by side. Returns the ids JetStream has stored, and the rows NATS refused for good
    /// (a key stops at its first refused row).
    async fn publish(
        &self,
        js: &jetstream::Context,
        checks: &mut Checks,
        rows: Vec<OutboxRow>,
        heads: &HashMap<String, i64>,
    ) -> Published {
        let mut keys: BTreeMap<String, Vec<OutboxRow>> = BTreeMap::new();
        for row in rows {
            keys.entry(row.order_key.clone()).or_default().push(row);
        }
        keys.retain(|key, rows| heads.get(key).is_none_or(|&head| head >= rows[0].id));
        // The budget counts the lookups too: the pass's transaction is idle meanwhile, and the
        // server ends one idle for a minute (PostgreSQL's turn).
        let deadline = Instant::now() + PASS_BUDGET;
        // Each subject's stream, checked once (and again after CHECK_TTL).
        let mut streams = HashMap::new();
        for row in keys.values().flatten() {
            if Instant::now() >= deadline {
                break;
            }
            // A subject NATS would refuse is refused below, before any lookup.
            if !streams.contains_key(&row.subject) && publish_subject(&row.subject).is_ok() {
                let stream = checks.stream_for(js, &row.subject, self.retention).await;
                streams.insert(row.subject.clone(), stream);
            }
        }
        let table = self.outbox.table().as_str();
        let sends = keys.into_values().map(|rows| {
            let streams = &streams;
            async move {
                let mut sent = Vec::with_capacity(rows.len());
                let mut failed = None;
                for OutboxRow { id, msg_id, subject, order_key, headers, payload } in rows {
                    if Instant::now() >= deadline {
                        break;
                    }
                    // Written by another writer: a publish to it would close the connection
                    // (a subject over `max_control_line`), or never be sent.
                    if let Err(why) = publish_subject(&subject) {
                        let error = format!("subject is not valid in NATS: {why}");
                        failed = Some(FailedSend { id, msg_id, subject, order_key, error });
                        break;
                    }
                    let stream = match streams.get(&subject) {
                        Some(Ok(stream)) => stream,
                        // Not looked up within the pass's budget: the next pass.
                        None => break,
                        Some(Err(why)) => {
                            tracing::warn!(outbox = table, %subject, "outbox row {msg_id} not relayed: {why}");
                            break;
                        }
                    };
                    match publish_one(js, stream, &subject, &msg_id, &headers, payload).await {
                        Ok(duplicate) => sent.push((id, duplicate)),
                        Err(Refusal::Later(e)) => {
                            tracing::warn!(outbox = table, %subject, error = %e, "publishing outbox row {msg_id} failed; it stays pending");
                            break;
                        }
                        Err(Refusal::ForGood(error)) => {
                            failed = Some(FailedSend { id, msg_id, subject, order_key, error });
                            break;
                        }
                    }
                }
                (sent, failed)
            }
        });
        let mut failed = Vec::new();
        let mut sent: Vec<(i64, bool)> = Vec::new();
        for (key_sent, key_failed) in futures::future::join_all(sends).await {
            sent.extend(key_sent);
            failed.extend(key_failed);
        }
        let again = sent.iter().filter(|(_, duplicate)| *duplicate).count() as u64;
        let new = sent.len() as u64 - again;
        self.counters.published.fetch_add(new, Ordering::Relaxed);
        self.counters
            .republished
            .fetch_add(again, Ordering::Relaxed);
        crate::metrics::outbox_published(table, new, again);
        Published {
            sent: sent.into_iter().map(|(id, _)| id).collect(),
            failed,
        }
    }

    /// Deletes rows sent longer ago than the retention, in batches, one instance at a time.
    pub(super) async fn clean_up(&self) {
        let name = format!("outbox-cleanup:{}", self.outbox.table());
        let mut lock = match FleetLock::try_take(self.outbox.pool(), name).await {
            Ok(Some(lock)) => lock,
            Ok(None) => return,
            Err(e) => {
                tracing::debug!(error = %e, "taking the outbox cleanup lock failed");
                return;
            }
        };
        let batch = DeleteBatch {
            consumer: None,
            older_than_secs: self.retention.as_secs_f64(),
            limit: CLEANUP_BATCH,
        };
        let sql = self.outbox.statements().cleanup.clone();
        // On the lock's connection: the relay holds one connection at a time, as the pool split
        // counted it.
        match delete_in_batches::<DB>(lock.conn(), sql, batch).await {
            Ok(0) => {}
            Ok(deleted) => tracing::info!(outbox = %self.outbox.table(), deleted, "outbox cleanup"),
            Err(e) => {
                close_if_read_only(lock.conn(), &e);
                tracing::warn!(error = %e, "outbox cleanup failed");
            }
        }
        lock.release().await;
    }
}

/// `result`, after marking `conn` to be closed if it failed on a database that takes no writes.
fn closing_read_only<DB: InboxBackend, T>(
    conn: &mut PoolConnection<DB>,
    result: Result<T, RelayError>,
) -> Result<T, RelayError> {
    if let Err(RelayError::Database(e)) = &result {
        close_if_read_only(conn, e);
    }
    result
}

/// What a pass's publishing came to.
struct Published {
    /// The rows JetStream stored.
    sent: Vec<i64>,
    /// The rows NATS refused for good.
    failed: Vec<FailedSend>,
}

/// A row NATS refused for good, and why.
struct FailedSend {
    id: i64,
    msg_id: String,
    subject: String,
    order_key: String,
    error: String,
}

/// Why a row was not published.
enum Refusal {
    /// It may go later (JetStream did not answer, or not yet): it stays pending.
    Later(async_nats::Error),
    /// NATS can never take it as it is (a header or id the protocol cannot carry, larger than
    /// `max_payload`): it is recorded as failed.
    ForGood(String),
}

/// Publishes one row and waits for its PubAck: `Ok(true)` when the stream had it already. A row
/// written by another writer (or an older version) that NATS cannot carry is refused, never a
/// panic inside the client.
async fn publish_one(
    js: &jetstream::Context,
    stream: &str,
    subject: &str,
    msg_id: &str,
    headers: &str,
    payload: Vec<u8>,
) -> Result<bool, Refusal> {
    let pairs: Vec<(String, String)> = serde_json::from_str(headers).map_err(|e| {
        Refusal::ForGood(format!(
            "its headers are not a JSON list of (name, value) pairs: {e}"
        ))
    })?;
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        let parsed = match name.is_empty() {
            true => None,
            false => HeaderName::from_str(&name).ok(),
        };
        let Some(parsed) = parsed else {
            return Err(Refusal::ForGood(format!(
                "header name {name:?} is not valid in NATS (empty, or not printable ASCII, or with ':')"
            )));
        };
        let Ok(value) = HeaderValue::from_str(&value) else {
            return Err(Refusal::ForGood(format!(
                "header {name:?} has a line break in its value"
            )));
        };
        map.append(parsed, value);
    }
    if !header_value_ok(msg_id) {
        return Err(Refusal::ForGood(format!(
            "message id {msg_id:?} has a line break (it is sent as the Nats-Msg-Id header)"
        )));
    }
    let message = PublishMessage::build()
        .payload(payload.into())
        .headers(map)
        .message_id(msg_id)
        .expected_stream(stream);
    let ack = js
        .send_publish(subject.to_owned(), message)
        .await
        .map_err(|e| match e.kind() {
            PublishErrorKind::MaxPayloadExceeded => Refusal::ForGood(e.to_string()),
            _ => Refusal::Later(e.into()),
        })?;
    let ack = ack.await.map_err(|e| {
        let code = std::error::Error::source(&e)
            .and_then(|s| s.downcast_ref::<jetstream::Error>())
            .map(|s| s.error_code());
        match code {
            Some(code) if refused_for_good(code) => Refusal::ForGood(e.to_string()),
            _ => Refusal::Later(e.into()),
        }
    })?;
    Ok(ack.duplicate)
}

/// Whether JetStream refused a row with `code` for good: it will never take the row as it is
/// (written by another writer or an older version, or with headers `enqueue` let through),
/// and trying it again at every pass would hold back its key's later rows for ever.
fn refused_for_good(code: jetstream::ErrorCode) -> bool {
    use jetstream::ErrorCode as E;
    [
        // Over the stream's `max_msg_size`.
        E::STREAM_MESSAGE_EXCEEDS_MAXIMUM,
        // A header block over 64 KiB.
        E::STREAM_HEADER_EXCEEDS_MAXIMUM,
        // `Nats-Expected-Last-Msg-Id`, `Nats-Expected-Last-(Subject-)Sequence` not met: the
        // stream only moves on.
        E::STREAM_WRONG_LAST_MESSAGE_ID,
        E::STREAM_WRONG_LAST_SEQUENCE,
        E::STREAM_WRONG_LAST_SEQUENCE_CONSTANT,
        // `Nats-Rollup` on a stream that does not allow it, or a bad one.
        E::STREAM_ROLLUP_FAILED,
    ]
    .contains(&code)
}
