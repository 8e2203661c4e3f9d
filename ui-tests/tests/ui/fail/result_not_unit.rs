use inbox_runtime::{Tx, idempotent};
use sqlx::Postgres;

#[idempotent(consumer = "credit", key = msg.id)]
async fn credit(msg: Credit, tx: &mut Tx<Postgres>) -> Result<u32, sqlx::Error> {
    let _ = (msg, tx);
    Ok(0)
}

include!("../uses_credit.rs");
