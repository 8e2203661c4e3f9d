use inbox_runtime::{BoxError, Claim, idempotent};
use sqlx::Postgres;

// A two-phase claim keeps no payload hash: key reuse cannot be told.
#[idempotent(consumer = "email", key = msg.id, claim, on_key_reuse = reject)]
async fn send(msg: Email, claim: &mut Claim<Postgres>) -> Result<(), BoxError> {
    let _ = (msg, claim);
    Ok(())
}

#[derive(serde::Deserialize)]
struct Email {
    id: String,
}

fn main() {}
