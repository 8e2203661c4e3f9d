//! `email`: sends requested e-mails through an HTTP API, one call per message id (two-phase
//! claims: see `inbox_examples::email`).
//!
//! Environment: `NATS_URL`, `DATABASE_URL`, `EMAIL_STREAM`, `EMAIL_SUBJECT`, `EMAIL_CONSUMER`,
//! `EMAIL_API_URL`, `EMAIL_LEASE_MS`, `EMAIL_CONCURRENCY` (see
//! `inbox_examples::email::EmailConfig`). Stops cleanly on SIGINT or SIGTERM and prints
//! `email stopped: applied=N skipped=N nacked=N terminated=N`.

use inbox_examples::email::{EmailConfig, run};
use inbox_examples::main_loop;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = match EmailConfig::from_env() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("email: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let secrets = config.secrets();
    main_loop("email", secrets, async |shutdown| {
        run(&config, shutdown).await
    })
    .await
}
