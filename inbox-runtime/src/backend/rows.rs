//! The rows the inbox and the outbox read and write, by name rather than as tuples. Each reads
//! its columns by position, in the order its statement selects them (`statements.rs`,
//! `outbox/statements.rs`). Public in a private module, like the sealed traits that use them:
//! not reachable outside this crate.

use sqlx::{ColumnIndex, Decode, FromRow, Row, Type};

/// A claim's state (`ClaimStatements::state`), locked for update.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimState {
    /// The marker's id.
    pub id: i64,
    /// Whether the claim is done (`processed_at` set).
    pub done: bool,
    /// Milliseconds until `lease_until`, or -1 without a lease.
    pub lease_left_ms: i64,
    /// The fence of its current owner.
    pub fence: i64,
    /// How many attempts were made.
    pub attempts: i64,
}

/// An open claim (`ClaimStatements::open`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenClaimRow {
    /// The message's key.
    pub key: String,
    /// The fence of its last owner.
    pub fence: i64,
    /// How many attempts were made.
    pub attempts: i64,
    /// Milliseconds since it was received.
    pub age_ms: i64,
    /// Milliseconds until `lease_until`, or -1 without a lease.
    pub lease_left_ms: i64,
}

/// A dead letter parked in `<table>_dead_letters`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkedRow {
    /// The row's id.
    pub id: i64,
    /// Its headers, as a JSON array of (name, value) pairs.
    pub headers: String,
    /// Its payload.
    pub payload: Vec<u8>,
}

/// A pending outbox row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRow {
    /// The row's id: the order rows of one key leave in.
    pub id: i64,
    /// Its `Nats-Msg-Id`.
    pub msg_id: String,
    /// The subject it is published to.
    pub subject: String,
    /// The key whose rows leave in id order.
    pub order_key: String,
    /// Its headers, as a JSON array of (name, value) pairs.
    pub headers: String,
    /// Its payload.
    pub payload: Vec<u8>,
}

/// An outbox row a relay gave up on ([`Outbox::failed`](crate::Outbox::failed)): NATS refused
/// it for good. It stays in the outbox, unsent, and holds back its order key's later rows.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct FailedRow {
    /// The row's id.
    pub id: i64,
    /// Its `Nats-Msg-Id`.
    pub msg_id: String,
    /// The subject it was to be published to.
    pub subject: String,
    /// Its order key, held back with it.
    pub order_key: String,
    /// Why NATS refused it.
    pub error: String,
    /// How long ago the relay gave up on it, in milliseconds.
    pub failed_ms_ago: i64,
}

/// An outbox row to write.
#[derive(Debug, Clone, Copy)]
pub struct NewOutboxRow<'a> {
    /// Its `Nats-Msg-Id`.
    pub msg_id: &'a str,
    /// The subject it is published to.
    pub subject: &'a str,
    /// The key whose rows leave in id order.
    pub order_key: &'a str,
    /// Its headers, as a JSON array of (name, value) pairs.
    pub headers: &'a str,
    /// Its payload.
    pub payload: &'a [u8],
}

/// A row id and its size in bytes (payload and headers): what a relay pass locks before it
/// loads the payloads that fit its byte budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdSize {
    /// The row's id.
    pub id: i64,
    /// Its payload's and headers' bytes.
    pub size: i64,
}

/// A key and a row id: a batch's new marker for a key, or an order key's oldest pending row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyId {
    /// The key.
    pub key: String,
    /// The row's id.
    pub id: i64,
}

/// An outbox's backlog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backlog {
    /// Pending rows.
    pub rows: i64,
    /// The age of the oldest, in milliseconds (0 with none).
    pub oldest_ms: i64,
}

/// What one batch of a cleanup deletes: rows older than `older_than_secs`, at most `limit`, of
/// `consumer` when the statement names one (markers; sent outbox rows have none).
#[derive(Debug, Clone, Copy)]
pub struct DeleteBatch<'a> {
    /// The consumer whose markers go, bound first; `None` for the outbox.
    pub consumer: Option<&'a str>,
    /// How old a row must be, in seconds.
    pub older_than_secs: f64,
    /// The most rows one statement deletes.
    pub limit: i64,
}

/// Implements `FromRow` for a struct read by column position, for any database whose rows can
/// decode its fields' types.
macro_rules! from_row_by_position {
    ($name:ident { $($field:ident: $ty:ty = $read:expr),* $(,)? }) => {
        impl<'r, R: Row> FromRow<'r, R> for $name
        where
            usize: ColumnIndex<R>,
            $($ty: Decode<'r, R::Database> + Type<R::Database>,)*
        {
            fn from_row(row: &'r R) -> Result<Self, sqlx::Error> {
                let mut column = 0usize..;
                let mut next = || column.next().expect("unbounded");
                $(let $field: $ty = row.try_get(next())?;)*
                Ok($name { $($field: $read),* })
            }
        }
    };
}

from_row_by_position!(ClaimState {
    id: i64 = id,
    done: i64 = done != 0,
    lease_left_ms: i64 = lease_left_ms,
    fence: i64 = fence,
    attempts: i64 = attempts,
});
from_row_by_position!(OpenClaimRow {
    key: String = key,
    fence: i64 = fence,
    attempts: i64 = attempts,
    age_ms: i64 = age_ms,
    lease_left_ms: i64 = lease_left_ms,
});
from_row_by_position!(ParkedRow {
    id: i64 = id,
    headers: String = headers,
    payload: Vec<u8> = payload,
});
from_row_by_position!(OutboxRow {
    id: i64 = id,
    msg_id: String = msg_id,
    subject: String = subject,
    order_key: String = order_key,
    headers: String = headers,
    payload: Vec<u8> = payload,
});
from_row_by_position!(FailedRow {
    id: i64 = id,
    msg_id: String = msg_id,
    subject: String = subject,
    order_key: String = order_key,
    error: String = error,
    failed_ms_ago: i64 = failed_ms_ago,
});
from_row_by_position!(IdSize {
    id: i64 = id,
    size: i64 = size,
});
from_row_by_position!(KeyId {
    key: String = key,
    id: i64 = id,
});
from_row_by_position!(Backlog {
    rows: i64 = rows,
    oldest_ms: i64 = oldest_ms,
});
