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
//!
//! With prefetch (`WorkerBuilder::prefetch`), the permits to fetch are the concurrency's and the
//! prefetch's: a message fetched beyond the concurrency waits on its task, with progress acks,
//! for a permit to run (the semaphore serves waiters in order), and a request is sent only once
//! half the prefetch can be asked for, so that it brings several messages while those fetched
//! ahead keep every permit busy.

use super::Inner;
use super::prefetch::{Turn, give_back};
use super::requests::{Budget, Held, Open, SUBJECTS_ROOM};
use super::serve::with_progress;
use super::serve_batch::Waiting;
use super::slots::{Ready, Slots};
use crate::backoff::Backoff;
use crate::handler::Handler;
use async_nats::StatusCode;
use async_nats::jetstream;
use async_nats::jetstream::consumer::pull::BatchConfig;
use futures::StreamExt;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Pulls until `shutdown`, spawning each message's processing on `tasks`.
pub(super) async fn run<H>(inner: &Arc<Inner<H>>, shutdown: &CancellationToken, tasks: &TaskTracker)
where
    H: Handler,
{
    let concurrency = inner.settings.concurrency;
    let prefetch = inner.settings.prefetch;
    // The permits to fetch; with prefetch, those to run are the concurrency's.
    let permits = Arc::new(Semaphore::new(concurrency + prefetch));
    let running = (prefetch > 0).then(|| Arc::new(Semaphore::new(concurrency)));
    let mut budget = Budget {
        bytes: Arc::new(Semaphore::new(0)),
        size: 0,
    };
    budget.fit(inner.settings.max_bytes);
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
            running: running.as_ref(),
            free: Vec::new(),
            budget: &mut budget,
            free_bytes: None,
            open: Open::default(),
            last_delivery: &mut last_delivery,
            slots: inner.settings.batch.map(|b| {
                Slots::new(
                    &inner.turns,
                    &inner.connections,
                    b.max_messages,
                    b.max_wait,
                    inner.settings.progress_every,
                )
            }),
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
    /// With prefetch, the permits to run (the concurrency's), which a fetched message waits for.
    running: Option<&'a Arc<Semaphore>>,
    /// Permits held for the requests open, and for those to be sent: never fewer than
    /// `open.outstanding`.
    free: Vec<OwnedSemaphorePermit>,
    budget: &'a mut Budget,
    /// Bytes of the budget held for the requests to be sent.
    free_bytes: Option<OwnedSemaphorePermit>,
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
        // The permits to fetch, and how many must be free for a request to go out: with
        // prefetch, half of it, so that a request brings several messages, while those fetched
        // ahead (at least the other half) keep the permits to run busy.
        let capacity = settings.concurrency + settings.prefetch;
        let least_batch = (settings.prefetch / 2).max(1);
        // A message of the largest size the server allows always fits in the budget, and a
        // request is sent only with room for one (or as much as the consumer lets one ask for),
        // so that no message is refused for good for its size.
        let biggest = client.server_info().max_payload + SUBJECTS_ROOM;
        self.budget.fit(biggest);
        let least_bytes = biggest.min(settings.max_request_bytes);
        let mut unbounded_next = false;
        let mut stopping = false;
        // Idle heartbeats while a request is open (the server allows at most half the expiry).
        let heartbeat = (settings.fetch_expiry / 2).min(Duration::from_secs(5));
        let mut heard = Instant::now();
        let result = loop {
            let mut wants_bytes = false;
            if !stopping && !inner.circuit.is_open() {
                self.take_free_permits();
                self.take_free_bytes();
                let room = self.free.len().saturating_sub(self.open.outstanding);
                let free_bytes = self.free_bytes.as_ref().map_or(0, |p| p.num_permits());
                // One request open at a time: the server serves a client's requests in turn,
                // not in order, so with two open a delivery could not be told apart, nor its
                // bytes counted against the right one.
                let due = room >= least_batch && self.open.requests.is_empty();
                wants_bytes = due && free_bytes < least_bytes;
                if due && !wants_bytes {
                    let mut batch = room.min(settings.max_batch);
                    // As many bytes as `batch` messages of the largest size, if free: small
                    // messages fill the batch, large ones stop at the budget.
                    let mut max_bytes = free_bytes
                        .min(batch.saturating_mul(biggest))
                        .min(settings.max_request_bytes);
                    let mut held = max_bytes;
                    if unbounded_next {
                        // The next message is larger than any request of ours may ask for (the
                        // consumer's max_bytes is below it): one message, without max_bytes,
                        // so that it is not held up for ever; over the budget by one at most.
                        (batch, max_bytes, held) = (1, 0, free_bytes.min(biggest));
                        unbounded_next = false;
                    }
                    let bytes = self
                        .free_bytes
                        .as_mut()
                        .and_then(|p| p.split(held))
                        .expect("the free bytes were counted above");
                    let request = BatchConfig {
                        batch,
                        max_bytes,
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
                    self.open.sent(batch, bytes, expires);
                }
            }
            if stopping && self.open.outstanding == 0 {
                break Ok(());
            }
            let wants_permit = !stopping && self.free.len() < capacity;
            let lost_at = self.open.next_lost();
            // A server that sends neither messages nor heartbeats for two heartbeats while
            // requests are open has lost them (restarted, or the connection was replaced).
            let silent_at = (self.open.outstanding > 0).then(|| heard + heartbeat * 2);
            let batch_due = self.slots.as_ref().and_then(|s| s.next_due(Instant::now()));
            let next = tokio::select! {
                biased;
                _ = self.shutdown.cancelled(), if !stopping => {
                    stopping = true;
                    self.flush_batches(None);
                    continue;
                }
                _ = sleep_until(batch_due), if batch_due.is_some() => {
                    self.flush_batches(Some(Instant::now()));
                    continue;
                }
                // A batch gave its slot's turn or a connection back: a batch may go.
                _ = inner.turns.freed.notified(), if batch_due.is_some() => {
                    self.flush_batches(Some(Instant::now()));
                    continue;
                }
                next = subscription.next() => next,
                permit = self.permits.clone().acquire_owned(), if wants_permit => {
                    self.free.push(permit.expect("the semaphore is never closed"));
                    continue;
                }
                // Wakes when the bytes a request needs are free (a message finished).
                bytes = self.budget.bytes.clone().acquire_many_owned(
                    u32::try_from(least_bytes.saturating_sub(
                        self.free_bytes.as_ref().map_or(0, |p| p.num_permits())
                    )).unwrap_or(u32::MAX)
                ), if wants_bytes => {
                    self.keep_free_bytes(bytes.expect("the semaphore is never closed"));
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
            // A stored message is a delivery whatever status its header block's first line
            // gives (a raw producer's `NATS/1.0 503`, a server's status message a stream took
            // in): only the server's own status messages come without an ack subject.
            let delivered = message
                .reply
                .as_ref()
                .is_some_and(|reply| reply.starts_with("$JS.ACK."));
            match message.status {
                _ if delivered => {}
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
                        // The next message is larger than the request's bytes left; if it
                        // brought nothing, larger than what a request of ours may ask for.
                        "Message Size Exceeds MaxBytes" => {
                            if let Some(r) = self.open.ended()
                                && !r.brought
                            {
                                tracing::debug!(
                                    asked = r.asked_bytes,
                                    "a message is larger than a pull request may ask for; one goes without max_bytes"
                                );
                                unbounded_next = true;
                            }
                        }
                        _ => {
                            self.open.ended();
                        }
                    }
                    continue;
                }
                Some(status) => {
                    let description = message.description.unwrap_or_default();
                    break Err(format!("pull answered {status} {description}"));
                }
            }
            let bytes = self.open.delivered(message.length);
            let message = jetstream::Message {
                message,
                context: inner.jetstream.clone(),
            };
            self.dispatch(message, bytes, stopping).await;
        };
        self.flush_batches(None);
        if let Err(e) = subscription.unsubscribe().await {
            tracing::debug!(error = %e, "unsubscribing the pull inbox failed");
        }
        result
    }

    /// Takes every free permit of the semaphore, up to the concurrency.
    fn take_free_permits(&mut self) {
        let settings = &self.inner.settings;
        while self.free.len() < settings.concurrency + settings.prefetch {
            match self.permits.clone().try_acquire_owned() {
                Ok(p) => self.free.push(p),
                Err(_) => break,
            }
        }
    }

    /// Takes every free byte of the budget.
    fn take_free_bytes(&mut self) {
        let free = self.budget.bytes.available_permits();
        if free == 0 {
            return;
        }
        let n = u32::try_from(free).unwrap_or(u32::MAX);
        if let Ok(bytes) = self.budget.bytes.clone().try_acquire_many_owned(n) {
            self.keep_free_bytes(bytes);
        }
    }

    fn keep_free_bytes(&mut self, bytes: OwnedSemaphorePermit) {
        match self.free_bytes.as_mut() {
            Some(free) => free.merge(bytes),
            None => self.free_bytes = Some(bytes),
        }
    }

    /// Serves `message` on a task of its own, holding a permit and its `bytes`; or, while
    /// stopping and unless it is its last delivery, naks it.
    async fn dispatch(
        &mut self,
        message: jetstream::Message,
        bytes: Option<OwnedSemaphorePermit>,
        stopping: bool,
    ) {
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
            give_back(&message, delay).await;
            return;
        }
        // Served, also while stopping when this is its last delivery: a nak would never be
        // redelivered, so it is processed (or dead-lettered) to the end, and shutdown waits.
        // One that came beyond the bytes asked for (a request given up for lost) takes what is
        // free, if anything: it is served all the same.
        let bytes = bytes.or_else(|| {
            let size = message.length;
            self.free_bytes
                .as_mut()
                .and_then(|free| free.split(size.min(free.num_permits())))
        });
        let slot = match self.free.pop() {
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
        let held = Held::new(slot, bytes);
        if let Some(slots) = self.slots.as_mut().filter(|_| !stopping) {
            let slot = match H::LANED {
                true => inner
                    .lane(&message)
                    .map_or(0, |lane| lane.slot(slots.len())),
                false => 0,
            };
            if let Some(ready) = slots.push(slot, (message, held)) {
                self.start_batch(ready);
            }
            return;
        }
        let (inner, shutdown) = (inner.clone(), self.shutdown.clone());
        // With prefetch, the permit to run is asked for here, in delivery order.
        let turn = match self.running {
            Some(running) => Some(Turn::ask(running).await),
            None => None,
        };
        self.tasks.spawn(async move {
            let held = match turn {
                None => held,
                Some(turn) => match turn.take(&inner, &message, &shutdown, last).await {
                    Some(permit) => held.running(permit),
                    None => return,
                },
            };
            inner.serve(message, held, shutdown).await
        });
    }

    /// Starts the batches that go at `now` (all of them with `None`), each on a task of its own.
    fn flush_batches(&mut self, now: Option<Instant>) {
        let ready = match self.slots.as_mut() {
            Some(slots) => slots.take_due(now),
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
