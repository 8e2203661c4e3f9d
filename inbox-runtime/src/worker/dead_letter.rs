//! Dead letters: a rejected message is published, with its payload and headers and the reason,
//! to `<prefix>.<consumer>` in a stream of its own (created on first use, with as many replicas
//! as the consumer's stream). The caller terms the
//! original only once [`DeadLetters::publish`] returns `Ok`, that is once JetStream has stored
//! the letter; on `Err` it naks, so that nothing rejected is ever lost. On the last delivery a
//! nak would never be redelivered: there the letter is parked in the database instead (then the
//! original is termed), and [`relay_parked`] publishes it once the stream takes it.

use crate::backend::InboxBackend;
use crate::error::{ProcessError, chain};
use crate::store::Inbox;
use async_nats::HeaderMap;
use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::{self, message::Message, stream};
use bytes::Bytes;
use sqlx::error::ErrorKind;
use std::sync::atomic::{AtomicBool, Ordering};

/// The default dead-letter stream.
pub const DEFAULT_DLQ_STREAM: &str = "INBOX_DLQ";
/// The default dead-letter subject prefix.
pub const DEFAULT_DLQ_PREFIX: &str = "inbox.dlq";

/// The header that carries, base64-encoded (one item per line, comma-separated), the header
/// lines of the original that cannot travel as NATS headers (see the delivery-limit backstop).
pub const UNREADABLE_HEADERS: &str = "Inbox-Unreadable-Headers";

/// The longest `Inbox-Error` a letter carries, in bytes: an error can be as long as a payload.
const MAX_ERROR_LEN: usize = 1024;

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

fn header_map(pairs: &[(String, String)]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    for (name, value) in pairs {
        headers.append(name.as_str(), value.as_str());
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

/// The letter as it fits within the server's `max_payload` (headers and payload together): as it
/// is when it fits; else its payload cut, with `Inbox-Truncated: <original length>` (the letter
/// still names the original's stream and sequence, to fetch it whole); and when the original's
/// headers alone are too large, without them too.
fn fit(headers: HeaderMap, payload: Bytes, max: usize) -> (HeaderMap, Bytes) {
    if wire_len(&headers) + payload.len() <= max {
        return (headers, payload);
    }
    let mut cut = headers;
    cut.insert(TRUNCATED, payload.len().to_string().as_str());
    if wire_len(&cut) >= max {
        let ours: HeaderMap = cut
            .iter()
            .filter(|(name, _)| {
                let name: &str = name.as_ref();
                // The original's unreadable header lines are the original's headers too.
                (name.starts_with("Inbox-") && name != UNREADABLE_HEADERS)
                    || name.eq_ignore_ascii_case("Nats-Msg-Id")
            })
            .flat_map(|(name, values)| values.iter().map(move |v| (name.clone(), v.clone())))
            .fold(HeaderMap::new(), |mut h, (name, value)| {
                h.append(name, value);
                h
            });
        cut = ours;
    }
    let room = max.saturating_sub(wire_len(&cut));
    let payload = payload.slice(..room.min(payload.len()));
    (cut, payload)
}

/// The header block's size on the wire: `NATS/1.0\r\n`, each `name: value\r\n`, `\r\n`.
fn wire_len(headers: &HeaderMap) -> usize {
    let mut len = "NATS/1.0\r\n\r\n".len();
    for (name, values) in headers.iter() {
        let name: &str = name.as_ref();
        for value in values {
            len += name.len() + ": \r\n".len() + value.as_str().len();
        }
    }
    len
}

/// The header a truncated letter carries: the original payload's length.
const TRUNCATED: &str = "Inbox-Truncated";

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
    headers.insert(
        "Inbox-Error",
        one_line(&scrub(letter.error), MAX_ERROR_LEN).as_str(),
    );
    headers.insert("Inbox-Consumer", letter.consumer);
    headers.insert("Inbox-Stream", letter.stream);
    headers.insert("Inbox-Stream-Seq", letter.stream_seq.to_string().as_str());
    headers.insert("Inbox-Delivered", letter.delivered.to_string().as_str());
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

/// `text` without the secrets an error's text is known to carry: the user info of a URL
/// (`scheme://user:password@host` becomes `scheme://***@host`), a URL's query (`?token=..`
/// becomes `?***`), and the value of a `name=value` or `name: value` pair whose name says
/// password, token, secret, key, auth, signature or credential. A letter travels on to whoever
/// reads the dead-letter stream; an HTTP client's error, say, carries its whole URL.
pub(crate) fn scrub(text: &str) -> String {
    const SECRET_NAMES: [&str; 9] = [
        "password",
        "passwd",
        "pwd",
        "token",
        "secret",
        "key",
        "auth",
        "signature",
        "credential",
    ];
    let ends_token = |c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '<' | '>' | ')' | ',');
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        // A URL: scheme, "://", then up to the next whitespace or quote.
        if let Some(at) = rest.find("://") {
            let scheme_start = after_last(&rest[..at], |c| {
                !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
            });
            out.push_str(&scrub_pairs(&rest[..scheme_start], &SECRET_NAMES));
            let url_end = rest[at + 3..]
                .find(ends_token)
                .map_or(rest.len(), |i| at + 3 + i);
            let url = &rest[scheme_start..url_end];
            let (head, query) = match url.find('?') {
                Some(q) => (&url[..q], Some(())),
                None => (url, None),
            };
            let body_start = at - scheme_start + 3;
            let authority_end = head[body_start..]
                .find('/')
                .map_or(head.len(), |i| body_start + i);
            match head[body_start..authority_end].rfind('@') {
                Some(user) => {
                    out.push_str(&head[..body_start]);
                    out.push_str("***");
                    out.push_str(&head[body_start + user..]);
                }
                None => out.push_str(head),
            }
            if query.is_some() {
                out.push_str("?***");
            }
            rest = &rest[url_end..];
        } else {
            out.push_str(&scrub_pairs(rest, &SECRET_NAMES));
            break;
        }
    }
    out
}

/// Where what follows the last character of `text` matching `pred` starts (a byte index on a
/// character boundary, whatever that character's width); 0 when none matches.
fn after_last(text: &str, pred: impl Fn(char) -> bool) -> usize {
    text.char_indices()
        .rev()
        .find(|&(_, c)| pred(c))
        .map_or(0, |(i, c)| i + c.len_utf8())
}

/// `text` with the value of each `name=value` / `name: value` pair whose name contains one of
/// `names` (any letter case) replaced by `***`.
fn scrub_pairs(text: &str, names: &[&str]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(sep) = rest.find(['=', ':']) {
        let name_start = after_last(&rest[..sep], |c| {
            !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-'))
        });
        let name = rest[name_start..sep].to_ascii_lowercase();
        let mut value_start = sep + 1;
        if rest[sep..].starts_with(": ") {
            value_start += 1;
        }
        out.push_str(&rest[..value_start]);
        let value_end = rest[value_start..]
            .find(|c: char| c.is_whitespace() || matches!(c, '&' | ',' | ';' | '"' | '\''))
            .map_or(rest.len(), |i| value_start + i);
        let value = &rest[value_start..value_end];
        let mut end = value_end;
        if !name.is_empty() && names.iter().any(|n| name.contains(n)) && !value.is_empty() {
            out.push_str("***");
            // `Authorization: Bearer <token>`: the scheme, then the credential.
            let scheme = ["bearer", "basic", "token", "digest"]
                .iter()
                .any(|s| value.eq_ignore_ascii_case(s));
            if scheme {
                let after = &rest[value_end..];
                let word = after.trim_start();
                let skipped = after.len() - word.len();
                let word_end = word.find(char::is_whitespace).unwrap_or(word.len());
                end = value_end + skipped + word_end;
            }
        } else {
            out.push_str(value);
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
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

/// What a dead letter says of `err`: our own words. A database's message can hold the row's
/// values (MySQL: `Duplicate entry '7' for key ..`, `Incorrect integer value: 'x'`), which belong
/// in the operator's logs, not in a letter that travels on: of a database error the letter names
/// the kind, the SQLSTATE and the constraint or table.
pub(crate) fn letter_text(err: &ProcessError) -> String {
    let db = match err {
        ProcessError::Database { source, .. } => source.as_database_error(),
        ProcessError::Handler(e) => chain(e.as_ref()).find_map(|e| {
            e.downcast_ref::<sqlx::Error>()
                .and_then(|e| e.as_database_error())
        }),
        _ => None,
    };
    let Some(db) = db else {
        return err.to_string();
    };
    let kind = match db.kind() {
        ErrorKind::UniqueViolation => "unique violation",
        ErrorKind::ForeignKeyViolation => "foreign key violation",
        ErrorKind::NotNullViolation => "not-null violation",
        ErrorKind::CheckViolation => "check violation",
        _ => "error",
    };
    let code = db.code().map(|c| format!(" {c}")).unwrap_or_default();
    let on = match (db.constraint(), db.table()) {
        (Some(c), _) => format!(" on constraint {c}"),
        (None, Some(t)) => format!(" on table {t}"),
        (None, None) => String::new(),
    };
    match err {
        ProcessError::Database { stage, .. } => {
            format!("inbox database {kind}{code}{on} while {stage}")
        }
        _ => format!("handler failed: database {kind}{code}{on}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn letter() -> DeadLetter<'static> {
        DeadLetter {
            consumer: "orders",
            stream: "S",
            stream_created: None,
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
        let (h, p) = fit(big, Bytes::from(vec![b'x'; 10]), max);
        assert!(h.get("X-Big").is_none());
        assert_eq!(h.get(TRUNCATED).unwrap().as_str(), "10");
        assert_eq!(h.get(NATS_MESSAGE_ID).unwrap().as_str(), "dlq:orders:S:9");
        assert!(wire_len(&h) + p.len() <= max);
    }

    #[test]
    fn secrets_in_an_error_do_not_reach_the_letter() {
        let cases = [
            (
                "error sending request for url (https://api.example.com/v1/pay?api_key=sk_live_123&x=1): timed out",
                "error sending request for url (https://api.example.com/v1/pay?***): timed out",
            ),
            (
                "connect postgres://app:hunter2@db.internal:5432/prod failed",
                "connect postgres://***@db.internal:5432/prod failed",
            ),
            (
                "upstream said 401 with Authorization: Bearer abc.def and password=p4ss; retry",
                "upstream said 401 with Authorization: *** and password=***; retry",
            ),
            (
                "balance would go below 0 for account 7",
                "balance would go below 0 for account 7",
            ),
            // Characters wider than a byte right before a pair or a URL.
            ("Größe: 5, café=1, ошибка: x", "Größe: 5, café=1, ошибка: x"),
            (
                "«https://u:p@h/x?k=v» Schlüssel=geheim",
                "«https://***@h/x?*** Schlüssel=geheim",
            ),
        ];
        for (error, shown) in cases {
            assert_eq!(scrub(error), shown, "{error}");
        }
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

    #[test]
    fn the_error_is_one_bounded_line() {
        assert_eq!(one_line("a\nb", 100), "a b");
        let long = "é".repeat(2000);
        let cut = one_line(&long, MAX_ERROR_LEN);
        assert!(cut.len() <= MAX_ERROR_LEN, "{}", cut.len());
        assert!(cut.ends_with('…'));
    }
}
