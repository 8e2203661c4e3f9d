//! Waiting at start: each step an [`App`](super::App) takes before its handlers run (a
//! handler's connection, its consumer, the backstop's stream, a relay's streams) is tried again
//! with capped backoff while NATS or JetStream is not there yet, until shutdown; any other
//! failure refuses the start.

use super::{AppError, Connect, Durable};
use crate::backend::InboxBackend;
use crate::backoff::Backoff;
use crate::error::{chain, unavailable};
use crate::outbox::{Relay, RelayError};
use crate::worker::{AdvisoryStream, ensure_advisory_stream};
use async_nats::jetstream::{
    self,
    context::{CreateStreamError, CreateStreamErrorKind, GetStreamError, GetStreamErrorKind},
};
use std::future::Future;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Why one try did not succeed.
pub(super) enum Failed {
    /// NATS or JetStream is not there yet: logged (`what` failed) and tried again.
    Wait(String),
    /// Anything else: the app does not start.
    Stop(AppError),
}

/// Runs `attempt` until it succeeds, waiting out [`Failed::Wait`] with capped backoff, until
/// `shutdown` ([`AppError::Cancelled`]).
pub(super) async fn retrying<T, F, Fut>(
    shutdown: &CancellationToken,
    mut attempt: F,
) -> Result<T, AppError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Failed>>,
{
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    loop {
        let tried = tokio::select! {
            tried = attempt() => tried,
            _ = shutdown.cancelled() => return Err(AppError::Cancelled),
        };
        match tried {
            Ok(done) => return Ok(done),
            Err(Failed::Stop(e)) => return Err(e),
            Err(Failed::Wait(what)) => {
                let wait = backoff.next();
                tracing::warn!(retry_in = ?wait, "{what}; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => return Err(AppError::Cancelled),
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        }
    }
}

/// Whether looking a stream up failed because JetStream is not answering yet.
pub(super) fn get_stream_unavailable(e: &GetStreamError) -> bool {
    match e.kind() {
        GetStreamErrorKind::Request => true,
        GetStreamErrorKind::JetStream(e) => unavailable(&e),
        _ => false,
    }
}

/// Whether creating a stream failed because JetStream is not answering yet.
pub(super) fn create_stream_unavailable(e: &CreateStreamError) -> bool {
    match e.kind() {
        CreateStreamErrorKind::TimedOut | CreateStreamErrorKind::JetStreamUnavailable => true,
        CreateStreamErrorKind::JetStream(e) => unavailable(&e),
        _ => false,
    }
}

/// Checks `relay`'s database and streams.
pub(super) async fn check_relay<DB: InboxBackend>(
    js: &jetstream::Context,
    relay: &Relay<DB>,
    shutdown: &CancellationToken,
) -> Result<(), AppError> {
    retrying(shutdown, || async {
        relay.check(js).await.map_err(|e| match e {
            RelayError::Nats {
                transient: true,
                what,
                source,
            } => Failed::Wait(format!("{what}: {source}")),
            // Reading the database's version: it may be starting.
            RelayError::Database(e) => {
                Failed::Wait(format!("relay: asking the database its version: {e}"))
            }
            source => Failed::Stop(AppError::Relay { source }),
        })
    })
    .await
}

/// Opens `consumer`'s own connection with `connect`.
pub(super) async fn own_connection(
    connect: &Connect,
    consumer: &str,
    shutdown: &CancellationToken,
) -> Result<jetstream::Context, AppError> {
    retrying(shutdown, || async {
        connect().await.map_err(|e| {
            Failed::Wait(format!(
                "opening the NATS connection of handler {consumer:?} failed: {e}"
            ))
        })
    })
    .await
}

/// Creates or checks the backstop's advisory stream before `durable`'s handler starts, so that a
/// stream that cannot take the advisories refuses the start.
pub(super) async fn check_backstop(
    js: &jetstream::Context,
    which: &AdvisoryStream,
    durable: &Durable,
    shutdown: &CancellationToken,
) -> Result<(), AppError> {
    retrying(shutdown, || async {
        let checked = ensure_advisory_stream(js, which, durable.stream(), durable.name()).await;
        checked.map(drop).map_err(|source| {
            let what = format!(
                "the delivery-limit backstop of consumer {:?}",
                durable.name()
            );
            let waiting = chain(source.as_ref()).any(|e| {
                e.downcast_ref::<GetStreamError>()
                    .is_some_and(get_stream_unavailable)
                    || e.downcast_ref::<CreateStreamError>()
                        .is_some_and(create_stream_unavailable)
            });
            match waiting {
                true => Failed::Wait(format!("{what}: {source}")),
                false => Failed::Stop(AppError::Nats { what, source }),
            }
        })
    })
    .await
}
