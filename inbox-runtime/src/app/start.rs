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
use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::{
    self,
    context::{CreateStreamError, CreateStreamErrorKind, GetStreamError, GetStreamErrorKind},
};
use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
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

/// How many times a stream found a moment ago may be "not found" before the start gives up:
/// about 25 s of backoff, longer than a cluster takes to elect a leader and catch up.
const NOT_FOUND_TRIES: u32 = 10;

/// Whether looking a stream up failed because JetStream says there is no such stream.
fn get_stream_not_found(e: &GetStreamError) -> bool {
    match e.kind() {
        GetStreamErrorKind::JetStream(e) => e.error_code() == ErrorCode::STREAM_NOT_FOUND,
        _ => false,
    }
}

/// Whether checking the backstop's advisory stream failed with `source` because JetStream is
/// not answering yet. The consumer's stream was found a moment before, so "stream not found"
/// is a cluster whose new meta leader has not caught up (seen after a leader kill), unless it
/// lasts: `not_found` counts such answers.
fn backstop_waits(source: &(dyn std::error::Error + 'static), not_found: &AtomicU32) -> bool {
    let missing = chain(source).any(|e| {
        e.downcast_ref::<GetStreamError>()
            .is_some_and(get_stream_not_found)
    });
    if missing && not_found.fetch_add(1, Ordering::Relaxed) < NOT_FOUND_TRIES {
        return true;
    }
    chain(source).any(|e| {
        e.downcast_ref::<GetStreamError>()
            .is_some_and(get_stream_unavailable)
            || e.downcast_ref::<CreateStreamError>()
                .is_some_and(create_stream_unavailable)
    })
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
    let not_found = AtomicU32::new(0);
    retrying(shutdown, || async {
        let checked = ensure_advisory_stream(js, which, durable.stream(), durable.name()).await;
        checked.map(drop).map_err(|source| {
            let what = format!(
                "the delivery-limit backstop of consumer {:?}",
                durable.name()
            );
            let waiting = backstop_waits(source.as_ref(), &not_found);
            match waiting {
                true => Failed::Wait(format!("{what}: {source}")),
                false => Failed::Stop(AppError::Nats { what, source }),
            }
        })
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(code: usize, err_code: u64, description: &str) -> jetstream::Error {
        serde_json::from_value(serde_json::json!({
            "code": code, "err_code": err_code, "description": description,
        }))
        .expect("a JetStream error")
    }

    fn get_failed(answer: jetstream::Error) -> async_nats::Error {
        Box::new(GetStreamError::new(GetStreamErrorKind::JetStream(answer)))
    }

    #[test]
    fn a_stream_found_then_not_found_is_waited_out_for_a_while() {
        let not_found = AtomicU32::new(0);
        let failed = get_failed(answer(404, 10059, "stream not found"));
        assert!(
            backstop_waits(failed.as_ref(), &not_found),
            "the first \"not found\" is waited out"
        );
        for k in 1..NOT_FOUND_TRIES {
            assert!(backstop_waits(failed.as_ref(), &not_found), "try {k}");
        }
        assert!(
            !backstop_waits(failed.as_ref(), &not_found),
            "a stream that stays missing refuses the start"
        );
    }

    #[test]
    fn an_advisory_stream_jetstream_cannot_create_yet_is_waited_out() {
        let not_found = AtomicU32::new(0);
        let unavailable = CreateStreamError::new(CreateStreamErrorKind::JetStream(answer(
            503,
            10008,
            "JetStream system temporarily unavailable",
        )));
        let created = crate::worker::create_advisory_stream_error(unavailable);
        assert!(backstop_waits(created.as_ref(), &not_found));
        let refused = CreateStreamError::new(CreateStreamErrorKind::JetStream(answer(
            400,
            10065,
            "subjects overlap with an existing stream",
        )));
        let created = crate::worker::create_advisory_stream_error(refused);
        assert!(!backstop_waits(created.as_ref(), &not_found));
    }

    #[test]
    fn other_refusals_stop_the_start() {
        let not_found = AtomicU32::new(0);
        let failed = get_failed(answer(400, 10052, "invalid stream name"));
        assert!(!backstop_waits(failed.as_ref(), &not_found));
    }
}
