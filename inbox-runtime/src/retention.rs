//! How long a marker must be kept: longer than any redelivery of its message can come.

use async_nats::jetstream::{consumer, stream};
use std::fmt;
use std::time::Duration;

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
    /// The stream's `max_age` (zero: unlimited, counted as zero).
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
