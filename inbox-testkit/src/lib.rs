//! The one test kit of the workspace, shared by the conformance suite (`inbox-tests`), the
//! `credit` example's process tests and `cargo xtask demo|chaos`:
//!
//! - [`PrivateNats`]: a `nats-server` of one's own (free port, temporary store) to kill and
//!   restart; [`connect`], [`publish_and_wait`] (or [`publish_acked`], keeping every PubAck),
//!   [`backlog`] for the JetStream side; [`publish_raw`], [`publish_raw_lines`] and
//!   [`publish_raw_acked`] over the wire protocol itself (header blocks no client library would
//!   write); [`PrivateCluster`], three of them routed into one JetStream cluster;
//! - [`CreditProcess`]: the `credit` binary as a child process, stopped with SIGTERM or SIGKILL,
//!   paused with SIGSTOP and resumed with SIGCONT, its summary line parsed into a [`Summary`];
//!   [`LastDeliveryHolds`]: what it holds on a last delivery, read from its log
//!   (`CREDIT_TEST_LAST_DELIVERY_HOLD_MS`);
//! - [`Database`]: a fresh PostgreSQL or MariaDB database or SQLite file, whose connections can
//!   be cut, removed when dropped;
//! - [`PrivatePostgres`]: a PostgreSQL of one's own (over TLS only, or in clear), and
//!   [`PrimaryStandby`]: a primary with a streaming standby, to kill the primary and promote the
//!   standby (failover);
//! - [`TcpProxy`]: a forwarder that can be cut, or switched to another server;
//! - [`wait_until`] and [`Poll`]: polling under a deadline (never a fixed sleep); [`throughout`]:
//!   what must hold all through a period; [`unique`]
//!   names.
//!
//! Errors are one style throughout: `Result<_, String>`, the message naming what failed (the
//! service, the address, the deadline). Tests `.expect()` them; xtask prints them.
//!
//! The services and their start commands are in the repository's `CONTRIBUTING.md`.

mod cluster;
mod credit;
mod db;
mod nats;
mod pg;
mod proxy;
mod raw;
mod sink;
mod wait;

pub use cluster::PrivateCluster;
pub use credit::{
    CreditConfig, CreditProcess, EmailConfig, LastDeliveryHolds, Summary, signal, terminate,
};
pub use db::{Backend, Database, remove_sqlite_files, with_database};
pub use nats::{
    Backlog, NATS_SERVER_ENV, Outgoing, PrivateNats, backlog, connect, consumer_ready,
    nats_server_binary, publish_acked, publish_and_wait,
};
pub use pg::{PrimaryStandby, PrivatePostgres, Replication};
pub use proxy::TcpProxy;
pub use raw::{publish_raw, publish_raw_acked, publish_raw_lines, publish_raw_status};
pub use sink::{Flaky, Sink, SinkCall, overlaps, why_again};
pub use wait::{Poll, throughout, wait_until};

use std::future::Future;

/// `prefix` followed by 12 random hex digits: names of databases, streams, consumers, files.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// Runs `fut` to completion on a runtime of its own on another thread: for cleanup from `Drop`,
/// which may run inside or outside a runtime.
pub fn off_runtime<F: Future<Output = ()> + Send + 'static>(fut: F) {
    let _ = std::thread::spawn(move || {
        if let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            runtime.block_on(fut)
        }
    })
    .join();
}
