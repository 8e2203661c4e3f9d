//! The relay: publishes an outbox's committed rows and marks them sent once JetStream has stored
//! them.
//!
//! One pass:
//! 1. PostgreSQL, MySQL 8, MariaDB 10.6+: in a transaction, the oldest pending rows (at most
//!    `batch`), locked `FOR UPDATE SKIP LOCKED`, so that relays side by side take different rows
//!    and none is sent by two at once. SQLite: the relay that holds the lease in
//!    `<table>_relay` reads them; the others wait their turn.
//! 2. Per order key, a row goes only when no older pending row of its key is left outside this
//!    pass (held by another relay, or committed late): a key's messages leave in id order.
//! 3. Rows are published with `Nats-Msg-Id` = their id and `Nats-Expected-Stream` = the stream
//!    checked for their subject; a key's rows one after the other (each waits for its PubAck),
//!    different keys side by side.
//! 4. The rows whose PubAck came are marked sent, and the transaction commits. A relay that dies
//!    before that leaves them pending: the next pass publishes them again, and the stream drops
//!    the copy (its PubAck says `duplicate`, counted as re-published).

use super::Outbox;
use crate::app::unavailable;
use crate::backend::{InboxBackend, OutboxRow};
use crate::backoff::Backoff;
use async_nats::HeaderMap;
use async_nats::jetstream::{self, message::PublishMessage, stream::PersistenceMode};
use futures::future::BoxFuture;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// How long sent rows are kept by default: an hour, longer than any duplicate window the
/// relay accepts (it refuses a stream whose window is as long or longer).
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(3600);

/// Rows one pass takes by default.
const DEFAULT_BATCH: u32 = 100;

/// How often the relay looks for rows nobody woke it for, by default.
const DEFAULT_POLL: Duration = Duration::from_secs(1);

/// A pass starts no publish after this long, so that the rows it holds (and SQLite's lease) are
/// let go within a bounded time even when JetStream is slow to answer.
const PASS_BUDGET: Duration = Duration::from_secs(10);

/// SQLite: how long the relays' lease lasts by default; renewed at every pass.
const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// How long a stream check is trusted before it is made again.
const CHECK_TTL: Duration = Duration::from_secs(60);

/// Rows one cleanup statement deletes at most.
const CLEANUP_BATCH: i64 = 1_000;

/// Why a relay refuses a stream, or a pass failed.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    /// The stream acknowledges before it has stored a message: marking rows sent on its PubAck
    /// could lose them.
    #[error(
        "stream {stream:?} has persist_mode async: its PubAck may come before the message is stored, so the relay would mark rows sent that a crash of the server loses; use the default persist mode"
    )]
    AsyncPersistence {
        /// The stream.
        stream: String,
    },
    /// The stream's duplicate window is not shorter than the relay's retention of sent rows.
    #[error(
        "stream {stream:?} has a duplicate window of {window:?}, and the relay keeps sent rows for {retention:?}: the retention must be longer than the window (a re-published row would otherwise be stored twice, or an id reused after cleanup dropped as a duplicate); raise Relay::retention"
    )]
    Retention {
        /// The stream.
        stream: String,
        /// Its duplicate window.
        window: Duration,
        /// The relay's retention.
        retention: Duration,
    },
    /// The stream has no duplicate window: it would store a re-published row twice.
    #[error(
        "stream {stream:?} has no duplicate window: a row published again after a crash would be stored twice; give it a duplicate window"
    )]
    NoDuplicateWindow {
        /// The stream.
        stream: String,
    },
    /// No stream takes the subject.
    #[error("no stream takes subject {subject:?}: its outbox rows stay pending until one does")]
    NoStream {
        /// The subject.
        subject: String,
    },
    /// JetStream failed to answer.
    #[error("{what}: {source}")]
    Nats {
        /// What was being done.
        what: String,
        /// The error.
        source: async_nats::Error,
        /// Whether it is worth waiting out (JetStream unavailable for now).
        transient: bool,
    },
    /// The database failed.
    #[error("relaying the outbox: {0}")]
    Database(#[from] sqlx::Error),
}

/// What a relay did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayStats {
    /// Rows JetStream stored (a new message).
    pub published: u64,
    /// Rows whose PubAck said the stream had them already: published before by a relay that
    /// died (or whose mark failed) before marking them sent. The stream kept one copy.
    pub republished: u64,
    /// Rows marked sent.
    pub marked: u64,
}

#[derive(Default)]
struct Counters {
    published: AtomicU64,
    republished: AtomicU64,
    marked: AtomicU64,
}

/// A hook between the PubAcks and the mark (tests stop a relay there, as a crash would).
type Hook = Arc<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync>;

/// Publishes an [`Outbox`]'s committed rows; run by [`App::relay`](crate::App::relay) next to
/// the workers, or on its own with [`Relay::run_until`].
pub struct Relay<DB: InboxBackend> {
    outbox: Outbox<DB>,
    batch: u32,
    poll: Duration,
    retention: Duration,
    streams: Vec<String>,
    counters: Arc<Counters>,
    /// This relay's name in SQLite's lease.
    owner: String,
    lease: Duration,
    before_mark: Option<Hook>,
}

impl<DB: InboxBackend> Relay<DB> {
    /// A relay of `outbox`: batches of 100 rows, a poll every second, sent rows kept an hour.
    pub fn new(outbox: Outbox<DB>) -> Self {
        Relay {
            outbox,
            batch: DEFAULT_BATCH,
            poll: DEFAULT_POLL,
            retention: DEFAULT_RETENTION,
            streams: Vec::new(),
            counters: Arc::default(),
            owner: nuid::next().to_string(),
            lease: DEFAULT_LEASE,
            before_mark: None,
        }
    }

    /// At most `rows` per pass (one transaction, one mark), at least 1.
    pub fn batch(mut self, rows: u32) -> Self {
        self.batch = rows.max(1);
        self
    }

    /// How often the relay looks for rows without being woken (rows whose writer died between
    /// COMMIT and the wake-up, rows written outside a worker).
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll = every.max(Duration::from_millis(10));
        self
    }

    /// How long sent rows are kept before cleanup deletes them; must be longer than the
    /// duplicate window of every stream the relay publishes to.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// A stream the relay publishes to, checked at start ([`Relay::check`]): the relay refuses
    /// to start on one it could not relay to safely. Streams not named are checked when a row
    /// for them first comes (and their rows stay pending if they fail).
    pub fn stream(mut self, name: impl Into<String>) -> Self {
        self.streams.push(name.into());
        self
    }

    /// The outbox it relays.
    pub fn outbox(&self) -> &Outbox<DB> {
        &self.outbox
    }

    /// SQLite, where relays take turns: how long one's turn lasts (renewed at every pass;
    /// default 30 s). A relay that dies holds the others off for at most this long. At least
    /// 2 s, and longer than a pass (which starts no publish after 10 s) by the PubAck timeout.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease.max(Duration::from_secs(2));
        self
    }

    /// Relays what is pending now, pass after pass until a pass finds less than a batch it can
    /// take, and returns what this call did: for a relay run on a schedule of the
    /// application's own rather than by [`Relay::run_until`].
    pub async fn drain(&self, js: &jetstream::Context) -> Result<RelayStats, RelayError> {
        let before = self.stats();
        let mut checks = Checks::default();
        while self.pass(js, &mut checks).await? {}
        let after = self.stats();
        Ok(RelayStats {
            published: after.published - before.published,
            republished: after.republished - before.republished,
            marked: after.marked - before.marked,
        })
    }

    /// What the relay has done so far (also while it runs, from a clone taken before).
    pub fn stats(&self) -> RelayStats {
        RelayStats {
            published: self.counters.published.load(Ordering::Relaxed),
            republished: self.counters.republished.load(Ordering::Relaxed),
            marked: self.counters.marked.load(Ordering::Relaxed),
        }
    }

    /// A handle on the counters that [`Relay::stats`] reads, to read them while the relay runs.
    pub fn stats_handle(&self) -> impl Fn() -> RelayStats + Send + Sync + 'static {
        let counters = Arc::clone(&self.counters);
        move || RelayStats {
            published: counters.published.load(Ordering::Relaxed),
            republished: counters.republished.load(Ordering::Relaxed),
            marked: counters.marked.load(Ordering::Relaxed),
        }
    }

    /// Not public API: runs `hook` after a pass's PubAcks and before its rows are marked sent.
    #[doc(hidden)]
    pub fn before_mark(mut self, hook: Hook) -> Self {
        self.before_mark = Some(hook);
        self
    }

    /// Checks every stream named with [`Relay::stream`]: it exists, stores a message before its
    /// PubAck (no `persist_mode: async`), and has a duplicate window shorter than the retention.
    pub async fn check(&self, js: &jetstream::Context) -> Result<(), RelayError> {
        for stream in &self.streams {
            check_stream(js, stream, self.retention).await?;
        }
        Ok(())
    }

    /// Relays until `shutdown` is cancelled, then makes one last pass (for rows committed by
    /// the last messages of a draining worker) and returns what it did. Failures are logged and
    /// retried with capped backoff; it never ends on its own.
    pub async fn run_until(
        self,
        js: &jetstream::Context,
        shutdown: CancellationToken,
    ) -> RelayStats {
        crate::metrics::describe_outbox();
        let table = self.outbox.table().to_string();
        let mut checks = Checks::default();
        let mut poll = tokio::time::interval(self.poll);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let cleanup_every =
            (self.retention / 10).clamp(Duration::from_secs(1), Duration::from_secs(300));
        let mut cleanup = tokio::time::interval(cleanup_every);
        cleanup.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        loop {
            let last = tokio::select! {
                biased;
                _ = shutdown.cancelled() => true,
                _ = self.outbox.waker().notified() => false,
                _ = poll.tick() => {
                    match self.outbox.pending().await {
                        Ok((n, oldest)) => crate::metrics::outbox_pending(&table, n, oldest),
                        Err(e) => tracing::debug!(error = %e, "reading the outbox's backlog failed"),
                    }
                    false
                }
                _ = cleanup.tick() => {
                    self.clean_up().await;
                    continue;
                }
            };
            // Passes until one finds less than a batch: the backlog is drained.
            loop {
                match self.pass(js, &mut checks).await {
                    Ok(full) => {
                        backoff.reset();
                        if !full {
                            break;
                        }
                    }
                    Err(e) => {
                        let wait = backoff.next();
                        tracing::warn!(outbox = %table, error = %e, retry_in = ?wait, "outbox relay pass failed");
                        if !last {
                            tokio::select! {
                                _ = shutdown.cancelled() => {}
                                _ = tokio::time::sleep(wait) => {}
                            }
                        }
                        break;
                    }
                }
            }
            if last {
                break;
            }
        }
        self.stats()
    }

    /// One pass; `Ok(true)` when it took a whole batch (more may be waiting).
    pub(crate) async fn pass(
        &self,
        js: &jetstream::Context,
        checks: &mut Checks,
    ) -> Result<bool, RelayError> {
        let sql = self.outbox.statements();
        let pool = self.outbox.pool();
        let limit = i64::from(self.batch);
        if DB::SKIP_LOCKED.is_empty() {
            // SQLite: the lease decides which relay reads; reading and publishing hold no lock,
            // marking is a short write of its own.
            let mut conn = pool.acquire().await?;
            let held = DB::execute_text_secs(
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
        let mut tx = DB::begin(pool, DB::begin_sql(crate::store::DEFAULT_LOCK_TIMEOUT)).await?;
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

    async fn hook(&self) {
        if let Some(hook) = &self.before_mark {
            hook().await;
        }
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
            keys.entry(row.3.clone()).or_default().push(row);
        }
        keys.retain(|key, rows| heads.get(key).is_none_or(|&head| head >= rows[0].0));
        // Each subject's stream, checked once (and again after CHECK_TTL).
        let mut streams = HashMap::new();
        for row in keys.values().flatten() {
            if !streams.contains_key(&row.2) {
                let stream = checks.stream_for(js, &row.2, self.retention).await;
                streams.insert(row.2.clone(), stream);
            }
        }
        let deadline = Instant::now() + PASS_BUDGET;
        let table = self.outbox.table().as_str();
        let sends = keys.into_values().map(|rows| {
            let streams = &streams;
            async move {
                let mut sent = Vec::with_capacity(rows.len());
                for (id, msg_id, subject, _, headers, payload) in rows {
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
    async fn clean_up(&self) {
        let pool = self.outbox.pool();
        let lock = format!("outbox-cleanup:{}", self.outbox.table());
        let Ok(conn) = pool.acquire().await else {
            return;
        };
        let mut conn = crate::cleanup::LockHolder::new(conn);
        match DB::try_cleanup_lock(conn.conn(), &lock).await {
            Ok(true) => {}
            Ok(false) => {
                conn.unlocked();
                return;
            }
            Err(e) => {
                tracing::debug!(error = %e, "taking the outbox cleanup lock failed");
                return;
            }
        }
        let secs = self.retention.as_secs_f64();
        let sql = self.outbox.statements().cleanup.clone();
        let mut deleted = 0;
        // On the lock's connection: the relay holds one connection at a time, as the pool split
        // counted it.
        loop {
            match DB::execute_secs_n(conn.conn(), sql.clone(), secs, CLEANUP_BATCH).await {
                Ok(done) if DB::rows_affected(&done) == 0 => break,
                Ok(done) => deleted += DB::rows_affected(&done),
                Err(e) => {
                    tracing::warn!(error = %e, "outbox cleanup failed");
                    break;
                }
            }
        }
        if deleted > 0 {
            tracing::info!(outbox = %self.outbox.table(), deleted, "outbox cleanup");
        }
        if DB::cleanup_unlock(conn.conn(), &lock).await.is_ok() {
            conn.unlocked();
        }
    }
}

/// Each key's smallest pending id among the rows up to the last of `rows`.
async fn heads<DB: InboxBackend>(
    conn: &mut DB::Connection,
    sql: &super::Statements,
    rows: &[OutboxRow],
) -> Result<HashMap<String, i64>, sqlx::Error> {
    let Some(last) = rows.last() else {
        return Ok(HashMap::new());
    };
    let heads = DB::keyed_ints(conn, sql.heads.clone(), last.0).await?;
    Ok(heads.into_iter().collect())
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

/// The streams checked so far, by subject.
#[derive(Default)]
pub(crate) struct Checks {
    by_subject: HashMap<String, (Instant, Result<String, String>)>,
}

impl Checks {
    /// The stream that takes `subject`, if it is safe to relay to; else why not.
    async fn stream_for(
        &mut self,
        js: &jetstream::Context,
        subject: &str,
        retention: Duration,
    ) -> Result<String, String> {
        if let Some((at, checked)) = self.by_subject.get(subject)
            && at.elapsed() < CHECK_TTL
        {
            return checked.clone();
        }
        let checked = match js.stream_by_subject(subject).await {
            Ok(stream) => match check_stream(js, &stream, retention).await {
                Ok(()) => Ok(stream),
                Err(e) => Err(e.to_string()),
            },
            Err(e) => {
                use async_nats::jetstream::context::GetStreamByNameErrorKind as K;
                if e.kind() == K::NotFound {
                    Err(RelayError::NoStream {
                        subject: subject.to_owned(),
                    }
                    .to_string())
                } else {
                    // Not cached: asked again at the next pass.
                    return Err(format!("looking up the stream of {subject:?}: {e}"));
                }
            }
        };
        self.by_subject
            .insert(subject.to_owned(), (Instant::now(), checked.clone()));
        checked
    }
}

/// Whether the relay can mark rows sent on `stream`'s PubAcks and keep one copy of a row
/// published twice.
async fn check_stream(
    js: &jetstream::Context,
    stream: &str,
    retention: Duration,
) -> Result<(), RelayError> {
    use async_nats::jetstream::context::GetStreamErrorKind;
    let found = js.get_stream(stream).await.map_err(|e| {
        let transient = match e.kind() {
            GetStreamErrorKind::Request => true,
            GetStreamErrorKind::JetStream(e) => unavailable(&e),
            _ => false,
        };
        RelayError::Nats {
            what: format!("relay: cannot get stream {stream:?}"),
            source: e.into(),
            transient,
        }
    })?;
    let config = &found.cached_info().config;
    if config.persist_mode == Some(PersistenceMode::Async) {
        return Err(RelayError::AsyncPersistence {
            stream: stream.to_owned(),
        });
    }
    if config.duplicate_window.is_zero() {
        return Err(RelayError::NoDuplicateWindow {
            stream: stream.to_owned(),
        });
    }
    if config.duplicate_window >= retention {
        return Err(RelayError::Retention {
            stream: stream.to_owned(),
            window: config.duplicate_window,
            retention,
        });
    }
    Ok(())
}
