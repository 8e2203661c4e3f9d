//! What differs per database, behind one sealed trait; the generic code never asks which database
//! it is (it asks for a capability, such as `RelayTurns`). A backend writes its dialect's SQL and
//! overrides only what behaves differently; the statements every dialect runs alike have default
//! bodies over sqlx's generic executor bounds.
//!
//! One concept per file: `begin` (a connection a BEGIN cut mid-flight cannot leave in a
//! transaction), `dialect` (the sealed per-database trait), `executor` (the statements
//! every dialect runs alike), `held_sql` (the held outbox rows' insert), `rows` (what they
//! read and write), `statements` (one inbox table's SQL), `table` (its checked name), `migrate`
//! (migrations, safe when instances race), `fleet` (the cleanup lock and batched deletes),
//! `transient` (which errors a fresh transaction may cure); then one file per dialect
//! (PostgreSQL's partitioned layout in `postgres/`).

mod begin;
mod dialect;
mod executor;
pub(crate) mod fleet;
mod held_sql;
pub(crate) mod migrate;
mod rows;
mod statements;
mod table;
mod transient;

#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

pub(crate) use begin::{ArmedTx, Beginning, Cut, Server, ServerFacts};
pub(crate) use dialect::{Backend, Claimed, RelayTurns};
pub(crate) use executor::{Generic, GenericOutbox};
pub use rows::FailedRow;
pub(crate) use rows::{DeleteBatch, IdSize, KeyId, NewOutboxRow, OutboxRow};
#[cfg(feature = "sqlite")]
pub use sqlite::sqlite_options;
#[cfg_attr(
    not(any(feature = "postgres", feature = "sqlite")),
    allow(unused_imports)
)]
pub(crate) use statements::{
    Begin, InboxStatements, claims_of, delete_ids_sql, finish_many_sql, outbox_rows_sql,
    stamp_ids_sql,
};
pub use table::{InvalidTableName, TableName};
pub use transient::is_transient;

use std::time::Duration;

/// How long a transaction waits for a lock by default: see
/// [`Inbox::lock_timeout`](crate::Inbox::lock_timeout).
pub const DEFAULT_LOCK_TIMEOUT: Duration = Duration::from_secs(30);

/// A database the inbox runs on: `sqlx::Postgres` (feature `postgres`), `sqlx::MySql` (feature
/// `mysql`, for MySQL and MariaDB) and `sqlx::Sqlite` (feature `sqlite`).
///
/// Sealed: its SQL is an implementation detail of this crate, and a new backend is added here,
/// where the conformance suite runs it (see CONTRIBUTING.md).
pub trait InboxBackend: sqlx::Database + Backend {}

impl<DB: Backend> InboxBackend for DB {}
