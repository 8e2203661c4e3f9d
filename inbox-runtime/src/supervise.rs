//! Background tasks that outlive a panic: each runs on a tokio task of its own, and a panic is
//! logged, counted and followed by a fresh start (after a capped backoff) rather than ending the
//! task for good, or taking down the future that joins it (an App's workers).

use crate::backoff::Backoff;
use std::any::Any;
use std::future::Future;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

/// Runs `start()` on a task of its own until it returns, and returns what it returned. A panic
/// is logged (naming `task`) and counted (`inbox_task_panics_total`), and `start()` runs again
/// after a pause that grows to 30 s; once `shutdown` is cancelled a panicked task is not started
/// again, and `None` is returned.
pub(crate) async fn supervised<F, Fut>(
    task: &'static str,
    shutdown: &CancellationToken,
    mut start: F,
) -> Option<Fut::Output>
where
    F: FnMut() -> Fut,
    Fut: Future + Send + 'static,
    Fut::Output: Send + 'static,
{
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(30));
    loop {
        // Aborted if this future is dropped (an App's run dropped by its caller): the task
        // never outlives what supervises it.
        let running = AbortOnDropHandle::new(tokio::spawn(start()));
        match running.await {
            Ok(done) => return Some(done),
            Err(e) if e.is_panic() => {
                let why = panic_text(&*e.into_panic());
                crate::metrics::task_panicked(task);
                if shutdown.is_cancelled() {
                    tracing::error!(task, panic = %why, "background task panicked while stopping; not started again");
                    return None;
                }
                let wait = backoff.next();
                tracing::error!(task, panic = %why, restart_in = ?wait, "background task panicked; starting it again");
                tokio::select! {
                    _ = shutdown.cancelled() => return None,
                    _ = tokio::time::sleep(wait) => {}
                }
            }
            // Cancelled: only a runtime shutting down cancels it.
            Err(_) => return None,
        }
    }
}

/// What a panic said, when it said it with a string.
pub(crate) fn panic_text(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_owned())
}
