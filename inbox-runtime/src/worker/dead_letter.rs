//! Dead letters: a rejected message is published, with its payload and headers and the reason,
//! to `<prefix>.<consumer>` in a stream of its own (created on first use, with as many replicas
//! as the consumer's stream). The caller terms the
//! original only once [`DeadLetters::publish`] returns `Ok`, that is once JetStream has stored
//! the letter; on `Err` it naks, so that nothing rejected is ever lost. On the last delivery a
//! nak would never be redelivered: there the letter is parked in the database instead (then the
//! original is termed), and [`relay_parked`] publishes it once the stream takes it.

use super::letter_fit::fit;
use super::letter_text::error_header;
use crate::backend::InboxBackend;
use crate::store::Inbox;
use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::{self, message::Message, stream};
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};

/// The default dead-letter stream.
pub const DEFAULT_DLQ_STREAM: &str = "INBOX_DLQ";
/// The default dead-letter subject prefix.
pub const DEFAULT_DLQ_PREFIX: &str = "inbox.dlq";

/// The header that carries, base64-encoded (one item per line, comma-separated), the header
/// lines of the original that cannot travel as NATS headers (see the delivery-limit backstop).
pub const UNREADABLE_HEADERS: &str = "Inbox-Unreadable-Headers";

/// Where a worker's dead letters go.
#[derive(Debug)]
pub(crate) struct DeadLetters {
    stream: String,
    /// The consumer's own stream: the dead-letter stream is created with its replica count, so
    /// that letters are as safe as the messages they stand for.
    source: String,
    prefix: String,
    subject: String,
    /// Whether the stream is known to exist: set once it is created or found, cleared when a
    /// letter finds it gone (deleted by an operator), so that the next letter creates it again.
    ready: AtomicBool,
}

/// What is known of a rejected delivery.
pub(crate) struct DeadLetter<'a> {
    pub consumer: &'a str,
    pub stream: &'a str,
    /// The stream's creation time (Unix nanoseconds), when known.
    pub stream_created: Option<i128>,
    pub stream_seq: u64,
    pub delivered: i64,
    pub error: &'a str,
    /// The subject the original was published to.
    pub subject: Option<&'a str>,
    /// The key it was (or would have been) processed under, when known.
    pub key: Option<&'a str>,
}

impl DeadLetters {
    pub(crate) fn new(stream: String, prefix: String, consumer: &str, source: String) -> Self {
        let subject = format!("{prefix}.{consumer}");
        DeadLetters {
            stream,
            source,
            prefix,
            subject,
            ready: AtomicBool::new(false),
        }
    }

    /// Publishes the dead letter and waits until JetStream has stored it.
    pub(crate) async fn publish(
        &self,
        message: &Message,
        letter: &DeadLetter<'_>,
    ) -> Result<(), async_nats::Error> {
        let headers = letter_headers(message.headers.as_ref(), letter);
        self.send(&message.context, headers, message.payload.clone())
            .await
    }

    /// Publishes a letter already composed (by [`letter_headers`]) and waits until JetStream has
    /// stored it; too large for the server, it is stored truncated (see [`fit`]).
    pub(crate) async fn send(
        &self,
        js: &jetstream::Context,
        headers: HeaderMap,
        payload: Bytes,
    ) -> Result<(), async_nats::Error> {
        self.ensure_stream(js).await?;
        let max = js.client().max_payload();
        let (headers, payload) = fit(headers, payload, max);
        let stored = self.store(js, headers.clone(), payload.clone()).await;
        let ack = match stored {
            Err(e) if e.kind() == PublishErrorKind::StreamNotFound => {
                // Deleted since it was made ready: made again, and the letter stored there.
                tracing::warn!(stream = %self.stream, "the dead-letter stream is gone; creating it again");
                self.ready.store(false, Ordering::Relaxed);
                self.ensure_stream(js).await?;
                self.store(js, headers, payload).await?
            }
            other => other?,
        };
        if ack.duplicate {
            // Our own letter for this very delivery, stored by an earlier attempt whose term was
            // lost: the letter id names consumer, stream and sequence, so nothing else matches.
            tracing::debug!(seq = ack.sequence, "dead letter was already stored");
        }
        Ok(())
    }
}

impl DeadLetters {
    /// Creates the dead-letter stream unless it is known to exist (with the replica count of the
    /// consumer's stream).
    async fn ensure_stream(&self, js: &jetstream::Context) -> Result<(), async_nats::Error> {
        if self.ready.load(Ordering::Relaxed) {
            return Ok(());
        }
        let replicas = js
            .get_stream(&self.source)
            .await?
            .cached_info()
            .config
            .num_replicas
            .max(1);
        js.get_or_create_stream(stream::Config {
            name: self.stream.clone(),
            subjects: vec![format!("{}.>", self.prefix)],
            num_replicas: replicas,
            ..Default::default()
        })
        .await?;
        self.ready.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Publishes a letter and waits for its PubAck.
    async fn store(
        &self,
        js: &jetstream::Context,
        headers: HeaderMap,
        payload: Bytes,
    ) -> Result<PublishAck, PublishError> {
        js.publish_with_headers(self.subject.clone(), headers, payload)
            .await?
            .await
    }
}

/// A letter's headers as stored in the database, and back.
pub(crate) fn header_pairs(headers: &HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .flat_map(|(name, values)| {
            let name: &str = name.as_ref();
            values
                .iter()
                .map(move |v| (name.to_owned(), v.as_str().to_owned()))
        })
        .collect()
}

/// A parked letter's headers as a map. A pair NATS cannot carry (in a row written by another
/// writer, or by hand) is left out and logged: async-nats's `append` of a bad name or value
/// panics, which stopped every later parked letter of the consumer.
fn header_map(pairs: &[(String, String)]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in pairs {
        let parsed = (
            HeaderName::from_str(name).ok().filter(|_| !name.is_empty()),
            HeaderValue::from_str(value).ok(),
        );
        match parsed {
            (Some(name), Some(value)) => headers.append(name, value),
            _ => {
                tracing::warn!(header = ?name, "a parked letter's header NATS cannot carry is left out")
            }
        }
    }
    headers
}

/// Publishes every letter parked for `consumer` in the database (on a last delivery whose
/// letter no stream would take) and forgets each once JetStream has stored it. A letter
/// published twice (two instances relaying at once, a crash before forgetting) keeps its msg-id:
/// the dead-letter stream drops the copy within its duplicate window. Returns how many went out.
pub(crate) async fn relay_parked<DB: InboxBackend>(
    inbox: &Inbox<DB>,
    letters: &DeadLetters,
    js: &jetstream::Context,
    consumer: &str,
) -> Result<usize, async_nats::Error> {
    let mut sent = 0;
    for letter in inbox.parked_letters(consumer).await? {
        let id = letter.id;
        // One letter the stream refuses (too large for its max_msg_size, say) must not hold up
        // the others: it stays parked, and is tried again next time.
        match letters
            .send(js, header_map(&letter.headers), Bytes::from(letter.payload))
            .await
        {
            Ok(()) => {
                inbox.unpark_letter(id).await?;
                sent += 1;
            }
            Err(e) => tracing::warn!(id, error = %e, "a parked dead letter is still refused"),
        }
    }
    Ok(sent)
}

impl<DB: InboxBackend> Inbox<DB> {
    /// Publishes `consumer`'s parked dead letters (kept in `<table>_dead_letters` when no stream
    /// took them on a last delivery) to `stream` under `<prefix>.<consumer>`, as the consumer's
    /// worker does every so often, and deletes each once JetStream stored it; returns how many
    /// went. A letter the stream still refuses stays parked. The stream is created if missing,
    /// with as many replicas as `source` (the consumer's stream) has.
    pub async fn relay_parked_letters(
        &self,
        js: &jetstream::Context,
        (stream, prefix): (&str, &str),
        consumer: &str,
        source: &str,
    ) -> Result<usize, async_nats::Error> {
        let letters = DeadLetters::new(stream.into(), prefix.into(), consumer, source.into());
        relay_parked(self, &letters, js, consumer).await
    }
}

/// The header that names the subject the original was published to.
pub const SUBJECT: &str = "Inbox-Subject";

/// The header that carries the key the original was (or would have been) processed under.
pub const KEY: &str = "Inbox-Key";

/// The letter's headers: the original's, except the JetStream control headers (`Nats-*`: an
/// expected stream, last sequence or msg-id, a rollup, a TTL, meant for the original's stream,
/// would make the dead-letter stream reject or drop the letter; the original's msg-id is kept as
/// `Inbox-Original-Msg-Id`), then ours.
pub(crate) fn letter_headers(original: Option<&HeaderMap>, letter: &DeadLetter<'_>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, values) in original.into_iter().flat_map(HeaderMap::iter) {
        let name: &str = name.as_ref();
        let control = name.len() >= 5 && name[..5].eq_ignore_ascii_case("nats-");
        // Ours, in any letter case: a producer's copy would stand next to ours for a reader that
        // ignores case, forging the error, the consumer or the original's place.
        let forged = name.len() >= 6 && name[..6].eq_ignore_ascii_case("inbox-");
        let kept = if forged {
            None
        } else if !control {
            Some(name)
        } else if name.eq_ignore_ascii_case(NATS_MESSAGE_ID.as_ref()) {
            Some("Inbox-Original-Msg-Id")
        } else {
            None
        };
        for value in kept
            .into_iter()
            .flat_map(|k| values.iter().map(move |v| (k, v)))
        {
            headers.append(value.0, value.1.as_str());
        }
    }
    headers.insert("Inbox-Error", error_header(letter.error).as_str());
    headers.insert("Inbox-Consumer", letter.consumer);
    headers.insert("Inbox-Stream", letter.stream);
    headers.insert("Inbox-Stream-Seq", letter.stream_seq.to_string().as_str());
    headers.insert("Inbox-Delivered", letter.delivered.to_string().as_str());
    // What a replay needs (`inbox dlq replay`): where the original went, and the key it keeps
    // (left out when no header can carry it: a key with a line break).
    for (name, value) in [(SUBJECT, letter.subject), (KEY, letter.key)] {
        if let Some(value) = value.and_then(|v| v.parse::<async_nats::HeaderValue>().ok()) {
            headers.insert(name, value);
        }
    }
    // One id per consumer and stored message: JetStream drops a second letter for the same
    // delivery (a retry after a lost PubAck), never the letter of another consumer.
    // With the stream's creation time when known: a stream created again restarts its
    // sequences, and its letters must not be dropped as duplicates of its predecessor's.
    let id = match letter.stream_created {
        Some(created) => format!(
            "dlq:{}:{}:{created}:{}",
            letter.consumer, letter.stream, letter.stream_seq
        ),
        None => format!(
            "dlq:{}:{}:{}",
            letter.consumer, letter.stream, letter.stream_seq
        ),
    };
    headers.insert(NATS_MESSAGE_ID, id.as_str());
    headers
}

#[cfg(test)]
mod tests {
    use super::super::letter_fit::{HEADERS_DROPPED, MAX_HEADER_BLOCK, TRUNCATED, wire_len};
    use super::*;

    fn letter() -> DeadLetter<'static> {
        DeadLetter {
            consumer: "orders",
            stream: "S",
            stream_created: None,
            stream_seq: 9,
            delivered: 1,
            error: "boom",
            subject: Some("orders.created"),
            key: Some("order-7"),
        }
    }

    #[test]
    fn parked_headers_nats_cannot_carry_are_left_out() {
        let pair = |n: &str, v: &str| (n.to_owned(), v.to_owned());
        let pairs = [
            pair("Bad Name", "v"),
            pair("", "v"),
            pair("Ünïcode", "v"),
            pair("X-Split", "a\r\nX-Forged: 1"),
            pair("Inbox-Consumer", "orders"),
        ];
        let headers = header_map(&pairs);
        assert_eq!(header_pairs(&headers), [pair("Inbox-Consumer", "orders")]);
    }

    #[test]
    fn control_headers_are_not_copied_and_the_original_id_is_kept() {
        let mut original = HeaderMap::new();
        original.insert("Nats-Expected-Stream", "ORDERS");
        original.insert("nats-expected-last-sequence", "4");
        original.insert("Nats-Rollup", "sub");
        original.insert("Nats-TTL", "1s");
        original.insert(NATS_MESSAGE_ID, "order-7");
        original.insert("Ce-Id", "abc");
        original.append("X-Many", "1");
        original.append("X-Many", "2");
        let h = letter_headers(Some(&original), &letter());
        for gone in [
            "Nats-Expected-Stream",
            "nats-expected-last-sequence",
            "Nats-Rollup",
            "Nats-TTL",
        ] {
            assert!(h.get(gone).is_none(), "{gone} was copied");
        }
        assert_eq!(h.get("Inbox-Original-Msg-Id").unwrap().as_str(), "order-7");
        assert_eq!(h.get(NATS_MESSAGE_ID).unwrap().as_str(), "dlq:orders:S:9");
        assert_eq!(h.get("Ce-Id").unwrap().as_str(), "abc");
        assert_eq!(h.get_all("X-Many").count(), 2);
    }

    #[test]
    fn letters_of_two_consumers_have_different_ids() {
        let a = letter_headers(None, &letter());
        let b = letter_headers(
            None,
            &DeadLetter {
                consumer: "inventory",
                ..letter()
            },
        );
        assert_ne!(a.get(NATS_MESSAGE_ID), b.get(NATS_MESSAGE_ID));
    }

    #[test]
    fn a_letter_too_large_is_cut_to_fit_and_says_so() {
        let max = 4096;
        let small = letter_headers(None, &letter());
        let (h, p) = fit(small.clone(), Bytes::from(vec![b'x'; 100]), max);
        assert!(h.get(TRUNCATED).is_none());
        assert_eq!(p.len(), 100);

        let (h, p) = fit(small, Bytes::from(vec![b'x'; 10_000]), max);
        assert_eq!(h.get(TRUNCATED).unwrap().as_str(), "10000");
        assert_eq!(h.get("Inbox-Stream-Seq").unwrap().as_str(), "9");
        assert!(wire_len(&h) + p.len() <= max, "{}", wire_len(&h) + p.len());
        assert!(p.len() > 3000, "as much as fits is kept: {}", p.len());

        // The original's own headers too large: only ours stay.
        let mut original = HeaderMap::new();
        original.insert("X-Big", "v".repeat(5000).as_str());
        let big = letter_headers(Some(&original), &letter());
        let (h, p) = fit(big.clone(), Bytes::from(vec![b'x'; 10]), max);
        assert!(h.get("X-Big").is_none());
        let dropped = wire_len(&big).to_string();
        assert_eq!(h.get(HEADERS_DROPPED).unwrap().as_str(), dropped);
        assert!(h.get(TRUNCATED).is_none(), "the payload is whole");
        assert_eq!(p.len(), 10);
        assert_eq!(h.get(NATS_MESSAGE_ID).unwrap().as_str(), "dlq:orders:S:9");
        assert!(wire_len(&h) + p.len() <= max);
    }

    #[test]
    fn original_headers_over_jetstreams_limit_are_dropped_and_said() {
        let max = 1024 * 1024;
        let mut original = HeaderMap::new();
        original.insert("X-Big", "v".repeat(65_400).as_str());
        assert!(
            wire_len(&original) <= MAX_HEADER_BLOCK,
            "JetStream stores the original"
        );
        let letter = letter_headers(Some(&original), &letter());
        assert!(wire_len(&letter) > MAX_HEADER_BLOCK);
        let (h, p) = fit(letter.clone(), Bytes::from(vec![b'x'; 100]), max);
        assert!(h.get("X-Big").is_none());
        assert_eq!(
            h.get(HEADERS_DROPPED).unwrap().as_str(),
            wire_len(&letter).to_string()
        );
        assert!(h.get(TRUNCATED).is_none(), "the payload fits");
        assert_eq!(p.len(), 100);
        assert_eq!(h.get(NATS_MESSAGE_ID).unwrap().as_str(), "dlq:orders:S:9");
        assert_eq!(h.get("Inbox-Stream-Seq").unwrap().as_str(), "9");
        assert!(wire_len(&h) <= MAX_HEADER_BLOCK);
    }

    #[test]
    fn secrets_in_an_error_do_not_reach_the_letter() {
        let mut l = letter();
        l.error = "GET https://u:tok3n@h/x?sig=s3cret failed";
        let headers = letter_headers(None, &l);
        let error = headers.get("Inbox-Error").unwrap().as_str().to_owned();
        assert!(
            !error.contains("tok3n") && !error.contains("s3cret"),
            "{error}"
        );
    }

    #[test]
    fn a_producers_inbox_headers_are_not_copied() {
        let mut original = HeaderMap::new();
        original.insert("inbox-error", "forged");
        original.insert("INBOX-CONSUMER", "forged");
        original.insert("Traceparent", "00-abc-def-01");
        let headers = letter_headers(Some(&original), &letter());
        for (name, values) in headers.iter() {
            for value in values {
                assert_ne!(value.as_str(), "forged", "{name} was copied");
            }
        }
        assert_eq!(
            headers.get("Traceparent").unwrap().as_str(),
            "00-abc-def-01"
        );
    }
}
