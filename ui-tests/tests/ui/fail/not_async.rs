use inbox_runtime::{Tx, idempotent};
use sqlx::Postgres;

#[idempotent(consumer = "credit", key = msg.id)]
fn credit(msg: Credit, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
    let _ = (msg, tx);
    Ok(())
}

include!("../uses_credit.rs");
