//! The periodic loop of the runtime's background tasks (cleanup, partitions ahead, the sweep of
//! open claims, parked dead letters): a tick every period, the first at once, until shutdown.

use std::time::Duration;
use tokio::time::Interval;
use tokio_util::sync::CancellationToken;

/// Ticks every `period` until `shutdown` is cancelled:
/// `while every.tick().await { one pass }`.
pub(crate) struct Every {
    ticks: Interval,
    shutdown: CancellationToken,
}

impl Every {
    /// Ticks every `period` (the first tick at once) until `shutdown`.
    pub(crate) fn new(period: Duration, shutdown: CancellationToken) -> Self {
        Every {
            ticks: tokio::time::interval(period),
            shutdown,
        }
    }

    /// Waits for the next tick: `true` to run a pass, `false` once shutdown is asked for.
    pub(crate) async fn tick(&mut self) -> bool {
        tokio::select! {
            _ = self.shutdown.cancelled() => false,
            _ = self.ticks.tick() => true,
        }
    }
}
