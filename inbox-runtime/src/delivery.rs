//! What a handler may know of a message besides its payload: [`Delivery`] (headers, subject,
//! stream sequence, delivery count, publish time), and how the payload is decoded: [`Codec`].

use crate::error::BoxError;
use crate::replay::{payload_hash, replay_of};
use async_nats::HeaderMap;
use async_nats::jetstream::message::{Info, Message};
use bytes::Bytes;
use std::time::SystemTime;

/// Where a message came from and how it travelled: a handler takes it as `delivery: &Delivery`,
/// and its `key` expression may use it (`key = delivery.header("Idempotency-Key")`).
///
/// Built by the worker from each JetStream delivery. In a unit test, without NATS, build one
/// with [`Delivery::new`] and the `with_*` methods, and pass it to
/// [`Inbox::process`](crate::Inbox::process):
///
/// ```
/// use inbox_runtime::Delivery;
/// let d = Delivery::new("orders.created")
///     .with_header("Idempotency-Key", "k-1")
///     .with_delivered(2);
/// assert_eq!(d.header("idempotency-key"), Some("k-1"));
/// assert_eq!(d.delivered(), 2);
/// ```
#[derive(Debug, Clone)]
pub struct Delivery {
    pub(crate) subject: String,
    pub(crate) headers: Option<HeaderMap>,
    pub(crate) stream: String,
    pub(crate) stream_seq: u64,
    pub(crate) consumer_seq: u64,
    pub(crate) delivered: i64,
    pub(crate) published: Option<SystemTime>,
    /// The producer's `Nats-Msg-Id`, unless absent or empty.
    pub(crate) msg_id: Option<String>,
    /// A replayed dead letter's consumer and key ([`REPLAY_CONSUMER`](crate::REPLAY_CONSUMER), [`REPLAY_KEY`](crate::REPLAY_KEY)).
    pub(crate) replay: Option<(String, String)>,
    /// A hash of the payload (JetStream deliveries): what the marker keeps, to tell a key
    /// reused with another payload.
    pub(crate) payload_hash: Option<String>,
}

impl Default for Delivery {
    fn default() -> Self {
        Delivery::new("")
    }
}

impl Delivery {
    /// A delivery on `subject`: first delivery, no headers, no stream. For tests and for callers
    /// that feed [`Inbox::process`](crate::Inbox::process) from elsewhere than JetStream.
    pub fn new(subject: impl Into<String>) -> Self {
        Delivery {
            subject: subject.into(),
            headers: None,
            stream: String::new(),
            stream_seq: 0,
            consumer_seq: 0,
            delivered: 1,
            published: None,
            msg_id: None,
            replay: None,
            payload_hash: None,
        }
    }

    /// With header `name` set to `value` (a `Nats-Msg-Id` also becomes the transport id).
    ///
    /// # Panics
    /// When `name` or `value` is not a valid NATS header name or value (a name with `:` or
    /// whitespace, a value with a line break): this builder is for tests.
    pub fn with_header(mut self, name: &str, value: &str) -> Self {
        let name: async_nats::HeaderName = name.parse().expect("a valid NATS header name");
        let value: async_nats::HeaderValue = value.parse().expect("a valid NATS header value");
        self.headers
            .get_or_insert_with(HeaderMap::new)
            .insert(name, value);
        self.msg_id = msg_id_of(self.headers.as_ref());
        self.replay = replay_of(self.headers.as_ref());
        self
    }

    /// With the stream and its sequence number.
    pub fn with_stream(mut self, stream: impl Into<String>, sequence: u64) -> Self {
        self.stream = stream.into();
        self.stream_seq = sequence;
        self
    }

    /// With the delivery count (1 for a first delivery).
    pub fn with_delivered(mut self, delivered: i64) -> Self {
        self.delivered = delivered;
        self
    }

    /// With `payload`'s hash, as a JetStream delivery of it has: a duplicate of its key with
    /// another payload is then told apart (key reuse).
    pub fn with_payload(mut self, payload: &[u8]) -> Self {
        self.payload_hash = Some(payload_hash(payload));
        self
    }

    /// With the publish time.
    pub fn with_published(mut self, at: SystemTime) -> Self {
        self.published = Some(at);
        self
    }

    /// The delivery of a JetStream message, whose `info` was parsed from its reply subject.
    pub(crate) fn of(message: &Message, info: &Info<'_>) -> Delivery {
        Delivery {
            subject: message.subject.to_string(),
            headers: message.headers.clone(),
            stream: info.stream.to_owned(),
            stream_seq: info.stream_sequence,
            consumer_seq: info.consumer_sequence,
            delivered: info.delivered,
            published: Some(SystemTime::from(info.published)),
            msg_id: msg_id_of(message.headers.as_ref()),
            replay: replay_of(message.headers.as_ref()),
            payload_hash: Some(payload_hash(&message.payload)),
        }
    }

    /// The delivery a stored message would have had on its `delivered`-th delivery from
    /// `stream`, with the headers the client can read (read by sequence, outside a consumer:
    /// the delivery-limit backstop).
    pub(crate) fn of_stored(
        message: &crate::stored::StoredMessage,
        headers: &HeaderMap,
        stream: &str,
        delivered: i64,
    ) -> Delivery {
        let headers = (!headers.is_empty()).then(|| headers.clone());
        Delivery {
            subject: message.subject.clone(),
            msg_id: msg_id_of(headers.as_ref()),
            replay: replay_of(headers.as_ref()),
            headers,
            stream: stream.to_owned(),
            stream_seq: message.sequence,
            consumer_seq: 0,
            delivered,
            published: Some(message.published),
            payload_hash: Some(payload_hash(&message.payload)),
        }
    }

    /// The subject the message was published to.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The first value of header `name`. The exact name is looked up first, then, since
    /// producers differ (Go's `http.CanonicalHeaderKey`, nats-py's dict keys as written), any
    /// name equal to it ignoring ASCII case: `header("idempotency-key")` finds
    /// `Idempotency-Key`.
    pub fn header(&self, name: &str) -> Option<&str> {
        let headers = self.headers.as_ref()?;
        // A name NATS cannot carry (a space, a colon) is in no message; looked up as it is,
        // async-nats would panic on it.
        let valid: async_nats::HeaderName = name.parse().ok()?;
        if let Some(v) = headers.get(valid) {
            return Some(v.as_str());
        }
        headers
            .iter()
            .find(|(n, _)| AsRef::<str>::as_ref(n).eq_ignore_ascii_case(name))
            .and_then(|(_, values)| values.first())
            .map(|v| v.as_str())
    }

    /// All the headers, if the message has any.
    pub fn headers(&self) -> Option<&HeaderMap> {
        self.headers.as_ref()
    }

    /// The producer's `Nats-Msg-Id`, unless absent or empty.
    pub fn msg_id(&self) -> Option<&str> {
        self.msg_id.as_deref()
    }

    /// Whether this is a replayed dead letter addressed to another consumer than `consumer`
    /// ([`REPLAY_CONSUMER`](crate::REPLAY_CONSUMER)): not this consumer's to process again.
    pub(crate) fn replay_not_for(&self, consumer: &str) -> bool {
        self.replay.as_ref().is_some_and(|(c, _)| c != consumer)
    }

    /// The stream the message is stored in (empty outside JetStream).
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The message's sequence number in its stream.
    pub fn stream_sequence(&self) -> u64 {
        self.stream_seq
    }

    /// The consumer's sequence number of this delivery.
    pub fn consumer_sequence(&self) -> u64 {
        self.consumer_seq
    }

    /// How many times the message has been delivered, this delivery included (1 the first time).
    pub fn delivered(&self) -> i64 {
        self.delivered
    }

    /// When the message was stored in the stream, as the server says.
    pub fn published(&self) -> Option<SystemTime> {
        self.published
    }

    /// The producer's W3C trace context, from the `traceparent` header, when well-formed. The
    /// worker records its trace and parent span ids on the message's span (`trace_id`,
    /// `parent_span_id`).
    pub fn trace_parent(&self) -> Option<TraceParent<'_>> {
        TraceParent::parse(self.header("traceparent")?)
    }

    /// The key of a [CloudEvent](https://github.com/cloudevents/spec/blob/main/cloudevents/spec.md#id)
    /// in binary mode: `ce-source` and `ce-id`, which together identify an event, as
    /// `"{source} {id}"`; `None` unless both headers are present. For
    /// `key = delivery.cloud_event_key()`.
    pub fn cloud_event_key(&self) -> Option<String> {
        let source = self.header("ce-source")?;
        let id = self.header("ce-id")?;
        Some(format!("{source} {id}"))
    }
}

/// A W3C trace context (`traceparent: 00-<trace id>-<parent id>-<flags>`), as a producer sent it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent<'a> {
    /// 32 lowercase hex digits, not all zero.
    pub trace_id: &'a str,
    /// The producer's span: 16 lowercase hex digits, not all zero.
    pub parent_id: &'a str,
    /// Whether the producer sampled the trace.
    pub sampled: bool,
}

impl<'a> TraceParent<'a> {
    /// Parses a `traceparent` header value; `None` unless it is well-formed (version `00`, or a
    /// later version's first four fields, as the specification asks).
    pub fn parse(value: &'a str) -> Option<TraceParent<'a>> {
        let mut parts = value.trim().split('-');
        let (version, trace_id, parent_id, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex = |s: &str, n: usize| {
            s.len() == n
                && s.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        };
        let zero = |s: &str| s.bytes().all(|b| b == b'0');
        let valid = hex(version, 2)
            && version != "ff"
            && (version != "00" || parts.next().is_none())
            && hex(trace_id, 32)
            && !zero(trace_id)
            && hex(parent_id, 16)
            && !zero(parent_id)
            && hex(flags, 2);
        let flags = u8::from_str_radix(flags, 16).ok()?;
        valid.then_some(TraceParent {
            trace_id,
            parent_id,
            sampled: flags & 1 == 1,
        })
    }
}

/// `Nats-Msg-Id`, unless absent or empty: some producers send the header empty, which is no id.
fn msg_id_of(headers: Option<&HeaderMap>) -> Option<String> {
    let value = |name: &str| {
        headers
            .and_then(|h| h.get(name))
            .map(|v| v.as_str())
            .filter(|id| !id.is_empty())
            .map(str::to_owned)
    };
    value(async_nats::header::NATS_MESSAGE_ID.as_ref())
}

/// How a handler's payload becomes its message type `M`: [`Json`] by default, [`Raw`] for the
/// bytes as they are, `MsgPack` with feature `msgpack`, `Cbor` with feature `cbor`; chosen with
/// `#[idempotent(.., codec = Raw)]`.
///
/// A payload that does not decode is permanent: the message is dead-lettered at once.
///
/// ```
/// use inbox_runtime::{BoxError, Codec};
/// /// Payloads that are one decimal number.
/// struct Decimal;
/// impl Codec<u64> for Decimal {
///     fn decode(payload: &bytes::Bytes) -> Result<u64, BoxError> {
///         Ok(std::str::from_utf8(payload)?.trim().parse()?)
///     }
/// }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot decode payloads into `{M}`",
    label = "no `Codec<{M}>` impl for this codec",
    note = "`Json` decodes any `serde::Deserialize` type; `Raw` gives `bytes::Bytes`, `Vec<u8>` or `String`; pick one with `#[idempotent(.., codec = Raw)]`"
)]
pub trait Codec<M>: Send + Sync + 'static {
    /// The codec's name, as errors and dead letters say it.
    const NAME: &'static str = "custom";

    /// Decodes one payload.
    fn decode(payload: &Bytes) -> Result<M, BoxError>;
}

/// JSON payloads, through `serde_json`: the default codec.
#[derive(Debug, Clone, Copy, Default)]
pub struct Json;

impl<M: serde::de::DeserializeOwned> Codec<M> for Json {
    const NAME: &'static str = "JSON";

    fn decode(payload: &Bytes) -> Result<M, BoxError> {
        Ok(serde_json::from_slice(payload)?)
    }
}

/// The payload as it is: `bytes::Bytes` (no copy), `Vec<u8>`, or `String` (which must be
/// UTF-8).
#[derive(Debug, Clone, Copy, Default)]
pub struct Raw;

impl Codec<Bytes> for Raw {
    const NAME: &'static str = "raw bytes";

    fn decode(payload: &Bytes) -> Result<Bytes, BoxError> {
        Ok(payload.clone())
    }
}

impl Codec<Vec<u8>> for Raw {
    const NAME: &'static str = "raw bytes";

    fn decode(payload: &Bytes) -> Result<Vec<u8>, BoxError> {
        Ok(payload.to_vec())
    }
}

impl Codec<String> for Raw {
    const NAME: &'static str = "UTF-8 text";

    fn decode(payload: &Bytes) -> Result<String, BoxError> {
        Ok(String::from_utf8(payload.to_vec())?)
    }
}

/// MessagePack payloads, through `rmp-serde` (feature `msgpack`).
#[cfg(feature = "msgpack")]
#[cfg_attr(docsrs, doc(cfg(feature = "msgpack")))]
#[derive(Debug, Clone, Copy, Default)]
pub struct MsgPack;

#[cfg(feature = "msgpack")]
impl<M: serde::de::DeserializeOwned> Codec<M> for MsgPack {
    const NAME: &'static str = "MessagePack";

    fn decode(payload: &Bytes) -> Result<M, BoxError> {
        Ok(rmp_serde::from_slice(payload)?)
    }
}

/// CBOR payloads, through `ciborium` (feature `cbor`).
#[cfg(feature = "cbor")]
#[cfg_attr(docsrs, doc(cfg(feature = "cbor")))]
#[derive(Debug, Clone, Copy, Default)]
pub struct Cbor;

#[cfg(feature = "cbor")]
impl<M: serde::de::DeserializeOwned> Codec<M> for Cbor {
    const NAME: &'static str = "CBOR";

    fn decode(payload: &Bytes) -> Result<M, BoxError> {
        Ok(ciborium::from_reader(&payload[..])?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_found_ignoring_case_and_empty_ids_are_no_ids() {
        let d = Delivery::new("s")
            .with_header("Idempotency-Key", "k")
            .with_header("ce-id", "1")
            .with_header("ce-source", "/orders");
        assert_eq!(d.header("Idempotency-Key"), Some("k"));
        assert_eq!(d.header("IDEMPOTENCY-KEY"), Some("k"));
        assert_eq!(d.header("missing"), None);
        assert_eq!(d.header("Idempotency Key"), None);
        assert_eq!(d.header("a:b"), None);
        assert_eq!(d.cloud_event_key().as_deref(), Some("/orders 1"));
        assert_eq!(d.msg_id(), None);
        let d = d.with_header("Nats-Msg-Id", "");
        assert_eq!(d.msg_id(), None);
        let d = d.with_header("Nats-Msg-Id", "m-1");
        assert_eq!(d.msg_id(), Some("m-1"));
    }

    #[test]
    fn trace_parents_are_parsed_strictly() {
        let tp = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        assert_eq!(
            tp,
            Some(TraceParent {
                trace_id: "4bf92f3577b34da6a3ce929d0e0e4736",
                parent_id: "00f067aa0ba902b7",
                sampled: true
            })
        );
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
        let d = Delivery::new("s").with_header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
        );
        assert!(!d.trace_parent().unwrap().sampled);
    }

    #[test]
    fn codecs_decode_or_say_why_not() {
        let json: Result<u32, _> = <Json as Codec<u32>>::decode(&Bytes::from_static(b"7"));
        assert_eq!(json.unwrap(), 7);
        assert!(<Json as Codec<u32>>::decode(&Bytes::from_static(b"{")).is_err());
        let raw: Bytes = <Raw as Codec<Bytes>>::decode(&Bytes::from_static(b"\xff")).unwrap();
        assert_eq!(&raw[..], b"\xff");
        assert!(<Raw as Codec<String>>::decode(&Bytes::from_static(b"\xff")).is_err());
    }

    #[cfg(any(feature = "msgpack", feature = "cbor"))]
    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Order {
        id: u64,
        sku: String,
    }

    #[cfg(feature = "msgpack")]
    #[test]
    fn msgpack_payloads_decode() {
        let order = Order {
            id: 7,
            sku: "a".into(),
        };
        let bytes = Bytes::from(rmp_serde::to_vec_named(&order).unwrap());
        assert_eq!(<MsgPack as Codec<Order>>::decode(&bytes).unwrap(), order);
        assert!(<MsgPack as Codec<Order>>::decode(&Bytes::from_static(b"\xc1")).is_err());
    }

    #[cfg(feature = "cbor")]
    #[test]
    fn cbor_payloads_decode() {
        let order = Order {
            id: 7,
            sku: "a".into(),
        };
        let mut bytes = Vec::new();
        ciborium::into_writer(&order, &mut bytes).unwrap();
        assert_eq!(
            <Cbor as Codec<Order>>::decode(&Bytes::from(bytes)).unwrap(),
            order
        );
        assert!(<Cbor as Codec<Order>>::decode(&Bytes::from_static(b"\xff")).is_err());
    }
}
