//! Which durable consumer a handler serves: [`Durable`], the configuration this crate
//! recommends, and resolving the consumer at start (creating or updating it when asked),
//! waiting out JetStream being unavailable.

use super::AppError;
use super::start::{Failed, create_stream_unavailable, get_stream_unavailable, retrying};
use crate::error::unavailable;
use async_nats::jetstream::{self, consumer, consumer::pull, stream};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The consumer configuration this crate recommends for a handler's durable consumer `durable`
/// on `subject` (empty: every subject of the stream): explicit acks, at most 10 deliveries (then
/// the message is dead-lettered), `ack_wait` 30 s (progress acks keep a slow handler's message),
/// no server-side backoff (the worker's own nak delays, 1 s doubling to 30 s, apply), and at most
/// 1,000 messages awaiting an ack (batched workers in several processes want room for all their
/// batches: see [`WorkerBuilder::batch`](crate::WorkerBuilder::batch)).
///
/// Its [retention floor](crate::retention_floor) is `ack_wait × max_deliver` (300 s) plus the
/// stream's duplicate window, plus a margin: the figure to keep markers above when cleanup runs,
/// counted back from the oldest message still in the stream (whatever its `max_age`, none
/// included).
///
/// ```
/// let config = inbox_runtime::recommended_consumer("credit", "credits.requested");
/// assert_eq!(config.max_deliver, 10);
/// ```
pub fn recommended_consumer(durable: &str, subject: &str) -> pull::Config {
    pull::Config {
        durable_name: Some(durable.to_owned()),
        name: Some(durable.to_owned()),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: Duration::from_secs(30),
        max_deliver: 10,
        max_ack_pending: 1000,
        filter_subject: subject.to_owned(),
        ..Default::default()
    }
}

/// Which durable consumer a handler of an [`App`](crate::App) serves, and whether the app creates it.
#[derive(Debug, Clone)]
pub struct Durable {
    pub(super) stream: String,
    pub(super) name: String,
    create: Option<pull::Config>,
    stream_config: Option<stream::Config>,
}

impl Durable {
    /// Consumer `name` of `stream`, which must exist when the app starts.
    pub fn existing(stream: impl Into<String>, name: impl Into<String>) -> Self {
        Durable {
            stream: stream.into(),
            name: name.into(),
            create: None,
            stream_config: None,
        }
    }

    /// Consumer `name` of `stream`, created at start, or updated to `config` if it exists
    /// (`config`'s `durable_name` and `name` are set to `name`).
    pub fn create_or_update(
        stream: impl Into<String>,
        name: impl Into<String>,
        config: pull::Config,
    ) -> Self {
        let name = name.into();
        let config = pull::Config {
            durable_name: Some(name.clone()),
            name: Some(name.clone()),
            ..config
        };
        Durable {
            create: Some(config),
            ..Durable::existing(stream, name)
        }
    }

    /// [`Durable::create_or_update`] with [`recommended_consumer`] on `subject`.
    pub fn recommended(
        stream: impl Into<String>,
        name: impl Into<String>,
        subject: impl Into<String>,
    ) -> Self {
        let name = name.into();
        let config = recommended_consumer(&name, &subject.into());
        Durable::create_or_update(stream, name, config)
    }

    /// Also creates the stream with `config` when it is missing (an existing stream is left as
    /// it is). `config.name` is set to the stream's name.
    pub fn with_stream(mut self, config: stream::Config) -> Self {
        self.stream_config = Some(stream::Config {
            name: self.stream.clone(),
            ..config
        });
        self
    }

    /// The consumer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Refuses names NATS would refuse (client side, where the error would look like a lost
    /// request and be retried forever): empty, with whitespace or control characters; a stream
    /// or durable name with `.`, `*` or `>`.
    pub(super) fn check(&self) -> Result<(), AppError> {
        let name = |what: &'static str, name: &str, token: bool| {
            let why = if name.is_empty() {
                Some("it is empty")
            } else if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
                Some("it contains whitespace or a control character")
            } else if token && name.contains(['.', '*', '>']) {
                Some("it contains `.`, `*` or `>`")
            } else {
                None
            };
            match why {
                Some(why) => Err(AppError::InvalidName {
                    what,
                    name: name.to_owned(),
                    why,
                }),
                None => Ok(()),
            }
        };
        name("stream", &self.stream, true)?;
        name("durable consumer", &self.name, true)?;
        if let Some(config) = &self.create
            && !config.filter_subject.is_empty()
        {
            name("filter subject", &config.filter_subject, false)?;
        }
        Ok(())
    }

    /// The stream's name.
    pub fn stream(&self) -> &str {
        &self.stream
    }
}

/// Looks the durable consumer up (creating the stream and consumer when asked), waiting out
/// NATS being unavailable, until `shutdown`.
pub(super) async fn resolve(
    js: &jetstream::Context,
    durable: &Durable,
    shutdown: &CancellationToken,
) -> Result<consumer::PullConsumer, AppError> {
    retrying(shutdown, || async {
        resolve_once(js, durable)
            .await
            .map_err(|(what, source, transient)| match transient {
                true => Failed::Wait(format!("{what}: {source}")),
                false => Failed::Stop(AppError::Nats { what, source }),
            })
    })
    .await
}

/// One try of [`resolve`]: the consumer, or what failed, its error, and whether it is worth
/// waiting out.
async fn resolve_once(
    js: &jetstream::Context,
    durable: &Durable,
) -> Result<consumer::PullConsumer, (String, async_nats::Error, bool)> {
    use async_nats::jetstream::stream::ConsumerErrorKind;
    let stream = match &durable.stream_config {
        Some(config) => js.get_or_create_stream(config.clone()).await.map_err(|e| {
            let transient = create_stream_unavailable(&e);
            let what = format!("cannot get or create stream {:?}", durable.stream);
            (what, e.into(), transient)
        })?,
        None => js.get_stream(&durable.stream).await.map_err(|e| {
            let transient = get_stream_unavailable(&e);
            let what = format!("cannot get stream {:?}", durable.stream);
            (what, e.into(), transient)
        })?,
    };
    let what = |verb: &str| {
        format!(
            "cannot {verb} consumer {:?} of stream {:?}",
            durable.name, durable.stream
        )
    };
    let consumer = match &durable.create {
        Some(config) => stream.create_consumer(config.clone()).await.map_err(|e| {
            let transient = match e.kind() {
                ConsumerErrorKind::TimedOut | ConsumerErrorKind::Request => true,
                ConsumerErrorKind::JetStream(e) => unavailable(&e),
                _ => false,
            };
            (what("create or update"), e.into(), transient)
        })?,
        None => stream.get_consumer(&durable.name).await.map_err(|e| {
            // A missing consumer is the user's to create; a timeout, "no responders" or a 503
            // is JetStream not answering yet (starting, or a cluster electing a leader).
            use async_nats::jetstream::context::{ConsumerInfoError, ConsumerInfoErrorKind as K};
            let transient = e
                .downcast_ref::<ConsumerInfoError>()
                .is_some_and(|e| match e.kind() {
                    K::TimedOut | K::NoResponders | K::Request | K::Offline => true,
                    K::JetStream(e) => unavailable(&e),
                    _ => false,
                });
            (what("get"), e, transient)
        })?,
    };
    Ok(consumer)
}
