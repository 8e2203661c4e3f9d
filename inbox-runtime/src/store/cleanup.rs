//! Retention and cleanup, together: how long a marker must be kept (longer than any redelivery
//! of its message can come, counted back from the oldest message still in the stream), the pass
//! that deletes older finished markers in bounded batches one instance at a time. The
//! per-database SQL and the fleet lock are the backends' (`backend/*`), the periodic task a
//! worker runs it in is the worker's (`worker/upkeep.rs`); the rules are here.

use super::Inbox;
use crate::backend::fleet::{FleetLock, delete_in_batches};
use crate::backend::{DeleteBatch, InboxBackend};
use crate::layout::Layout;
use crate::stored::{self, Lookup};
use async_nats::jetstream::consumer::{self, PullConsumer};
use async_nats::jetstream::{self, stream};
use std::fmt;
use std::time::Duration;

/// The smallest safe retention for one consumer, and the figures it is made of.
///
/// The retention is counted back from the publish time of the oldest message still in the
/// stream (and of the consumer's oldest unacked one, see [`Inbox::cleanup_behind`]), so the
/// stream's `max_age` is not a figure of it: a replay of a stored message (a consumer reset, a
/// new consumer from the start) always finds its marker, whatever the stream's age limit. The
/// retention covers what may come once a message has left the stream: the redeliveries still
/// owed, a producer's retry within the duplicate window, a dead letter replayed by hand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RetentionFloor {
    /// The longest one delivery can stay unacknowledged: the consumer's `ack_wait`, or the
    /// worker's longest nak delay when that is longer.
    pub per_delivery: Duration,
    /// The consumer's `max_deliver`.
    pub max_deliver: i64,
    /// The sum of the consumer's `backoff` steps.
    pub backoff_sum: Duration,
    /// The stream's duplicate window, during which a producer's retry is still deduplicated.
    pub duplicate_window: Duration,
    /// The operator's margin (replaying dead letters, clock skew).
    pub margin: Duration,
}

impl RetentionFloor {
    /// `per_delivery × max_deliver + backoff_sum + duplicate_window + margin`.
    pub fn total(&self) -> Duration {
        let deliveries = u32::try_from(self.max_deliver.max(1)).unwrap_or(u32::MAX);
        self.per_delivery.saturating_mul(deliveries)
            + self.backoff_sum
            + self.duplicate_window
            + self.margin
    }
}

impl fmt::Display for RetentionFloor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ack_wait {:?} × max_deliver {} + backoff {:?} + duplicate window {:?} + margin {:?} = {:?}",
            self.per_delivery,
            self.max_deliver,
            self.backoff_sum,
            self.duplicate_window,
            self.margin,
            self.total()
        )
    }
}

/// The smallest retention that outlives every redelivery of a message on `consumer` of `stream`,
/// with `longest_nak` the longest delay the worker naks with and `margin` the operator's. The
/// stream's `max_age` does not count (see [`RetentionFloor`]).
///
/// ```
/// use async_nats::jetstream::{consumer, stream};
/// use std::time::Duration;
/// let consumer = consumer::Config { ack_wait: Duration::from_secs(30), max_deliver: 10, ..Default::default() };
/// let stream = stream::Config {
///     duplicate_window: Duration::from_secs(120),
///     max_age: Duration::from_secs(3 * 86400),
///     ..Default::default()
/// };
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
    /// `older_than` must cover every possible redelivery ([`retention_floor`]) and, since this
    /// pass goes by the wall clock, every replay of a stored message too: the stream's `max_age`
    /// on top of the floor (no bound at all for a stream that keeps messages forever).
    /// [`Inbox::cleanup_behind`] follows the stream and the consumer instead.
    pub async fn cleanup(
        &self,
        consumer: &str,
        older_than: Duration,
        batch: u32,
    ) -> Result<Option<u64>, sqlx::Error> {
        let name = format!("inbox-cleanup:{}:{consumer}", self.table());
        let Some(mut lock) = FleetLock::try_take(self.pool(), name).await? else {
            return Ok(None);
        };
        let (secs, limit) = (older_than.as_secs_f64(), i64::from(batch.max(1)));
        let result = if let Layout::Partitioned(_) = self.layout() {
            // Whole partitions past the same cutoff: see `backend/postgres/partitioned.rs`.
            DB::drop_partitions(lock.conn(), self.table(), consumer, secs, limit).await
        } else {
            let batch = DeleteBatch {
                consumer: Some(consumer),
                older_than_secs: secs,
                limit,
            };
            delete_in_batches::<DB>(lock.conn(), self.sql.cleanup.clone(), batch).await
        };
        if let Err(e) = &result {
            crate::classify::close_if_read_only(lock.conn(), e);
        }
        lock.release().await;
        result.map(Some)
    }
}

/// Why a stream- and consumer-following cleanup pass did not run to the end.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CleanupError {
    /// The stream's oldest stored message could not be read from JetStream (its state): nothing
    /// was deleted.
    #[error("reading the state of stream {stream:?}: {source}")]
    Stream {
        /// The stream's name.
        stream: String,
        /// NATS's error.
        source: async_nats::Error,
    },
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
    /// [`Inbox::cleanup`] with a cutoff that follows the stream and the JetStream consumer rather
    /// than the wall clock: markers are deleted only when older than `retention` before the
    /// publish time of the oldest message still stored in `stream`, and before that of the oldest
    /// message `durable` has not acked (or not yet received), whichever is older. With the stream
    /// empty and nothing pending, the cutoff is `retention` ago.
    ///
    /// So a marker is kept while its message is stored, and `retention` longer: a replay (a
    /// consumer reset, a new consumer from the start) finds it, and a consumer stopped or lagging
    /// for longer than the retention still finds the markers of what it has yet to process. A
    /// stream that keeps its messages forever (no `max_age`, `max_msgs` or `max_bytes`, retention
    /// policy `Limits`) keeps their markers as long: one row per stored message. A stream with
    /// limits, a work queue or an interest stream lets the markers go once their messages are
    /// gone and `retention` has passed. The oldest stored message is the whole stream's, whatever
    /// subject `durable` filters.
    ///
    /// The stream's state and the consumer's progress are read on `js`. When either cannot be
    /// read, nothing is deleted.
    pub async fn cleanup_behind(
        &self,
        consumer: &str,
        js: &jetstream::Context,
        durable: &PullConsumer,
        retention: Duration,
        batch: u32,
    ) -> Result<Option<u64>, CleanupError> {
        let stream = &durable.cached_info().stream_name;
        let stored = stream_lag(js, stream)
            .await
            .map_err(|source| CleanupError::Stream {
                stream: stream.clone(),
                source,
            })?;
        let pending = consumer_lag(js, durable)
            .await
            .map_err(|source| CleanupError::Progress {
                durable: durable.cached_info().name.clone(),
                source,
            })?;
        let lag = stored.max(pending);
        Ok(self
            .cleanup(consumer, retention.saturating_add(lag), batch)
            .await?)
    }
}

/// How long ago the oldest message still stored in `stream` was published, from the stream's
/// state: zero when it stores none.
async fn stream_lag(js: &jetstream::Context, stream: &str) -> Result<Duration, async_nats::Error> {
    let state = js.get_stream(stream).await?.cached_info().state.clone();
    if state.messages == 0 {
        return Ok(Duration::ZERO);
    }
    Ok(age(state.first_timestamp.unix_timestamp_nanos()))
}

/// How long ago the oldest message that `durable` has not acked was published: zero when every
/// message is acked. Conservative: the first message stored after the consumer's ack floor
/// (of its subject, when it filters one) is at most as old as the oldest unacked one.
async fn consumer_lag(
    js: &jetstream::Context,
    durable: &PullConsumer,
) -> Result<Duration, async_nats::Error> {
    let info = durable.get_info().await?;
    if info.num_pending == 0 && info.num_ack_pending == 0 {
        return Ok(Duration::ZERO);
    }
    let subject = match info.config.filter_subject.as_str() {
        "" => ">".to_owned(),
        one => one.to_owned(),
    };
    // Read through the JSON API: a header block the client cannot parse (sent by another
    // client) must not stop cleanup (see `stored.rs`).
    let lookup = Lookup::NextBySubject(info.ack_floor.stream_sequence + 1, &subject);
    let published = match stored::read(js, &info.stream_name, lookup).await? {
        Some(message) => message.published,
        // Nothing stored after the floor any more (removed by the stream's limits): nothing
        // can be redelivered.
        None => return Ok(Duration::ZERO),
    };
    let published = published
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as i128;
    Ok(age(published))
}

/// How long before now `published` (nanoseconds since the Unix epoch) was: zero if later, and
/// at most `u64::MAX` nanoseconds (some 584 years, which keeps every marker) if older.
fn age(published: i128) -> Duration {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos() as i128;
    let ago = (now - published).clamp(0, i128::from(u64::MAX));
    Duration::from_nanos(ago as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_age_is_never_negative_and_saturates() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as i128;
        assert_eq!(age(now + 60_000_000_000), Duration::ZERO);
        let hour_ago = age(now - 3_600_000_000_000);
        assert!(hour_ago >= Duration::from_secs(3600), "{hour_ago:?}");
        assert!(hour_ago < Duration::from_secs(3660), "{hour_ago:?}");
        // Year 1 (Go's zero time), far beyond what u64 nanoseconds hold: kept, not zero.
        assert_eq!(
            age(-62_135_596_800 * 1_000_000_000),
            Duration::from_nanos(u64::MAX)
        );
    }
}
