use inbox_runtime::{Tx, idempotent};
use sqlx::Postgres;

#[idempotent(consumer = "credit", key = msg.id)]
async fn credit(msg: Credit, tx: &mut Tx<Postgres>) {
    let _ = (msg, tx);
}

include!("../uses_credit.rs");
