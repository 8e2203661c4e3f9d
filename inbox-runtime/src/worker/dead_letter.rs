//! Dead letters: a rejected message is published, with its payload and headers and the reason,
//! to `<prefix>.<consumer>` in a stream of its own (created on first use). The caller terms the
//! original only once [`DeadLetters::publish`] returns `Ok`, that is once JetStream has stored
//! the letter; on `Err` it naks, so that nothing rejected is ever lost.

use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::message::Message;
use async_nats::jetstream::stream;
use tokio::sync::OnceCell;

/// The default dead-letter stream.
pub const DEFAULT_DLQ_STREAM: &str = "INBOX_DLQ";
/// The default dead-letter subject prefix.
pub const DEFAULT_DLQ_PREFIX: &str = "inbox.dlq";

/// The longest `Inbox-Error` a letter carries, in bytes: an error can be as long as a payload.
const MAX_ERROR_LEN: usize = 1024;

/// Where a worker's dead letters go.
#[derive(Debug)]
pub(crate) struct DeadLetters {
    stream: String,
    prefix: String,
    subject: String,
    ready: OnceCell<()>,
}

/// What is known of a rejected delivery.
pub(crate) struct DeadLetter<'a> {
    pub consumer: &'a str,
    pub stream: &'a str,
    pub stream_seq: u64,
    pub delivered: i64,
    pub error: &'a str,
}

impl DeadLetters {
    pub(crate) fn new(stream: String, prefix: String, consumer: &str) -> Self {
        let subject = format!("{prefix}.{consumer}");
        DeadLetters {
            stream,
            prefix,
            subject,
            ready: OnceCell::new(),
        }
    }

    /// Publishes the dead letter and waits until JetStream has stored it.
    pub(crate) async fn publish(
        &self,
        message: &Message,
        letter: &DeadLetter<'_>,
    ) -> Result<(), async_nats::Error> {
        let js = &message.context;
        self.ready
            .get_or_try_init(|| async {
                js.get_or_create_stream(stream::Config {
                    name: self.stream.clone(),
                    subjects: vec![format!("{}.>", self.prefix)],
                    ..Default::default()
                })
                .await
                .map(|_| ())
            })
            .await?;
        let headers = letter_headers(message.headers.as_ref(), letter);
        let ack = js
            .publish_with_headers(self.subject.clone(), headers, message.payload.clone())
            .await?
            .await?;
        if ack.duplicate {
            // Our own letter for this very delivery, stored by an earlier attempt whose term was
            // lost: the letter id names consumer, stream and sequence, so nothing else matches.
            tracing::debug!(seq = ack.sequence, "dead letter was already stored");
        }
        Ok(())
    }
}

/// The letter's headers: the original's, except the JetStream control headers (`Nats-*`: an
/// expected stream, last sequence or msg-id, a rollup, a TTL, meant for the original's stream,
/// would make the dead-letter stream reject or drop the letter; the original's msg-id is kept as
/// `Inbox-Original-Msg-Id`), then ours.
fn letter_headers(original: Option<&HeaderMap>, letter: &DeadLetter<'_>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, values) in original.into_iter().flat_map(HeaderMap::iter) {
        let name: &str = name.as_ref();
        let control = name.len() >= 5 && name[..5].eq_ignore_ascii_case("nats-");
        let kept = if !control {
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
    headers.insert(
        "Inbox-Error",
        one_line(letter.error, MAX_ERROR_LEN).as_str(),
    );
    headers.insert("Inbox-Consumer", letter.consumer);
    headers.insert("Inbox-Stream", letter.stream);
    headers.insert("Inbox-Stream-Seq", letter.stream_seq.to_string().as_str());
    headers.insert("Inbox-Delivered", letter.delivered.to_string().as_str());
    // One id per consumer and stored message: JetStream drops a second letter for the same
    // delivery (a retry after a lost PubAck), never the letter of another consumer.
    let id = format!(
        "dlq:{}:{}:{}",
        letter.consumer, letter.stream, letter.stream_seq
    );
    headers.insert(NATS_MESSAGE_ID, id.as_str());
    headers
}

/// `text` on one line (a header holds one) and at most `max` bytes, cut at a character boundary
/// and marked with `…` when cut.
fn one_line(text: &str, max: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max));
    for c in text.chars() {
        let c = if c.is_control() { ' ' } else { c };
        if out.len() + c.len_utf8() > max - '…'.len_utf8() {
            out.push('…');
            return out;
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letter() -> DeadLetter<'static> {
        DeadLetter {
            consumer: "orders",
            stream: "S",
            stream_seq: 9,
            delivered: 1,
            error: "boom",
        }
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
    fn the_error_is_one_bounded_line() {
        assert_eq!(one_line("a\nb", 100), "a b");
        let long = "é".repeat(2000);
        let cut = one_line(&long, MAX_ERROR_LEN);
        assert!(cut.len() <= MAX_ERROR_LEN, "{}", cut.len());
        assert!(cut.ends_with('…'));
    }
}
