//! `credit`: credits accounts from JetStream messages, exactly once per message id.
//!
//! Environment: `NATS_URL`, `DATABASE_URL`, `CREDIT_STREAM`, `CREDIT_SUBJECT`, `CREDIT_CONSUMER`,
//! `CREDIT_CONCURRENCY`, `CREDIT_BATCH`, `CREDIT_ACK`
//! (see `inbox_examples::Config`). Stops cleanly on SIGINT or SIGTERM.
//!
//! Never prints a credential: every log line, the final error and a panic's message are scrubbed
//! of the passwords and tokens in `NATS_URL` and `DATABASE_URL` (see `inbox_examples::redact`).

use inbox_examples::redact::ScrubbedStderr;
use inbox_examples::{Config, run};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

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
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(ScrubbedStderr::new(secrets.clone()))
        .init();
    let on_panic = secrets.clone();
    std::panic::set_hook(Box::new(move |panic| {
        eprintln!("credit: {}", on_panic.scrub(&panic.to_string()));
    }));

    let shutdown = CancellationToken::new();
    let on_signal = shutdown.clone();
    let (mut term, mut int) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(t), Ok(i)) => (t, i),
        _ => {
            eprintln!("credit: cannot install signal handlers");
            return std::process::ExitCode::FAILURE;
        }
    };
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::info!("signal received; stopping");
        on_signal.cancel();
    });

    match run(&config, shutdown).await {
        Ok(stats) => {
            // One machine-readable line for scripts such as `cargo xtask demo`.
            println!(
                "credit stopped: applied={} skipped={} nacked={} terminated={}",
                stats.acked, stats.skipped, stats.nacked, stats.terminated
            );
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("credit: {}", secrets.scrub(&e.to_string()));
            std::process::ExitCode::FAILURE
        }
    }
}
