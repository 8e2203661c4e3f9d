//! A letter on a message's last delivery, where a nak would never be redelivered: kept in the
//! dead-letter stream, else parked in the database, tried until one holds it.

use super::Inner;
use super::dead_letter::{DeadLetter, header_pairs, letter_headers};
use crate::backoff::Backoff;
use crate::handler::Handler;
use async_nats::jetstream::message::Message;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

impl<H> Inner<H>
where
    H: Handler,
{
    /// Stores the letter of a message on its last delivery, where a nak would never be
    /// redelivered: in the dead-letter stream, else parked in the database (published later by
    /// the worker), trying both with a growing wait until one holds it. Only a shutdown ends
    /// the wait without it, and then the whole letter is logged, the last trace there can be.
    pub(super) async fn keep_letter(
        &self,
        message: &Message,
        letter: &DeadLetter<'_>,
        shutdown: &CancellationToken,
    ) -> Result<(), ()> {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(10));
        loop {
            let published = match self.dead_letters.publish(message, letter).await {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            let headers = header_pairs(&letter_headers(message.headers.as_ref(), letter));
            let parked = self
                .inbox
                .park_letter(H::CONSUMER, &headers, &message.payload)
                .await;
            match parked {
                Ok(()) => {
                    tracing::error!(publish_error = %published, "dead letter refused by the stream on the last delivery; kept in the database until the stream takes it");
                    return Ok(());
                }
                Err(db) => {
                    let wait = backoff.next();
                    tracing::error!(publish_error = %published, database_error = %db, retry_in = ?wait, "dead letter neither published nor kept on the last delivery; trying again");
                    tokio::select! {
                        _ = shutdown.cancelled() => {
                            // Where it is, not what it holds: a payload (and its headers) may carry
                            // personal data or secrets that have no place in a log.
                            tracing::error!(
                                stream = letter.stream,
                                stream_seq = letter.stream_seq,
                                payload_bytes = message.payload.len(),
                                "shutting down with a dead letter nowhere to store: the message stays in its stream (read it by sequence), unacknowledged, and is not redelivered"
                            );
                            return Err(());
                        }
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
    }
}
