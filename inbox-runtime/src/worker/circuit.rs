//! The database circuit: when a delivery fails because the database cannot be reached (a lost
//! connection, a pool that cannot connect), the failure is the same for every message, and
//! redelivering would only spend deliveries until healthy messages reach `max_deliver` and are
//! dead-lettered. So the circuit opens: the worker stops pulling, and the deliveries it holds
//! wait for the database (with progress acks, spending no delivery), each retry being the probe.
//! The first answer from the database closes it.

use tokio::sync::watch;

/// Open while the database is unreachable.
#[derive(Debug)]
pub(super) struct Circuit {
    open: watch::Sender<bool>,
}

impl Default for Circuit {
    fn default() -> Self {
        Circuit {
            open: watch::Sender::new(false),
        }
    }
}

impl Circuit {
    /// The database could not be reached, with `error`: stop pulling.
    pub(super) fn trip(&self, error: &dyn std::fmt::Display) {
        self.open.send_if_modified(|open| {
            let opened = !*open;
            if opened {
                tracing::warn!(%error, "database unreachable: pulling paused, held messages wait for it");
            }
            *open = true;
            opened
        });
    }

    /// The database answered: pull again.
    pub(super) fn close(&self) {
        self.open.send_if_modified(|open| {
            let closed = *open;
            if closed {
                tracing::info!("database reachable again: pulling resumed");
            }
            *open = false;
            closed
        });
    }

    /// Whether the circuit is open (the database unreachable).
    pub(super) fn is_open(&self) -> bool {
        *self.open.borrow()
    }

    /// Waits until the circuit is closed.
    pub(super) async fn closed(&self) {
        let mut open = self.open.subscribe();
        // The sender lives as long as the circuit, which outlives this borrow.
        let _ = open.wait_for(|open| !*open).await;
    }
}
