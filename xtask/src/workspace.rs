//! The workspace and its cargo: where it lives, running cargo in it, building an example.
//!
//! Kept apart from `main.rs` so that every task can use it without importing the crate root,
//! which imports the tasks.

use std::ffi::OsStr;
use std::path::PathBuf;

/// The workspace's root directory.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_owned()
}

/// Runs `cargo args`, failing with `what` when it fails.
pub fn cargo_step(what: &str, args: &[&str]) -> Result<(), String> {
    cargo_step_with(what, args, &[])
}

/// [`cargo_step`] with `env` set for cargo and what it runs.
pub fn cargo_step_with(what: &str, args: &[&str], env: &[(&str, &OsStr)]) -> Result<(), String> {
    eprintln!("xtask: cargo {}", args.join(" "));
    let status = cargo_command(args)
        .envs(env.iter().copied())
        .status()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{what} failed ({status})"))
    }
}

/// Runs `cargo args` and returns what it printed on stdout (its messages go to stderr as they
/// come), failing with `what` when it fails.
pub fn cargo_output(what: &str, args: &[&str]) -> Result<String, String> {
    eprintln!("xtask: cargo {}", args.join(" "));
    let output = cargo_command(args)
        .stderr(std::process::Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run cargo: {e}"))?;
    if output.status.success() {
        String::from_utf8(output.stdout).map_err(|e| format!("{what}: cargo printed {e}"))
    } else {
        Err(format!("{what} failed ({})", output.status))
    }
}

/// `cargo args` in the workspace's root, without the variables `cargo run` set for xtask.
fn cargo_command(args: &[&str]) -> std::process::Command {
    let mut command = std::process::Command::new(cargo());
    without_cargos_own_env(&mut command);
    command.args(args).current_dir(root());
    command
}

/// Removes from `command`'s environment what `cargo run` set for xtask itself (its package's
/// name, version and manifest): that is not the caller's environment. Build scripts that watch
/// such a variable (ring's watches CARGO_PKG_NAME, CARGO_MANIFEST_DIR and OUT_DIR) would find it
/// changed since `cargo xtask` built xtask, and ring, rustls, async-nats and sqlx would be
/// compiled again.
pub fn without_cargos_own_env(command: &mut std::process::Command) {
    for (name, _) in std::env::vars_os() {
        let watched = name.to_str().is_some_and(|n| {
            n.starts_with("CARGO_PKG_")
                || matches!(
                    n,
                    "CARGO_MANIFEST_DIR"
                        | "CARGO_MANIFEST_PATH"
                        | "CARGO_MANIFEST_LINKS"
                        | "CARGO_CRATE_NAME"
                        | "CARGO_BIN_NAME"
                        | "CARGO_PRIMARY_PACKAGE"
                        | "OUT_DIR"
                )
        });
        if watched {
            command.env_remove(name);
        }
    }
}

/// The cargo that runs us.
pub fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".into())
}

/// Builds the `credit` binary (release or debug) and returns its path.
pub fn build_credit(release: bool) -> Result<PathBuf, String> {
    build_example("credit", release)
}

/// Builds the example binary `bin` (debug, or release) and returns its path.
pub fn build_example(bin: &str, release: bool) -> Result<PathBuf, String> {
    let mut build = vec!["build", "--quiet", "-p", "inbox-examples", "--bin", bin];
    if release {
        build.push("--release");
    }
    cargo_step(&format!("building {bin}"), &build)?;
    let profile = if release { "release" } else { "debug" };
    Ok(root().join("target").join(profile).join(bin))
}

/// The demo's binaries (every example and the `inbox` command), built by one cargo command, the
/// same each time, so that later calls find everything built (a narrower command would unify
/// features otherwise, and build again); [`demo_binary`] names each.
///
/// The dev profile, as `cargo xtask` itself and the tests: the workspace's `[profile.dev]`
/// optimises dependencies a little and drops their debug info, which makes them quick to build
/// and quick enough to run; dependencies built for one are there for the others (see
/// CONTRIBUTING.md, "Build profile"). `timings` adds `--timings`.
pub fn build_demo(timings: bool) -> Result<(), String> {
    let mut args = vec![
        "build",
        "--quiet",
        "-p",
        "inbox-examples",
        "--bins",
        "-p",
        "inbox-cli",
    ];
    if timings {
        args.push("--timings");
    }
    cargo_step("building the demo", &args)
}

/// Where [`build_demo`] put the binary `bin`.
pub fn demo_binary(bin: &str) -> PathBuf {
    root().join("target").join("debug").join(bin)
}
