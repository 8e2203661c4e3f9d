//! The delivery-limit backstop: a message whose last delivery ended without a verdict (the
//! process holding it was killed, a header block the client cannot parse kept it from ever
//! reaching the handler, `max_deliver` was lowered under a running instance) is never delivered
//! again, and nothing else would dead-letter it.
//!
//! JetStream publishes an advisory for each such message,
//! `$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>`. Advisories are not stored
//! unless a stream takes them, so the backstop keeps them in a stream of its own (default
//! `INBOX_ADVISORIES_<stream>`, bounded age, created or checked at start and left in place, so
//! that advisories published while no instance runs are kept) and reads those of its consumer
//! with a durable consumer of its own, shared by every instance. For each: the message is read
//! by sequence through the JSON API (`stored.rs`: a header block the client cannot parse is
//! still read); its marker committed, nothing happens (only the ack was lost); else it is
//! dead-lettered as any letter, with the same `Nats-Msg-Id` as a worker's letter for that message,
//! so that two instances, a repeated advisory or a letter the worker stored already come to one
//! letter (within the dead-letter stream's duplicate window).
//!
//! What it does not cover: an advisory the server does not publish or loses (around a stream
//! leader change), and a message removed from its stream before the advisory is read (the
//! stream's limits). Operators find those as messages of the stream with neither a marker nor a
//! letter: see the README's "Delivery limit".

use super::Inner;
use super::advisories::{AdvisoryStream, backstop_consumer, ensure_stream};
use super::dead_letter::{DeadLetter, UNREADABLE_HEADERS, letter_headers};
use super::serve::panic_text;
use super::transport_id::key_on;
use crate::backoff::Backoff;
use crate::delivery::{Codec, Delivery};
use crate::error::ProcessError;
use crate::handler::Handler;
use crate::stored::{self, Lookup};
use async_nats::jetstream::consumer;
use async_nats::jetstream::{self, AckKind};
use futures::{FutureExt, StreamExt};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// How the `Inbox-Error` of every letter the backstop writes begins.
pub const BACKSTOP_ERROR: &str = "delivery limit reached without a verdict";

/// What an advisory says (`io.nats.jetstream.advisory.v1.max_deliver`).
#[derive(Debug, serde::Deserialize)]
struct Advisory {
    stream: String,
    consumer: String,
    stream_seq: u64,
    deliveries: i64,
    /// When the server published it (RFC 3339).
    #[serde(default)]
    timestamp: Option<String>,
}

/// What the backstop did with one advisory.
#[derive(Debug, PartialEq, Eq)]
enum Done {
    /// The message's marker is committed: nothing to do.
    Committed,
    /// The message is no longer in its stream.
    Gone,
    /// Dead-lettered.
    Lettered,
    /// About an earlier instance of the stream or consumer.
    Stale,
}

/// Makes sure the advisory stream of `inner`'s consumer exists before the worker first pulls:
/// an advisory published before it would be lost. Waits out failures until `shutdown`.
pub(super) async fn ready<H: Handler>(
    inner: &Inner<H>,
    advisories: &AdvisoryStream,
    shutdown: &CancellationToken,
) {
    let info = inner.consumer.cached_info();
    let (stream, durable) = (&info.stream_name, &info.name);
    let js = &inner.backstop_js;
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    loop {
        let failed = tokio::select! {
            _ = shutdown.cancelled() => return,
            made = ensure_stream(js, advisories, stream, durable) => match made {
                Ok(_) => return,
                Err(e) => e,
            },
        };
        let wait = backoff.next();
        tracing::warn!(consumer = H::CONSUMER, error = %failed, retry_in = ?wait, "delivery-limit backstop: its advisory stream is not ready; not pulling yet");
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// Runs the backstop of `inner`'s consumer, reading advisory stream `advisories`, until
/// `shutdown`. Failures are logged and waited out; an advisory is acknowledged only once its
/// message is known to be committed, gone, or dead-lettered.
pub(super) async fn run<H: Handler>(
    inner: Arc<Inner<H>>,
    advisories: AdvisoryStream,
    shutdown: CancellationToken,
) {
    let info = inner.consumer.cached_info();
    let (stream, durable) = (info.stream_name.clone(), info.name.clone());
    let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
    while !shutdown.is_cancelled() {
        let failed = tokio::select! {
            _ = shutdown.cancelled() => return,
            failed = inner.serve_advisories(&advisories, &stream, &durable) => failed,
        };
        let wait = backoff.next();
        tracing::warn!(consumer = H::CONSUMER, error = %failed, retry_in = ?wait, "delivery-limit backstop: reading advisories failed");
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

impl<H: Handler> Inner<H> {
    /// Makes sure of the advisory stream and the backstop's consumer, then handles advisories
    /// until something fails: returns the failure.
    async fn serve_advisories(
        &self,
        advisories: &AdvisoryStream,
        stream: &str,
        durable: &str,
    ) -> async_nats::Error {
        let js = &self.backstop_js;
        let consumer = async {
            let advisories = ensure_stream(js, advisories, stream, durable).await?;
            backstop_consumer(js, &advisories, stream, durable).await
        };
        let consumer = match consumer.await {
            Ok(consumer) => consumer,
            Err(e) => return e,
        };
        loop {
            let batch = consumer
                .batch()
                .max_messages(16)
                .expires(Duration::from_secs(5))
                .messages()
                .await;
            let mut batch = match batch {
                Ok(batch) => batch,
                Err(e) => return e.into(),
            };
            while let Some(advisory) = batch.next().await {
                match advisory {
                    Ok(advisory) => self.backstop_one(&advisory, stream, durable).await,
                    Err(e) => return e,
                }
            }
        }
    }

    /// Handles one advisory message: acked once handled, nak'd (to be tried again) on failure.
    /// Its body must name `stream` and `durable`, which its subject names: anyone may publish
    /// to that subject, and the names and the sequence are the body's.
    async fn backstop_one(&self, message: &jetstream::Message, stream: &str, durable: &str) {
        let advisory: Advisory = match serde_json::from_slice(&message.payload) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(consumer = H::CONSUMER, error = %e, subject = %message.subject, "not a delivery-limit advisory; ignored");
                if let Err(e) = message.ack().await {
                    tracing::debug!(error = %e, "acking an unreadable advisory failed");
                }
                return;
            }
        };
        // Not the server's advisory for this consumer: another stream's sequence would have
        // that stream's message dead-lettered, and a name no API subject carries (too long)
        // would have the server close the connection at each try.
        if advisory.stream != stream || advisory.consumer != durable {
            tracing::warn!(
                consumer = H::CONSUMER,
                subject = %message.subject,
                "a delivery-limit advisory whose body names another stream or consumer than its subject; ignored"
            );
            if let Err(e) = message.ack().await {
                tracing::debug!(error = %e, "acking a foreign advisory failed");
            }
            return;
        }
        // Every line logged for this advisory names its consumer, stream and sequence.
        let span = tracing::info_span!(
            "inbox.backstop",
            consumer = H::CONSUMER,
            stream = %advisory.stream,
            seq = advisory.stream_seq,
        );
        let answer = match self.backstop(&advisory).instrument(span.clone()).await {
            Ok(done) => {
                let _in = span.enter();
                match done {
                    Done::Stale => tracing::info!(
                        "a delivery-limit advisory older than the stream or consumer it names; ignored"
                    ),
                    Done::Gone => tracing::warn!(
                        "a message reached its delivery limit without a verdict, and its stream no longer holds it: it cannot be dead-lettered"
                    ),
                    Done::Committed | Done::Lettered => {
                        tracing::debug!(?done, "delivery-limit advisory handled")
                    }
                }
                AckKind::Ack
            }
            Err(e) => {
                let _in = span.enter();
                tracing::warn!(error = %e, "delivery-limit backstop failed; trying again");
                AckKind::Nak(Some(Duration::from_secs(5)))
            }
        };
        if let Err(e) = message.ack_with(answer).await {
            tracing::debug!(error = %e, "answering a delivery-limit advisory failed; it comes back");
        }
    }

    /// Whether `advisory` is about an earlier instance of the stream or of the consumer (both
    /// deleted and created again since, or the consumer reset to replay): its sequence then
    /// names another message, or one the new consumer is to deliver afresh.
    async fn is_stale(&self, advisory: &Advisory) -> Result<bool, async_nats::Error> {
        let Some(at) = advisory.timestamp.as_deref().and_then(|t| {
            time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339).ok()
        }) else {
            return Ok(false);
        };
        let at = at.unix_timestamp_nanos();
        let stream = self
            .stream_created
            .get(&self.backstop_js, &advisory.stream)
            .await?;
        let durable = &self.consumer.cached_info().name;
        let consumer = self
            .backstop_js
            .get_stream(&advisory.stream)
            .await?
            .get_consumer::<consumer::pull::Config>(durable)
            .await?
            .cached_info()
            .created
            .unix_timestamp_nanos();
        Ok(at < stream || at < consumer)
    }

    /// Reads the advisory's message and dead-letters it unless its marker is committed.
    async fn backstop(&self, advisory: &Advisory) -> Result<Done, async_nats::Error> {
        let js = &self.backstop_js;
        if self.is_stale(advisory).await? {
            return Ok(Done::Stale);
        }
        let lookup = Lookup::Sequence(advisory.stream_seq);
        let Some(stored) = stored::read(js, &advisory.stream, lookup).await? else {
            return Ok(Done::Gone);
        };
        let headers = stored.headers();
        let delivery = Delivery::of_stored(
            &stored,
            &headers.readable,
            &advisory.stream,
            advisory.deliveries,
        );
        let mut letter_key = None;
        let why = match self.stored_key(&stored.payload, &delivery).await? {
            Ok(key) => {
                if self.inbox.is_done(H::CONSUMER, &key).await? {
                    return Ok(Done::Committed);
                }
                letter_key = Some(key);
                format!(
                    "{BACKSTOP_ERROR} (delivery {} of consumer {:?}): the process holding its last delivery stopped, or the client could not read the message",
                    advisory.deliveries, advisory.consumer
                )
            }
            // No key, so it was never applied: the worker would have dead-lettered it.
            Err(e) => format!("{BACKSTOP_ERROR}, and {e}"),
        };
        // Without it the letter's id would not match a worker's for the same message: asked
        // again later rather than written without.
        let created = Some(self.stream_created.get(js, &advisory.stream).await?);
        let letter = DeadLetter {
            consumer: H::CONSUMER,
            stream: &advisory.stream,
            stream_created: created,
            stream_seq: advisory.stream_seq,
            delivered: advisory.deliveries,
            error: &why,
            subject: Some(&stored.subject),
            key: letter_key.as_deref(),
        };
        let readable = (!headers.readable.is_empty()).then_some(&headers.readable);
        let mut letter_headers = letter_headers(readable, &letter);
        if !headers.unreadable.is_empty() {
            let encoded = stored::encode_unreadable(&headers.unreadable);
            letter_headers.insert(UNREADABLE_HEADERS, encoded.as_str());
        }
        self.dead_letters
            .send(js, letter_headers, stored.payload.clone())
            .await?;
        crate::metrics::backstop_lettered(H::CONSUMER);
        tracing::error!(
            unreadable_headers = headers.unreadable.len(),
            error = %why,
            "message dead-lettered by the delivery-limit backstop"
        );
        Ok(Done::Lettered)
    }

    /// The key the worker would have given the stored message, decoded and keyed as a delivery
    /// is; `Ok(Err(why))` when it has none (a payload that does not decode, a key expression that
    /// fails or panics), `Err` when the stream could not be looked up for the default key.
    async fn stored_key(
        &self,
        payload: &bytes::Bytes,
        delivery: &Delivery,
    ) -> Result<Result<String, String>, async_nats::Error> {
        let explicit = AssertUnwindSafe(async {
            let decoded = <H::Codec as Codec<H::Message>>::decode(payload).map_err(|e| {
                format!(
                    "its payload does not decode as {} ({}): {e}",
                    std::any::type_name::<H::Message>(),
                    <H::Codec as Codec<H::Message>>::NAME
                )
            })?;
            self.handler
                .key(&decoded, delivery, &self.state)
                .map_err(|e| format!("it has no usable key: {e}"))
        })
        .catch_unwind()
        .await
        .unwrap_or_else(|panic| Err(format!("its key panicked: {}", panic_text(&*panic))));
        let explicit = match explicit {
            Ok(explicit) => explicit,
            Err(why) => return Ok(Err(why)),
        };
        match key_on(explicit, &self.backstop_js, delivery, &self.stream_created).await {
            Ok(key) => Ok(Ok(key)),
            Err(e @ ProcessError::StreamLookup { .. }) => Err(e.into()),
            Err(e) => Ok(Err(format!("it has no usable key: {e}"))),
        }
    }
}
