use inbox_runtime::{BoxError, Claim, idempotent};
use sqlx::Postgres;

#[idempotent(consumer = "email", key = msg.id)]
async fn credit(msg: Credit, claim: &mut Claim<Postgres>) -> Result<(), BoxError> {
    let _ = (msg, claim);
    Ok(())
}

include!("../uses_credit.rs");
