//! Whether an [`App`](super::App) can do its work, for a probe.

use futures::future::BoxFuture;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Whether an [`App`](crate::App) can do its work: NATS connected, the database answering, every handler's
/// worker running. Cheap to clone; take it with [`App::health`](crate::App::health) before running the app, and
/// serve [`Health::check`] on a probe (`/healthz`), as the examples do.
#[derive(Clone)]
pub struct Health {
    pub(super) inner: Arc<HealthInner>,
}

pub(super) struct HealthInner {
    pub(super) nats: async_nats::Client,
    /// The handlers' own connections (`App::pull_connections`), once opened.
    pub(super) pulls: std::sync::Mutex<Vec<async_nats::Client>>,
    pub(super) database: Box<dyn Fn() -> BoxFuture<'static, bool> + Send + Sync>,
    /// Workers registered, and running now.
    pub(super) workers: AtomicUsize,
    pub(super) running: AtomicUsize,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("workers", &self.inner.workers.load(Ordering::Relaxed))
            .field("running", &self.inner.running.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// What [`Health::check`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct HealthReport {
    /// The NATS connection is up, and so is every handler's own connection: each answers a
    /// flush within 2 s (a connection whose reader died, as async-nats's does on a header value
    /// with a bare CR, never does: the probe failing restarts the process).
    pub nats: bool,
    /// The database answered a ping, on a connection of its own (the pool's may all be busy),
    /// within 5 s.
    pub database: bool,
    /// Handlers registered.
    pub workers: usize,
    /// Handlers whose worker is running.
    pub running: usize,
}

impl HealthReport {
    /// Everything is up and every worker runs.
    pub fn healthy(&self) -> bool {
        self.nats && self.database && self.workers > 0 && self.running == self.workers
    }
}

impl Health {
    /// Looks now: pings the database (at most 5 s), reads the NATS connection's state and
    /// flushes each handler's own connection (at most 2 s).
    pub async fn check(&self) -> HealthReport {
        let pulls = self.inner.pulls.lock().expect("the pulls lock").clone();
        let answers = pulls.iter().map(|client| async move {
            let flushed = tokio::time::timeout(Duration::from_secs(2), client.flush()).await;
            matches!(flushed, Ok(Ok(())))
        });
        let pulls_up = futures::future::join_all(answers)
            .await
            .into_iter()
            .all(|up| up);
        let nats = pulls_up
            && self.inner.nats.connection_state() == async_nats::connection::State::Connected;
        let database = (self.inner.database)().await;
        HealthReport {
            nats,
            database,
            workers: self.inner.workers.load(Ordering::Relaxed),
            running: self.inner.running.load(Ordering::Relaxed),
        }
    }
}
