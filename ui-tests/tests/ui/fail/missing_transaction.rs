use inbox_runtime::idempotent;

#[derive(serde::Deserialize)]
struct Credit {
    id: String,
}

#[idempotent(consumer = "credit", key = msg.id)]
async fn credit(msg: Credit) -> Result<(), sqlx::Error> {
    let _ = msg;
    Ok(())
}

fn main() {}
