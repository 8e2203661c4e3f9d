// Included by the fail tests after their handler `credit`: the message type, and the handler
// used as a value and as a type the way users use it, so that each test shows that its one
// mistake is the only error.

#[derive(serde::Deserialize)]
struct Credit {
    id: String,
}

type Db = sqlx::Postgres;

fn worker(
    builder: inbox_runtime::WorkerBuilder<Db>,
) -> Result<inbox_runtime::Worker<credit>, inbox_runtime::WorkerError> {
    builder.build(credit)
}

async fn process(
    inbox: inbox_runtime::Inbox<Db>,
    msg: Credit,
) -> Result<inbox_runtime::Outcome, inbox_runtime::ProcessError> {
    inbox
        .process(&credit, &(), msg, &inbox_runtime::Delivery::new("credits"))
        .await
}

fn main() {
    let _ = (worker, process);
}
