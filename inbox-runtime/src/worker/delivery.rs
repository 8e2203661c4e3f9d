//! One delivery, start to finish: decode the payload, compute the key, process it through the
//! inbox (retried in process in a fresh transaction while the failure is transient), send
//! progress acks while a handler runs long, then carry out the verdict: ack, nak with a delay, or
//! dead-letter and term. Nothing here decides; `verdict.rs` does.

use super::dead_letter::{DeadLetter, header_pairs, letter_headers};
use super::verdict::{Verdict, retry_in_process, verdict};
use super::{AckMode, Inner};
use crate::backoff::Backoff;
use crate::classify::{ErrorClass, classify, is_outage};
use crate::handler::{Handler, Outcome};
use crate::key::{KeyError, validate_key};
use crate::store::{Inbox, ProcessError};
use async_nats::jetstream::AckKind;
use async_nats::jetstream::message::{Info, Message};
use futures::FutureExt;
use serde::de::DeserializeOwned;
use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, field};

/// Where a delivery came from, as the dead letter and the logs name it.
struct Delivery {
    /// The producer's `Nats-Msg-Id`, unless absent or empty.
    msg_id: Option<String>,
    stream: String,
    stream_seq: u64,
    delivered: i64,
}

impl Delivery {
    fn of(message: &Message, info: &Info<'_>) -> Delivery {
        Delivery {
            msg_id: message
                .headers
                .as_ref()
                .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
                .map(|v| v.as_str())
                // Some producers send the header empty: that is no id, not the id "".
                .filter(|id| !id.is_empty())
                .map(str::to_owned),
            stream: info.stream.to_owned(),
            stream_seq: info.stream_sequence,
            delivered: info.delivered,
        }
    }

    /// The transport id: the `Nats-Msg-Id`, else `"{stream}:{created}:{stream_sequence}"`, the
    /// same for every redelivery of the stored message. A stream's sequences start again at 1
    /// when it is deleted and created again, so its creation time (Unix nanoseconds) tells its
    /// messages apart from those of the stream it replaced.
    async fn transport_id(
        &self,
        js: &async_nats::jetstream::Context,
        created: &StreamCreated,
    ) -> Result<String, ProcessError> {
        match &self.msg_id {
            Some(id) => Ok(id.clone()),
            None => {
                let created = created.get(js, &self.stream).await?;
                Ok(format!("{}:{created}:{}", self.stream, self.stream_seq))
            }
        }
    }
}

/// When the consumer's stream was created, looked up once (the first time a message needs the
/// default key) and forgotten when pulling fails, since the stream may have been replaced.
#[derive(Debug, Default)]
pub(super) struct StreamCreated(std::sync::Mutex<Option<i128>>);

impl StreamCreated {
    async fn get(
        &self,
        js: &async_nats::jetstream::Context,
        stream: &str,
    ) -> Result<i128, ProcessError> {
        if let Some(created) = *self.0.lock().expect("the stream lock") {
            return Ok(created);
        }
        let lookup = async { Ok::<_, async_nats::Error>(js.get_stream(stream).await?) };
        let created = lookup
            .await
            .map_err(|source| ProcessError::StreamLookup {
                stream: stream.to_owned(),
                source,
            })?
            .cached_info()
            .created
            .unix_timestamp_nanos();
        *self.0.lock().expect("the stream lock") = Some(created);
        Ok(created)
    }

    /// Looks the stream up again next time.
    pub(super) fn forget(&self) {
        *self.0.lock().expect("the stream lock") = None;
    }
}

impl<H> Inner<H>
where
    H: Handler,
    H::Message: DeserializeOwned,
{
    /// Processes one delivery and answers JetStream according to the verdict; the permit (none
    /// for a last delivery that arrived while stopping) is released when it is done.
    pub(super) async fn serve(
        &self,
        message: Message,
        permit: Option<OwnedSemaphorePermit>,
        shutdown: CancellationToken,
    ) {
        let _permit = permit;
        self.jetstream.get_or_init(|| message.context.clone());
        let delivery = match message.info() {
            Ok(info) => Delivery::of(&message, &info),
            Err(e) => {
                tracing::error!(error = %e, subject = %message.subject, "not a JetStream delivery; ignored");
                return;
            }
        };
        let span = tracing::info_span!(
            "inbox.message",
            consumer = H::CONSUMER,
            key = field::Empty,
            stream_seq = delivery.stream_seq,
            delivered = delivery.delivered,
            outcome = field::Empty,
        );
        async {
            let limits = &self.settings.limits;
            let tries = self.process_with_retries(&message, &delivery, &shutdown);
            let verdict = match with_progress(&message, self.settings.progress_every, tries).await {
                Ok(outcome) => verdict(Ok(outcome), delivery.delivered, limits),
                Err((err, class)) => {
                    let v = verdict(Err((&err, class)), delivery.delivered, limits);
                    // The whole error, the database's message with it, goes to the log; the
                    // dead letter carries our summary of it (see `letter_text`).
                    match v {
                        Verdict::Nak(_) => tracing::warn!(error = %err, ?class, "processing failed; nak"),
                        _ => tracing::warn!(error = %err, ?class, "processing failed; dead-lettering"),
                    }
                    v
                }
            };
            self.answer(&message, verdict, &delivery).await
        }
        .instrument(span)
        .await
    }

    /// Tells JetStream the verdict and counts it.
    async fn answer(&self, message: &Message, verdict: Verdict, delivery: &Delivery) {
        let span = tracing::Span::current();
        // Recorded before acting, so that what is logged while answering carries it.
        let outcome = |name: &'static str| {
            span.record("outcome", name);
        };
        let counters = &self.counters;
        let counter = match verdict {
            Verdict::Ack | Verdict::Skip => {
                outcome(if verdict == Verdict::Ack {
                    "ack"
                } else {
                    "skip"
                });
                let double = verdict == Verdict::Ack && self.settings.ack_mode == AckMode::Double;
                let acked = if double {
                    message.double_ack().await
                } else {
                    message.ack().await
                };
                if let Err(e) = acked {
                    // Committed either way: a redelivery finds the marker and is skipped.
                    tracing::warn!(error = %e, "ack failed; a redelivery will be skipped");
                }
                match verdict {
                    Verdict::Ack => &counters.acked,
                    _ => &counters.skipped,
                }
            }
            Verdict::DeadLetter(reason) => {
                let letter = DeadLetter {
                    consumer: H::CONSUMER,
                    stream: &delivery.stream,
                    stream_seq: delivery.stream_seq,
                    delivered: delivery.delivered,
                    error: &reason,
                };
                match self.dead_letters.publish(message, &letter).await {
                    Ok(()) => {
                        outcome("dead_letter");
                        tracing::error!(error = %reason, "message dead-lettered and terminated");
                        if let Err(e) = message.ack_with(AckKind::Term).await {
                            // The dead letter exists; a redelivery would add a second one.
                            tracing::warn!(error = %e, "term failed after dead-lettering");
                        }
                        &counters.terminated
                    }
                    // Never lose it. On the last delivery a nak would never come back: the letter
                    // waits in the database for the stream to take it, and the original is termed.
                    Err(e) if delivery.delivered >= self.settings.limits.max_deliver => {
                        let headers =
                            header_pairs(&letter_headers(message.headers.as_ref(), &letter));
                        match self
                            .inbox
                            .park_letter(H::CONSUMER, &headers, &message.payload)
                            .await
                        {
                            Ok(()) => {
                                outcome("dead_letter");
                                tracing::error!(error = %reason, publish_error = %e, "dead letter refused by the stream on the last delivery; kept in the database until the stream takes it, message terminated");
                                if let Err(e) = message.ack_with(AckKind::Term).await {
                                    tracing::warn!(error = %e, "term failed after parking the dead letter");
                                }
                                &counters.terminated
                            }
                            Err(db) => {
                                outcome("nak");
                                tracing::error!(error = %reason, publish_error = %e, database_error = %db, stream_seq = delivery.stream_seq, "dead letter neither published nor kept on the last delivery: the message stays in its stream, unacknowledged, and is not redelivered");
                                nak(message, Duration::from_secs(1)).await;
                                &counters.nacked
                            }
                        }
                    }
                    // Leave it with JetStream and try again later.
                    Err(e) => {
                        outcome("nak");
                        tracing::error!(error = %e, original = %reason, "dead-letter publish failed; nak");
                        let delay = self.settings.limits.redelivery_delay(delivery.delivered);
                        nak(message, delay).await;
                        &counters.nacked
                    }
                }
            }
            Verdict::Nak(delay) => {
                outcome("nak");
                nak(message, delay).await;
                &counters.nacked
            }
        };
        counter.fetch_add(1, Ordering::Relaxed);
        tracing::debug!("answered");
    }

    /// [`Self::process`], tried again in process with a fresh transaction while
    /// [`retry_in_process`] says so, and for as long as the database is unreachable (see
    /// `circuit.rs`; until `shutdown`). A failure comes with its class, decided once.
    async fn process_with_retries(
        &self,
        message: &Message,
        delivery: &Delivery,
        shutdown: &CancellationToken,
    ) -> Result<Outcome, (ProcessError, ErrorClass)> {
        let mut attempt = 1;
        let mut outage = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        loop {
            let deadline = self.settings.deadline;
            let tried = tokio::time::timeout(deadline, self.process(message, delivery)).await;
            let err = match tried {
                Ok(Ok(outcome)) => {
                    self.circuit.close();
                    return Ok(outcome);
                }
                Ok(Err(err)) => err,
                Err(_) => ProcessError::Deadline(deadline),
            };
            let class = classify::<H::Db>(&err);
            if is_outage::<H::Db>(&err) {
                // Every message would fail the same way: not this one's fault, so it spends no
                // delivery. It waits, and its next try probes the database.
                self.circuit.trip(&err);
                let wait = outage.next();
                tracing::debug!(error = %err, retry_in = ?wait, "database unreachable; waiting");
                tokio::select! {
                    _ = shutdown.cancelled() => return Err((err, class)),
                    _ = tokio::time::sleep(wait) => continue,
                }
            }
            self.circuit.close();
            let Some(wait) = retry_in_process(class, attempt, &self.settings.limits) else {
                return Err((err, class));
            };
            tracing::debug!(error = %err, attempt, retry_in = ?wait, "transient failure; retrying");
            tokio::time::sleep(wait).await;
            attempt += 1;
        }
    }

    /// Decodes, keys and processes the message once.
    async fn process(
        &self,
        message: &Message,
        delivery: &Delivery,
    ) -> Result<Outcome, ProcessError> {
        // A panic in the key expression or the handler is this message's failure, not the
        // worker's: caught here, it is dead-lettered like any permanent failure (uncaught, the task
        // would end with neither ack nor nak, and the message would vanish after max_deliver).
        // The transaction is dropped while unwinding, which rolls it back.
        AssertUnwindSafe(async {
            let decoded = decode::<H>(message)?;
            let explicit = self.handler.key(&decoded, &self.state);
            let key = key_of(explicit, message, delivery, &self.stream_created).await?;
            tracing::Span::current().record("key", key.as_str());
            self.inbox
                .process_keyed(&self.handler, &self.state, decoded, &key)
                .await
        })
        .catch_unwind()
        .await
        .unwrap_or_else(|panic| Err(ProcessError::Panicked(panic_text(&*panic))))
    }
}

/// Runs `work`, sending a progress ack every `every` while it runs: a slow but healthy handler,
/// or a message waiting for the database, must not be redelivered to another instance.
async fn with_progress<T>(message: &Message, every: Duration, work: impl Future<Output = T>) -> T {
    tokio::pin!(work);
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            result = &mut work => return result,
            _ = ticks.tick() => {
                if let Err(e) = message.ack_with(AckKind::Progress).await {
                    tracing::debug!(error = %e, "progress ack failed");
                }
            }
        }
    }
}

/// What a panic said, when it said it with a string.
fn panic_text(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

async fn nak(message: &Message, delay: Duration) {
    if let Err(e) = message.ack_with(AckKind::Nak(Some(delay))).await {
        tracing::warn!(error = %e, "nak failed; redelivered after ack_wait");
    }
}

/// The transport id of a JetStream delivery: its `Nats-Msg-Id` header (unless empty), else
/// `"{stream}:{created}:{stream_sequence}"`, which is the same for every redelivery of the stored
/// message and names the stream's creation time (Unix nanoseconds), so that a stream deleted and
/// created again does not reuse the keys of the old one. The latter costs a stream info request.
pub async fn transport_id(message: &Message) -> Result<String, ProcessError> {
    let info = message.info().map_err(|_| KeyError::Missing)?;
    Delivery::of(message, &info)
        .transport_id(&message.context, &StreamCreated::default())
        .await
}

/// Decodes the payload as JSON.
fn decode<H>(message: &Message) -> Result<H::Message, ProcessError>
where
    H: Handler,
    H::Message: DeserializeOwned,
{
    serde_json::from_slice(&message.payload).map_err(|source| ProcessError::Decode {
        ty: std::any::type_name::<H::Message>(),
        source,
    })
}

/// The validated key: `explicit` (the handler's `key` expression, evaluated before any await
/// since the message need not be `Sync`), else the transport id.
async fn key_of(
    explicit: Option<String>,
    message: &Message,
    delivery: &Delivery,
    created: &StreamCreated,
) -> Result<String, ProcessError> {
    let key = match explicit {
        Some(key) => key,
        None => delivery.transport_id(&message.context, created).await?,
    };
    validate_key(&key)?;
    Ok(key)
}

/// Processes one JetStream delivery through `inbox` (decode, key, claim, handler, commit) without
/// acking it: the core a [`Worker`](super::Worker) wraps, for callers that manage acks themselves.
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
    let info = message.info().map_err(|_| KeyError::Missing)?;
    let delivery = Delivery::of(message, &info);
    let decoded = decode::<H>(message)?;
    let created = StreamCreated::default();
    let explicit = handler.key(&decoded, state);
    let key = key_of(explicit, message, &delivery, &created).await?;
    inbox.process_keyed(handler, state, decoded, &key).await
}
