//! The behaviours every backend must show, each a generic async fn over a [`TestBackend`];
//! [`conformance!`](crate::conformance) instantiates all of them for one backend, so a behaviour
//! cannot be tested on one backend only.
//!
//! [`TestBackend`]: crate::backends::TestBackend

pub mod all_or_nothing;
pub mod bad_input_is_dead_lettered;
pub mod business_unique_violation_is_an_error;
pub mod cleanup;
pub mod committed_not_acked_is_skipped_on_redelivery;
pub mod concurrent_migrations;
pub mod failures_are_retried_or_dead_lettered;
pub mod graceful_shutdown;
pub mod held_race;
pub mod held_race_commit;
pub mod held_race_rollback;
pub mod invalid_keys_are_rejected;
pub mod long_handler_sends_progress;
pub mod nats_restart_mid_stream;
pub mod two_instances_apply_each_message_once;

use crate::backends::{TestBackend, TestDb};
use inbox_runtime::Inbox;

/// A fresh database of `B` with the inbox migrated, and the inbox on it.
pub async fn setup<B: TestBackend>(max: u32) -> (TestDb<B::Db>, Inbox<B::Db>) {
    let db = B::create(max).await;
    let inbox = Inbox::new(db.pool.clone());
    inbox.migrate().await.expect("migrate the inbox");
    (db, inbox)
}

/// Instantiates every behaviour of the suite as a `#[tokio::test]` for `$backend`, in a module
/// named `$name`: `inbox_tests::conformance!(postgres, inbox_tests::backends::Postgres);`
#[macro_export]
macro_rules! conformance {
    ($name:ident, $backend:ty) => {
        mod $name {
            $crate::conformance!(@tests $backend;
                all_or_nothing::check_violation_rolls_back_the_marker,
                all_or_nothing::check_violation_is_dead_lettered_not_acked,
                business_unique_violation_is_an_error::business_unique_violation_is_an_error_not_a_skip,
                cleanup::cleanup_deletes_only_old_finished_markers,
                cleanup::cleanup_runs_one_instance_at_a_time,
                committed_not_acked_is_skipped_on_redelivery::committed_but_not_acked_is_skipped_on_redelivery,
                concurrent_migrations::instances_migrating_together_all_succeed,
                failures_are_retried_or_dead_lettered::transient_failure_is_retried_in_process,
                failures_are_retried_or_dead_lettered::permanent_failure_is_dead_lettered_at_once,
                failures_are_retried_or_dead_lettered::failure_is_dead_lettered_at_max_deliver,
                failures_are_retried_or_dead_lettered::unstorable_dead_letter_leaves_the_message,
                graceful_shutdown::shutdown_finishes_in_flight_and_leaves_the_rest,
                held_race_commit::held_race_commit_makes_the_twin_skip,
                held_race_rollback::held_race_rollback_lets_the_twin_apply,
                invalid_keys_are_rejected::empty_long_and_missing_keys_are_rejected,
                long_handler_sends_progress::long_handler_is_not_redelivered,
                nats_restart_mid_stream::nats_restart_mid_stream_keeps_exactly_once,
                bad_input_is_dead_lettered::bad_input_is_dead_lettered_and_does_not_block,
                two_instances_apply_each_message_once::two_instances_apply_each_message_once,
            );
        }
    };
    (@tests $backend:ty; $($module:ident :: $test:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $test() {
                $crate::suite::$module::$test::<$backend>().await
            }
        )*
    };
}
