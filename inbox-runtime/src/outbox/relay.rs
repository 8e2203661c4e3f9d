//! The relay: publishes an outbox's committed rows and marks them sent once JetStream has stored
//! them. This file holds [`Relay`], its options and its loop; one pass is `pass.rs`, the checks
//! of the streams it publishes to `streams.rs`.

use super::Outbox;
use super::error::RelayError;
use super::streams::{Checks, check_stream};
use crate::backend::{InboxBackend, RelayTurns};
use crate::backoff::Backoff;
use async_nats::jetstream;
#[cfg(feature = "test-util")]
use futures::future::BoxFuture;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How long sent rows are kept by default: an hour, longer than any duplicate window the
/// relay accepts (it refuses a stream whose window is as long or longer).
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(3600);

/// Rows one pass takes by default.
const DEFAULT_BATCH: u32 = 500;

/// Payload and header bytes one pass loads at most by default (a pass always takes its first
/// row, whatever its size).
const DEFAULT_MAX_BYTES: u64 = 16 * 1024 * 1024;

/// How often the relay looks for rows nobody woke it for, by default.
const DEFAULT_POLL: Duration = Duration::from_secs(1);

/// Where relays take turns by a lease (SQLite): how long one's turn lasts by default; renewed at
/// every pass.
const DEFAULT_RELAY_LEASE: Duration = Duration::from_secs(30);

/// What a relay did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayStats {
    /// Rows JetStream stored (a new message).
    pub published: u64,
    /// Rows whose PubAck said the stream had them already: published before by a relay that
    /// died (or whose mark failed) before marking them sent. The stream kept one copy.
    pub republished: u64,
    /// Rows marked sent.
    pub marked: u64,
    /// Rows NATS refused for good, recorded as failed ([`Outbox::failed`]).
    pub failed: u64,
}

/// What a relay did, counted while it runs (shared with its stats handles).
#[derive(Default)]
pub(super) struct Counters {
    pub(super) published: AtomicU64,
    pub(super) republished: AtomicU64,
    pub(super) marked: AtomicU64,
    pub(super) failed: AtomicU64,
    /// Whether the relay said once that its outbox has no turn table yet (MySQL, before
    /// `Outbox::migrate` of this version), so relays work side by side without turns.
    pub(super) turnless: AtomicBool,
}

impl Counters {
    fn snapshot(&self) -> RelayStats {
        RelayStats {
            published: self.published.load(Ordering::Relaxed),
            republished: self.republished.load(Ordering::Relaxed),
            marked: self.marked.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
        }
    }
}

/// A hook between the PubAcks and the mark (tests stop a relay there, as a crash would).
#[cfg(feature = "test-util")]
pub type Hook = Arc<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync>;

/// Publishes an [`Outbox`]'s committed rows; run by [`App::relay`](crate::App::relay) next to
/// the workers, or on its own with [`Relay::run_until`].
pub struct Relay<DB: InboxBackend> {
    pub(super) outbox: Outbox<DB>,
    pub(super) batch: u32,
    pub(super) max_bytes: u64,
    poll: Duration,
    pub(super) retention: Duration,
    streams: Vec<String>,
    pub(super) counters: Arc<Counters>,
    /// This relay's name in a lease relays take turns by.
    pub(super) owner: String,
    pub(super) lease: Duration,
    /// Whether its passes take the relays' turn (PostgreSQL, MySQL); only tests (`test-util`)
    /// turn it off, to run a relay as an older version's.
    pub(super) turns: bool,
    #[cfg(feature = "test-util")]
    before_mark: Option<Hook>,
}

impl<DB: InboxBackend> Clone for Relay<DB> {
    /// The same relay: same outbox, options, counters and name in the lease (a relay started
    /// again after a panic).
    fn clone(&self) -> Self {
        Relay {
            outbox: self.outbox.clone(),
            batch: self.batch,
            max_bytes: self.max_bytes,
            poll: self.poll,
            retention: self.retention,
            streams: self.streams.clone(),
            counters: Arc::clone(&self.counters),
            owner: self.owner.clone(),
            lease: self.lease,
            turns: self.turns,
            #[cfg(feature = "test-util")]
            before_mark: self.before_mark.clone(),
        }
    }
}

impl<DB: InboxBackend> Relay<DB> {
    /// A relay of `outbox`: batches of 500 rows, a poll every second, sent rows kept an hour.
    pub fn new(outbox: Outbox<DB>) -> Self {
        Relay {
            outbox,
            batch: DEFAULT_BATCH,
            max_bytes: DEFAULT_MAX_BYTES,
            poll: DEFAULT_POLL,
            retention: DEFAULT_RETENTION,
            streams: Vec::new(),
            counters: Arc::default(),
            owner: nuid::next().to_string(),
            lease: DEFAULT_RELAY_LEASE,
            turns: true,
            #[cfg(feature = "test-util")]
            before_mark: None,
        }
    }

    /// At most `rows` per pass (one transaction, one mark), at least 1.
    pub fn batch(mut self, rows: u32) -> Self {
        self.batch = rows.max(1);
        self
    }

    /// At most `bytes` of payloads and headers loaded by one pass (default 16 MiB): the rows it
    /// takes are the oldest that fit, and always at least one, so that a relay's memory is
    /// bounded by bytes rather than by the batch's row count times the largest payload.
    pub fn max_bytes(mut self, bytes: u64) -> Self {
        self.max_bytes = bytes.max(1);
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
    /// application's own rather than by [`Relay::run_until`]. A pass that waited in vain for
    /// the relays' turn (another relay's pass held it all along) ends it too, with rows
    /// pending: that relay sends them, or the next call does.
    pub async fn drain(&self, js: &jetstream::Context) -> Result<RelayStats, RelayError> {
        let before = self.stats();
        self.learn_max_payload(js);
        let mut checks = Checks::default();
        while self.pass(js, &mut checks).await? {}
        let after = self.stats();
        Ok(RelayStats {
            published: after.published - before.published,
            republished: after.republished - before.republished,
            marked: after.marked - before.marked,
            failed: after.failed - before.failed,
        })
    }

    /// What the relay has done so far (also while it runs, from a clone taken before).
    pub fn stats(&self) -> RelayStats {
        self.counters.snapshot()
    }

    /// A handle on the counters that [`Relay::stats`] reads, to read them while the relay runs.
    pub fn stats_handle(&self) -> impl Fn() -> RelayStats + Send + Sync + 'static {
        let counters = Arc::clone(&self.counters);
        move || counters.snapshot()
    }

    /// For tests (feature `test-util`, not part of the stable API): runs `hook` after a pass's
    /// PubAcks and before its rows are marked sent, where a test stops the relay as a crash
    /// would.
    #[cfg(feature = "test-util")]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    pub fn before_mark(mut self, hook: Hook) -> Self {
        self.before_mark = Some(hook);
        self
    }

    /// For tests (feature `test-util`, not part of the stable API): a relay that takes no turn
    /// on PostgreSQL and MySQL, as relays of earlier versions did (they still run beside newer
    /// ones during a rolling upgrade): its passes lock their rows `SKIP LOCKED` alone.
    #[cfg(feature = "test-util")]
    #[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
    pub fn without_turns(mut self) -> Self {
        self.turns = false;
        self
    }

    /// Refuses a database the relay cannot run on (a MySQL or MariaDB without
    /// `FOR UPDATE SKIP LOCKED`), naming its version.
    async fn check_database(&self) -> Result<(), RelayError> {
        if let Some(sql) = DB::VERSION_SQL {
            let version = DB::fetch_text(self.outbox.pool(), sql).await?;
            if let Some(why) = DB::relay_unsupported(&version) {
                return Err(RelayError::Unsupported(why));
            }
        }
        Ok(())
    }

    /// Tells the outbox the server's `max_payload`, so that it refuses larger messages when they
    /// are written rather than when they are relayed.
    fn learn_max_payload(&self, js: &jetstream::Context) {
        self.outbox
            .learn_max_payload(js.client().server_info().max_payload);
    }

    /// Runs the `before_mark` hook, if a test set one (nothing without `test-util`).
    pub(super) async fn hook(&self) {
        #[cfg(feature = "test-util")]
        if let Some(hook) = &self.before_mark {
            hook().await;
        }
    }

    /// Checks the database (a MySQL or MariaDB without `FOR UPDATE SKIP LOCKED` is refused,
    /// naming its version) and every stream named with [`Relay::stream`]: it exists, stores a
    /// message before its PubAck (no `persist_mode: async`), and has a duplicate window shorter
    /// than the retention.
    pub async fn check(&self, js: &jetstream::Context) -> Result<(), RelayError> {
        self.learn_max_payload(js);
        self.check_database().await?;
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
        self.learn_max_payload(js);
        if let Err(e @ RelayError::Unsupported(_)) = self.check_database().await {
            // Every pass will fail: said once, loudly (App::run refuses to start instead).
            tracing::error!(outbox = %table, error = %e, "the outbox relay cannot run on this database");
        }
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
        self.release_lease().await;
        self.stats()
    }

    /// Where relays take turns by a lease (SQLite): ends this relay's turn now, so that another
    /// relay need not wait for it to run out.
    async fn release_lease(&self) {
        if DB::RELAY_TURNS != RelayTurns::Lease {
            return;
        }
        let sql = self.outbox.statements().release.clone();
        let released = async {
            let mut conn = self.outbox.pool().acquire().await?;
            DB::take_relay_lease(&mut *conn, sql, &self.owner, 0.0).await
        };
        if let Err(e) = released.await {
            tracing::debug!(error = %e, "ending the relay's lease failed; it runs out by itself");
        }
    }
}
