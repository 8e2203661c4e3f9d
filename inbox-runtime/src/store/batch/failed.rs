//! Why a try of a batch ended without its COMMIT, and what that means for the batch.

use crate::backend::InboxBackend;
use crate::classify::{ErrorClass, classify};
use crate::error::{ProcessError, chain};

/// Why a try of the batch ended without its COMMIT.
pub(super) enum Failed {
    /// Some message failed (the one at this index, when known): try again with a savepoint per
    /// message, leaving that one out without running it again.
    OneMessage(Option<usize>),
    /// A conflict with another transaction ended the try: the batch may be tried again.
    Conflict,
    /// The transaction as a whole failed: every message goes alone.
    Whole,
}

/// What a failure inside a batch means for the batch. A conflict with another transaction
/// (deadlock, serialization failure, lock wait timeout, busy) may have ended the whole
/// transaction (InnoDB rolls it back on a deadlock), and is no message's fault: the whole batch
/// is tried again. Any other transient failure (a lost connection, too many connections, a
/// handler's error marked transient) sends every message alone, each with its own retries.
/// Anything else is one message's fault.
pub(super) fn failed_by<DB: InboxBackend>(err: &ProcessError, at: Option<usize>) -> Failed {
    if is_conflict::<DB>(err) {
        return Failed::Conflict;
    }
    match classify::<DB>(err) {
        ErrorClass::Transient => Failed::Whole,
        _ => Failed::OneMessage(at),
    }
}

/// Whether `err` is, or wraps, a database error the dialect calls a conflict.
fn is_conflict<DB: InboxBackend>(err: &ProcessError) -> bool {
    let source: &(dyn std::error::Error + 'static) = match err {
        ProcessError::Database { source, .. } => source,
        ProcessError::Handler(e) => &**e,
        _ => return false,
    };
    chain(source).any(|e| {
        matches!(
            e.downcast_ref::<sqlx::Error>(),
            Some(sqlx::Error::Database(d)) if DB::is_conflict_error(d.as_ref())
        )
    })
}
