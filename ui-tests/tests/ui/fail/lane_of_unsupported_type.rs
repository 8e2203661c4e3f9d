use inbox_runtime::{Tx, idempotent};
use sqlx::Postgres;

// A lane names one row: a float is not one.
#[idempotent(consumer = "credit", key = msg.id, lane = msg.weight)]
async fn credit(msg: Credit, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
    let _ = (msg, tx);
    Ok(())
}

#[derive(serde::Deserialize)]
struct Credit {
    id: String,
    weight: f64,
}

fn main() {}
