//! `orders`: two handlers (`orders`, keyed on the payload's integer `order_id`, and `inventory`,
//! keyed on the `Idempotency-Key` header) in one process, on one `inbox_runtime::App`, which
//! drains both on SIGINT or SIGTERM.
//!
//! Environment: `NATS_URL`, `DATABASE_URL` (`postgres://`, `mysql://`, `sqlite://`), `ORDERS_STREAM`,
//! `ORDERS_SUBJECT_PREFIX`, `ORDERS_POOL` (see `inbox_examples::orders::OrdersConfig`). Prints
//! `orders stopped: applied=N skipped=N nacked=N terminated=N` (both handlers together) when it
//! stops, after one `orders handler <consumer>: ...` line each.

use inbox_examples::init_logs;
use inbox_examples::orders::{OrdersConfig, run, total};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = match OrdersConfig::from_env() {
        Ok(config) => config,
        Err(e) => {
            eprintln!("orders: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let secrets = config.secrets();
    init_logs("orders", &secrets);
    // Signals are the App's once it runs; start-up waits for the services until they answer.
    match run(&config, CancellationToken::new()).await {
        Ok(stats) => {
            for (consumer, s) in &stats {
                println!(
                    "orders handler {consumer}: applied={} skipped={} nacked={} terminated={}",
                    s.acked, s.skipped, s.nacked, s.terminated
                );
            }
            let all = total(&stats);
            println!(
                "orders stopped: applied={} skipped={} nacked={} terminated={}",
                all.acked, all.skipped, all.nacked, all.terminated
            );
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("orders: {}", secrets.scrub(&e.to_string()));
            std::process::ExitCode::FAILURE
        }
    }
}
