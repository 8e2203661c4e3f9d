//! The default key of a JetStream delivery, its transport id: `Nats-Msg-Id` (unless empty), else
//! `"{stream}:{created}:{stream_sequence}"`, with the stream's creation time looked up once.
//! [`Inbox::process`](crate::Inbox::process), which has no stream to ask, takes `Nats-Msg-Id`
//! alone (`handler::message_key`).

use crate::delivery::Delivery;
use crate::error::ProcessError;
use crate::key::{KeyError, validate_key};
use async_nats::jetstream::message::Message;

impl Delivery {
    /// The transport id: the `Nats-Msg-Id`, else `"{stream}:{created}:{stream_sequence}"`, the
    /// same for every redelivery of the stored message. A stream's sequences start again at 1
    /// when it is deleted and created again, so its creation time (Unix nanoseconds) tells its
    /// messages apart from those of the stream it replaced.
    async fn transport_id(
        &self,
        js: &async_nats::jetstream::Context,
        created: &StreamCreated,
    ) -> Result<String, ProcessError> {
        if let Some((_, key)) = &self.replay {
            return Ok(key.clone());
        }
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
    pub(super) async fn get(
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

    /// The creation time, if looked up already.
    pub(super) fn cached(&self) -> Option<i128> {
        *self.0.lock().expect("the stream lock")
    }

    /// Looks the stream up again next time.
    pub(super) fn forget(&self) {
        *self.0.lock().expect("the stream lock") = None;
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

/// The validated key: `explicit` (the handler's `key` expression, evaluated before any await
/// since the message need not be `Sync`), else the transport id.
pub(super) async fn key_of(
    explicit: Option<String>,
    message: &Message,
    delivery: &Delivery,
    created: &StreamCreated,
) -> Result<String, ProcessError> {
    key_on(explicit, &message.context, delivery, created).await
}

/// [`key_of`] for a delivery that came some other way than a consumer (a message read by
/// sequence), the stream looked up on `js` when the key is the transport id.
pub(super) async fn key_on(
    explicit: Option<String>,
    js: &async_nats::jetstream::Context,
    delivery: &Delivery,
    created: &StreamCreated,
) -> Result<String, ProcessError> {
    let key = match explicit {
        Some(key) => key,
        None => delivery.transport_id(js, created).await?,
    };
    validate_key(&key)?;
    Ok(key)
}
