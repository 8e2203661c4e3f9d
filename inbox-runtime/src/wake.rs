//! Wake-ups after a transaction: code that writes something a background task should pick up
//! (an outbox row, for its relay) names that task's [`Notify`] while the work runs; the store runs
//! each message's work in a [`scope`] that notifies them all once it has ended, commit included.
//! The store knows nothing of who is woken, and the writer nothing of when its transaction ends.

use std::cell::RefCell;
use std::future::Future;
use std::sync::Arc;
use tokio::sync::Notify;

tokio::task_local! {
    /// The tasks to wake once the work running in this task's scope ends.
    static WRITTEN: RefCell<Vec<Arc<Notify>>>;
}

/// Notes that the work of the current task's [`scope`] wrote something for the task behind
/// `wake`; nothing outside a scope (the caller's own transaction: it wakes its relay itself).
pub(crate) fn after_scope(wake: &Arc<Notify>) {
    let _ = WRITTEN.try_with(|w| {
        let mut w = w.borrow_mut();
        if !w.iter().any(|n| Arc::ptr_eq(n, wake)) {
            w.push(Arc::clone(wake));
        }
    });
}

/// Runs `work` (a message's or a batch's processing, commit included) and then wakes every task
/// noted with [`after_scope`] on the way. Woken after a rollback too: a relay then finds nothing,
/// which costs one query.
pub(crate) async fn scope<T>(work: impl Future<Output = T>) -> T {
    let (out, written) = WRITTEN
        .scope(RefCell::new(Vec::new()), async {
            let out = work.await;
            (out, WRITTEN.with(|w| std::mem::take(&mut *w.borrow_mut())))
        })
        .await;
    for wake in written {
        wake.notify_one();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_scope_wakes_each_task_written_for_once() {
        let (a, b) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        scope(async {
            after_scope(&a);
            after_scope(&a);
            after_scope(&b);
        })
        .await;
        // A permit each: both are woken now, without waiting.
        tokio::time::timeout(std::time::Duration::from_secs(1), a.notified())
            .await
            .unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(1), b.notified())
            .await
            .unwrap();
        // Outside a scope, nothing is recorded (and nothing panics).
        after_scope(&a);
    }
}
