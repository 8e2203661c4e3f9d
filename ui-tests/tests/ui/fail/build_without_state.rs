use inbox_runtime::{Tx, idempotent};
use sqlx::Postgres;

struct Rates {
    factor: i64,
}

#[idempotent(consumer = "credit", key = msg.id)]
async fn credit(msg: Credit, rates: &Rates, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
    let _ = (msg, rates.factor, tx);
    Ok(())
}

#[derive(serde::Deserialize)]
struct Credit {
    id: String,
}

// A handler with state is built with its state: `build_with_state(credit, rates)`.
fn worker(
    builder: inbox_runtime::WorkerBuilder<sqlx::Postgres>,
) -> Result<inbox_runtime::Worker<credit>, inbox_runtime::WorkerError> {
    builder.build(credit)
}

fn main() {
    let _ = worker;
}
