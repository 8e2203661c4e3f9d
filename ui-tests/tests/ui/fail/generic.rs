use inbox_runtime::{Tx, idempotent};
use sqlx::Postgres;

#[derive(serde::Deserialize)]
struct Credit {
    id: String,
}

#[idempotent(consumer = "credit", key = msg.id)]
async fn credit<T>(msg: Credit, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
    let _ = (msg, tx);
    Ok(())
}

fn main() {}
