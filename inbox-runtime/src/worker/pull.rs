//! Pulling: one long-lived subscription on an inbox of our own, and pull requests sent to it as
//! capacity frees, so that what is requested and not yet delivered never exceeds the free permits
//! (a message never waits for a slot while its `ack_wait` runs). One task per message holds its
//! permit. Pull errors are waited out with capped backoff, and on shutdown every message that
//! arrives for a request still open is nak'd, so that it goes to another instance as soon as the
//! pull it came on has expired (or, on its last delivery, is served to the end). Each pull
//! session starts by reading the consumer's `max_deliver` again (`max_deliver.rs`).
//!
//! Why not a new subscription per fetch (`consumer.batch()`): in steady state a permit frees at a
//! time, so that was a SUB, a pull request and an UNSUB per message or two, which cost the
//! nats-server twice the CPU per message of one subscription fed by requests. Why not
//! async-nats's `consumer.stream()`: it asks for a new batch whenever half of the last one has
//! arrived, whatever the consumer can start, so up to one and a half batches wait in the client
//! with their `ack_wait` running.

use super::Inner;
use super::serve::with_progress;
use super::serve_batch::Waiting;
use super::slots::{Ready, Slots};
use crate::backoff::Backoff;
use crate::handler::Handler;
use async_nats::StatusCode;
use async_nats::jetstream::consumer::pull::BatchConfig;
use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long after its expiry a request that brought neither all its messages nor a 408 is given
/// up for lost (a restarted server, a lost connection), and its permits asked for again.
const LOST_AFTER: Duration = Duration::from_secs(1);

/// The pull requests sent and not yet used up, oldest first: the server serves a client's
/// waiting requests in order.
#[derive(Debug, Default)]
struct Open {
    requests: VecDeque<Request>,
    /// Messages asked for and not yet delivered.
    outstanding: usize,
}

#[derive(Debug)]
struct Request {
    /// Messages it may still bring.
    remaining: usize,
    /// When the server expires it.
    expires: Instant,
}

impl Open {
    fn sent(&mut self, batch: usize, expires: Instant) {
        self.outstanding += batch;
        self.requests.push_back(Request {
            remaining: batch,
            expires,
        });
    }

    /// A message arrived: it used up one message of the oldest request.
    fn delivered(&mut self) {
        if let Some(front) = self.requests.front_mut() {
            front.remaining -= 1;
            self.outstanding -= 1;
            if front.remaining == 0 {
                self.requests.pop_front();
            }
        }
    }

    /// The oldest request ended (expired, or refused) with what it had not brought.
    fn ended(&mut self) {
        if let Some(front) = self.requests.pop_front() {
            self.outstanding -= front.remaining;
        }
    }

    /// Forgets requests expired more than [`LOST_AFTER`] ago without a word from the server.
    fn forget_lost(&mut self, now: Instant) -> bool {
        let mut lost = false;
        while self
            .requests
            .front()
            .is_some_and(|r| r.expires + LOST_AFTER <= now)
        {
            self.ended();
            lost = true;
        }
        lost
    }

    /// When the oldest request is given up for lost.
    fn next_lost(&self) -> Option<Instant> {
        self.requests.front().map(|r| r.expires + LOST_AFTER)
    }

    /// When the last open request expires at the server.
    fn last_expiry(&self) -> Option<Instant> {
        self.requests.back().map(|r| r.expires)
    }

    fn clear(&mut self) {
        self.requests.clear();
        self.outstanding = 0;
    }
}

/// Pulls until `shutdown`, spawning each message's processing on `tasks`.
pub(super) async fn run<H>(inner: &Arc<Inner<H>>, shutdown: &CancellationToken, tasks: &TaskTracker)
where
    H: Handler,
{
    let concurrency = inner.settings.concurrency;
    let permits = Arc::new(Semaphore::new(concurrency));
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
    // The highest delivery sequence seen: a consumer numbers its deliveries 1, 2, .. for as long
    // as it lives, so one that goes back is a new consumer, on a stream that may be new too.
    let mut last_delivery = 0;
    while !shutdown.is_cancelled() {
        // A session that starts (the first, or one after a pull error: perhaps a consumer
        // updated or created again) reads the consumer's max_deliver first, so that it judges
        // last deliveries by the limit the server has now.
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = inner.refresh_max_deliver() => {}
        }
        let mut session = Session {
            inner,
            shutdown,
            tasks,
            permits: &permits,
            free: Vec::new(),
            open: Open::default(),
            last_delivery: &mut last_delivery,
            slots: inner
                .settings
                .batch
                .map(|b| Slots::new(&inner.turns, b.max_messages, b.max_wait)),
        };
        match session.pull().await {
            Ok(()) => break,
            Err(e) => {
                // The consumer (and its stream) may have been deleted and created again.
                inner.stream_created.forget();
                pause(&mut backoff, shutdown, "pulling failed", e).await;
            }
        }
    }
}

/// One subscription and the requests sent to it.
struct Session<'a, H: Handler> {
    inner: &'a Arc<Inner<H>>,
    shutdown: &'a CancellationToken,
    tasks: &'a TaskTracker,
    permits: &'a Arc<Semaphore>,
    /// Permits held for the requests open, and for those to be sent: never fewer than
    /// `open.outstanding`.
    free: Vec<OwnedSemaphorePermit>,
    open: Open,
    last_delivery: &'a mut u64,
    /// Deliveries collected for the next batches (batched mode only).
    slots: Option<Slots<Waiting>>,
}

impl<H> Session<'_, H>
where
    H: Handler,
{
    /// Pulls until shutdown (`Ok`) or until the subscription or a request fails (`Err`).
    async fn pull(&mut self) -> Result<(), String> {
        let inner = self.inner;
        let settings = &inner.settings;
        let client = inner.jetstream.client();
        let inbox = client.new_inbox();
        let mut subscription = client
            .subscribe(inbox.clone())
            .await
            .map_err(|e| format!("subscribing to {inbox}: {e}"))?;
        let concurrency = settings.concurrency;
        // Ask for messages once at least this many can start: one request per message would
        // cost the server (and us) a request each; waiting for all would leave slots idle.
        let refill_at = concurrency.div_ceil(2);
        let mut stopping = false;
        // Idle heartbeats while a request is open (the server allows at most half the expiry).
        let heartbeat = (settings.fetch_expiry / 2).min(Duration::from_secs(5));
        let mut heard = Instant::now();
        let result = loop {
            if !stopping && !inner.circuit.is_open() {
                self.take_free_permits();
                let room = self.free.len().saturating_sub(self.open.outstanding);
                if room > 0 && (room >= refill_at || self.open.outstanding == 0) {
                    let batch = room.min(settings.max_batch);
                    let request = BatchConfig {
                        batch,
                        expires: Some(settings.fetch_expiry),
                        idle_heartbeat: heartbeat,
                        ..Default::default()
                    };
                    if self.open.outstanding == 0 {
                        heard = Instant::now();
                    }
                    let expires = Instant::now() + settings.fetch_expiry;
                    if let Err(e) = inner
                        .consumer
                        .request_batch(request, inbox.clone().into())
                        .await
                    {
                        break Err(format!("pull request: {e}"));
                    }
                    self.open.sent(batch, expires);
                }
            }
            if stopping && self.open.outstanding == 0 {
                break Ok(());
            }
            let wants_permit = !stopping && self.free.len() < concurrency;
            let lost_at = self.open.next_lost();
            // A server that sends neither messages nor heartbeats for two heartbeats while
            // requests are open has lost them (restarted, or the connection was replaced).
            let silent_at = (self.open.outstanding > 0).then(|| heard + heartbeat * 2);
            let batch_due = self.slots.as_ref().and_then(Slots::next_due);
            let next = tokio::select! {
                biased;
                _ = self.shutdown.cancelled(), if !stopping => {
                    stopping = true;
                    self.flush_batches(None);
                    continue;
                }
                _ = sleep_until(batch_due), if batch_due.is_some() => {
                    self.flush_batches(batch_due);
                    continue;
                }
                next = subscription.next() => next,
                permit = self.permits.clone().acquire_owned(), if wants_permit => {
                    self.free.push(permit.expect("the semaphore is never closed"));
                    continue;
                }
                _ = inner.circuit.closed(), if inner.circuit.is_open() && !stopping => continue,
                _ = sleep_until(silent_at), if silent_at.is_some() => {
                    tracing::debug!(?heartbeat, "no heartbeat from open pull requests; asking again");
                    self.open.clear();
                    continue;
                }
                _ = sleep_until(lost_at), if lost_at.is_some() => {
                    if self.open.forget_lost(Instant::now()) {
                        tracing::debug!("a pull request expired without an answer; asking again");
                    }
                    continue;
                }
            };
            let Some(message) = next else {
                break Err("the pull subscription ended".into());
            };
            heard = Instant::now();
            match message.status {
                None | Some(StatusCode::OK) => {}
                Some(StatusCode::IDLE_HEARTBEAT) => continue,
                // A request expired, or the server ended it, with what it had not brought.
                Some(StatusCode::TIMEOUT | StatusCode::REQUEST_TERMINATED) => {
                    let description = message.description.as_deref().unwrap_or("");
                    match description {
                        "Consumer Deleted" | "Consumer is push based" => {
                            break Err(format!("pull ended: {description}"));
                        }
                        d if d.starts_with("Exceeded MaxRequest") => {
                            break Err(format!("the consumer refuses our pull requests: {d}"));
                        }
                        // Every request open is void after a leader change.
                        "Leadership Change" => self.open.clear(),
                        _ => self.open.ended(),
                    }
                    continue;
                }
                Some(status) => {
                    let description = message.description.unwrap_or_default();
                    break Err(format!("pull answered {status} {description}"));
                }
            }
            self.open.delivered();
            let message = jetstream::Message {
                message,
                context: inner.jetstream.clone(),
            };
            self.dispatch(message, stopping).await;
        };
        self.flush_batches(None);
        if let Err(e) = subscription.unsubscribe().await {
            tracing::debug!(error = %e, "unsubscribing the pull inbox failed");
        }
        result
    }

    /// Takes every free permit of the semaphore, up to the concurrency.
    fn take_free_permits(&mut self) {
        while self.free.len() < self.inner.settings.concurrency {
            match self.permits.clone().try_acquire_owned() {
                Ok(p) => self.free.push(p),
                Err(_) => break,
            }
        }
    }

    /// Serves `message` on a task of its own, holding a permit; or, while stopping and unless it
    /// is its last delivery, naks it.
    async fn dispatch(&mut self, message: jetstream::Message, stopping: bool) {
        let inner = self.inner;
        let (last, delivery_seq) = message.info().map_or((false, 0), |i| {
            (inner.last_delivery(i.delivered), i.consumer_sequence)
        });
        if delivery_seq <= *self.last_delivery {
            // The stream's creation time, which the default key names, must be looked up
            // again: its messages may be another stream's under the same name.
            inner.stream_created.forget();
        }
        *self.last_delivery = delivery_seq;
        if stopping && !last {
            // Fetched but not started: given back rather than left to wait out ack_wait. While
            // a request of ours is open at the server, a nak without delay would bring the message
            // straight back to it, spending a delivery each time until max_deliver: the delay
            // outlasts the last open request.
            let delay = self.open.last_expiry().map(|at| {
                at.saturating_duration_since(Instant::now()) + Duration::from_millis(100)
            });
            if let Err(e) = message.ack_with(AckKind::Nak(delay)).await {
                tracing::debug!(error = %e, "nak on shutdown failed");
            }
            return;
        }
        // Served, also while stopping when this is its last delivery: a nak would never be
        // redelivered, so it is processed (or dead-lettered) to the end, and shutdown waits.
        let permit = match self.free.pop() {
            Some(permit) => Some(permit),
            // More arrived than asked for (a request given up for lost came through after all):
            // it waits for a slot like any other, with progress acks so that its delivery does
            // not end at the server meanwhile.
            None if !stopping => {
                let every = inner.settings.progress_every;
                let waiting = self.permits.clone().acquire_owned();
                with_progress(&[&message], every, waiting).await.ok()
            }
            None => None,
        };
        if let Some(slots) = self.slots.as_mut().filter(|_| !stopping) {
            let slot = match H::LANED {
                true => inner
                    .lane(&message)
                    .map_or(0, |lane| lane.slot(slots.len())),
                false => 0,
            };
            if let Some(ready) = slots.push(slot, (message, permit)) {
                self.start_batch(ready);
            }
            return;
        }
        let (inner, shutdown) = (inner.clone(), self.shutdown.clone());
        self.tasks
            .spawn(async move { inner.serve(message, permit, shutdown).await });
    }

    /// Starts the batches due by `due` (all of them with `None`), each on a task of its own.
    fn flush_batches(&mut self, due: Option<Instant>) {
        let ready = match self.slots.as_mut() {
            Some(slots) => slots.take_due(due),
            None => return,
        };
        for ready in ready {
            self.start_batch(ready);
        }
    }

    /// Starts `ready` on a task of its own.
    fn start_batch(&self, ready: Ready<Waiting>) {
        let (inner, shutdown, tasks) = (
            self.inner.clone(),
            self.shutdown.clone(),
            self.tasks.clone(),
        );
        self.tasks.spawn(async move {
            inner
                .serve_batch(ready.batch, ready.turn, shutdown, tasks)
                .await
        });
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_requests_are_used_up_oldest_first_and_lost_ones_forgotten() {
        let t = Instant::now();
        let mut open = Open::default();
        open.sent(2, t + Duration::from_secs(2));
        open.sent(3, t + Duration::from_secs(4));
        assert_eq!(open.outstanding, 5);
        open.delivered();
        open.delivered();
        assert_eq!((open.outstanding, open.requests.len()), (3, 1));
        assert_eq!(open.last_expiry(), Some(t + Duration::from_secs(4)));
        assert!(!open.forget_lost(t + Duration::from_secs(4)));
        assert!(open.forget_lost(t + Duration::from_secs(5)));
        assert_eq!((open.outstanding, open.requests.len()), (0, 0));
        open.sent(4, t);
        open.delivered();
        open.ended();
        assert_eq!(open.outstanding, 0);
        open.ended();
        open.delivered();
        assert_eq!(open.outstanding, 0);
    }
}
