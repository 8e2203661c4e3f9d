//! `cargo xtask test`: with no options, what CI runs (services, formatting, lints, docs, every
//! test on the machine's nats-server and on a current one, batched, and a short chaos run); with
//! options, only the tests they select.

use crate::workspace::{cargo_step, cargo_step_with};
use crate::{nats_current, services};
use inbox_testkit::Backend;

/// What `cargo xtask test` was asked for.
pub enum Options {
    /// Nothing: CI's whole run.
    Everything,
    /// Only the tests these select.
    Only(Selection),
}

/// The tests `cargo xtask test` was asked to run.
pub struct Selection {
    /// Only this backend's tests: those named `<backend>::..`.
    pub db: Option<Backend>,
    /// Whether they run against a current nats-server instead of the machine's.
    pub current_nats: bool,
    /// Whether every worker of the behaviour suite is batched.
    pub batched: bool,
    /// Only the tests whose name contains one of these; with `db`, the start of the name after
    /// the backend.
    pub filters: Vec<String>,
}

/// `cargo xtask test [--db X] [--nats N] [--batched] [-- FILTER...]`: with none, services,
/// formatting, lints, every test, a short chaos run; with any, services and the selected tests
/// only.
pub async fn run(options: Options) -> Result<(), String> {
    let options = match options {
        Options::Everything => return everything().await,
        Options::Only(selection) => selection,
    };
    let (db, filters, batched) = (options.db, options.filters.as_slice(), options.batched);
    let current = options.current_nats;
    let backends = db.map_or(Backend::ALL.to_vec(), |b| vec![b]);
    services::ensure(&services::needed(&backends)).await?;
    // PostgreSQL's tests include those of its partitioned layout (`postgres_partitioned::`).
    let prefixes = |b: Backend| match b {
        Backend::Postgres => vec!["postgres".to_owned(), "postgres_partitioned".to_owned()],
        other => vec![other.name().to_owned()],
    };
    let filters: Vec<String> = match (db, filters) {
        (Some(b), []) => prefixes(b).iter().map(|p| format!("{p}::")).collect(),
        (Some(b), f) => prefixes(b)
            .iter()
            .flat_map(|p| f.iter().map(move |f| format!("{p}::{f}")))
            .collect(),
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

/// What CI runs: services, formatting, lints, docs, one build; then, as jobs two at a time
/// ([`crate::jobs`]): every test on the machine's nats-server, the behaviour suite batched, every
/// test but the macro's UI tests on a current release, and a short chaos run per backend on each
/// server.
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
    // The docs.rs page: the crate's README with every feature, no broken link.
    cargo_step_with(
        "docs",
        &[
            "doc",
            "--quiet",
            "--no-deps",
            "--all-features",
            "-p",
            "inbox-runtime",
            "-p",
            "inbox-macros",
        ],
        &[("RUSTDOCFLAGS", std::ffi::OsStr::new("-D warnings"))],
    )?;
    // Everything built once, up front; the jobs run what it built.
    let binaries = crate::jobs::build_tests()?;
    // The example binaries the chaos runs use are those the test build made for the examples'
    // process tests: a `cargo build -p inbox-examples` would unify features otherwise and build
    // much of the workspace again.
    let credit = test_built("credit")?;
    let email = test_built("email")?;
    // Installed once here, not by the jobs at once.
    nats_current::binary()?;
    crate::jobs::run_all(&binaries, credit, email).await
}

/// The binary `bin` that `cargo test --workspace --no-run` built (the process tests of the
/// examples need every binary of their package).
fn test_built(bin: &str) -> Result<std::path::PathBuf, String> {
    let path = crate::workspace::root().join("target/debug").join(bin);
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "the test build made no {}: the chaos runs need it",
            path.display()
        ))
    }
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

/// What batches every worker of the behaviour suite (8 messages per transaction): both modes
/// keep the same contract.
pub const BATCHED_ENV: (&str, &str) = ("INBOX_TEST_BATCH", "8");

/// Runs `cargo args` with every worker of the behaviour suite batched ([`BATCHED_ENV`]).
fn batched_tests(args: &[&str]) -> Result<(), String> {
    let (name, value) = BATCHED_ENV;
    cargo_step_with(
        "batched tests",
        args,
        &[(name, std::ffi::OsStr::new(value))],
    )
}

/// Runs `cargo args` against a current nats-server ([`nats_current::private_server`]).
async fn on_current_nats(args: &[&str]) -> Result<(), String> {
    let (server, env) = nats_current::private_server().await?;
    let what = format!("tests on nats-server {}", nats_current::VERSION);
    eprintln!("xtask: {what}, at {}", server.url);
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
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
