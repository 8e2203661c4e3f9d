#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(not(any(feature = "postgres", feature = "mysql", feature = "sqlite")))]
compile_error!(
    "inbox-runtime needs a database: enable at least one of its features `postgres`, `mysql`, `sqlite`"
);

// The layers, lowest first (ARCHITECTURE.md, "Layers"; `tests/layers.rs` fails on an import
// that goes up a layer or closes a circle): core (`error`, `key`, `lane`, `backoff`, `metrics`,
// `layout`, `wake`, `periodic`, `stored`, `supervise`), backend (`backend`), the handler contract (`delivery`, `handler`,
// `claim`), the store (`store`, `classify`), worker and outbox (`worker`, `outbox`), app (`app`).
mod app;
mod backend;
mod backoff;
mod claim;
mod classify;
mod delivery;
mod error;
mod handler;
mod key;
mod lane;
mod layout;
pub mod metrics;
mod outbox;
mod periodic;
mod replay;
mod store;
pub mod stored;
mod supervise;
mod wake;
mod worker;

pub use app::{App, AppError, AppStats, Durable, Health, HealthReport, recommended_consumer};
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use backend::sqlite_options;
pub use backend::{DEFAULT_LOCK_TIMEOUT, InboxBackend, InvalidTableName, TableName, is_transient};
pub use backoff::Backoff;
pub use claim::{Claim, DEFAULT_LEASE, OpenClaim, idempotency_key};
pub use classify::{ErrorClass, Permanent, Transient, classify};
#[cfg(feature = "cbor")]
#[cfg_attr(docsrs, doc(cfg(feature = "cbor")))]
pub use delivery::Cbor;
#[cfg(feature = "msgpack")]
#[cfg_attr(docsrs, doc(cfg(feature = "msgpack")))]
pub use delivery::MsgPack;
pub use delivery::{Codec, Delivery, Json, Raw, TraceParent};
pub use error::{BoxError, ProcessError, Stage};
pub use handler::{Handler, Outcome};
pub use key::{KeyError, MAX_KEY_LEN, ToMessageKey, validate_key};
pub use lane::{Lane, LaneOf};
pub use layout::Partitions;
#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub use outbox::Hook as RelayHook;
pub use outbox::{
    DEFAULT_RETENTION as DEFAULT_OUTBOX_RETENTION, InvalidMessage,
    MAX_HEADERS_LEN as MAX_OUTBOX_HEADERS_LEN, MAX_SUBJECT_LEN as MAX_OUTBOX_SUBJECT_LEN, Outbox,
    OutboxMessage, Relay, RelayError, RelayStats,
};
pub use replay::{REPLAY_CONSUMER, REPLAY_KEY};
pub use store::{CleanupError, Inbox, RetentionFloor, retention_floor};

/// The `sqlx` this crate is built with: name its types (`inbox_runtime::sqlx::PgPool`) without
/// a dependency of your own at exactly this version.
pub use sqlx;

/// The `async_nats` this crate is built with, for the same reason.
pub use async_nats;
pub use worker::{
    AckMode, BACKSTOP_ERROR, DEFAULT_DEADLINE, DEFAULT_DLQ_PREFIX, DEFAULT_DLQ_STREAM, NoState,
    Stats, UNREADABLE_HEADERS, Worker, WorkerBuilder, WorkerError, advisory_stream_name,
    process_delivery, transport_id,
};

/// Makes an `async fn` an idempotent message handler.
///
/// ```no_run
/// use inbox_runtime::{Tx, idempotent};
/// use sqlx::Postgres;
///
/// #[derive(serde::Deserialize)]
/// struct CreditRequested { id: String, account: i64, amount: i64 }
///
/// #[idempotent(consumer = "credit", key = msg.id)]
/// async fn credit(msg: CreditRequested, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
///     sqlx::query("UPDATE accounts SET balance = balance + $1 WHERE id = $2")
///         .bind(msg.amount)
///         .bind(msg.account)
///         .execute(&mut **tx)
///         .await?;
///     Ok(())
/// }
/// ```
///
/// - `consumer` (required): a non-empty string literal of at most 200 bytes and one NATS subject
///   token (no spaces, `.`, `*` or `>`), stored with every marker; handlers with different
///   consumer names dedup independently.
/// - `key` (optional): an expression over the arguments, evaluated on borrows of them before the
///   body runs; its value converts through [`ToMessageKey`] (strings, integers, `Uuid`). Without
///   it the transport id is the key: `Nats-Msg-Id` (unless empty), else
///   `"{stream}:{created}:{stream_sequence}"` through a worker, where `created` is the stream's
///   creation time in Unix nanoseconds (see [`transport_id`]); [`Inbox::process`], which has
///   no stream to ask, takes `Nats-Msg-Id` alone.
///
/// - `claim` (optional): a two-phase handler, for side effects outside the database (an e-mail,
///   a card charge, an HTTP call): it takes `claim: &mut Claim<DB>` in place of the transaction.
///   The key is claimed with a lease and committed before the body runs; the body performs the
///   side effect with [`Claim::idempotency_key`] while the lease is renewed, and writes what must
///   commit with "done" in [`Claim::tx`]; the claim is then marked done only if its fence still
///   holds. See [`Claim`].
///
/// The function takes the decoded message by value, the transaction as `&mut Tx<DB>` (or, with
/// `claim`, the claim as `&mut Claim<DB>`), and optionally a shared `&State` supplied once at
/// registration, in any order, and returns `Result<(), E>`. It becomes a unit struct of the same
/// name implementing [`Handler`].
pub use inbox_macros::idempotent;

/// The transaction a handler writes in: `&mut Tx<Postgres>` in a handler's signature.
pub type Tx<'c, DB> = sqlx::Transaction<'c, DB>;

pub use sqlx::Transaction;

/// Not public API: what the code generated by `#[idempotent]` refers to.
#[doc(hidden)]
pub mod __private {
    pub use crate::claim::Claim;
    pub use crate::error::BoxError;
    pub use crate::handler::{Handler, HandlerResult, ReturnsUnit};
    pub use sqlx::Transaction;

    pub use crate::delivery::{Delivery, Json};
    pub use crate::key::{KeyError, KeyOf};
    pub use crate::lane::{Lane, LaneOf};

    /// The lane expression's value.
    pub fn lane_of<L: LaneOf + ?Sized>(lane: &L) -> Option<Lane> {
        lane.lane_of()
    }

    /// The key expression's value as stored; `expr` is the expression as written.
    pub fn key_of<K: KeyOf + ?Sized>(key: &K, expr: &'static str) -> Result<String, KeyError> {
        key.key_of(expr)
    }
}
