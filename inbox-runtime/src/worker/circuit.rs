//! The database circuit: when a delivery fails because the database cannot be reached (a lost
//! connection, a pool that cannot connect), the failure is the same for every message, and
//! redelivering would only spend deliveries until healthy messages reach `max_deliver` and are
//! dead-lettered. So the circuit opens: the worker stops pulling, and the deliveries it holds
//! wait for the database (with progress acks, spending no delivery), each retry being the probe.
//! The first answer from the database closes it: a held message's try, or the probe of a task of
//! its own ([`probe_while_open`]), so that a worker whose held messages all ended otherwise (a
//! deadline, a panic) does not stay paused for ever. Where asked for
//! (`WorkerBuilder::pause_on_server`) and the server can (2.11+), the consumer itself is paused
//! on the server meanwhile ([`mirror_on_server`]).

use crate::backend::InboxBackend;
use crate::backoff::Backoff;
use crate::store::Inbox;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Open while the database is unreachable.
#[derive(Debug)]
pub(super) struct Circuit {
    open: watch::Sender<bool>,
}

impl Default for Circuit {
    fn default() -> Self {
        Circuit {
            open: watch::Sender::new(false),
        }
    }
}

impl Circuit {
    /// The database could not be reached, with `error`: stop pulling.
    pub(super) fn trip(&self, error: &dyn std::fmt::Display) {
        self.open.send_if_modified(|open| {
            let opened = !*open;
            if opened {
                tracing::warn!(%error, "database unreachable: pulling paused, held messages wait for it");
            }
            *open = true;
            opened
        });
    }

    /// The database answered: pull again.
    pub(super) fn close(&self) {
        self.open.send_if_modified(|open| {
            let closed = *open;
            if closed {
                tracing::info!("database reachable again: pulling resumed");
            }
            *open = false;
            closed
        });
    }

    /// Whether the circuit is open (the database unreachable).
    pub(super) fn is_open(&self) -> bool {
        *self.open.borrow()
    }

    /// Waits until the circuit is closed.
    pub(super) async fn closed(&self) {
        let mut open = self.open.subscribe();
        // The sender lives as long as the circuit, which outlives this borrow.
        let _ = open.wait_for(|open| !*open).await;
    }
}

/// While the circuit is open, asks the database every so often (a write that changes nothing, on
/// a pooled connection: [`Inbox::answers`]) and closes the circuit when it answers. Until
/// `shutdown`.
pub(super) async fn probe_while_open<DB: InboxBackend>(
    circuit: &Circuit,
    inbox: &Inbox<DB>,
    shutdown: &CancellationToken,
) {
    let mut open = circuit.open.subscribe();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            opened = open.wait_for(|open| *open) => if opened.is_err() { return },
        }
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
        while *open.borrow() {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = open.wait_for(|open| !*open) => break,
                _ = tokio::time::sleep(backoff.next()) => {}
            }
            if inbox.answers().await {
                circuit.close();
            }
        }
    }
}

/// How long one server-side pause lasts. It is renewed every half of it while the circuit stays
/// open, so a worker that dies with its circuit open leaves the consumer paused this long at most.
pub(super) const SERVER_PAUSE: Duration = Duration::from_secs(20);

/// Whether a nats-server of `version` (`"2.11.0"`, `"2.15.1-beta"`) pauses consumers
/// (`$JS.API.CONSUMER.PAUSE`, new in 2.11).
pub(super) fn pauses_consumers(version: &str) -> bool {
    let mut parts = version
        .trim_start_matches('v')
        .split(['.', '-'])
        .map(|p| p.parse::<u64>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) >= (2, 11),
        _ => false,
    }
}

/// Mirrors the circuit on the server, where asked for (`WorkerBuilder::pause_on_server`: a pause
/// stops every instance, also when only this one is cut off from the database) and the server
/// can (2.11+, see [`pauses_consumers`]):
/// while the database is unreachable the durable consumer is paused, so that JetStream delivers
/// nothing to any instance and redelivers nothing whose `ack_wait` ran out (an instance that
/// died holding messages, say), and no delivery is spent on a database that cannot answer. Acks
/// and progress acks still work on a paused consumer. Resumed as soon as the circuit closes;
/// each pause expires after [`SERVER_PAUSE`] unless renewed. On an older server only the
/// worker's own pulling stops (the circuit itself). Until `shutdown`.
pub(super) async fn mirror_on_server(
    circuit: &Circuit,
    js: &async_nats::jetstream::Context,
    stream: &str,
    consumer: &str,
    shutdown: &CancellationToken,
) {
    let version = js.client().server_info().version;
    if !pauses_consumers(&version) {
        tracing::debug!(%version, "nats-server does not pause consumers: the circuit stops this worker's pulls only");
        return;
    }
    let mut open = circuit.open.subscribe();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            opened = open.wait_for(|open| *open) => if opened.is_err() { return },
        }
        let mut paused = false;
        while *open.borrow() {
            let until = time::OffsetDateTime::now_utc() + SERVER_PAUSE;
            match pause(js, stream, consumer, Some(until)).await {
                Ok(()) => {
                    if !paused {
                        tracing::warn!(
                            consumer,
                            "database unreachable: consumer paused on the server"
                        );
                    }
                    paused = true;
                }
                Err(error) => tracing::debug!(consumer, %error, "pausing the consumer failed"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = open.wait_for(|open| !*open) => break,
                _ = tokio::time::sleep(SERVER_PAUSE / 2) => {}
            }
        }
        if paused {
            match pause(js, stream, consumer, None).await {
                Ok(()) => tracing::info!(consumer, "consumer resumed on the server"),
                // It expires on its own.
                Err(error) => {
                    tracing::warn!(consumer, %error, "resuming the consumer failed: its pause expires within {SERVER_PAUSE:?}")
                }
            }
        }
        if shutdown.is_cancelled() {
            return;
        }
    }
}

/// Pauses `consumer` of `stream` until `until`, or resumes it (`None`), asked raw through `js`
/// (so through its API prefix or domain).
async fn pause(
    js: &async_nats::jetstream::Context,
    stream: &str,
    consumer: &str,
    until: Option<time::OffsetDateTime>,
) -> Result<(), String> {
    let body = match until {
        Some(until) => {
            let until = until
                .format(&time::format_description::well_known::Rfc3339)
                .map_err(|e| e.to_string())?;
            serde_json::json!({ "pause_until": until })
        }
        None => serde_json::json!({}),
    };
    let answer: serde_json::Value = js
        .request(format!("CONSUMER.PAUSE.{stream}.{consumer}"), &body)
        .await
        .map_err(|e| e.to_string())?;
    match answer.get("error") {
        None => Ok(()),
        Some(error) => Err(error.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::pauses_consumers;

    #[test]
    fn servers_from_2_11_pause_consumers() {
        for (version, pauses) in [
            ("2.9.10", false),
            ("2.10.24", false),
            ("2.11.0", true),
            ("2.15.1", true),
            ("v2.12.0-beta.1", true),
            ("3.0.0", true),
            ("", false),
            ("x.y", false),
        ] {
            assert_eq!(pauses_consumers(version), pauses, "{version}");
        }
    }
}
