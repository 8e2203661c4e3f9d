use inbox_runtime::{
    Inbox, Outcome, ProcessError, Tx, Worker, WorkerBuilder, WorkerError, idempotent,
};
use sqlx::Postgres;

#[derive(serde::Deserialize)]
struct Credit {
    id: String,
}

#[idempotent(consumer = "credit", key = msg.id)]
async fn credit(msg: Credit, tx: &mut Tx<Postgres>) -> Result<u32, sqlx::Error> {
    let _ = (msg, tx);
    Ok(0)
}

// The handler used as a value and as a type: the mistake above is the only error.
fn worker(builder: WorkerBuilder<Postgres>) -> Result<Worker<credit>, WorkerError> {
    builder.build(credit)
}

async fn process(inbox: Inbox<Postgres>, msg: Credit) -> Result<Outcome, ProcessError> {
    inbox.process(&credit, &(), msg, None).await
}

fn main() {
    let _ = (worker, process);
}
