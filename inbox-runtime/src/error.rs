//! The errors every layer shares: a handler's boxed error, why a message was not processed, the
//! walk down an error's sources, and what JetStream's error codes mean.

use crate::key::KeyError;
use std::fmt;
use std::time::Duration;

/// Errors of any handler, boxed: what `Handler::Error` converts into.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The step of the inbox protocol at which the database failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stage {
    /// Opening the transaction.
    Begin,
    /// Inserting the marker.
    Claim,
    /// After the handler, before COMMIT: writing the outbox rows the handler wrote (held until
    /// it returned) where the marker is, checking that the marker is still in the
    /// transaction (where the claim inserted it finished), or recording when the effect was
    /// done (`processed_at`, PostgreSQL's partitioned inbox; a batch's markers).
    Finish,
    /// Committing marker and effect. The result is unknown: redelivery lets the marker decide.
    Commit,
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Stage::Begin => "beginning the transaction",
            Stage::Claim => "claiming the message key",
            Stage::Finish => "finishing the marker after the handler",
            Stage::Commit => "committing",
        })
    }
}

/// Why a message was not processed. Nothing was committed in any of these cases but
/// [`ProcessError::TransactionEnded`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProcessError {
    /// The payload does not decode as the handler's message type. Permanent.
    #[error("payload does not decode as {ty} ({codec}): {source}")]
    Decode {
        /// The expected message type.
        ty: &'static str,
        /// The codec's name ([`Codec::NAME`](crate::Codec::NAME)).
        codec: &'static str,
        /// The decoder's error.
        source: BoxError,
    },
    /// The key is empty, too long or missing. Permanent.
    #[error(transparent)]
    Key(#[from] KeyError),
    /// The inbox's own SQL failed. Transient: retry with a fresh transaction.
    #[error("inbox database error while {stage}: {source}")]
    Database {
        /// Where it failed.
        stage: Stage,
        /// The driver's error.
        source: sqlx::Error,
    },
    /// The handler returned an error; its transaction was rolled back.
    #[error("handler failed: {0}")]
    Handler(BoxError),
    /// The message's transaction ended while its handler ran: its marker was gone when the
    /// inbox came to finish it. A handler that swallowed an error which rolls the whole
    /// transaction back (MySQL/MariaDB's deadlock 1213, some SQLite errors) and went on, or one
    /// that ended the transaction itself. The statements it ran after that ran outside the
    /// transaction, each committed on its own: trying again would commit them again, so this
    /// is permanent (dead-lettered), the one case where something may have been committed.
    #[error(
        "the transaction of key {key:?} ended while its handler ran (a swallowed deadlock or other error that rolls the whole transaction back, or a ROLLBACK/COMMIT in the handler): statements the handler ran after that were committed on their own, so the message is not tried again; return such errors from the handler"
    )]
    TransactionEnded {
        /// The message's key.
        key: String,
    },
    /// The message has no `Nats-Msg-Id` and its stream, whose creation time the default key
    /// names, could not be looked up. Transient.
    #[error("looking up stream {stream} for the message's default key: {source}")]
    StreamLookup {
        /// The stream.
        stream: String,
        /// NATS's error.
        source: BoxError,
    },
    /// Processing did not finish within the worker's per-delivery deadline; its transaction was
    /// rolled back. Redelivered with a delay.
    #[error("processing did not finish within the deadline of {0:?}")]
    Deadline(Duration),
    /// The handler (or its key expression) panicked; its transaction was rolled back. Permanent:
    /// the same message would panic again.
    #[error("handler panicked: {0}")]
    Panicked(String),
    /// Two-phase: the key's claim is held by another owner whose lease runs `remaining` longer.
    /// Redelivered after it (never acked: that owner may still fail, and then this delivery
    /// takes over); on the last delivery the worker waits the lease out in process instead.
    #[error("the key's claim is held by another owner for {remaining:?} more")]
    ClaimHeld {
        /// How long the owner's lease still runs.
        remaining: Duration,
    },
    /// Two-phase: another owner took the claim over (this one's lease had run out, a frozen
    /// process say), so this owner's completion was refused and its writes rolled back. The
    /// side effect may have happened twice, with the same idempotency key. Nak'd; the
    /// redelivery finds the claim done (or held).
    #[error(
        "the claim was taken over by another owner: fence {fence} no longer holds it, so its completion was refused"
    )]
    FencedOut {
        /// The fence this owner held.
        fence: i64,
    },
    /// A two-phase handler (consumer named) was run in a caller's transaction
    /// ([`Inbox::process_in`](crate::Inbox::process_in)), where its claim cannot commit on its own. Permanent.
    #[error(
        "handler for consumer {0:?} is two-phase (`claim`): it runs through Inbox::process or a worker, not in a caller's transaction"
    )]
    TwoPhaseInTransaction(&'static str),
    /// The key was processed before with another payload (the marker keeps a hash of each
    /// key's first payload), and the handler rejects key reuse (`on_key_reuse = reject`).
    /// Permanent.
    #[error(
        "key reused with another payload: key {key:?} was processed with payload hash {original}, this one's is {this}"
    )]
    KeyReused {
        /// The key.
        key: String,
        /// The hash of the payload the key was first processed with.
        original: String,
        /// This payload's hash.
        this: String,
    },
}

/// `err` and every error below it, following [`source`](std::error::Error::source): where a
/// wrapped `sqlx::Error`, a [`Permanent`](crate::Permanent) mark or a database error is found.
pub(crate) fn chain<'e>(
    err: &'e (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'e (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(err), |e| e.source())
}

/// Whether JetStream's answer says it cannot serve the request for now: 503 (JetStream
/// temporarily unavailable, a cluster without a meta or stream leader during an election) or
/// 408 (a request that timed out inside the cluster).
pub(crate) fn unavailable(e: &async_nats::jetstream::Error) -> bool {
    matches!(e.code(), 503 | 408)
}
