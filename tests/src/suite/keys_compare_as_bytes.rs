//! A key means the same bytes on every backend: keys that differ only by trailing spaces, by
//! case, or by Unicode normalisation are different messages.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Entry, Probe};
use inbox_runtime::Outcome;

/// MariaDB's `utf8mb4_bin` is a PAD SPACE collation: `"k"` and `"k "` were one key in the UNIQUE
/// index (`Duplicate entry 'k '`), so the second message was skipped as a duplicate and its
/// effect lost.
async fn repro_keys_differing_by_trailing_spaces_collide<B: TestBackend>() {
    let (db, inbox) = setup::<B>(2).await;
    let probe = Probe::open();
    let ledger = B::Ledger::default();
    let keys = ["k", "k ", "k  ", "K", "\u{e9}", "e\u{301}"];
    for key in keys {
        let outcome = inbox
            .process(
                &ledger,
                &probe,
                Entry::new(key, 1, 1),
                &inbox_runtime::Delivery::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("{key:?}: {e}"));
        assert_eq!(outcome, Outcome::Ack, "{key:?} was taken for another key");
    }
    for key in keys {
        let outcome = inbox
            .process(
                &ledger,
                &probe,
                Entry::new(key, 1, 1),
                &inbox_runtime::Delivery::default(),
            )
            .await
            .unwrap();
        assert_eq!(outcome, Outcome::Skip, "{key:?} again");
    }
    assert_eq!(probe.runs(), keys.len());
    let markers = B::count(&db, "SELECT count(*) FROM inbox").await;
    assert_eq!(markers, keys.len() as i64);
}

super::behaviours!(
    partitioned_too;
    repro_keys_differing_by_trailing_spaces_collide);
