//! Behaviour tests against the real PostgreSQL and NATS: one module per behaviour.

mod all_or_nothing;
mod business_unique_violation_is_an_error;
mod committed_not_acked_is_skipped_on_redelivery;
mod held_race_commit;
mod held_race_rollback;
mod invalid_keys_are_rejected;
mod poison_message_is_terminated;
mod two_instances_apply_each_message_once;
