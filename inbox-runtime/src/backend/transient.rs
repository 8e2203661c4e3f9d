//! Which database errors a fresh transaction may cure.

use super::InboxBackend;

/// Whether `err` is worth retrying with a fresh transaction: a transient database error of the
/// backend, a lost connection, or a pool timeout. Constraint violations and the like are not.
pub fn is_transient<DB: InboxBackend>(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Database(e) => DB::is_transient_error(e.as_ref()),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::WorkerCrashed => true,
        _ => false,
    }
}
