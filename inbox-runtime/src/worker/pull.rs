//! Pulling: as many messages as there are free permits (never more than can start now), one task
//! per message holding its permit, pull errors waited out with capped backoff, and on shutdown a
//! nak for every message fetched but not started, so that it goes to another instance as soon as
//! the pull it came on has expired (or, on its last delivery, is served to the end).

use super::Inner;
use crate::backoff::Backoff;
use crate::handler::Handler;
use async_nats::jetstream::AckKind;
use futures::StreamExt;
use serde::de::DeserializeOwned;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Pulls until `shutdown`, spawning each message's processing on `tasks`. Returns the NATS client
/// the messages came on (to flush), if any came.
pub(super) async fn run<H>(
    inner: &Arc<Inner<H>>,
    shutdown: &CancellationToken,
    tasks: &TaskTracker,
) -> Option<async_nats::Client>
where
    H: Handler,
    H::Message: DeserializeOwned,
{
    let concurrency = inner.settings.concurrency;
    let permits = Arc::new(Semaphore::new(concurrency));
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
    let mut client = None;
    // The highest delivery sequence seen: a consumer numbers its deliveries 1, 2, .. for as long
    // as it lives, so one that goes back is a new consumer, on a stream that may be new too.
    let mut last_delivery = 0;
    while let Some(mut free) = free_permits(&permits, concurrency, shutdown).await {
        // While the database is unreachable, nothing new is fetched (see `circuit.rs`).
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            _ = inner.circuit.closed() => {}
        }
        let (requested, mut received) = (free.len(), 0);
        let request = inner
            .consumer
            .batch()
            .max_messages(free.len())
            .expires(inner.settings.fetch_expiry)
            .messages();
        let (mut batch, pulled_at) = match request.await {
            // Taken once the request is out: the server's expiry starts no earlier.
            Ok(batch) => (batch, tokio::time::Instant::now()),
            Err(e) => {
                inner.stream_created.forget();
                pause(&mut backoff, shutdown, "pull request failed", e.to_string()).await;
                continue;
            }
        };
        let mut stopping = false;
        loop {
            let next = tokio::select! {
                biased;
                _ = shutdown.cancelled(), if !stopping => {
                    stopping = true;
                    continue;
                }
                next = batch.next() => next,
            };
            let message = match next {
                None => break,
                Some(Ok(message)) => message,
                Some(Err(e)) => {
                    // The consumer (and its stream) may have been deleted and created again.
                    inner.stream_created.forget();
                    pause(&mut backoff, shutdown, "pull failed", e.to_string()).await;
                    break;
                }
            };
            backoff.reset();
            received += 1;
            client.get_or_insert_with(|| message.context.client());
            let (last, delivery_seq) = message.info().map_or((false, 0), |i| {
                (
                    i.delivered >= inner.settings.limits.max_deliver,
                    i.consumer_sequence,
                )
            });
            if delivery_seq <= last_delivery {
                // The stream's creation time, which the default key names, must be looked up
                // again: its messages may be another stream's under the same name.
                inner.stream_created.forget();
            }
            last_delivery = delivery_seq;
            let permit = free.pop();
            if stopping && !last {
                // Fetched but not started: given back rather than left to wait out ack_wait. A
                // pull that has not brought all it asked for stays open at the server until it
                // expires, and a nak without delay would bring the message straight back to it,
                // spending a delivery each time until max_deliver: the delay outlasts the pull.
                let delay = if received >= requested {
                    None
                } else {
                    let open_for = inner
                        .settings
                        .fetch_expiry
                        .saturating_sub(pulled_at.elapsed());
                    Some(open_for + Duration::from_millis(100))
                };
                if let Err(e) = message.ack_with(AckKind::Nak(delay)).await {
                    tracing::debug!(error = %e, "nak on shutdown failed");
                }
                continue;
            }
            // Served, also while stopping when this is its last delivery: a nak would never be
            // redelivered, so it is processed (or dead-lettered) to the end, and shutdown waits.
            let (inner, shutdown) = (inner.clone(), shutdown.clone());
            tasks.spawn(async move { inner.serve(message, permit, shutdown).await });
        }
    }
    client
}

/// Waits for at least one free permit and takes every other free one; `None` on shutdown.
async fn free_permits(
    permits: &Arc<Semaphore>,
    concurrency: usize,
    shutdown: &CancellationToken,
) -> Option<Vec<OwnedSemaphorePermit>> {
    let first = tokio::select! {
        biased;
        _ = shutdown.cancelled() => return None,
        p = permits.clone().acquire_owned() => p.expect("the semaphore is never closed"),
    };
    let mut free = vec![first];
    while free.len() < concurrency {
        match permits.clone().try_acquire_owned() {
            Ok(p) => free.push(p),
            Err(_) => break,
        }
    }
    Some(free)
}

/// Logs `what` failed with `error`, then sleeps the backoff's next wait, or until shutdown.
async fn pause(
    backoff: &mut Backoff,
    shutdown: &CancellationToken,
    what: &str,
    error: impl std::fmt::Display,
) {
    let wait = backoff.next();
    tracing::warn!(%error, retry_in = ?wait, "{what}");
    tokio::select! {
        _ = shutdown.cancelled() => {}
        _ = tokio::time::sleep(wait) => {}
    }
}
