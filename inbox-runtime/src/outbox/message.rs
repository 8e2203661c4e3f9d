//! What an outbox message is, and what NATS would refuse of it before it is written.

use serde::Serialize;
use std::str::FromStr;

/// The longest message id and order key the outbox stores.
pub const MAX_ID_LEN: usize = 255;

/// The longest subject, in bytes, the outbox takes. A publish's subject travels in the
/// protocol's control line (`HPUB <subject> <reply> <sizes>`), which nats-server caps at its
/// `max_control_line` (4,096 bytes unless configured): over it, the server answers `maximum
/// control line exceeded` and closes the connection, with every publish, ack and pull on it.
/// This leaves 256 bytes of the default for the PubAck's reply subject and the sizes.
pub const MAX_SUBJECT_LEN: usize = 4096 - 256;

/// The largest header block, in bytes, the outbox takes for a message, `Nats-Msg-Id`
/// included: JetStream refuses a header block over 65,535 bytes for good, and this leaves room
/// for the `Nats-Expected-Stream` header the relay adds (a stream name is at most 255 bytes).
pub const MAX_HEADERS_LEN: usize = 65_535 - 300;

/// The headers that set a publish's expectations, which are the relay's to set.
const EXPECTED: &str = "Nats-Expected-";
// The number `publish_subject`'s refusal names.
const _: () = assert!(MAX_SUBJECT_LEN == 3840);

/// A message to publish through an [`Outbox`](crate::Outbox): its subject, payload and headers, and optionally
/// its id and ordering key.
///
/// ```
/// use inbox_runtime::OutboxMessage;
/// let message = OutboxMessage::new("credits.applied", br#"{"id":"r-1"}"#.to_vec())
///     .header("Content-Type", "application/json")
///     .order_key("account-7");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxMessage {
    pub(crate) subject: String,
    pub(crate) payload: Vec<u8>,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) msg_id: Option<String>,
    pub(crate) order_key: Option<String>,
}

impl OutboxMessage {
    /// A message of `payload` to `subject` (at most [`MAX_SUBJECT_LEN`] bytes).
    pub fn new(subject: impl Into<String>, payload: impl Into<Vec<u8>>) -> Self {
        OutboxMessage {
            subject: subject.into(),
            payload: payload.into(),
            headers: Vec::new(),
            msg_id: None,
            order_key: None,
        }
    }

    /// A message of `value` as JSON to `subject`, with `Content-Type: application/json`.
    pub fn json<T: Serialize + ?Sized>(
        subject: impl Into<String>,
        value: &T,
    ) -> Result<Self, serde_json::Error> {
        Ok(OutboxMessage::new(subject, serde_json::to_vec(value)?)
            .header("Content-Type", "application/json"))
    }

    /// Adds a header (a name may repeat). `Nats-Msg-Id` is set by the relay: use
    /// [`OutboxMessage::msg_id`] for it.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The message's id (`Nats-Msg-Id`), for a message that has one of its own (an event id):
    /// the target stream drops a second message with the same id within its duplicate window.
    /// Without it, the outbox generates one (a NUID) when the row is written.
    pub fn msg_id(mut self, id: impl Into<String>) -> Self {
        self.msg_id = Some(id.into());
        self
    }

    /// The key whose messages are published in the order they were written (the order of their
    /// rows' ids). Messages of different keys may overtake each other. Without it, the subject
    /// is the key: every message to one subject is published in order.
    pub fn order_key(mut self, key: impl Into<String>) -> Self {
        self.order_key = Some(key.into());
        self
    }

    /// The subject.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// Why NATS would refuse this message, if it would.
    pub(crate) fn check(&self) -> Result<(), InvalidMessage> {
        if let Err(why) = publish_subject(&self.subject) {
            return Err(InvalidMessage::Subject {
                subject: self.subject.clone(),
                why,
            });
        }
        for (name, value) in &self.headers {
            if !header_name_ok(name) {
                return Err(InvalidMessage::HeaderName(name.clone()));
            }
            if !header_value_ok(value) {
                return Err(InvalidMessage::HeaderValue(name.clone()));
            }
            if name.eq_ignore_ascii_case("Nats-Msg-Id") {
                return Err(InvalidMessage::MsgIdHeader);
            }
            // A publish's expectations are the relay's: one of the stream's last sequence or
            // message id fails for good once the stream moves on, a row published again too.
            let prefix = name.get(..EXPECTED.len());
            if prefix.is_some_and(|p| p.eq_ignore_ascii_case(EXPECTED)) {
                return Err(InvalidMessage::ExpectedHeader(name.clone()));
            }
        }
        if let Some(id) = &self.msg_id
            && !header_value_ok(id)
        {
            return Err(InvalidMessage::MsgId);
        }
        for (what, text) in [("message id", &self.msg_id), ("order key", &self.order_key)] {
            if let Some(text) = text
                && (text.is_empty() || text.len() > MAX_ID_LEN)
            {
                return Err(InvalidMessage::Length {
                    what,
                    len: text.len(),
                });
            }
        }
        Ok(())
    }

    /// Its header block's size on the wire, `Nats-Msg-Id` included, without the
    /// `Nats-Expected-Stream` header the relay adds (with the payload: at most what NATS counts
    /// against `max_payload`, less that header).
    pub(crate) fn header_size(&self, msg_id: &str) -> usize {
        // "NATS/1.0\r\n", each "name: value\r\n", the closing "\r\n".
        let header = |name: &str, value: &str| name.len() + value.len() + 4;
        let headers: usize = self.headers.iter().map(|(n, v)| header(n, v)).sum();
        10 + headers + header("Nats-Msg-Id", msg_id) + 2
    }
}

/// Whether async-nats takes `name` as a header name (its own fallible parse, not the assert its
/// infallible conversions end in). Empty names are refused too: the wire has no place for one.
pub(crate) fn header_name_ok(name: &str) -> bool {
    !name.is_empty() && async_nats::HeaderName::from_str(name).is_ok()
}

/// Whether async-nats takes `value` as a header value (its own fallible parse).
pub(crate) fn header_value_ok(value: &str) -> bool {
    async_nats::HeaderValue::from_str(value).is_ok()
}

/// Why NATS would refuse `subject` as a publish subject.
pub(crate) fn publish_subject(subject: &str) -> Result<(), &'static str> {
    if subject.is_empty() {
        return Err("it is empty");
    }
    if subject.len() > MAX_SUBJECT_LEN {
        return Err(
            "it is longer than 3,840 bytes (MAX_SUBJECT_LEN): over nats-server's max_control_line, \
             a publish to it closes the connection",
        );
    }
    if subject
        .bytes()
        .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
    {
        return Err("it contains whitespace");
    }
    for token in subject.split('.') {
        match token {
            "" => return Err("it has an empty token"),
            "*" | ">" => return Err("a message cannot be published to a wildcard"),
            _ => {}
        }
    }
    Ok(())
}

/// A message [`Outbox::enqueue`](crate::Outbox::enqueue) refuses, before anything is written: NATS would never take it,
/// and the row would stay pending for ever. A permanent error for the handler (its message is
/// dead-lettered).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidMessage {
    /// Not a subject a message can be published to.
    #[error("outbox message subject {subject:?} is not valid: {why}")]
    Subject {
        /// The subject.
        subject: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A header name NATS would refuse.
    #[error(
        "outbox message header name {0:?} is not valid (empty, or with ':', whitespace or a control character)"
    )]
    HeaderName(String),
    /// A header value with a line break.
    #[error("outbox message header {0:?} has a line break in its value")]
    HeaderValue(String),
    /// `Nats-Msg-Id` set as a header.
    #[error(
        "outbox messages get Nats-Msg-Id from their row: set it with OutboxMessage::msg_id, not as a header"
    )]
    MsgIdHeader,
    /// A message id with a line break (NATS headers cannot carry one).
    #[error("outbox message id has a line break: it is sent as the Nats-Msg-Id header")]
    MsgId,
    /// Payload and headers larger than the server's `max_payload`.
    #[error(
        "outbox message is {size} bytes with its headers, over the server's max_payload of {max} bytes"
    )]
    TooLarge {
        /// Its size on the wire (payload and headers).
        size: usize,
        /// The server's `max_payload`.
        max: usize,
    },
    /// A `Nats-Expected-*` header: what a publish expects of the stream is the relay's to set
    /// (an expectation of its last sequence or message id fails for good once the stream moves
    /// on, and would hold back the row's key for ever).
    #[error(
        "outbox message header {0:?} sets a publish's expectation, which is the relay's to set"
    )]
    ExpectedHeader(String),
    /// A header block larger than JetStream takes.
    #[error(
        "outbox message headers are {size} bytes on the wire, over the {max} JetStream takes with the relay's own"
    )]
    HeadersTooLarge {
        /// Its header block's size on the wire.
        size: usize,
        /// [`MAX_HEADERS_LEN`].
        max: usize,
    },
    /// A message id or order key empty or too long.
    #[error("outbox message {what} is {len} bytes: it must be 1 to 255")]
    Length {
        /// "message id" or "order key".
        what: &'static str,
        /// Its length.
        len: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_nats_would_refuse_is_refused_before_it_is_written() {
        let ok = OutboxMessage::new("credits.applied", b"{}".to_vec());
        assert_eq!(ok.check(), Ok(()));
        for subject in ["", "a..b", "credits.*", "credits.>", "a b", ".a", "a."] {
            let m = OutboxMessage::new(subject, Vec::new());
            assert!(
                matches!(m.check(), Err(InvalidMessage::Subject { .. })),
                "{subject:?}"
            );
        }
        for name in ["", "a:b", "a b", "Ünïcode", "tab\there", "del\u{7f}"] {
            let m = ok.clone().header(name, "v");
            assert_eq!(m.check(), Err(InvalidMessage::HeaderName(name.into())));
        }
        let m = ok.clone().header("X", "a\r\nb");
        assert_eq!(m.check(), Err(InvalidMessage::HeaderValue("X".into())));
        for name in ["Nats-Expected-Last-Sequence", "nats-expected-last-msg-id"] {
            let m = ok.clone().header(name, "1");
            assert_eq!(m.check(), Err(InvalidMessage::ExpectedHeader(name.into())));
        }
        let m = ok.clone().header("nats-msg-id", "x");
        assert_eq!(m.check(), Err(InvalidMessage::MsgIdHeader));
        let m = ok.clone().msg_id("a\r\nX-Forged: 1");
        assert_eq!(m.check(), Err(InvalidMessage::MsgId));
        let m = ok.clone().msg_id("");
        assert!(matches!(m.check(), Err(InvalidMessage::Length { .. })));
        let longest = format!("a.{}", "b".repeat(MAX_SUBJECT_LEN - 2));
        assert_eq!(OutboxMessage::new(&longest, Vec::new()).check(), Ok(()));
        let m = OutboxMessage::new(format!("{longest}b"), Vec::new());
        assert!(
            matches!(&m.check(), Err(InvalidMessage::Subject { why, .. }) if why.contains("max_control_line")),
            "{:?}",
            m.check()
        );
        let m = ok.clone().order_key("k".repeat(256));
        assert!(matches!(
            m.check(),
            Err(InvalidMessage::Length { len: 256, .. })
        ));
    }
}
