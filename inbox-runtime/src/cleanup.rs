//! Retention and cleanup, together: how long a marker must be kept (longer than any redelivery
//! of its message can come), the pass that deletes older finished markers in bounded batches one
//! instance at a time, and the periodic task a worker runs it in. The per-database SQL and fleet
//! lock are the backends' (`backend/*`); the rules are here.

use crate::backend::InboxBackend;
use crate::partition::Layout;
use crate::store::Inbox;
use async_nats::jetstream::consumer::{self, PullConsumer};
use async_nats::jetstream::stream::{self, RawMessageErrorKind, Stream};
use std::fmt;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The smallest safe retention for one consumer, and the figures it is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetentionFloor {
    /// The longest one delivery can stay unacknowledged: the consumer's `ack_wait`, or the
    /// worker's longest nak delay when that is longer.
    pub per_delivery: Duration,
    /// The consumer's `max_deliver`.
    pub max_deliver: i64,
    /// The sum of the consumer's `backoff` steps.
    pub backoff_sum: Duration,
    /// The stream's `max_age` (zero: unlimited, counted as zero; `WorkerBuilder::cleanup`
    /// refuses such a stream unless `allow_unlimited_stream_age` accepts it).
    pub max_age: Duration,
    /// The stream's duplicate window, during which a producer's retry is still deduplicated.
    pub duplicate_window: Duration,
    /// The operator's margin (replaying dead letters, clock skew).
    pub margin: Duration,
}

impl RetentionFloor {
    /// `per_delivery × max_deliver + backoff_sum + max_age + duplicate_window + margin`.
    pub fn total(&self) -> Duration {
        let deliveries = u32::try_from(self.max_deliver.max(1)).unwrap_or(u32::MAX);
        self.per_delivery.saturating_mul(deliveries)
            + self.backoff_sum
            + self.max_age
            + self.duplicate_window
            + self.margin
    }
}

impl fmt::Display for RetentionFloor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ack_wait {:?} × max_deliver {} + backoff {:?} + stream max_age {:?} + duplicate window {:?} + margin {:?} = {:?}",
            self.per_delivery,
            self.max_deliver,
            self.backoff_sum,
            self.max_age,
            self.duplicate_window,
            self.margin,
            self.total()
        )
    }
}

/// The smallest retention that outlives every redelivery of a message on `consumer` of `stream`,
/// with `longest_nak` the longest delay the worker naks with and `margin` the operator's.
///
/// ```
/// use async_nats::jetstream::{consumer, stream};
/// use std::time::Duration;
/// let consumer = consumer::Config { ack_wait: Duration::from_secs(30), max_deliver: 10, ..Default::default() };
/// let stream = stream::Config { duplicate_window: Duration::from_secs(120), ..Default::default() };
/// let floor = inbox_runtime::retention_floor(&consumer, &stream, Duration::from_secs(30), Duration::from_secs(3600));
/// assert_eq!(floor.total(), Duration::from_secs(300 + 120 + 3600));
/// ```
pub fn retention_floor(
    consumer: &consumer::Config,
    stream: &stream::Config,
    longest_nak: Duration,
    margin: Duration,
) -> RetentionFloor {
    let ack_wait = if consumer.ack_wait.is_zero() {
        Duration::from_secs(30)
    } else {
        consumer.ack_wait
    };
    RetentionFloor {
        per_delivery: ack_wait.max(longest_nak),
        max_deliver: consumer.max_deliver,
        backoff_sum: consumer.backoff.iter().sum(),
        max_age: stream.max_age,
        duplicate_window: stream.duplicate_window,
        margin,
    }
}

impl<DB: InboxBackend> Inbox<DB> {
    /// Deletes `consumer`'s finished markers received more than `older_than` ago, in batches of
    /// `batch` rows (short statements that never hold up the hot path for long), one instance at
    /// a time across the fleet. Returns how many were deleted, or `None` when another instance
    /// is cleaning up. Open claims are never deleted.
    ///
    /// A [partitioned](Inbox::partitioned) inbox drops, instead, the partitions whose whole
    /// range is older than the same cutoff and that hold nothing else (no open claim, no other
    /// consumer's marker); where something else is left, it deletes the consumer's finished
    /// markers of that partition in batches, and the partition goes once it is empty.
    ///
    /// `older_than` must cover every possible redelivery: see [`retention_floor`].
    pub async fn cleanup(
        &self,
        consumer: &str,
        older_than: Duration,
        batch: u32,
    ) -> Result<Option<u64>, sqlx::Error> {
        let lock = format!("inbox-cleanup:{}:{consumer}", self.table());
        let mut conn = LockHolder {
            conn: self.pool().acquire().await?,
            locked: false,
        };
        // Counted as held from before the request: cancelled while the server grants it, the
        // connection must not go back to the pool holding it.
        conn.locked = true;
        if !DB::try_cleanup_lock(&mut conn.conn, &lock).await? {
            conn.locked = false;
            return Ok(None);
        }
        let (secs, limit) = (older_than.as_secs_f64(), i64::from(batch.max(1)));
        let mut deleted = 0;
        let result = if let Layout::Partitioned(_) = self.layout() {
            // Whole partitions past the same cutoff: see `partition.rs`.
            DB::drop_partitions(&mut conn.conn, self.table(), consumer, secs, limit)
                .await
                .map(Some)
        } else {
            loop {
                let sql = self.sql.cleanup.clone();
                match DB::cleanup_batch(&mut conn.conn, sql, consumer, secs, limit).await {
                    Ok(done) if DB::rows_affected(&done) == 0 => break Ok(Some(deleted)),
                    Ok(done) => deleted += DB::rows_affected(&done),
                    Err(e) => break Err(e),
                }
            }
        };
        match DB::cleanup_unlock(&mut conn.conn, &lock).await {
            Ok(()) => conn.locked = false,
            // Still locked: the holder closes the connection rather than pool it.
            Err(e) => {
                tracing::warn!(error = %e, "releasing the cleanup lock failed; closing the connection")
            }
        }
        result
    }
}

/// Why a consumer-following cleanup pass did not run to the end.
#[derive(Debug, thiserror::Error)]
pub enum CleanupError {
    /// The consumer's progress could not be read from JetStream: nothing was deleted.
    #[error("reading the progress of consumer {durable:?}: {source}")]
    Progress {
        /// The durable consumer's name.
        durable: String,
        /// NATS's error.
        source: async_nats::Error,
    },
    /// The database failed.
    #[error("deleting old markers: {0}")]
    Database(#[from] sqlx::Error),
}

impl<DB: InboxBackend> Inbox<DB> {
    /// [`Inbox::cleanup`] with a cutoff that follows the JetStream consumer rather than the wall
    /// clock: markers are deleted only when older than `retention` before the publish time of the
    /// oldest message `durable` has not acked (or not yet received), so that a consumer that was
    /// stopped or lagging for longer than the retention still finds the markers of what it has
    /// yet to process. With nothing pending, the cutoff is `retention` ago.
    ///
    /// `stream` is the consumer's stream. When the consumer's progress cannot be read, nothing is
    /// deleted.
    pub async fn cleanup_behind(
        &self,
        consumer: &str,
        durable: &PullConsumer,
        stream: &Stream,
        retention: Duration,
        batch: u32,
    ) -> Result<Option<u64>, CleanupError> {
        let lag = consumer_lag(durable, stream)
            .await
            .map_err(|source| CleanupError::Progress {
                durable: durable.cached_info().name.clone(),
                source,
            })?;
        Ok(self
            .cleanup(consumer, retention.saturating_add(lag), batch)
            .await?)
    }
}

/// How long ago the oldest message that `durable` has not acked was published: zero when every
/// message is acked. Conservative: the first message stored after the consumer's ack floor
/// (of its subject, when it filters one) is at most as old as the oldest unacked one.
async fn consumer_lag(
    durable: &PullConsumer,
    stream: &Stream,
) -> Result<Duration, async_nats::Error> {
    let info = durable.get_info().await?;
    if info.num_pending == 0 && info.num_ack_pending == 0 {
        return Ok(Duration::ZERO);
    }
    let subject = match info.config.filter_subject.as_str() {
        "" => ">".to_owned(),
        one => one.to_owned(),
    };
    let oldest = stream
        .raw_message_builder()
        .sequence(info.ack_floor.stream_sequence + 1)
        .next_by_subject(subject)
        .send()
        .await;
    let published = match oldest {
        Ok(message) => message.time.unix_timestamp_nanos(),
        // Nothing stored after the floor any more (removed by the stream's limits): nothing
        // can be redelivered.
        Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => return Ok(Duration::ZERO),
        Err(e) => return Err(e.into()),
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as i128;
    let lag = u64::try_from(now - published).unwrap_or(0);
    Ok(Duration::from_nanos(lag))
}

/// The connection a cleanup runs on. The fleet lock is a *session* lock: a connection returned
/// to the pool while still holding it (a cleanup cancelled half-way, an unlock that failed)
/// would keep every instance from cleaning up for as long as it lives. So a connection that may
/// still hold the lock is closed when dropped, which makes the server release it.
pub(crate) struct LockHolder<DB: InboxBackend> {
    conn: sqlx::pool::PoolConnection<DB>,
    locked: bool,
}

impl<DB: InboxBackend> LockHolder<DB> {
    /// `conn`, counted as holding the lock from before it is asked for: cancelled while the
    /// server grants it, the connection must not go back to the pool holding it.
    pub(crate) fn new(conn: sqlx::pool::PoolConnection<DB>) -> Self {
        LockHolder { conn, locked: true }
    }

    /// The connection, to take and release the lock on.
    pub(crate) fn conn(&mut self) -> &mut DB::Connection {
        &mut self.conn
    }

    /// The lock is not held (refused, or released): the connection may go back to the pool.
    pub(crate) fn unlocked(&mut self) {
        self.locked = false;
    }
}

impl<DB: InboxBackend> Drop for LockHolder<DB> {
    fn drop(&mut self) {
        if self.locked {
            self.conn.close_on_drop();
        }
    }
}

/// When a worker cleans up: markers older than `retention`, every `every`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Schedule {
    pub retention: Duration,
    pub every: Duration,
}

/// The rows one cleanup statement deletes at most.
const BATCH: u32 = 1_000;

/// Passes in a row without the lock after which a stuck lock is reported.
const STUCK_AFTER: u32 = 10;

/// Runs [`Inbox::cleanup_behind`] for `consumer` (behind `durable` of `stream`) on `schedule`
/// until `shutdown`; failures are logged and retried at the next tick.
pub(crate) async fn run_periodically<DB: InboxBackend>(
    inbox: Inbox<DB>,
    consumer: &'static str,
    (durable, stream): (PullConsumer, Stream),
    schedule: Schedule,
    shutdown: CancellationToken,
) {
    let mut ticks = tokio::time::interval(schedule.every);
    // Passes in a row in which another instance held the lock. Instances clean up in turns, so a
    // long run of them means the lock is stuck (a session that holds it and does nothing, or a
    // pooler that pins advisory locks to the wrong session), and cleanup has silently stopped.
    let mut skipped = 0u32;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = ticks.tick() => {}
        }
        let pass = inbox.cleanup_behind(consumer, &durable, &stream, schedule.retention, BATCH);
        match pass.await {
            Ok(Some(n)) => {
                skipped = 0;
                crate::metrics::cleaned(consumer, n);
                if n > 0 {
                    tracing::info!(consumer, deleted = n, "inbox cleanup");
                }
            }
            Ok(None) => {
                skipped += 1;
                tracing::debug!(consumer, "another instance is cleaning up the inbox");
                if skipped == STUCK_AFTER {
                    tracing::warn!(
                        consumer,
                        passes = skipped,
                        "another instance has held the inbox cleanup lock at every pass; if none \
                         is cleaning up, a database session holds the lock (a transaction-mode \
                         pooler can cause this) and markers are no longer deleted"
                    );
                }
            }
            Err(e) => tracing::warn!(consumer, error = %e, "inbox cleanup failed"),
        }
    }
}
