//! A worker's background tasks beside the pull loop, each a periodic pass until shutdown:
//! cleanup of old markers, partitions ahead, the sweep of open two-phase claims, the dead
//! letters parked in the database, the read of the consumer's `max_deliver`, and the release of
//! connections kept idle.

use super::Inner;
use super::check::Sweep;
use super::dead_letter;
use crate::backend::InboxBackend;
use crate::handler::Handler;
use crate::layout::Partitions;
use crate::periodic::Every;
use crate::store::{Inbox, KEPT_IDLE};
use async_nats::jetstream;
use async_nats::jetstream::consumer::PullConsumer;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

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

/// Runs [`Inbox::cleanup_behind`] for `consumer` (behind `durable`, read on `js`) on `schedule`
/// until `shutdown`; failures are logged and retried at the next tick.
pub(super) async fn clean_up<DB: InboxBackend>(
    inbox: Inbox<DB>,
    consumer: &'static str,
    (js, durable): (jetstream::Context, PullConsumer),
    schedule: Schedule,
    shutdown: CancellationToken,
) {
    let mut every = Every::new(schedule.every, shutdown);
    // Passes in a row in which another instance held the lock. Instances clean up in turns, so a
    // long run of them means the lock is stuck (a session that holds it and does nothing, or a
    // pooler that pins advisory locks to the wrong session), and cleanup has silently stopped.
    let mut skipped = 0u32;
    while every.tick().await {
        let pass = inbox.cleanup_behind(consumer, &js, &durable, schedule.retention, BATCH);
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

/// Creates partitions ahead every [`Partitions::upkeep_every`] until `shutdown`, so that a
/// worker keeps its table ready for the markers to come whether or not it cleans up.
pub(super) async fn add_partitions<DB: InboxBackend>(
    inbox: Inbox<DB>,
    partitions: Partitions,
    shutdown: CancellationToken,
) {
    let mut every = Every::new(partitions.upkeep_every(), shutdown);
    while every.tick().await {
        match inbox.add_partitions().await {
            Ok(0) => {}
            Ok(n) => {
                tracing::info!(table = %inbox.table(), created = n, "inbox partitions created")
            }
            Err(e) => {
                tracing::warn!(table = %inbox.table(), error = %e, "creating inbox partitions failed")
            }
        }
    }
}

/// Reports the claims of a two-phase handler left open past the threshold, every period, until
/// `shutdown`: a warning each, and their number in [`Stats::open_claims`].
pub(super) async fn sweep_open_claims<H: Handler>(
    inner: Arc<Inner<H>>,
    sweep: Sweep,
    shutdown: CancellationToken,
) {
    let mut every = Every::new(sweep.every, shutdown);
    while every.tick().await {
        match inner.inbox.open_claims(H::CONSUMER, sweep.older_than).await {
            Ok(open) => {
                for claim in &open {
                    tracing::warn!(
                        consumer = H::CONSUMER,
                        key = %claim.key,
                        age = ?claim.age,
                        fence = claim.fence,
                        attempts = claim.attempts,
                        lease_left = ?claim.lease_left,
                        "claim open longer than {:?}: its side effect may not have happened; release or forget it (Inbox::release_claim, Inbox::forget_claim) once its owner is known to be gone",
                        sweep.older_than
                    );
                }
                inner
                    .counters
                    .open_claims
                    .store(open.len() as u64, Ordering::Relaxed);
                let oldest = open.iter().map(|c| c.age).max().unwrap_or_default();
                crate::metrics::open_claims(H::CONSUMER, open.len(), oldest);
            }
            Err(e) => {
                tracing::debug!(consumer = H::CONSUMER, error = %e, "listing open claims failed")
            }
        }
    }
}

/// How often parked dead letters are retried.
const RELAY_EVERY: Duration = Duration::from_secs(5);

/// Publishes the dead letters parked in the database for this handler's consumer (see
/// `dead_letter.rs`) every few seconds, until `shutdown`.
pub(super) async fn relay_parked_letters<H: Handler>(
    inner: Arc<Inner<H>>,
    shutdown: CancellationToken,
) {
    let mut every = Every::new(RELAY_EVERY, shutdown);
    while every.tick().await {
        let js = &inner.jetstream;
        let relayed =
            dead_letter::relay_parked(&inner.inbox, &inner.dead_letters, js, H::CONSUMER).await;
        match relayed {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                consumer = H::CONSUMER,
                letters = n,
                "parked dead letters published"
            ),
            Err(e) => {
                tracing::debug!(consumer = H::CONSUMER, error = %e, "parked dead letters not published yet")
            }
        }
    }
}

/// Reads the consumer's `max_deliver` again every `Settings::max_deliver_every` until
/// `shutdown` (see `max_deliver.rs`), so that a worker whose pull session lasts sees a change
/// within a minute. The first read is the pull session's, at start.
pub(super) async fn refresh_max_deliver<H: Handler>(
    inner: Arc<Inner<H>>,
    shutdown: CancellationToken,
) {
    let mut every = Every::new(inner.settings.max_deliver_every, shutdown.clone());
    // The first tick is at once, when the pull session reads it anyway.
    if !every.tick().await {
        return;
    }
    while every.tick().await {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = inner.refresh_max_deliver() => {}
        }
    }
}

/// Gives back to the pool, twice per [`KEPT_IDLE`], the connections the tries kept and have not
/// used for that long (see `store/kept.rs`), until `shutdown`.
pub(super) async fn release_kept_connections<DB: InboxBackend>(
    inbox: Inbox<DB>,
    shutdown: CancellationToken,
) {
    let mut every = Every::new(KEPT_IDLE / 2, shutdown);
    while every.tick().await {
        inbox.release_idle_connections();
    }
}
