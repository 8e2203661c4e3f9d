//! Project tasks, run as `cargo xtask <task>` (matklad's xtask convention).

mod demo;
mod services;

use std::process::ExitCode;

const HELP: &str = "\
usage: cargo xtask <task>

tasks:
  demo    publish a few thousand credits (many duplicated), consume them with two `credit`
          processes at once, and check that every balance is exact; SQLite under target/
          unless DATABASE_URL is set, and a private nats-server if none answers at NATS_URL
  test    make sure NATS, PostgreSQL and MariaDB answer (starting them if they are down), check
          formatting and clippy, then run every test in the workspace
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("demo") => demo::run(),
        Some("test") => test(&args[1..]),
        Some("help" | "-h" | "--help") | None => {
            print!("{HELP}");
            return ExitCode::SUCCESS;
        }
        Some(other) => Err(format!("unknown task `{other}`\n\n{HELP}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `cargo xtask test [extra cargo test args]`: services, formatting, lints, then every test.
fn test(extra: &[String]) -> Result<(), String> {
    services::ensure(&[services::POSTGRES, services::MARIADB, services::NATS])?;
    cargo_step("formatting", &["fmt", "--all", "--", "--check"])?;
    cargo_step(
        "clippy",
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--quiet",
            "--",
            "-D",
            "warnings",
        ],
    )?;
    let mut args = vec!["test", "--workspace"];
    args.extend(extra.iter().map(String::as_str));
    cargo_step("tests", &args)
}

/// Runs `cargo args`, failing with `what` when it fails.
fn cargo_step(what: &str, args: &[&str]) -> Result<(), String> {
    eprintln!("xtask: cargo {}", args.join(" "));
    let status = std::process::Command::new(cargo())
        .args(args)
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({status})"))
    }
}

/// The cargo that runs us.
fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}
