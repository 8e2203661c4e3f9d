//! `credit`: credits accounts from JetStream messages, exactly once per message id.
//!
//! Environment: `NATS_URL`, `DATABASE_URL`, `CREDIT_STREAM`, `CREDIT_SUBJECT`, `CREDIT_CONSUMER`,
//! `CREDIT_CONCURRENCY`, `CREDIT_BATCH`, `CREDIT_ACK`
//! (see `inbox_examples::Config`). Stops cleanly on SIGINT or SIGTERM.
//!
//! Never prints a credential: every log line, the final error and a panic's message are scrubbed
//! of the passwords and tokens in `NATS_URL` and `DATABASE_URL` (see `inbox_examples::redact`).

use inbox_examples::{Config, main_loop, run};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = match Config::from_env() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("credit: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let secrets = config.secrets();
    main_loop("credit", secrets, async |shutdown| {
        run(&config, shutdown).await
    })
    .await
}
