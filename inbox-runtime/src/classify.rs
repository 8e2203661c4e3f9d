//! What an error means for the message: retry it now, retry it later, or take it out of the
//! stream. Users mark their own errors with [`Permanent`] or [`Transient`].

use crate::backend::{InboxBackend, is_transient};
use crate::handler::BoxError;
use crate::store::ProcessError;
use sqlx::error::ErrorKind;
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
        ProcessError::Decode { .. } | ProcessError::Key(_) | ProcessError::Panicked(_) => {
            ErrorClass::Permanent
        }
        // The inbox's own SQL: a transient failure is retried, anything else (a missing table,
        // say) is an operator's problem that redelivery gives time to fix.
        ProcessError::Database { source, .. } if is_transient::<DB>(source) => {
            ErrorClass::Transient
        }
        ProcessError::Database { .. } => ErrorClass::Unknown,
        ProcessError::StreamLookup { .. } => ErrorClass::Transient,
        ProcessError::Handler(e) => classify_handler_error::<DB>(e.as_ref()),
    }
}

fn classify_handler_error<DB: InboxBackend>(
    err: &(dyn std::error::Error + Send + Sync + 'static),
) -> ErrorClass {
    let mut next: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = next {
        if e.is::<Permanent>() {
            return ErrorClass::Permanent;
        }
        if e.is::<Transient>() {
            return ErrorClass::Transient;
        }
        if let Some(sqlx_err) = e.downcast_ref::<sqlx::Error>() {
            if let Some(db) = sqlx_err.as_database_error()
                && (matches!(
                    db.kind(),
                    ErrorKind::UniqueViolation
                        | ErrorKind::NotNullViolation
                        | ErrorKind::CheckViolation
                ) || DB::is_data_error(db))
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
        next = e.source();
    }
    ErrorClass::Unknown
}
