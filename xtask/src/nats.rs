//! A private `nats-server` for the demo and the chaos run.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// A `nats-server` of our own: JetStream, a free loopback port, a temporary store.
pub struct PrivateNats {
    /// `nats://127.0.0.1:<port>`.
    pub url: String,
    port: u16,
    binary: PathBuf,
    child: Option<std::process::Child>,
    store: PathBuf,
}

impl PrivateNats {
    /// Starts one, storing under a temporary directory named after `run`.
    pub fn start(run: &str) -> Result<PrivateNats, String> {
        let binary = std::env::var_os("PATH")
            .into_iter()
            .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
            .map(|dir| dir.join("nats-server"))
            .find(|p| p.is_file())
            .ok_or(
                "no NATS answers at NATS_URL and there is no nats-server binary to start one: \
                 install it (Debian: `apt-get install nats-server`) or set NATS_URL",
            )?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free port: {e}"))?
            .port();
        let store = std::env::temp_dir().join(format!("inbox-xtask-nats-{run}"));
        println!("starting {} on port {port}", binary.display());
        let mut nats = PrivateNats {
            url: format!("nats://127.0.0.1:{port}"),
            port,
            binary,
            child: None,
            store,
        };
        nats.restart()?;
        Ok(nats)
    }

    /// Kills the server (SIGKILL) and starts it again on the same port and store.
    pub fn restart(&mut self) -> Result<(), String> {
        self.kill();
        let child = std::process::Command::new(&self.binary)
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&self.store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.binary.display()))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !crate::services::answers(&format!("127.0.0.1:{}", self.port)) {
            if Instant::now() > deadline {
                return Err("the private nats-server did not start within 30 s".into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}
