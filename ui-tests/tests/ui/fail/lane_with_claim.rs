use inbox_runtime::{BoxError, Claim, idempotent};
use sqlx::Postgres;

// Two-phase handlers are never batched: a lane would order nothing.
#[idempotent(consumer = "email", key = msg.id, lane = msg.account, claim)]
async fn credit(msg: Credit, claim: &mut Claim<Postgres>) -> Result<(), BoxError> {
    let _ = (msg, claim);
    Ok(())
}

#[derive(serde::Deserialize)]
struct Credit {
    id: String,
    account: i64,
}

fn main() {}
