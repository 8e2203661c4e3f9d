//! What the runtime reports through the [`metrics`](https://docs.rs/metrics) facade: a worker
//! registers its series once, when it starts (install the recorder before), and then costs an
//! atomic operation per event; nothing is recorded unless the application installs a recorder (for example
//! `metrics-exporter-prometheus`, as the examples do). Every series has the label `consumer`
//! (the handler's consumer name).
//!
//! | name | kind | what |
//! |---|---|---|
//! | `inbox_messages_total` | counter | deliveries answered, by `outcome`: `ack` (effect committed), `skip` (duplicate), `nak` (redelivered later), `dead_letter` |
//! | `inbox_retries_total` | counter | in-process retries of a transient failure |
//! | `inbox_handler_seconds` | histogram | one try of a delivery (claim, handler and commit), or of one batch |
//! | `inbox_claim_wait_seconds` | histogram | two-phase: time a delivery waited out another owner's lease on its last delivery |
//! | `inbox_in_flight` | gauge | deliveries being processed |
//! | `inbox_cleanup_deleted_total` | counter | markers deleted by cleanup |
//! | `inbox_cleanup_last_success_timestamp_seconds` | gauge | Unix time of the last cleanup pass that ran (lag: now minus this) |
//! | `inbox_open_claims` | gauge | two-phase: claims open past the sweeper's threshold |
//! | `inbox_oldest_open_claim_seconds` | gauge | two-phase: age of the oldest of them (0 when none) |
//! | `inbox_batch_conflicts_total` | counter | batched: tries of a batch ended by a conflict with another transaction (deadlock, serialization failure, lock timeout, busy); give the handler a `lane` when it moves |
//! | `inbox_batch_retries_total` | counter | batched: tries of a whole batch again after such a conflict |
//! | `inbox_backstop_letters_total` | counter | messages dead-lettered by the delivery-limit backstop (their last delivery ended without a verdict) |
//!
//! A [`Relay`](crate::Relay)'s series have the label `outbox` (the outbox's table) instead:
//!
//! | name | kind | what |
//! |---|---|---|
//! | `inbox_outbox_pending` | gauge | rows committed and not yet marked sent, read at every poll |
//! | `inbox_outbox_oldest_pending_seconds` | gauge | age of the oldest of them (0 when none) |
//! | `inbox_outbox_published_total` | counter | rows JetStream stored as a new message |
//! | `inbox_outbox_republished_total` | counter | rows published again whose PubAck said the stream had them already (a relay died, or its mark failed, after publishing them) |

use metrics::{Counter, Gauge, Histogram};
use std::time::Duration;

/// `inbox_messages_total`.
pub const MESSAGES: &str = "inbox_messages_total";
/// `inbox_retries_total`.
pub const RETRIES: &str = "inbox_retries_total";
/// `inbox_handler_seconds`.
pub const HANDLER_SECONDS: &str = "inbox_handler_seconds";
/// `inbox_claim_wait_seconds`.
pub const CLAIM_WAIT_SECONDS: &str = "inbox_claim_wait_seconds";
/// `inbox_in_flight`.
pub const IN_FLIGHT: &str = "inbox_in_flight";
/// `inbox_cleanup_deleted_total`.
pub const CLEANUP_DELETED: &str = "inbox_cleanup_deleted_total";
/// `inbox_cleanup_last_success_timestamp_seconds`.
pub const CLEANUP_LAST_SUCCESS: &str = "inbox_cleanup_last_success_timestamp_seconds";
/// `inbox_open_claims`.
pub const OPEN_CLAIMS: &str = "inbox_open_claims";
/// `inbox_oldest_open_claim_seconds`.
pub const OLDEST_OPEN_CLAIM: &str = "inbox_oldest_open_claim_seconds";

/// `inbox_batch_conflicts_total`.
pub const BATCH_CONFLICTS: &str = "inbox_batch_conflicts_total";
/// `inbox_batch_retries_total`.
pub const BATCH_RETRIES: &str = "inbox_batch_retries_total";
/// `inbox_backstop_letters_total`.
pub const BACKSTOP_LETTERS: &str = "inbox_backstop_letters_total";

/// `inbox_outbox_pending`.
pub const OUTBOX_PENDING: &str = "inbox_outbox_pending";
/// `inbox_outbox_oldest_pending_seconds`.
pub const OUTBOX_OLDEST_PENDING: &str = "inbox_outbox_oldest_pending_seconds";
/// `inbox_outbox_published_total`.
pub const OUTBOX_PUBLISHED: &str = "inbox_outbox_published_total";
/// `inbox_outbox_republished_total`.
pub const OUTBOX_REPUBLISHED: &str = "inbox_outbox_republished_total";
/// `inbox_task_panics_total`: background tasks (relays, upkeep) that panicked and were started
/// again.
pub const TASK_PANICS: &str = "inbox_task_panics_total";
/// `inbox_outbox_failed_total`: outbox rows NATS refused for good.
pub const OUTBOX_FAILED: &str = "inbox_outbox_failed_total";

/// Registers the descriptions of every series, so that exporters show them (`# HELP`). Called
/// when a worker starts; harmless when no recorder is installed.
pub(crate) fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        MESSAGES,
        "Deliveries answered, by outcome (ack, skip, nak, dead_letter)."
    );
    describe_counter!(RETRIES, "In-process retries of transient failures.");
    describe_histogram!(
        HANDLER_SECONDS,
        Unit::Seconds,
        "One try of a delivery: claim, handler and commit."
    );
    describe_histogram!(
        CLAIM_WAIT_SECONDS,
        Unit::Seconds,
        "Time waited out for another owner's lease on a last delivery."
    );
    describe_gauge!(IN_FLIGHT, "Deliveries being processed.");
    describe_counter!(CLEANUP_DELETED, "Markers deleted by cleanup.");
    describe_gauge!(
        CLEANUP_LAST_SUCCESS,
        Unit::Seconds,
        "Unix time of the last cleanup pass that ran."
    );
    describe_gauge!(OPEN_CLAIMS, "Claims open past the sweeper's threshold.");
    describe_gauge!(
        OLDEST_OPEN_CLAIM,
        Unit::Seconds,
        "Age of the oldest claim open past the threshold."
    );
    describe_counter!(
        BATCH_CONFLICTS,
        "Tries of a batch ended by a conflict with another transaction."
    );
    describe_counter!(
        BATCH_RETRIES,
        "Tries of a whole batch again after a conflict."
    );
    describe_counter!(
        BACKSTOP_LETTERS,
        "Messages dead-lettered by the delivery-limit backstop."
    );
}

/// Counts one message dead-lettered by `consumer`'s delivery-limit backstop.
pub(crate) fn backstop_lettered(consumer: &'static str) {
    metrics::counter!(BACKSTOP_LETTERS, "consumer" => consumer).increment(1);
}

/// A worker's series, registered once when it starts: per message, only atomic operations.
pub(crate) struct Handles {
    ack: Counter,
    skip: Counter,
    nak: Counter,
    dead_letter: Counter,
    retries: Counter,
    batch_conflicts: Counter,
    batch_retries: Counter,
    handler_seconds: Histogram,
    claim_wait: Histogram,
    in_flight: Gauge,
}

impl Handles {
    /// The handles of `consumer`'s series, from the recorder installed now.
    pub(crate) fn new(consumer: &'static str) -> Handles {
        let outcome = |outcome: &'static str| metrics::counter!(MESSAGES, "consumer" => consumer, "outcome" => outcome);
        Handles {
            ack: outcome("ack"),
            skip: outcome("skip"),
            nak: outcome("nak"),
            dead_letter: outcome("dead_letter"),
            retries: metrics::counter!(RETRIES, "consumer" => consumer),
            batch_conflicts: metrics::counter!(BATCH_CONFLICTS, "consumer" => consumer),
            batch_retries: metrics::counter!(BATCH_RETRIES, "consumer" => consumer),
            handler_seconds: metrics::histogram!(HANDLER_SECONDS, "consumer" => consumer),
            claim_wait: metrics::histogram!(CLAIM_WAIT_SECONDS, "consumer" => consumer),
            in_flight: metrics::gauge!(IN_FLIGHT, "consumer" => consumer),
        }
    }

    /// Counts one delivery answered with `outcome` (`ack`, `skip`, `nak`, `dead_letter`).
    pub(crate) fn answered(&self, outcome: &str) {
        match outcome {
            "ack" => &self.ack,
            "skip" => &self.skip,
            "nak" => &self.nak,
            _ => &self.dead_letter,
        }
        .increment(1);
    }

    /// Counts one in-process retry.
    pub(crate) fn retried(&self) {
        self.retries.increment(1);
    }

    /// Counts a batch's tries ended by conflicts, and its tries again.
    pub(crate) fn batch_conflicts(&self, conflicts: u32, retries: u32) {
        self.batch_conflicts.increment(u64::from(conflicts));
        self.batch_retries.increment(u64::from(retries));
    }

    /// Records one try's duration (of one delivery, or of one batch).
    pub(crate) fn tried(&self, took: Duration) {
        self.handler_seconds.record(took.as_secs_f64());
    }

    /// Records a wait for another owner's lease.
    pub(crate) fn claim_waited(&self, took: Duration) {
        self.claim_wait.record(took.as_secs_f64());
    }

    /// `n` more deliveries in flight, until the guard is dropped.
    pub(crate) fn in_flight(&self, n: usize) -> InFlight {
        self.in_flight.increment(n as f64);
        InFlight(self.in_flight.clone(), n)
    }
}

/// Takes its deliveries off [`IN_FLIGHT`] when dropped.
pub(crate) struct InFlight(Gauge, usize);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.decrement(self.1 as f64);
    }
}

/// A cleanup pass that ran and deleted `deleted` markers.
pub(crate) fn cleaned(consumer: &'static str, deleted: u64) {
    metrics::counter!(CLEANUP_DELETED, "consumer" => consumer).increment(deleted);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    metrics::gauge!(CLEANUP_LAST_SUCCESS, "consumer" => consumer).set(now.as_secs_f64());
}

/// What the sweeper found: how many claims are open past its threshold, and the oldest's age.
pub(crate) fn open_claims(consumer: &'static str, open: usize, oldest: Duration) {
    metrics::gauge!(OPEN_CLAIMS, "consumer" => consumer).set(open as f64);
    metrics::gauge!(OLDEST_OPEN_CLAIM, "consumer" => consumer).set(oldest.as_secs_f64());
}

/// Registers the descriptions of a relay's series.
pub(crate) fn describe_outbox() {
    use metrics::{Unit, describe_counter, describe_gauge};
    describe_gauge!(
        OUTBOX_PENDING,
        "Outbox rows committed and not yet marked sent."
    );
    describe_gauge!(
        OUTBOX_OLDEST_PENDING,
        Unit::Seconds,
        "Age of the oldest outbox row not yet marked sent."
    );
    describe_counter!(OUTBOX_PUBLISHED, "Outbox rows stored as a new message.");
    describe_counter!(
        OUTBOX_REPUBLISHED,
        "Outbox rows published again that the stream had already."
    );
    describe_counter!(
        OUTBOX_FAILED,
        "Outbox rows NATS refused for good (kept as failed; their order key waits)."
    );
}

/// What a relay's poll found pending in `outbox`.
pub(crate) fn outbox_pending(outbox: &str, rows: u64, oldest: Duration) {
    let outbox = outbox.to_owned();
    metrics::gauge!(OUTBOX_PENDING, "outbox" => outbox.clone()).set(rows as f64);
    metrics::gauge!(OUTBOX_OLDEST_PENDING, "outbox" => outbox).set(oldest.as_secs_f64());
}

/// Rows of `outbox` a pass published: `new` stored as new messages, `again` already stored.
pub(crate) fn outbox_published(outbox: &str, new: u64, again: u64) {
    let outbox = outbox.to_owned();
    metrics::counter!(OUTBOX_PUBLISHED, "outbox" => outbox.clone()).increment(new);
    metrics::counter!(OUTBOX_REPUBLISHED, "outbox" => outbox).increment(again);
}

/// Rows of `outbox` NATS refused for good.
pub(crate) fn outbox_failed(outbox: &str, rows: u64) {
    metrics::counter!(OUTBOX_FAILED, "outbox" => outbox.to_owned()).increment(rows);
}

/// Background task `task` panicked (and is started again).
pub(crate) fn task_panicked(task: &'static str) {
    metrics::describe_counter!(
        TASK_PANICS,
        "Background tasks (relays, upkeep) that panicked and were started again."
    );
    metrics::counter!(TASK_PANICS, "task" => task).increment(1);
}

/// Duplicates with another payload than their key's first.
const KEY_REUSE: &str = "inbox_key_reuse_total";

/// `consumer` found a key reused with another payload.
pub(crate) fn key_reused(consumer: &'static str) {
    metrics::describe_counter!(
        KEY_REUSE,
        "Duplicates whose payload differs from the one their key was first processed with."
    );
    metrics::counter!(KEY_REUSE, "consumer" => consumer).increment(1);
}
