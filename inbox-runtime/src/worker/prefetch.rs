//! Prefetch (`WorkerBuilder::prefetch`): a message fetched beyond the concurrency waits on its
//! task for a permit to run. The permit is asked for in the pull loop, as the message is
//! dispatched, so that permits go out in delivery order (the semaphore serves its waiters in
//! order; the tasks' first polls come in no set order). While it waits, the message gets
//! progress acks; once the shutdown has begun it is given back, unless on its last delivery.

use super::Inner;
use super::serve::with_progress;
use crate::handler::Handler;
use async_nats::jetstream::{self, AckKind};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;
use tokio::sync::{AcquireError, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

type Acquire = Pin<Box<dyn Future<Output = Result<OwnedSemaphorePermit, AcquireError>> + Send>>;

/// A fetched message's permit to run: taken at once, or asked for and in the queue.
pub(super) enum Turn {
    Now(OwnedSemaphorePermit),
    Queued(Acquire),
}

impl Turn {
    /// Asks `running` for a permit, in the queue from now on when none is free.
    pub(super) async fn ask(running: &Arc<Semaphore>) -> Turn {
        // A free permit means no one waits: the semaphore hands released permits to its
        // waiters first.
        if let Ok(permit) = running.clone().try_acquire_owned() {
            return Turn::Now(permit);
        }
        let mut acquire: Acquire = Box::pin(running.clone().acquire_owned());
        // Polled once here, which puts it in the semaphore's queue.
        match std::future::poll_fn(|cx| Poll::Ready(acquire.as_mut().poll(cx))).await {
            Poll::Ready(permit) => Turn::Now(permit.expect("the semaphore is never closed")),
            Poll::Pending => Turn::Queued(acquire),
        }
    }

    /// The permit, once `message` (its `last` delivery or not) has its turn. `None`: the
    /// shutdown came first and, not on its last delivery, the message was given back.
    pub(super) async fn take<H: Handler>(
        self,
        inner: &Inner<H>,
        message: &jetstream::Message,
        shutdown: &CancellationToken,
        last: bool,
    ) -> Option<OwnedSemaphorePermit> {
        let mut acquire = match self {
            Turn::Now(permit) => return Some(permit),
            Turn::Queued(acquire) => acquire,
        };
        let every = inner.settings.progress_every;
        let turn = with_progress(&[message], every, async {
            // Once the shutdown has begun, what has not started is given back, even with a
            // permit free: as what the pull brings then.
            tokio::select! {
                biased;
                _ = shutdown.cancelled(), if !last => None,
                permit = &mut acquire => Some(permit.expect("the semaphore is never closed")),
            }
        })
        .await;
        if turn.is_none() {
            // No pull request is sent once stopping, so none open outlasts this delay.
            give_back(
                message,
                Some(inner.settings.fetch_expiry + Duration::from_millis(100)),
            )
            .await;
        }
        turn
    }
}

/// Gives `message`, fetched but not started, back to JetStream on shutdown: a nak delayed by
/// `delay` (none: no pull request is open), past the pull requests still open, so that it goes
/// to another instance rather than straight back to this one.
pub(super) async fn give_back(message: &jetstream::Message, delay: Option<Duration>) {
    if let Err(e) = message.ack_with(AckKind::Nak(delay)).await {
        tracing::debug!(error = %e, "nak on shutdown failed");
    }
}
