//! What every chaos run starts from, whichever it is: the log directory, sqlx's drivers, and the
//! nats-server binary its private servers run.

use inbox_testkit::Backend;
use std::path::PathBuf;

/// What every chaos run is asked for, whichever it is (`--db`, `--messages`, `--release`,
/// `--nats`): the options of `--cluster` and `--failover`, and part of the others'.
pub struct Common {
    /// The backends to run on, one after the other.
    pub backends: Vec<Backend>,
    /// Credit requests per backend.
    pub messages: usize,
    /// Whether the examples are built in release mode.
    pub release: bool,
    /// Whether the private nats-servers run the current release instead of the machine's.
    pub current_nats: bool,
}

/// A chaos run's surroundings.
pub struct Setup {
    /// Where the processes' logs go (`target/chaos`).
    pub logs: PathBuf,
    /// The nats-server binary the private servers run.
    pub nats_server: PathBuf,
    /// Its release, as the run's heading names it.
    pub version: &'static str,
}

/// Makes the log directory, installs sqlx's drivers and finds the nats-server: a current release
/// when `current_nats`, else the machine's.
pub fn prepare(current_nats: bool) -> Result<Setup, String> {
    let logs = crate::workspace::root().join("target/chaos");
    std::fs::create_dir_all(&logs).map_err(|e| e.to_string())?;
    sqlx::any::install_default_drivers();
    let (nats_server, version) = if current_nats {
        (crate::nats_current::binary()?, crate::nats_current::VERSION)
    } else {
        (inbox_testkit::nats_server_binary()?, "the machine's")
    };
    Ok(Setup {
        logs,
        nats_server,
        version,
    })
}
