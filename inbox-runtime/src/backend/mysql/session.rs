//! What a MySQL session carries from one transaction to the next: the lock wait and MariaDB's
//! statement bound, set again at every BEGIN in the same round trip as `START TRANSACTION`
//! (with the next transaction's isolation level), and the statement that gives them back.

use std::time::Duration;

/// A message's BEGIN, less the COMMIT of `Backend::begin_sql`: three statements in one round
/// trip. The lock wait (InnoDB's is in whole seconds, at least 1) and MariaDB's
/// `max_statement_time`, which bounds every statement, lock waits included (seconds, fractions
/// allowed), are the session's, set again at every BEGIN (a handler may have changed them); the
/// isolation level is the next transaction's alone. MySQL has no bound for every statement (its
/// `max_execution_time` bounds SELECTs only; a cut try's session is killed there instead,
/// `session_to_kill`): the executable comment is MariaDB's alone. The session's bound stays on
/// the connection (see `RESET_STATEMENT_TIME` for the statements that must not have it).
pub(super) fn begin_again(lock_timeout: Duration, statement_timeout: Option<Duration>) -> String {
    let secs = lock_timeout.as_secs().max(1);
    let bound = statement_timeout
        .map(|t| {
            let secs = t.as_secs_f64().max(0.001);
            format!(" /*M!100100 , max_statement_time = {secs:.3} */")
        })
        .unwrap_or_default();
    format!(
        "SET SESSION innodb_lock_wait_timeout = {secs}{bound}; \
         SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION"
    )
}

/// Gives the session back the server's `max_statement_time` (MariaDB), which a message's
/// transaction set to the worker's deadline (`Backend::begin_sql`); nothing on MySQL.
pub(super) const RESET_STATEMENT_TIME: &str = "SET SESSION innodb_lock_wait_timeout = \
     @@SESSION.innodb_lock_wait_timeout \
     /*M!100100 , max_statement_time = @@GLOBAL.max_statement_time */";
