use inbox_runtime::{Tx, idempotent};
use sqlx::Postgres;

#[derive(serde::Deserialize)]
struct Credit {
    id: String,
}

#[idempotent(consumer = "credit", key = msg.id)]
async fn credit(msg: Credit, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
    let _ = tx;
    let amount: i64 = msg.id;
    let _ = amount;
    Ok(())
}

fn main() {}
