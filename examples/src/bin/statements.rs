//! `statements`: the second link of the demo's chain. Reads the `CreditApplied` events `credit`
//! publishes through its outbox and writes one statement line per applied credit, exactly once
//! per event id, on an `inbox_runtime::App` that drains on SIGINT or SIGTERM.
//!
//! Environment: `NATS_URL`, `DATABASE_URL` (`postgres://`, `mysql://`, `sqlite://`),
//! `STATEMENTS_STREAM`, `STATEMENTS_SUBJECT`, `STATEMENTS_CONSUMER`, `STATEMENTS_POOL` (see
//! `inbox_examples::statements::StatementsConfig`). Prints
//! `statements stopped: applied=N skipped=N nacked=N terminated=N` when it stops.

use inbox_examples::init_logs;
use inbox_examples::orders::total;
use inbox_examples::statements::{StatementsConfig, run};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = match StatementsConfig::from_env() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("statements: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let secrets = config.secrets();
    init_logs("statements", &secrets);
    // Signals are the App's once it runs; start-up waits for the services until they answer.
    match run(&config, CancellationToken::new()).await {
        Ok(stats) => {
            let all = total(&stats);
            println!(
                "statements stopped: applied={} skipped={} nacked={} terminated={}",
                all.acked, all.skipped, all.nacked, all.terminated
            );
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("statements: {}", secrets.scrub(&e.to_string()));
            std::process::ExitCode::FAILURE
        }
    }
}
