//! The behaviours every backend must show, one file each, compiled only into this crate's tests.
//!
//! A behaviour is a private generic async fn over a [`TestBackend`]; the file's last line,
//! `super::behaviours!(fn_a, fn_b);`, turns each into a `#[tokio::test]` on every backend of
//! [`behaviours!`]'s list (as `<file>::<backend>::<fn>`). A behaviour left out of that line is
//! never called, and `dead_code` is denied here: the build fails. A file left out of the `mod`
//! list below fails the build too (`build.rs` checks every file of this directory is declared).
//!
//! [`TestBackend`]: crate::backends::TestBackend

#![deny(dead_code)]

/// Declares a suite file's behaviours: a `#[tokio::test]` for each, on every backend. Adding a
/// backend is one line here (and its [`TestBackend`](crate::backends::TestBackend) impl).
///
/// `behaviours!(partitioned_too; fn_a, fn_b)` runs them on PostgreSQL's partitioned inbox too
/// (`<file>::postgres_partitioned::<fn>`): every behaviour that must hold whatever the table's
/// layout (all but the row-by-row cleanup's, whose cutoff a partition only meets whole).
macro_rules! behaviours {
    (partitioned_too; $($test:ident),+ $(,)?) => {
        super::behaviours!($($test),+);
        super::on_backend!(postgres_partitioned, crate::backends::PostgresPartitioned; $($test),+);
    };
    ($($test:ident),+ $(,)?) => {
        super::on_backend!(postgres, crate::backends::Postgres; $($test),+);
        super::on_backend!(mysql, crate::backends::MySql; $($test),+);
        super::on_backend!(sqlite, crate::backends::Sqlite; $($test),+);
    };
}

/// The tests of one backend, in a module named after it.
macro_rules! on_backend {
    ($name:ident, $backend:ty; $($test:ident),+) => {
        mod $name {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test::<$backend>().await
                }
            )+
        }
    };
}

use {behaviours, on_backend};

mod all_or_nothing;
mod bad_input_is_dead_lettered;
mod batches;
mod business_unique_violation_is_an_error;
mod claims;
mod cleanup;
mod committed_not_acked_is_skipped_on_redelivery;
mod concurrent_migrations;
mod dead_letters_are_stored;
mod default_key_names_the_stream_instance;
mod delivery_limit_backstop;
mod empty_msg_id_is_no_id;
mod failures_are_retried_or_dead_lettered;
mod graceful_shutdown;
mod held_race;
mod held_race_commit;
mod held_race_rollback;
mod hot_rows_in_batches;
mod invalid_keys_are_rejected;
mod kept_connections;
mod key_reuse;
mod keys_compare_as_bytes;
mod long_handler_sends_progress;
mod max_deliver_changes_are_seen;
mod memory_is_bounded_by_bytes;
mod nats_restart_mid_stream;
mod outbox;
mod prefetch;
mod relays_take_turns;
mod status_lines_are_deliveries;
mod stuck_deliveries_have_a_deadline;
mod two_instances_apply_each_message_once;

use crate::backends::{TestBackend, TestDb};
use inbox_runtime::Inbox;

/// A fresh database of `B` with the inbox migrated, and the inbox on it.
async fn setup<B: TestBackend>(max: u32) -> (TestDb<B::Db>, Inbox<B::Db>) {
    let db = B::create(max).await;
    let inbox = B::inbox(db.pool.clone());
    inbox.migrate().await.expect("migrate the inbox");
    (db, inbox)
}

/// Takes all `size` connections of `pool` (MariaDB's) and asserts that none is inside a
/// transaction: one left inside would run the pool's next user's statements in it, uncommitted.
async fn assert_no_transaction_left_on_mysql(pool: &sqlx::MySqlPool, size: usize) {
    let mut conns = Vec::new();
    for _ in 0..size {
        conns.push(pool.acquire().await.expect("a connection of the pool"));
    }
    for conn in &mut conns {
        let open: i64 = sqlx::query_scalar("SELECT CAST(@@in_transaction AS SIGNED)")
            .fetch_one(&mut **conn)
            .await
            .expect("@@in_transaction (MariaDB)");
        assert_eq!(open, 0, "a connection was left inside a transaction");
    }
}
