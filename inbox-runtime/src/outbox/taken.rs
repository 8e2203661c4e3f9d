//! Which of a pass's pending rows it loads and publishes: the oldest within its byte budget
//! (`within`), and each key's oldest pending row (`heads`), which holds back a key whose older
//! row the pass does not have.

use super::statements::OutboxStatements;
use crate::backend::{IdSize, InboxBackend, OutboxRow, RelayTurns};
use std::collections::HashMap;

/// The ids of the oldest of `sizes` whose bytes add up to at most `budget`, and always the first.
pub(super) fn within(sizes: &[IdSize], budget: u64) -> Vec<i64> {
    let mut total = 0u64;
    let mut ids = Vec::new();
    for row in sizes {
        total = total.saturating_add(u64::try_from(row.size).unwrap_or(0));
        if total > budget && !ids.is_empty() {
            break;
        }
        ids.push(row.id);
    }
    ids
}

/// Each key's smallest pending id up to the last of `rows` (pending, in id order). Where the pass
/// locks its rows: none, as usual, when a count (an index range; the grouping costs MariaDB a
/// temporary table on disk) finds no other; under a lease (nothing locked) one may be marked
/// meanwhile, so the grouping always runs.
pub(super) async fn heads<DB: InboxBackend>(
    conn: &mut DB::Connection,
    sql: &OutboxStatements,
    rows: &[OutboxRow],
) -> Result<HashMap<String, i64>, sqlx::Error> {
    let Some(last) = rows.last() else {
        return Ok(HashMap::new());
    };
    if DB::RELAY_TURNS == RelayTurns::SkipLocked {
        let pending = DB::outbox_pending_up_to(conn, sql.pending_up_to.clone(), last.id);
        if pending.await? <= rows.len() as i64 {
            return Ok(HashMap::new());
        }
    }
    let heads = DB::outbox_heads(conn, sql.heads.clone(), last.id).await?;
    Ok(heads.into_iter().map(|head| (head.key, head.id)).collect())
}
