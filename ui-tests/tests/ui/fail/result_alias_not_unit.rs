use inbox_runtime::{Tx, idempotent};
use sqlx::Postgres;

#[idempotent(consumer = "credit", key = msg.id)]
async fn credit(msg: Credit, tx: &mut Tx<Postgres>) -> std::io::Result<u32> {
    let _ = (msg, tx);
    Ok(0)
}

include!("../uses_credit.rs");
