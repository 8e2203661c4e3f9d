//! The `credit` example: a consumer that credits accounts exactly once per message and announces
//! each credit through its transactional outbox; the `statements` example ([`statements`]),
//! which consumes those announcements with an inbox of its own; the `email` example
//! ([`email`]): a two-phase consumer that calls an HTTP API once per message; and `orders`.
//!
//! The binaries in `src/bin/` are thin `main`s over [`run`] and [`email::run`], configured from
//! the environment (see [`Config::from_env`], [`email::EmailConfig::from_env`]).

mod balances;
mod config;
mod credit;
#[cfg(feature = "email")]
pub mod email;
mod observe;
pub mod orders;
pub mod redact;
mod startup;
pub mod statements;

pub use balances::*;
pub use config::NatsAuth;
pub(crate) use config::Vars;
pub use credit::*;

use inbox_runtime::Stats;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How long markers are kept once their message has left the stream (cleanup counts it back from
/// the oldest message still stored): above the floor of the consumer and stream credit creates
/// (ack_wait 30 s × max_deliver 10 + the stream's duplicate window + a 1 h margin), with room to
/// replay a dead letter by hand within a week.
pub const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The `max_age` of the streams the examples create when missing: messages are kept three days,
/// and their markers three days plus [`RETENTION`]. A stream that exists already is used as it
/// is, one without `max_age` (the `nats stream add` default) included: its markers are then kept
/// as long as its messages.
pub const MAX_AGE: Duration = Duration::from_secs(3 * 24 * 3600);

/// Why the example could not start.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// Logs (scrubbed of `secrets`) to stderr at `RUST_LOG` (default `info`), in colour only on a
/// terminal without `NO_COLOR`, and a panic's message scrubbed too, for the example binary
/// `name`.
pub fn init_logs(name: &'static str, secrets: &redact::Secrets) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    // Colours for a terminal only: a file, a pipe or a log collector gets plain text.
    let colour = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    tracing_subscriber::fmt()
        .with_ansi(colour)
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(redact::ScrubbedStderr::new(secrets.clone()))
        .init();
    let on_panic = secrets.clone();
    std::panic::set_hook(Box::new(move |panic| {
        eprintln!("{name}: {}", on_panic.scrub(&panic.to_string()));
    }));
}

/// The `main` of an example binary named `name`: logs (scrubbed of `secrets`) to stderr at
/// `RUST_LOG` (default `info`), a panic's message scrubbed too, SIGINT and SIGTERM cancelling the
/// token `consume` runs until, and on success one machine-readable line on stdout for scripts
/// such as `cargo xtask demo`: `<name> stopped: applied=N skipped=N nacked=N terminated=N`,
/// followed by ` conflicts=N batch_retries=N` when batches met conflicts.
pub async fn main_loop(
    name: &'static str,
    secrets: redact::Secrets,
    consume: impl AsyncFnOnce(CancellationToken) -> Result<Stats, Error>,
) -> std::process::ExitCode {
    use tokio::signal::unix::{SignalKind, signal};
    init_logs(name, &secrets);

    let shutdown = CancellationToken::new();
    let on_signal = shutdown.clone();
    let (mut term, mut int) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(t), Ok(i)) => (t, i),
        _ => {
            eprintln!("{name}: cannot install signal handlers");
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

    match consume(shutdown).await {
        Ok(stats) => {
            // Batched runs that met conflicts say so (`cargo xtask bench` reads them).
            let conflicts = match stats.conflicts {
                0 => String::new(),
                n => format!(" conflicts={n} batch_retries={}", stats.batch_retries),
            };
            println!(
                "{name} stopped: applied={} skipped={} nacked={} terminated={}{conflicts}",
                stats.acked, stats.skipped, stats.nacked, stats.terminated
            );
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{name}: {}", secrets.scrub(&e.to_string()));
            std::process::ExitCode::FAILURE
        }
    }
}
