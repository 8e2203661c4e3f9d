//! Why a relay refuses a stream, or a pass failed.

use std::time::Duration;

/// Why a relay refuses a stream, or a pass failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The stream acknowledges before it has stored a message: marking rows sent on its PubAck
    /// could lose them.
    #[error(
        "stream {stream:?} has persist_mode async: its PubAck may come before the message is stored, so the relay would mark rows sent that a crash of the server loses; use the default persist mode"
    )]
    AsyncPersistence {
        /// The stream.
        stream: String,
    },
    /// The stream's duplicate window is not shorter than the relay's retention of sent rows.
    #[error(
        "stream {stream:?} has a duplicate window of {window:?}, and the relay keeps sent rows for {retention:?}: the retention must be longer than the window (a re-published row would otherwise be stored twice, or an id reused after cleanup dropped as a duplicate); raise Relay::retention"
    )]
    Retention {
        /// The stream.
        stream: String,
        /// Its duplicate window.
        window: Duration,
        /// The relay's retention.
        retention: Duration,
    },
    /// The stream has no duplicate window: it would store a re-published row twice.
    #[error(
        "stream {stream:?} has no duplicate window: a row published again after a crash would be stored twice; give it a duplicate window"
    )]
    NoDuplicateWindow {
        /// The stream.
        stream: String,
    },
    /// No stream takes the subject.
    #[error("no stream takes subject {subject:?}: its outbox rows stay pending until one does")]
    NoStream {
        /// The subject.
        subject: String,
    },
    /// The database cannot run a relay (a MySQL or MariaDB without `FOR UPDATE SKIP LOCKED`).
    #[error("{0}")]
    Unsupported(String),
    /// JetStream failed to answer.
    #[error("{what}: {source}")]
    Nats {
        /// What was being done.
        what: String,
        /// The error.
        source: async_nats::Error,
        /// Whether it is worth waiting out (JetStream unavailable for now).
        transient: bool,
    },
    /// The database failed.
    #[error("relaying the outbox: {0}")]
    Database(#[from] sqlx::Error),
}
