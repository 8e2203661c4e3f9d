use inbox_runtime::{Tx, idempotent};
use sqlx::Postgres;

// A composite key must be made a string: `format!("{}:{}", msg.tenant, msg.id)`.
#[idempotent(consumer = "credit", key = (msg.tenant, msg.seq))]
async fn credit(msg: Credit, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
    let _ = (msg, tx);
    Ok(())
}

#[derive(serde::Deserialize)]
struct Credit {
    tenant: u32,
    seq: u64,
}

fn main() {}
