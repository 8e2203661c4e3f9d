//! `cargo xtask chaos`: exactly-once under faults, for a user to run, audited message by message.
//!
//! Per backend, the `credit` run (`credit.rs`), then the `email` run of two-phase claims
//! (`email.rs`). Instead of them, `--cluster` runs the `credit` run on a 3-node JetStream
//! cluster (`cluster.rs`) and `--failover` across a database failover (`failover.rs`).
//!
//! The modules build on each other in one direction: `streams` (names, the consumer's settings,
//! reading a stream back) and `db` at the bottom; `publish`, `observe`, `faults` above them;
//! `audit` over what was published and observed; `report` over the audit; the runs on top. This
//! file only says which runs to make and prints how they ended.

mod audit;
pub mod cluster;
mod credit;
mod db;
mod email;
pub mod failover;
mod faults;
mod observe;
mod publish;
mod report;
mod setup;
mod streams;

use inbox_testkit::Backend;
use report::Report;
pub use setup::Common;
use std::path::Path;
use streams::EVENTS_STREAM;

/// What `cargo xtask chaos` was asked for.
pub struct Options {
    /// What every chaos run is asked for (the email run gets a tenth of the requests, at least
    /// 100).
    pub common: Common,
    /// Whether the `credit` run is made.
    pub credit: bool,
    /// Whether the `email` run is made.
    pub email: bool,
}

impl Options {
    /// The short run `cargo xtask test` ends with: every backend, 2,000 requests, debug build.
    pub fn short() -> Options {
        Options {
            common: Common {
                backends: Backend::ALL.to_vec(),
                messages: 2_000,
                release: false,
                current_nats: false,
            },
            credit: true,
            email: true,
        }
    }
}

/// Runs chaos on each backend asked for and prints the table.
pub async fn run(options: Options) -> Result<(), String> {
    let credit = crate::workspace::build_credit(options.common.release)?;
    let email = crate::workspace::build_example("email", options.common.release)?;
    run_with(options, &credit, &email).await
}

/// [`run`] with the `credit` and `email` binaries already built.
pub async fn run_with(options: Options, credit: &Path, email: &Path) -> Result<(), String> {
    let setup = setup::prepare(options.common.current_nats)?;
    let version = setup.version;
    let mut rows = Vec::new();
    let mut email_reports = Vec::new();
    for &backend in &options.common.backends {
        let n = options.common.messages;
        if options.credit {
            println!(
                "\n== chaos on {} ({n} requests, nats-server {version})",
                backend.name()
            );
            let binaries = (credit, setup.nats_server.as_path());
            rows.push(credit::run(backend, n, binaries, &setup.logs).await?);
        }
        if !options.email {
            continue;
        }
        let emails = (n / 10).max(100);
        println!(
            "\n== chaos, email (two-phase claims), on {} ({emails} requests, nats-server {version})",
            backend.name()
        );
        let binaries = (email, setup.nats_server.as_path());
        email_reports.push(email::run(backend, emails, binaries, &setup.logs).await?);
    }
    for r in &email_reports {
        r.print();
    }
    let emails_failed = email_reports.iter().filter(|r| !r.ok()).count();

    let report = Report {
        columns: credit::COLUMNS,
        rows,
    };
    if !report.rows.is_empty() {
        report.print_table();
        println!(
            "(applied once: request ids whose balance is 1 with a committed marker; announced: of \
             them, those with exactly one event in {EVENTS_STREAM} (and no event for anything \
             else); dead: messages to reject with exactly one letter; backstop: letters the \
             delivery-limit backstop wrote; lost: stream sequences neither applied nor \
             dead-lettered; kills: SIGKILLs (of them while the process held a message on its \
             last delivery); dlq rej.: letter publishes the dead-letter stream rejected (of them \
             on a last delivery); skipped, by the processes that stopped cleanly: {})",
            report.skipped()
        );
    }
    report.print_failures();
    let failed = report.failed();
    println!(
        "chaos: {} passed, {failed} failed; email: {} passed, {emails_failed} failed",
        report.rows.len() - failed,
        email_reports.len() - emails_failed
    );
    if failed == 0 && emails_failed == 0 {
        println!(
            "\nexactly once under faults, message by message: every stream sequence applied or \
             dead-lettered, every request applied once and announced once, every rejected \
             message (unreadable headers and deaths on a last delivery included) dead-lettered \
             once (and never announced), nothing else; every e-mail done or dead-lettered, \
             called under one idempotency key, never twice at once."
        );
        Ok(())
    } else {
        Err("chaos run FAILED: see the findings above".into())
    }
}
