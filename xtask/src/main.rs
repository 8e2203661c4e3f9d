//! Project tasks, run as `cargo xtask <task>` (matklad's xtask convention).

mod chaos;
mod demo;
mod nats;
mod services;

use std::process::ExitCode;

const HELP: &str = "\
usage: cargo xtask <task>

tasks:
  demo    publish a few thousand credits (many duplicated), consume them with two `credit`
          processes at once, and check that every balance is exact; SQLite under target/
          unless DATABASE_URL is set, and a private nats-server if none answers at NATS_URL
  chaos   [--db postgres|mysql|sqlite|all] [--messages N] [--release]
          exactly once under faults: three `credit` processes, one SIGKILLed every 2 s, the
          nats-server restarted once, every database connection cut once; prints a table and
          fails if anything was lost, applied twice, or not dead-lettered
  test    make sure NATS, PostgreSQL and MariaDB answer (starting them if they are down), check
          formatting and clippy, run every test in the workspace, then a short chaos run
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("demo") => demo::run(),
        Some("chaos") => chaos::run(&args[1..]),
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
    cargo_step("tests", &args)?;
    // The chaos run's shorter variant, on every backend.
    chaos::run(&[
        "--db".into(),
        "all".into(),
        "--messages".into(),
        "2000".into(),
    ])
}

/// The workspace's root directory.
fn workspace_root() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_owned()
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
