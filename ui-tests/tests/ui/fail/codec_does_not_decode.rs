use inbox_runtime::{Raw, Tx, idempotent};
use sqlx::Postgres;

// `Raw` gives the payload's bytes, not a struct: the codec must decode into the message type.
#[idempotent(consumer = "credit", key = msg.id, codec = Raw)]
async fn credit(msg: Credit, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
    let _ = (msg, tx);
    Ok(())
}

#[derive(serde::Deserialize)]
struct Credit {
    id: String,
}

fn main() {}
