use inbox_runtime::{Tx, idempotent};
use sqlx::Postgres;

#[idempotent(consumer = "credit", key = msg.id, on_key_reuse = refuse)]
async fn credit(msg: Credit, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
    let _ = (msg, tx);
    Ok(())
}

#[derive(serde::Deserialize)]
struct Credit {
    id: String,
}

fn main() {}
