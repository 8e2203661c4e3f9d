//! One delivery, start to finish: decode the payload, compute the key, process it through the
//! inbox (retried in process in a fresh transaction while the failure is transient), send
//! progress acks while a handler runs long, then carry out the verdict: ack, nak with a delay, or
//! dead-letter and term. Nothing here decides; `verdict.rs` does.

use super::dead_letter::DeadLetter;
use super::requests::Held;
use super::transport_id::{StreamCreated, key_of};
use super::verdict::{Verdict, retry_in_process, verdict};
use super::{AckMode, Inner};
use crate::backoff::Backoff;
use crate::classify::{ErrorClass, classify, is_outage, is_timeout};
use crate::delivery::{Codec, Delivery};
use crate::error::ProcessError;
use crate::handler::{Handler, Outcome};
use crate::key::KeyError;
use crate::store::Inbox;
use async_nats::jetstream::AckKind;
use async_nats::jetstream::message::Message;
use futures::FutureExt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, field};

impl<H> Inner<H>
where
    H: Handler,
{
    /// Processes one delivery and answers JetStream according to the verdict; what it `held`
    /// (its slot and bytes) is released when it is done.
    pub(super) async fn serve(&self, message: Message, held: Held, shutdown: CancellationToken) {
        let _held = held;
        let _in_flight = self.metrics.get().map(|m| m.in_flight(1));
        let delivery = match message.info() {
            Ok(info) => Delivery::of(&message, &info),
            Err(e) => {
                tracing::error!(error = %e, subject = %message.subject, "not a JetStream delivery; ignored");
                return;
            }
        };
        // At debug level: a span per message is work on the hot path no one asked for at info.
        let span = tracing::debug_span!(
            "inbox.message",
            consumer = H::CONSUMER,
            key = field::Empty,
            stream_seq = delivery.stream_seq,
            delivered = delivery.delivered,
            outcome = field::Empty,
            trace_id = field::Empty,
            parent_span_id = field::Empty,
        );
        // A producer's W3C trace context, when it sent one: the span names the trace and the
        // producer's span as its parent, so that the message's logs join the producer's trace.
        // Looked for only when the span is recorded.
        if !span.is_disabled()
            && let Some(tp) = delivery.trace_parent()
        {
            span.record("trace_id", tp.trace_id);
            span.record("parent_span_id", tp.parent_id);
        }
        async {
            let limits = &self.settings.limits;
            let tries = self.process_with_retries(&message, &delivery, &shutdown);
            let ended = with_progress(&[&message], self.settings.progress_every, tries).await;
            // The limit as acted on now, once processing is over: a change read meanwhile counts.
            let max_deliver = self.max_deliver.get();
            let verdict = match ended {
                Ok(outcome) => verdict(Ok(outcome), delivery.delivered, max_deliver, limits),
                Err((err, class)) => {
                    let v = verdict(Err((&err, class)), delivery.delivered, max_deliver, limits);
                    // The whole error, the database's message with it, goes to the log; the
                    // dead letter carries our summary of it (see `letter_text`).
                    match v {
                        // A twin of a key another owner is working on: the usual, not a failure.
                        Verdict::Nak(_) if matches!(err, ProcessError::ClaimHeld { .. }) => {
                            tracing::info!(error = %err, "nak until the owner's lease ends");
                        }
                        Verdict::Nak(_) => tracing::warn!(error = %err, ?class, "processing failed; nak"),
                        _ => tracing::warn!(error = %err, ?class, "processing failed; dead-lettering"),
                    }
                    v
                }
            };
            self.answer(&message, verdict, &delivery, &shutdown).await
        }
        .instrument(span)
        .await
    }

    /// Tells JetStream the verdict and counts it.
    pub(super) async fn answer(
        &self,
        message: &Message,
        verdict: Verdict,
        delivery: &Delivery,
        shutdown: &CancellationToken,
    ) {
        let span = tracing::Span::current();
        // Recorded before acting, so that what is logged while answering carries it.
        let outcome = |name: &'static str| {
            span.record("outcome", name);
            if let Some(m) = self.metrics.get() {
                m.answered(name);
            }
        };
        let counters = &self.counters;
        // A letter that must be kept as on the last delivery: a nak would run the message again.
        let keep = matches!(verdict, Verdict::Keep(_));
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
            Verdict::DeadLetter(reason) | Verdict::Keep(reason) => {
                // The letter's id names the stream's creation time, looked up if need be: the
                // delivery-limit backstop, in any instance, names it too, and the two ids must
                // agree for the dead-letter stream to keep one letter.
                let created = match self
                    .stream_created
                    .get(&self.jetstream, &delivery.stream)
                    .await
                {
                    Ok(created) => Some(created),
                    Err(e) => {
                        tracing::debug!(error = %e, "the stream's creation time is unknown; the letter's id goes without it");
                        self.stream_created.cached()
                    }
                };
                let key = self.letter_key(message, delivery, created);
                let letter = DeadLetter {
                    consumer: H::CONSUMER,
                    stream: &delivery.stream,
                    stream_created: created,
                    stream_seq: delivery.stream_seq,
                    delivered: delivery.delivered,
                    error: &reason,
                    subject: Some(&delivery.subject),
                    key: key.as_deref(),
                };
                let last = keep || self.last_delivery(delivery.delivered);
                // The letter's futures boxed (here and below): kept inline they would make every
                // message's task as large as the rarest path (tens of KiB, allocated and copied
                // per message).
                let stored = if last {
                    let keep = self.keep_letter(message, &letter, shutdown);
                    Box::pin(with_progress(
                        &[message],
                        self.settings.progress_every,
                        keep,
                    ))
                    .await
                } else if created.is_none() {
                    // A letter without the creation time has another id than the one a later
                    // try (or the backstop) writes: if its term were lost (a leader election,
                    // when the lookup fails too), the message would be lettered twice. Nak it,
                    // to be dead-lettered under the one id once the stream answers.
                    tracing::warn!(original = %reason, "the stream's creation time is unknown; nak, to dead-letter it later");
                    Err(())
                } else {
                    Box::pin(self.dead_letters.publish(message, &letter)).await.map_err(|e| {
                        tracing::error!(error = %e, original = %reason, "dead-letter publish failed; nak");
                    })
                };
                match stored {
                    Ok(()) => {
                        outcome("dead_letter");
                        tracing::error!(error = %reason, "message dead-lettered and terminated");
                        if let Err(e) = message.ack_with(AckKind::Term).await {
                            // The dead letter exists; a redelivery would add a second one.
                            tracing::warn!(error = %e, "term failed after dead-lettering");
                        }
                        &counters.terminated
                    }
                    // Leave it with JetStream and try again later.
                    Err(()) => {
                        outcome("nak");
                        let delay = self.settings.limits.nak_request(delivery.delivered);
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
        // Jittered: twins that failed together do not all come back at once.
        let mut outage =
            Backoff::new(Duration::from_millis(100), Duration::from_secs(5)).with_jitter();
        loop {
            let deadline = self.settings.deadline;
            let started = std::time::Instant::now();
            let tried = tokio::time::timeout(deadline, self.process(message, delivery)).await;
            if let Some(m) = self.metrics.get() {
                m.tried(started.elapsed());
            }
            let err = match tried {
                Ok(Ok(outcome)) => {
                    self.circuit.close();
                    return Ok(outcome);
                }
                Ok(Err(err)) => err,
                Err(_) => ProcessError::Deadline(deadline),
            };
            let class = classify::<H::Db>(&err);
            // Another owner's claim, on the last delivery: a nak would never come back, so the
            // owner's lease is waited out here (progress acks keep the message), then tried again:
            // a Skip once the owner is done, a takeover if it died.
            if matches!(err, ProcessError::ClaimHeld { .. }) {
                self.counters.held.fetch_add(1, Ordering::Relaxed);
            }
            if let ProcessError::ClaimHeld { remaining } = &err
                && self.last_delivery(delivery.delivered)
            {
                let wait = *remaining + Duration::from_millis(100);
                tracing::debug!(retry_in = ?wait, "claim held by another owner on the last delivery; waiting");
                let waiting = std::time::Instant::now();
                tokio::select! {
                    _ = shutdown.cancelled() => return Err((err, class)),
                    _ = tokio::time::sleep(wait) => {
                        if let Some(m) = self.metrics.get() {
                            m.claim_waited(waiting.elapsed());
                        }
                        continue;
                    }
                }
            }
            // A lost connection in the chain may be another database's (a handler's own pool):
            // only when the inbox's database does not answer either is it an outage. A try cut
            // by the deadline while the database does not answer (waiting for a connection, a
            // statement on a connection that went silent) is one too, not a spent delivery; so
            // is a statement cut by its own bound at the deadline, or a lock wait that timed out,
            // while the inbox table itself is locked (DDL, `LOCK TABLE`), which the probe meets
            // too, unlike a row's lock.
            let may_be_outage = is_outage::<H::Db>(&err)
                || is_timeout::<H::Db>(&err)
                || matches!(err, ProcessError::Deadline(_));
            // The probe boxed: a cold path, as large as the whole try inline.
            if may_be_outage && !Box::pin(self.inbox.answers()).await {
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
            if reached_the_database(&err) {
                self.circuit.close();
            }
            let Some(wait) = retry_in_process(class, attempt, &self.settings.limits) else {
                return Err((err, class));
            };
            tracing::debug!(error = %err, attempt, retry_in = ?wait, "transient failure; retrying");
            if let Some(m) = self.metrics.get() {
                m.retried();
            }
            tokio::time::sleep(wait).await;
            attempt += 1;
        }
    }

    /// The key a rejected message was (or would have been) processed under, for its letter, so
    /// that a replay keeps it: the handler's `key` expression on the decoded message, else the
    /// transport id; `None` when it cannot be told (a payload that does not decode, a key
    /// expression that fails or panics, a stream whose creation time is unknown).
    fn letter_key(
        &self,
        message: &Message,
        delivery: &Delivery,
        created: Option<i128>,
    ) -> Option<String> {
        let explicit = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let decoded = decode::<H>(message).ok()?;
            self.handler.key(&decoded, delivery, &self.state).ok()
        }))
        .ok()??;
        match explicit {
            Some(key) => Some(key),
            None => match (
                delivery
                    .replay
                    .as_ref()
                    .map(|(_, k)| k)
                    .or(delivery.msg_id.as_ref()),
                created,
            ) {
                (Some(id), _) => Some(id.clone()),
                (None, Some(created)) => Some(format!(
                    "{}:{created}:{}",
                    delivery.stream, delivery.stream_seq
                )),
                (None, None) => None,
            },
        }
    }

    /// Decodes and keys the message: what a batch needs of it before its transaction.
    pub(super) async fn decode_and_key(
        &self,
        message: &Message,
        delivery: &Delivery,
    ) -> Result<(H::Message, String), ProcessError> {
        let decoded = decode::<H>(message)?;
        let explicit = self.handler.key(&decoded, delivery, &self.state)?;
        let key = key_of(explicit, message, delivery, &self.stream_created).await?;
        Ok((decoded, key))
    }

    /// Decodes, keys and processes the message once.
    async fn process(
        &self,
        message: &Message,
        delivery: &Delivery,
    ) -> Result<Outcome, ProcessError> {
        // A replayed dead letter of another consumer: this one may have applied the original.
        if delivery.replay_not_for(H::CONSUMER) {
            return Ok(Outcome::Skip);
        }
        // A panic in the key expression or the handler is this message's failure, not the
        // worker's: caught here, it is dead-lettered like any permanent failure (uncaught, the task
        // would end with neither ack nor nak, and the message would vanish after max_deliver).
        // The transaction is dropped while unwinding, which rolls it back.
        AssertUnwindSafe(async {
            let decoded = decode::<H>(message)?;
            let explicit = self.handler.key(&decoded, delivery, &self.state)?;
            let key = key_of(explicit, message, delivery, &self.stream_created).await?;
            tracing::Span::current().record("key", key.as_str());
            self.inbox
                .process_keyed(&self.handler, &self.state, decoded, delivery, &key)
                .await
        })
        .catch_unwind()
        .await
        .unwrap_or_else(|panic| Err(ProcessError::Panicked(panic_text(&*panic))))
    }
}

/// Whether the database answered on the way to `err` (so that it is reachable): a failure of
/// the handler or of the inbox's SQL, not one that never got there (decoding, the key, the
/// stream lookup, a deadline, a panic).
fn reached_the_database(err: &ProcessError) -> bool {
    matches!(
        err,
        ProcessError::Handler(_)
            | ProcessError::Database { .. }
            | ProcessError::ClaimHeld { .. }
            | ProcessError::FencedOut { .. }
    )
}

/// Runs `work`, sending a progress ack every `every` while it runs: a slow but healthy handler,
/// or a message waiting for the database, must not be redelivered to another instance.
/// Every message of a batch gets one.
pub(super) async fn with_progress<T>(
    messages: &[&Message],
    every: Duration,
    work: impl Future<Output = T>,
) -> T {
    tokio::pin!(work);
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            result = &mut work => return result,
            _ = ticks.tick() => {
                for message in messages {
                    if let Err(e) = message.ack_with(AckKind::Progress).await {
                        tracing::debug!(error = %e, "progress ack failed");
                    }
                }
            }
        }
    }
}

pub(super) use crate::supervise::panic_text;

async fn nak(message: &Message, delay: Duration) {
    if let Err(e) = message.ack_with(AckKind::Nak(Some(delay))).await {
        tracing::warn!(error = %e, "nak failed; redelivered after ack_wait");
    }
}

/// Decodes the payload with the handler's codec.
pub(super) fn decode<H: Handler>(message: &Message) -> Result<H::Message, ProcessError> {
    <H::Codec as Codec<H::Message>>::decode(&message.payload).map_err(|source| {
        ProcessError::Decode {
            ty: std::any::type_name::<H::Message>(),
            codec: <H::Codec as Codec<H::Message>>::NAME,
            source,
        }
    })
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
{
    let info = message.info().map_err(|_| KeyError::Missing)?;
    let delivery = Delivery::of(message, &info);
    if delivery.replay_not_for(H::CONSUMER) {
        return Ok(Outcome::Skip);
    }
    let decoded = decode::<H>(message)?;
    let created = StreamCreated::default();
    let explicit = handler.key(&decoded, &delivery, state)?;
    let key = key_of(explicit, message, &delivery, &created).await?;
    inbox
        .process_keyed(handler, state, decoded, &delivery, &key)
        .await
}
