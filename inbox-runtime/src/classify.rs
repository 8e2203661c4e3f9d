//! What an error means for the message: retry it now, retry it later, or take it out of the
//! stream. Users mark their own errors with [`Permanent`] or [`Transient`].

use crate::backend::{InboxBackend, is_transient};
use crate::error::{BoxError, ProcessError, chain};
use sqlx::error::ErrorKind;
use sqlx::pool::PoolConnection;
use std::fmt;

/// How a failure is treated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Worth retrying at once with a fresh transaction (deadlock, serialization failure, busy,
    /// lost connection), then with a delayed redelivery.
    Transient,
    /// Can never succeed: dead-letter now (poison payload, bad key, integrity violation in the
    /// business write, or an error the handler marked [`Permanent`]).
    Permanent,
    /// Anything else: redelivered with a delay until `max_deliver`, then dead-lettered.
    Unknown,
}

/// Marks a handler error as permanent: the message is dead-lettered at once.
///
/// Return it from a handler whose error type is [`BoxError`], or carry it as the `#[source]` of
/// your own error (not `#[error(transparent)]`, which hides it from the source chain).
///
/// ```
/// use inbox_runtime::Permanent;
/// let err = Permanent::new("account 7 is closed");
/// assert_eq!(err.to_string(), "account 7 is closed");
/// ```
#[derive(Debug)]
pub struct Permanent(BoxError);

/// Marks a handler error as transient: retried at once with a fresh transaction, then redelivered.
#[derive(Debug)]
pub struct Transient(BoxError);

macro_rules! marker {
    ($t:ident) => {
        impl $t {
            /// Wraps `err`.
            pub fn new(err: impl Into<BoxError>) -> Self {
                $t(err.into())
            }
        }
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
        impl std::error::Error for $t {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&*self.0)
            }
        }
    };
}
marker!(Permanent);
marker!(Transient);

/// Classifies a processing failure on backend `DB`.
pub fn classify<DB: InboxBackend>(err: &ProcessError) -> ErrorClass {
    match err {
        ProcessError::Decode { .. }
        | ProcessError::Key(_)
        | ProcessError::Panicked(_)
        | ProcessError::TwoPhaseInTransaction(_)
        | ProcessError::KeyReused { .. }
        | ProcessError::TransactionEnded { .. } => ErrorClass::Permanent,
        // Another owner holds the key, or took it over: redelivered later (the verdict waits out
        // a held lease), never tried again at once.
        ProcessError::ClaimHeld { .. } | ProcessError::FencedOut { .. } => ErrorClass::Unknown,
        // The inbox's own SQL: a transient failure is retried, anything else (a missing table,
        // say) is an operator's problem that redelivery gives time to fix.
        ProcessError::Database { source, .. } if is_transient::<DB>(source) => {
            ErrorClass::Transient
        }
        ProcessError::Database { .. } => ErrorClass::Unknown,
        ProcessError::StreamLookup { .. } => ErrorClass::Transient,
        // Stuck (a frozen peer holding the key, a handler that hangs): redelivered later, with a
        // delay, rather than tried again at once.
        ProcessError::Deadline(_) => ErrorClass::Unknown,
        ProcessError::Handler(e) => classify_handler_error::<DB>(e.as_ref()),
    }
}

/// Whether `err` says the database cannot be reached at all (a lost or refused connection, a
/// pool that cannot connect, a server shutting down): a failure that every message would meet,
/// not this message's. The worker then waits for the database instead of spending deliveries.
pub(crate) fn is_outage<DB: InboxBackend>(err: &ProcessError) -> bool {
    match err {
        ProcessError::Database { source, .. } => is_connection_error::<DB>(source),
        ProcessError::Handler(e) => {
            for e in chain(e.as_ref()) {
                if let Some(sqlx_err) = e.downcast_ref::<sqlx::Error>() {
                    return is_connection_error::<DB>(sqlx_err);
                }
                if let Some(db) = database_error::<DB>(e) {
                    return DB::is_connection_error(db) || DB::is_read_only_error(db);
                }
            }
            false
        }
        _ => false,
    }
}

fn is_connection_error<DB: InboxBackend>(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(e) => {
            DB::is_connection_error(e.as_ref()) || DB::is_read_only_error(e.as_ref())
        }
        _ => false,
    }
}

/// Whether `err` is, or wraps, a statement that ran out of time (`Backend::is_timeout_error`):
/// a lock wait, a statement cut at the worker's deadline. The lock may be a row's, which is
/// this message's matter, or the inbox table's, which every message would meet.
pub(crate) fn is_timeout<DB: InboxBackend>(err: &ProcessError) -> bool {
    database_error_in::<DB>(err).is_some_and(|db| DB::is_timeout_error(db))
}

/// The database error `err` is or wraps (the inbox's own statement's, or the first in a
/// handler error's chain), if any.
fn database_error_in<DB: InboxBackend>(
    err: &ProcessError,
) -> Option<&dyn sqlx::error::DatabaseError> {
    match err {
        ProcessError::Database { source, .. } => source.as_database_error(),
        ProcessError::Handler(e) => chain(e.as_ref()).find_map(|e| {
            e.downcast_ref::<sqlx::Error>()
                .and_then(|e| e.as_database_error())
                .or_else(|| database_error::<DB>(e))
        }),
        _ => None,
    }
}

/// Whether `err` says the database takes no writes now (a standby during a failover): the
/// connection it came on should leave the pool, since a new one may reach the new primary.
pub(crate) fn is_read_only<DB: InboxBackend>(err: &ProcessError) -> bool {
    database_error_in::<DB>(err).is_some_and(|db| DB::is_read_only_error(db))
}

/// Closes `conn` when it is released if `err` says the database takes no writes (a standby,
/// after a failover): pooled again, it would refuse every later try, while a new connection may
/// reach the new primary.
pub(crate) fn close_if_read_only<DB: InboxBackend>(
    conn: &mut PoolConnection<DB>,
    err: &sqlx::Error,
) {
    if let sqlx::Error::Database(e) = err
        && DB::is_read_only_error(e.as_ref())
    {
        conn.close_on_drop();
    }
}

fn classify_handler_error<DB: InboxBackend>(
    err: &(dyn std::error::Error + Send + Sync + 'static),
) -> ErrorClass {
    for e in chain(err) {
        if e.is::<Permanent>() {
            return ErrorClass::Permanent;
        }
        if e.is::<Transient>() {
            return ErrorClass::Transient;
        }
        // A handler's error that wraps a sqlx::Error transparently (thiserror's
        // `#[error(transparent)]`) has the database error itself as its source.
        if let Some(db) = database_error::<DB>(e) {
            if is_integrity_or_data::<DB>(db) {
                return ErrorClass::Permanent;
            }
            if DB::is_transient_error(db) {
                return ErrorClass::Transient;
            }
        }
        if let Some(sqlx_err) = e.downcast_ref::<sqlx::Error>() {
            if let Some(db) = sqlx_err.as_database_error()
                && is_integrity_or_data::<DB>(db)
            {
                // Integrity violations and bad data in the business write: the same message will
                // fail the same way every time. Not a foreign-key violation: the parent row may
                // be on its way (an event arriving before the one that creates it), so it is
                // redelivered with a delay and dead-lettered only at max_deliver.
                return ErrorClass::Permanent;
            }
            if is_transient::<DB>(sqlx_err) {
                return ErrorClass::Transient;
            }
        }
    }
    ErrorClass::Unknown
}

/// `e` as a database error, when it is one: what a `sqlx::Error::Database` gives as its source
/// (the boxed error), or the backend's own error type.
fn database_error<'e, DB: InboxBackend>(
    e: &'e (dyn std::error::Error + 'static),
) -> Option<&'e dyn sqlx::error::DatabaseError> {
    match e.downcast_ref::<Box<dyn sqlx::error::DatabaseError>>() {
        Some(boxed) => Some(boxed.as_ref()),
        None => DB::downcast_database_error(e),
    }
}

/// An integrity violation or bad data in the business write: the same message fails the same
/// way every time.
fn is_integrity_or_data<DB: InboxBackend>(db: &dyn sqlx::error::DatabaseError) -> bool {
    matches!(
        db.kind(),
        ErrorKind::UniqueViolation | ErrorKind::NotNullViolation | ErrorKind::CheckViolation
    ) || DB::is_data_error(db)
}

#[cfg(all(test, feature = "postgres"))]
mod tests {
    use super::*;
    use crate::error::Stage;

    #[test]
    fn an_unreachable_database_is_an_outage_and_a_deadlock_is_not() {
        type Pg = sqlx::Postgres;
        let refused = || sqlx::Error::Io(std::io::ErrorKind::ConnectionRefused.into());
        let outage = [
            ProcessError::Database {
                stage: Stage::Begin,
                source: sqlx::Error::PoolTimedOut,
            },
            ProcessError::Database {
                stage: Stage::Commit,
                source: refused(),
            },
            ProcessError::Handler(Box::new(refused())),
        ];
        for err in &outage {
            assert!(is_outage::<Pg>(err), "{err}");
        }
        let not = [
            ProcessError::Handler("plain".into()),
            ProcessError::Handler(Box::new(Transient::new("flaky downstream"))),
            ProcessError::Deadline(std::time::Duration::from_secs(1)),
        ];
        for err in &not {
            assert!(!is_outage::<Pg>(err), "{err}");
        }
    }
}
