//! The JetStream adapter: a durable pull consumer whose messages go through the inbox, and whose
//! acks follow the outcome. The database decides; JetStream only hears the verdict.

use crate::backend::InboxBackend;
use crate::classify::{ErrorClass, classify};
use crate::dead_letter::{DEFAULT_DLQ_PREFIX, DEFAULT_DLQ_STREAM, DeadLetter, DeadLetters};
use crate::handler::{Handler, Outcome};
use crate::key::KeyError;
use crate::retention::{RetentionFloor, retention_floor};
use crate::store::{Inbox, ProcessError, message_key};
use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::message::Message;
use futures::StreamExt;
use serde::de::DeserializeOwned;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, field};

/// How a committed message is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AckMode {
    /// `double_ack`: waits for the server to confirm the ack (default).
    #[default]
    Double,
    /// Plain `ack`: fire and forget; a lost ack means a redelivery, which the marker skips.
    Plain,
}

/// A consumer that cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The consumer does not use explicit acks, so nothing ties an ack to a commit.
    #[error(
        "consumer {consumer:?} has ack policy {policy:?}; the inbox needs AckPolicy::Explicit so that every message is acked only after its effect is committed"
    )]
    AckPolicy {
        /// The consumer's name.
        consumer: String,
        /// Its ack policy.
        policy: AckPolicy,
    },
    /// `concurrency(0)` was asked for.
    #[error("concurrency must be at least 1")]
    ZeroConcurrency,
    /// The consumer redelivers forever, so a message that always fails is never dead-lettered.
    #[error(
        "consumer {consumer:?} has no max_deliver limit (-1); set a finite max_deliver (for example 10) so that failing messages are dead-lettered"
    )]
    UnboundedMaxDeliver {
        /// The consumer's name.
        consumer: String,
    },
    /// Markers would be deleted while their message can still be redelivered.
    #[error(
        "retention {retention:?} is shorter than the minimum safe retention for this consumer: {floor}"
    )]
    RetentionTooShort {
        /// The configured retention.
        retention: Duration,
        /// The minimum and its figures.
        floor: RetentionFloor,
    },
    /// The handler's consumer name cannot be a NATS subject token (dead letters go to
    /// `<prefix>.<consumer>`).
    #[error(
        "consumer name {name:?} is not a valid NATS subject token: use letters, digits, `-` and `_`, without spaces, `.`, `*` or `>`"
    )]
    ConsumerName {
        /// The rejected name.
        name: String,
    },
}

/// Counters of what a worker did, by outcome.
#[derive(Debug, Default)]
struct Counters {
    acked: AtomicU64,
    skipped: AtomicU64,
    nacked: AtomicU64,
    terminated: AtomicU64,
}

/// A snapshot of a worker's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Messages whose effect this worker committed.
    pub acked: u64,
    /// Duplicates this worker acked without running the handler.
    pub skipped: u64,
    /// Deliveries nak'd for redelivery (handler or database errors).
    pub nacked: u64,
    /// Poison messages terminated.
    pub terminated: u64,
}

/// Builds a [`Worker`]: `WorkerBuilder::new(inbox, consumer).concurrency(8).build(handler)`.
#[derive(Debug)]
pub struct WorkerBuilder<DB: InboxBackend> {
    inbox: Inbox<DB>,
    consumer: PullConsumer,
    concurrency: Option<usize>,
    ack_mode: AckMode,
    fetch_expiry: Duration,
    nak_delay: (Duration, Duration),
    attempts: u32,
    dead_letter_stream: String,
    dead_letter_prefix: String,
    cleanup: Option<(Duration, async_nats::jetstream::stream::Config)>,
    cleanup_margin: Duration,
    cleanup_every: Duration,
}

impl<DB: InboxBackend> WorkerBuilder<DB> {
    /// A builder for a worker that processes `consumer`'s messages through `inbox`.
    pub fn new(inbox: Inbox<DB>, consumer: PullConsumer) -> Self {
        WorkerBuilder {
            inbox,
            consumer,
            concurrency: None,
            ack_mode: AckMode::default(),
            fetch_expiry: Duration::from_secs(2),
            nak_delay: (Duration::from_secs(1), Duration::from_secs(30)),
            attempts: 3,
            dead_letter_stream: DEFAULT_DLQ_STREAM.to_owned(),
            dead_letter_prefix: DEFAULT_DLQ_PREFIX.to_owned(),
            cleanup: None,
            cleanup_margin: Duration::from_secs(3600),
            cleanup_every: Duration::from_secs(60),
        }
    }

    /// At most `n` messages in flight. Capped at the pool's `max_connections` and the consumer's
    /// `max_ack_pending`; defaults to the pool size.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = Some(n);
        self
    }

    /// How committed messages are acked (default [`AckMode::Double`]).
    pub fn ack_mode(mut self, mode: AckMode) -> Self {
        self.ack_mode = mode;
        self
    }

    /// How long one pull request waits for messages (default 2 s). Shutdown waits at most this long
    /// for a pull in progress, so that messages it brings are nak'd rather than left to `ack_wait`.
    pub fn fetch_expiry(mut self, expiry: Duration) -> Self {
        self.fetch_expiry = expiry;
        self
    }

    /// The delay of a nak after a failure: `base * 2^(delivered - 1)`, at most `max`
    /// (default 1 s and 30 s). Never zero: a nak without delay redelivers at once, a hot loop.
    pub fn nak_delay(mut self, base: Duration, max: Duration) -> Self {
        self.nak_delay = (base.max(Duration::from_millis(1)), max);
        self
    }

    /// How many times a delivery is tried in-process while its failure is transient, each time
    /// in a fresh transaction (default 3); after that it is nak'd with a delay.
    pub fn attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts;
        self
    }

    /// Where rejected messages go: the stream (default `INBOX_DLQ`, created when missing) and the
    /// subject prefix (default `inbox.dlq`; the subject is `<prefix>.<consumer>`).
    pub fn dead_letters(
        mut self,
        stream: impl Into<String>,
        subject_prefix: impl Into<String>,
    ) -> Self {
        self.dead_letter_stream = stream.into();
        self.dead_letter_prefix = subject_prefix.into();
        self
    }

    /// Deletes this handler's finished markers once they are older than `retention`, every minute,
    /// in batches, one instance at a time. `stream` is the consumer's stream's configuration
    /// (`stream.cached_info().config`): `build` refuses a retention shorter than the
    /// [`retention_floor`](crate::retention_floor) of the consumer and stream, naming each figure.
    pub fn cleanup(
        mut self,
        retention: Duration,
        stream: &async_nats::jetstream::stream::Config,
    ) -> Self {
        self.cleanup = Some((retention, stream.clone()));
        self
    }

    /// The operator's margin added to the retention floor (default 1 hour).
    pub fn cleanup_margin(mut self, margin: Duration) -> Self {
        self.cleanup_margin = margin;
        self
    }

    /// How often cleanup runs (default every 60 s).
    pub fn cleanup_every(mut self, every: Duration) -> Self {
        self.cleanup_every = every;
        self
    }

    /// A worker for `handler`, whose state is `()`.
    pub fn build<H>(self, handler: H) -> Result<Worker<H>, WorkerError>
    where
        H: Handler<Db = DB, State = ()>,
        H::Message: DeserializeOwned,
    {
        self.build_with_state(handler, ())
    }

    /// A worker for `handler`, with the state passed to every call.
    pub fn build_with_state<H>(self, handler: H, state: H::State) -> Result<Worker<H>, WorkerError>
    where
        H: Handler<Db = DB>,
        H::Message: DeserializeOwned,
    {
        let info = self.consumer.cached_info();
        if info.config.ack_policy != AckPolicy::Explicit {
            return Err(WorkerError::AckPolicy {
                consumer: info.name.clone(),
                policy: info.config.ack_policy,
            });
        }
        if self.concurrency == Some(0) {
            return Err(WorkerError::ZeroConcurrency);
        }
        if info.config.max_deliver <= 0 {
            return Err(WorkerError::UnboundedMaxDeliver {
                consumer: info.name.clone(),
            });
        }
        if !is_subject_token(H::CONSUMER) {
            return Err(WorkerError::ConsumerName {
                name: H::CONSUMER.to_owned(),
            });
        }
        let pool_size = self.inbox.pool().options().get_max_connections() as usize;
        let mut concurrency = self.concurrency.unwrap_or(pool_size).min(pool_size);
        if info.config.max_ack_pending > 0 {
            concurrency = concurrency.min(info.config.max_ack_pending as usize);
        }
        let ack_wait = match info.config.ack_wait {
            d if d.is_zero() => Duration::from_secs(30),
            d => d,
        };
        let (max_deliver, backoff) = (info.config.max_deliver, info.config.backoff.clone());
        let longest_nak = backoff.iter().copied().max().unwrap_or(self.nak_delay.1);
        let cleanup = match &self.cleanup {
            None => None,
            Some((retention, stream)) => {
                let floor = retention_floor(&info.config, stream, longest_nak, self.cleanup_margin);
                if *retention < floor.total() {
                    return Err(WorkerError::RetentionTooShort {
                        retention: *retention,
                        floor,
                    });
                }
                Some((*retention, self.cleanup_every))
            }
        };
        Ok(Worker {
            inner: Arc::new(Inner {
                inbox: self.inbox,
                consumer: self.consumer,
                handler,
                state,
                concurrency: concurrency.max(1),
                ack_mode: self.ack_mode,
                fetch_expiry: self.fetch_expiry,
                nak_delay: self.nak_delay,
                progress_every: ack_wait / 3,
                counters: Counters::default(),
                max_deliver,
                backoff,
                attempts: self.attempts.max(1),
                cleanup,
                dead_letters: DeadLetters::new(
                    self.dead_letter_stream,
                    self.dead_letter_prefix,
                    H::CONSUMER,
                ),
            }),
        })
    }
}

/// Serves one handler on one JetStream pull consumer.
///
/// ```no_run
/// # use inbox_runtime::{Inbox, WorkerBuilder, idempotent, Tx};
/// # use sqlx::Postgres;
/// # #[derive(serde::Deserialize)] struct Credit { id: String }
/// # #[idempotent(consumer = "credit", key = msg.id)]
/// # async fn credit(msg: Credit, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> { Ok(()) }
/// # async fn demo(inbox: Inbox<Postgres>, consumer: async_nats::jetstream::consumer::PullConsumer)
/// # -> Result<(), Box<dyn std::error::Error>> {
/// let shutdown = tokio_util::sync::CancellationToken::new();
/// let worker = WorkerBuilder::new(inbox, consumer).concurrency(8).build(credit)?;
/// let stats = worker.run_until(shutdown).await;
/// # Ok(()) }
/// ```
pub struct Worker<H: Handler> {
    inner: Arc<Inner<H>>,
}

/// Clones share one worker: its counters, and its state.
impl<H: Handler> Clone for Worker<H> {
    fn clone(&self) -> Self {
        Worker {
            inner: self.inner.clone(),
        }
    }
}

struct Inner<H: Handler> {
    inbox: Inbox<H::Db>,
    consumer: PullConsumer,
    handler: H,
    state: H::State,
    concurrency: usize,
    ack_mode: AckMode,
    fetch_expiry: Duration,
    nak_delay: (Duration, Duration),
    progress_every: Duration,
    counters: Counters,
    max_deliver: i64,
    backoff: Vec<Duration>,
    attempts: u32,
    cleanup: Option<(Duration, Duration)>,
    dead_letters: DeadLetters,
}

impl<H> Worker<H>
where
    H: Handler,
    H::Message: DeserializeOwned,
{
    /// How many messages this worker processes at once.
    pub fn concurrency(&self) -> usize {
        self.inner.concurrency
    }

    /// The state handed to every call of the handler.
    pub fn state(&self) -> &H::State {
        &self.inner.state
    }

    /// What the worker has done so far.
    pub fn stats(&self) -> Stats {
        let c = &self.inner.counters;
        Stats {
            acked: c.acked.load(Ordering::Relaxed),
            skipped: c.skipped.load(Ordering::Relaxed),
            nacked: c.nacked.load(Ordering::Relaxed),
            terminated: c.terminated.load(Ordering::Relaxed),
        }
    }

    /// Pulls and processes messages until `shutdown` is cancelled; then stops pulling, naks what
    /// was fetched but not started, lets in-flight handlers finish and ack, and returns the stats.
    ///
    /// Pull errors (NATS down, consumer gone) are logged and retried with capped backoff; the
    /// client reconnects by itself.
    pub async fn run_until(&self, shutdown: CancellationToken) -> Stats {
        let inner = &self.inner;
        let permits = Arc::new(Semaphore::new(inner.concurrency));
        let tasks = TaskTracker::new();
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(10));
        // The client the acks go through, flushed before returning.
        let mut client: Option<async_nats::Client> = None;
        tracing::info!(
            consumer = H::CONSUMER,
            durable = %inner.consumer.cached_info().name,
            concurrency = inner.concurrency,
            "inbox worker started"
        );

        if let Some((retention, every)) = inner.cleanup {
            let (inner, shutdown) = (self.inner.clone(), shutdown.clone());
            tasks.spawn(async move {
                let mut ticks = tokio::time::interval(every);
                loop {
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = ticks.tick() => {}
                    }
                    match inner.inbox.cleanup(H::CONSUMER, retention, 1_000).await {
                        Ok(Some(n)) if n > 0 => tracing::info!(deleted = n, "inbox cleanup"),
                        Ok(_) => {}
                        Err(e) => tracing::warn!(error = %e, "inbox cleanup failed"),
                    }
                }
            });
        }

        'pull: while !shutdown.is_cancelled() {
            // Fetch only as many messages as can start now: prefetching more than can be processed
            // within ack_wait turns into redelivery storms.
            let first = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break 'pull,
                p = permits.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            };
            let mut free = vec![first];
            while free.len() < inner.concurrency {
                match permits.clone().try_acquire_owned() {
                    Ok(p) => free.push(p),
                    Err(_) => break,
                }
            }
            let request = inner
                .consumer
                .batch()
                .max_messages(free.len())
                .expires(inner.fetch_expiry)
                .messages();
            let mut batch = match request.await {
                Ok(batch) => batch,
                Err(e) => {
                    let wait = backoff.next();
                    tracing::warn!(error = %e, retry_in = ?wait, "pull request failed");
                    tokio::select! {
                        _ = shutdown.cancelled() => break 'pull,
                        _ = tokio::time::sleep(wait) => continue 'pull,
                    }
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
                match next {
                    None => break,
                    Some(Err(e)) => {
                        let wait = backoff.next();
                        tracing::warn!(error = %e, retry_in = ?wait, "pull failed");
                        if !stopping {
                            tokio::select! {
                                _ = shutdown.cancelled() => {}
                                _ = tokio::time::sleep(wait) => {}
                            }
                        }
                        break;
                    }
                    Some(Ok(message)) => {
                        backoff.reset();
                        client.get_or_insert_with(|| message.context.client());
                        match free.pop() {
                            Some(permit) if !stopping => {
                                let inner = self.inner.clone();
                                tasks.spawn(async move { inner.serve(message, permit).await });
                            }
                            // Fetched but not started: give it back at once rather than let it
                            // wait out ack_wait.
                            _ => {
                                if let Err(e) = message.ack_with(AckKind::Nak(None)).await {
                                    tracing::debug!(error = %e, "nak on shutdown failed");
                                }
                            }
                        }
                    }
                }
            }
        }

        tasks.close();
        tasks.wait().await;
        if let Some(client) = client
            && let Err(e) = client.flush().await
        {
            tracing::warn!(error = %e, "flushing acks on shutdown failed");
        }
        let stats = self.stats();
        tracing::info!(consumer = H::CONSUMER, ?stats, "inbox worker stopped");
        stats
    }
}

impl<H> Inner<H>
where
    H: Handler,
    H::Message: DeserializeOwned,
{
    /// Processes one delivery and answers JetStream according to the outcome.
    async fn serve(&self, message: Message, permit: OwnedSemaphorePermit) {
        let _permit = permit;
        let (transport_id, stream, stream_seq, delivered) = match message.info() {
            Ok(info) => (
                transport_id_of(&message, &info),
                info.stream.to_owned(),
                info.stream_sequence,
                info.delivered,
            ),
            Err(e) => {
                tracing::error!(error = %e, subject = %message.subject, "not a JetStream delivery; ignored");
                return;
            }
        };
        let span = tracing::info_span!(
            "inbox.message",
            consumer = H::CONSUMER,
            key = field::Empty,
            stream_seq,
            delivered,
            outcome = field::Empty,
        );
        async {
            let result = self.process_with_retries(&message, &transport_id).await;
            let span = tracing::Span::current();
            let err = match result {
                Ok(outcome) => {
                    span.record("outcome", outcome.as_str());
                    let acked = match (outcome, self.ack_mode) {
                        (Outcome::Ack, AckMode::Double) => message.double_ack().await,
                        _ => message.ack().await,
                    };
                    if let Err(e) = acked {
                        // Committed either way: a redelivery finds the marker and is skipped.
                        tracing::warn!(error = %e, "ack failed; a redelivery will be skipped");
                    }
                    let counter = match outcome {
                        Outcome::Ack => &self.counters.acked,
                        Outcome::Skip => &self.counters.skipped,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!("processed");
                    return;
                }
                Err(e) => e,
            };
            let class = classify::<H::Db>(&err);
            let last_delivery = self.max_deliver > 0 && delivered >= self.max_deliver;
            if class == ErrorClass::Permanent || last_delivery {
                let reason = if last_delivery && class != ErrorClass::Permanent {
                    format!("{err} (delivery {delivered} of max_deliver {})", self.max_deliver)
                } else {
                    err.to_string()
                };
                let letter = DeadLetter {
                    consumer: H::CONSUMER,
                    stream: &stream,
                    stream_seq,
                    delivered,
                    error: &reason,
                };
                match self.dead_letters.publish(&message, &letter).await {
                    Ok(()) => {
                        span.record("outcome", "dead_letter");
                        tracing::error!(error = %reason, "message dead-lettered and terminated");
                        if let Err(e) = message.ack_with(AckKind::Term).await {
                            // The dead letter exists; a redelivery would add a second one.
                            tracing::warn!(error = %e, "term failed after dead-lettering");
                        }
                        self.counters.terminated.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    Err(e) => {
                        // Never lose it: leave it with JetStream and try again later.
                        tracing::error!(error = %e, original = %reason, "dead-letter publish failed; nak");
                    }
                }
            } else {
                tracing::warn!(error = %err, class = ?class, "processing failed; nak");
            }
            span.record("outcome", "nak");
            let delay = self.redelivery_delay(delivered);
            if let Err(e) = message.ack_with(AckKind::Nak(Some(delay))).await {
                tracing::warn!(error = %e, "nak failed; redelivered after ack_wait");
            }
            self.counters.nacked.fetch_add(1, Ordering::Relaxed);
        }
        .instrument(span)
        .await
    }

    /// The consumer's `backoff` step for this delivery when it has one, else ours.
    fn redelivery_delay(&self, delivered: i64) -> Duration {
        redelivery_delay(&self.backoff, self.nak_delay, delivered)
    }

    /// [`Self::process`], retried at once with a fresh transaction while the failure is
    /// transient, at most `attempts` times, with capped exponential backoff and jitter.
    async fn process_with_retries(
        &self,
        message: &Message,
        transport_id: &str,
    ) -> Result<Outcome, ProcessError> {
        let mut attempt = 1;
        loop {
            match self.process(message, transport_id).await {
                Err(e)
                    if attempt < self.attempts
                        && classify::<H::Db>(&e) == ErrorClass::Transient =>
                {
                    let wait = retry_wait(attempt);
                    tracing::debug!(error = %e, attempt, retry_in = ?wait, "transient failure; retrying");
                    tokio::time::sleep(wait).await;
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// Decodes, keys and processes the message, sending progress acks while it runs long.
    async fn process(
        &self,
        message: &Message,
        transport_id: &str,
    ) -> Result<Outcome, ProcessError> {
        let (decoded, key) = decode_and_key(&self.handler, &self.state, message, transport_id)?;
        tracing::Span::current().record("key", key.as_str());

        let work = self
            .inbox
            .process_keyed(&self.handler, &self.state, decoded, &key);
        tokio::pin!(work);
        let every = self.progress_every.max(Duration::from_millis(100));
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tokio::select! {
                result = &mut work => return result,
                _ = ticks.tick() => {
                    // A slow but healthy handler must not be redelivered to another instance.
                    if let Err(e) = message.ack_with(AckKind::Progress).await {
                        tracing::debug!(error = %e, "progress ack failed");
                    }
                }
            }
        }
    }
}

/// The transport id of a JetStream delivery: its `Nats-Msg-Id` header, else
/// `"{stream}:{stream_sequence}"`, which is the same for every redelivery of the stored message.
pub fn transport_id(message: &Message) -> Result<String, async_nats::Error> {
    Ok(transport_id_of(message, &message.info()?))
}

fn transport_id_of(message: &Message, info: &async_nats::jetstream::message::Info<'_>) -> String {
    message
        .headers
        .as_ref()
        .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
        .map(|v| v.as_str().to_owned())
        .unwrap_or_else(|| format!("{}:{}", info.stream, info.stream_sequence))
}

/// Decodes the payload as JSON and computes the validated key.
fn decode_and_key<H>(
    handler: &H,
    state: &H::State,
    message: &Message,
    transport_id: &str,
) -> Result<(H::Message, String), ProcessError>
where
    H: Handler,
    H::Message: DeserializeOwned,
{
    let decoded: H::Message =
        serde_json::from_slice(&message.payload).map_err(|source| ProcessError::Decode {
            ty: std::any::type_name::<H::Message>(),
            source,
        })?;
    let key = message_key(handler, state, &decoded, Some(transport_id))?;
    Ok((decoded, key))
}

/// Processes one JetStream delivery through `inbox` (decode, key, claim, handler, commit) without
/// acking it: the core a [`Worker`] wraps, for callers that manage acks themselves.
pub async fn process_delivery<H>(
    inbox: &Inbox<H::Db>,
    handler: &H,
    state: &H::State,
    message: &Message,
) -> Result<Outcome, ProcessError>
where
    H: Handler,
    H::Message: DeserializeOwned,
{
    let id = transport_id(message).map_err(|_| KeyError::Missing)?;
    let (decoded, key) = decode_and_key(handler, state, message, &id)?;
    inbox.process_keyed(handler, state, decoded, &key).await
}

/// The delay of the nak after delivery `delivered` failed: the consumer's `backoff` step for it
/// (the last step repeating) when the consumer has a backoff, else [`nak_delay`].
fn redelivery_delay(backoff: &[Duration], ours: (Duration, Duration), delivered: i64) -> Duration {
    match backoff.last() {
        None => nak_delay(ours, delivered),
        Some(last) => {
            let i = usize::try_from(delivered.max(1) - 1).unwrap_or(usize::MAX);
            backoff.get(i).copied().unwrap_or(*last)
        }
    }
}

/// `base * 2^(delivered - 1)`, capped at `max`.
fn nak_delay((base, max): (Duration, Duration), delivered: i64) -> Duration {
    let exp = delivered.saturating_sub(1).clamp(0, 16) as u32;
    base.saturating_mul(1 << exp).min(max)
}

/// Whether `name` can stand as one token of a NATS subject.
fn is_subject_token(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_graphic() && !matches!(b, b'.' | b'*' | b'>'))
}

/// The wait before in-process retry `attempt + 1`: 50 ms doubling, at most 2 s, with up to 50 %
/// jitter so that twins that collided do not collide again.
fn retry_wait(attempt: u32) -> Duration {
    let base = Duration::from_millis(50)
        .saturating_mul(1 << attempt.min(6))
        .min(Duration::from_secs(2));
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    base + base.mul_f64(f64::from(nanos % 1000) / 2000.0)
}

/// Capped exponential backoff for pull errors.
struct Backoff {
    base: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    fn new(base: Duration, max: Duration) -> Self {
        Backoff {
            base,
            max,
            current: base,
        }
    }

    fn next(&mut self) -> Duration {
        let wait = self.current;
        self.current = (self.current * 2).min(self.max);
        wait
    }

    fn reset(&mut self) {
        self.current = self.base;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redelivery_delay_follows_the_consumer_backoff() {
        let ours = (Duration::from_secs(1), Duration::from_secs(30));
        let backoff = [Duration::from_secs(5), Duration::from_secs(60)];
        assert_eq!(redelivery_delay(&backoff, ours, 1), Duration::from_secs(5));
        assert_eq!(redelivery_delay(&backoff, ours, 2), Duration::from_secs(60));
        assert_eq!(redelivery_delay(&backoff, ours, 9), Duration::from_secs(60));
        assert_eq!(redelivery_delay(&[], ours, 3), Duration::from_secs(4));
    }

    #[test]
    fn subject_tokens() {
        assert!(is_subject_token("credit"));
        assert!(is_subject_token("credit-v2_x"));
        for bad in ["", "a b", "a.b", "a*", ">", "tab\t"] {
            assert!(!is_subject_token(bad), "{bad:?}");
        }
    }

    #[test]
    fn retry_wait_is_capped() {
        assert!(retry_wait(1) >= Duration::from_millis(100));
        assert!(retry_wait(30) <= Duration::from_secs(3));
    }

    #[test]
    fn nak_delay_grows_and_is_capped() {
        let cfg = (Duration::from_secs(1), Duration::from_secs(30));
        assert_eq!(nak_delay(cfg, 1), Duration::from_secs(1));
        assert_eq!(nak_delay(cfg, 3), Duration::from_secs(4));
        assert_eq!(nak_delay(cfg, 100), Duration::from_secs(30));
    }
}
