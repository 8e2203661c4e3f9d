//! How an inbox table is laid out: one plain table, or range partitions of `received_at`
//! (PostgreSQL, opt in). Only the configuration: the SQL is the dialect's (`backend/postgres/
//! partitioned.rs`), the upkeep the store's (`store/partitions.rs`) and the worker's
//! (`worker/upkeep.rs`). See ARCHITECTURE.md ("The partitioned inbox") for why a twin still
//! waits.

use std::time::Duration;

/// How a partitioned inbox table is cut: one partition per `span` of `received_at` (aligned on
/// the Unix epoch, so daily partitions run from UTC midnight to UTC midnight), with `ahead`
/// partitions created beyond the current one.
///
/// ```
/// use inbox_runtime::Partitions;
/// use std::time::Duration;
/// let daily = Partitions::daily();
/// assert_eq!(daily.span_duration(), Duration::from_secs(86_400));
/// let hourly = Partitions::daily().span(Duration::from_secs(3600)).ahead(24);
/// assert_eq!(hourly.ahead_count(), 24);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Partitions {
    span: Duration,
    ahead: u32,
}

impl Partitions {
    /// One partition per UTC day, three created ahead of today.
    pub fn daily() -> Self {
        Partitions {
            span: Duration::from_secs(86_400),
            ahead: 3,
        }
    }

    /// How much of `received_at` one partition holds: rounded down to whole hours, at least one
    /// hour. Cleanup frees space a partition at a time, so markers are kept up to one span longer
    /// than the retention. Keep one span for the life of a table: partitions of a different span
    /// that would overlap existing ones are not created.
    pub fn span(mut self, span: Duration) -> Self {
        let hours = (span.as_secs() / 3600).max(1);
        self.span = Duration::from_secs(hours * 3600);
        self
    }

    /// How many partitions are created beyond the current one (default 3, at least 1): the time
    /// the worker may be down before a marker has no partition to go to (its claim then fails,
    /// and the message is redelivered later; nothing is lost or dead-lettered at once).
    pub fn ahead(mut self, ahead: u32) -> Self {
        self.ahead = ahead.max(1);
        self
    }

    /// The span of one partition.
    pub fn span_duration(&self) -> Duration {
        self.span
    }

    /// How many partitions are created ahead.
    pub fn ahead_count(&self) -> u32 {
        self.ahead
    }

    /// How often a worker creates the partitions ahead: a quarter of a span, at most an hour.
    pub(crate) fn upkeep_every(&self) -> Duration {
        (self.span / 4).min(Duration::from_secs(3600))
    }
}

/// The layout of an inbox table (not public API: `layout` is a private module).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Layout {
    /// One table, UNIQUE (consumer, message_key); cleanup deletes rows.
    #[default]
    Plain,
    /// Range partitions of `received_at`; cleanup drops partitions.
    Partitioned(Partitions),
}
