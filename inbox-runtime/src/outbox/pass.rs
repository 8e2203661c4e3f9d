//! One pass of a relay:
//! 1. PostgreSQL, MySQL 8, MariaDB 10.6+: in a transaction, the oldest pending rows (at most
//!    `batch`), locked `FOR UPDATE SKIP LOCKED`, so that relays side by side take different rows
//!    and none is sent by two at once. SQLite (`RelayTurns::Lease`): the relay that holds the
//!    lease in `<table>_relay` reads them; the others wait their turn.
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
use super::relay::Relay;
use super::statements::OutboxStatements;
use super::streams::Checks;
use crate::backend::fleet::{FleetLock, delete_in_batches};
use crate::backend::{DEFAULT_LOCK_TIMEOUT, DeleteBatch, InboxBackend, OutboxRow, RelayTurns};
use async_nats::HeaderMap;
use async_nats::jetstream::{self, message::PublishMessage};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// A pass starts no publish after this long, so that the rows it holds (and a relay's lease) are
/// let go within a bounded time even when JetStream is slow to answer.
const PASS_BUDGET: Duration = Duration::from_secs(10);

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
        if DB::RELAY_TURNS == RelayTurns::Lease {
            // The lease decides which relay reads; reading and publishing hold no lock,
            // marking is a short write of its own.
            let mut conn = pool.acquire().await?;
            let held = DB::take_relay_lease(
                &mut *conn,
                sql.lease.clone(),
                &self.owner,
                self.lease.as_secs_f64(),
            )
            .await?;
            if DB::rows_affected(&held) == 0 {
                return Ok(false);
            }
            let rows = DB::outbox_rows(&mut *conn, sql.fetch.clone(), limit).await?;
            if rows.is_empty() {
                return Ok(false);
            }
            let taken = rows.len();
            let heads = heads::<DB>(&mut *conn, sql, &rows).await?;
            drop(conn);
            let sent = self.publish(js, checks, rows, &heads).await;
            // More may wait only when a whole batch went: a row held back or failing waits for
            // the next wake-up or poll, rather than being tried again at once.
            let full = taken as i64 >= limit && sent.len() == taken;
            self.hook().await;
            if !sent.is_empty() {
                let mut conn = pool.acquire().await?;
                DB::execute_raw(&mut *conn, sql.mark_sent::<DB>(&sent)).await?;
                self.counters
                    .marked
                    .fetch_add(sent.len() as u64, Ordering::Relaxed);
            }
            return Ok(full);
        }
        let mut tx = DB::begin(pool, DB::begin_sql(DEFAULT_LOCK_TIMEOUT)).await?;
        let rows = DB::outbox_rows(&mut *tx, sql.fetch.clone(), limit).await?;
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(false);
        }
        let taken = rows.len();
        let heads = heads::<DB>(&mut *tx, sql, &rows).await?;
        let sent = self.publish(js, checks, rows, &heads).await;
        let full = taken as i64 >= limit && sent.len() == taken;
        self.hook().await;
        if !sent.is_empty() {
            DB::execute_raw(&mut *tx, sql.mark_sent::<DB>(&sent)).await?;
        }
        tx.commit().await?;
        self.counters
            .marked
            .fetch_add(sent.len() as u64, Ordering::Relaxed);
        Ok(full)
    }

    /// Publishes `rows` (in id order) whose key is not held back by an older pending row outside
    /// them (`heads`: each key's smallest pending id), a key's rows one after the other, keys
    /// side by side. Returns the ids JetStream has stored.
    async fn publish(
        &self,
        js: &jetstream::Context,
        checks: &mut Checks,
        rows: Vec<OutboxRow>,
        heads: &HashMap<String, i64>,
    ) -> Vec<i64> {
        let mut keys: BTreeMap<String, Vec<OutboxRow>> = BTreeMap::new();
        for row in rows {
            keys.entry(row.order_key.clone()).or_default().push(row);
        }
        keys.retain(|key, rows| heads.get(key).is_none_or(|&head| head >= rows[0].id));
        // Each subject's stream, checked once (and again after CHECK_TTL).
        let mut streams = HashMap::new();
        for row in keys.values().flatten() {
            if !streams.contains_key(&row.subject) {
                let stream = checks.stream_for(js, &row.subject, self.retention).await;
                streams.insert(row.subject.clone(), stream);
            }
        }
        let deadline = Instant::now() + PASS_BUDGET;
        let table = self.outbox.table().as_str();
        let sends = keys.into_values().map(|rows| {
            let streams = &streams;
            async move {
                let mut sent = Vec::with_capacity(rows.len());
                for OutboxRow { id, msg_id, subject, headers, payload, .. } in rows {
                    if Instant::now() >= deadline {
                        break;
                    }
                    let stream = match &streams[&subject] {
                        Ok(stream) => stream,
                        Err(why) => {
                            tracing::warn!(outbox = table, %subject, "outbox row {msg_id} not relayed: {why}");
                            break;
                        }
                    };
                    match publish_one(js, stream, &subject, &msg_id, &headers, payload).await {
                        Ok(duplicate) => sent.push((id, duplicate)),
                        Err(e) => {
                            tracing::warn!(outbox = table, %subject, error = %e, "publishing outbox row {msg_id} failed; it stays pending");
                            break;
                        }
                    }
                }
                sent
            }
        });
        let sent: Vec<(i64, bool)> = futures::future::join_all(sends)
            .await
            .into_iter()
            .flatten()
            .collect();
        let again = sent.iter().filter(|(_, duplicate)| *duplicate).count() as u64;
        let new = sent.len() as u64 - again;
        self.counters.published.fetch_add(new, Ordering::Relaxed);
        self.counters
            .republished
            .fetch_add(again, Ordering::Relaxed);
        crate::metrics::outbox_published(table, new, again);
        sent.into_iter().map(|(id, _)| id).collect()
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
            Err(e) => tracing::warn!(error = %e, "outbox cleanup failed"),
        }
        lock.release().await;
    }
}

/// Each key's smallest pending id among the rows up to the last of `rows`.
async fn heads<DB: InboxBackend>(
    conn: &mut DB::Connection,
    sql: &OutboxStatements,
    rows: &[OutboxRow],
) -> Result<HashMap<String, i64>, sqlx::Error> {
    let Some(last) = rows.last() else {
        return Ok(HashMap::new());
    };
    let heads = DB::outbox_heads(conn, sql.heads.clone(), last.id).await?;
    Ok(heads.into_iter().map(|head| (head.key, head.id)).collect())
}

/// Publishes one row and waits for its PubAck: `Ok(true)` when the stream had it already.
async fn publish_one(
    js: &jetstream::Context,
    stream: &str,
    subject: &str,
    msg_id: &str,
    headers: &str,
    payload: Vec<u8>,
) -> Result<bool, async_nats::Error> {
    let pairs: Vec<(String, String)> = serde_json::from_str(headers)?;
    let mut map = HeaderMap::new();
    for (name, value) in &pairs {
        map.append(name.as_str(), value.as_str());
    }
    let message = PublishMessage::build()
        .payload(payload.into())
        .headers(map)
        .message_id(msg_id)
        .expected_stream(stream);
    let ack = js.send_publish(subject.to_owned(), message).await?.await?;
    Ok(ack.duplicate)
}
