//! A PostgreSQL server of a test's own: `initdb` into a temporary directory, a throwaway
//! self-signed certificate, and only TLS connections accepted over TCP, on a free loopback port.
//! Stopped, and its directory removed, when dropped.

use crate::wait_until;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A private PostgreSQL that accepts TCP connections only over TLS (`hostssl` alone in
/// `pg_hba.conf`, trust auth), for user `postgres`, database `postgres`.
#[derive(Debug)]
pub struct PrivatePostgres {
    /// The port it listens on (127.0.0.1).
    pub port: u16,
    /// Removed when dropped, after the server is stopped.
    dir: tempfile::TempDir,
    child: Option<Child>,
}

/// The directory of Debian's PostgreSQL binaries (`/usr/lib/postgresql/<version>/bin`), the
/// newest there is.
fn pg_bin() -> Result<PathBuf, String> {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|e| format!("no PostgreSQL server binaries in /usr/lib/postgresql: {e}"))?
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|bin| bin.join("initdb").is_file())
        .collect();
    versions.sort();
    versions
        .pop()
        .ok_or_else(|| "no initdb under /usr/lib/postgresql/*/bin".to_owned())
}

/// `program` with `args`, as the `postgres` user when this runs as root (PostgreSQL refuses to
/// run as root).
fn as_postgres(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

fn run(mut command: Command, what: &str) -> Result<(), String> {
    let out = command
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {what}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{what} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

impl PrivatePostgres {
    /// Creates the cluster, its certificate (`openssl req -x509`, valid for a day, CN
    /// `localhost`), starts the server and waits (up to 60 s) until it accepts connections.
    pub async fn start_with_tls() -> Result<PrivatePostgres, String> {
        let bin = pg_bin()?;
        let temp = tempfile::Builder::new()
            .prefix("inbox-pg-")
            .tempdir()
            .map_err(|e| format!("a temporary directory for PostgreSQL: {e}"))?;
        let dir = temp.path().to_owned();
        let data = dir.join("data");
        let port = crate::nats::free_port()?;
        let mut pg = PrivatePostgres {
            port,
            dir: temp,
            child: None,
        };
        run(
            {
                let mut c = Command::new("chown");
                c.args(["postgres:postgres"]).arg(&dir);
                c
            },
            "chown of the private PostgreSQL's directory",
        )
        .or_else(|e| if is_root() { Err(e) } else { Ok(()) })?;
        let mut initdb = as_postgres(&bin.join("initdb"));
        initdb
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "-D"])
            .arg(&data);
        run(initdb, "initdb")?;
        let mut cert = as_postgres(Path::new("openssl"));
        cert.args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args(["-subj", "/CN=localhost", "-keyout"])
        .arg(data.join("server.key"))
        .arg("-out")
        .arg(data.join("server.crt"));
        run(cert, "openssl req (the private PostgreSQL's certificate)")?;
        // PostgreSQL refuses a key that its group or others can read.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(
            data.join("server.key"),
            std::fs::Permissions::from_mode(0o600),
        )
        .map_err(|e| format!("chmod server.key: {e}"))?;
        std::fs::write(
            data.join("pg_hba.conf"),
            "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
        )
        .map_err(|e| format!("pg_hba.conf: {e}"))?;
        let mut server = as_postgres(&bin.join("postgres"));
        server
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string(), "-c", "listen_addresses=127.0.0.1"])
            .args(["-c", "ssl=on", "-c", "fsync=off", "-k"])
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        pg.child = Some(
            server
                .spawn()
                .map_err(|e| format!("cannot start the private PostgreSQL: {e}"))?,
        );
        let url = pg.url("require");
        let what = format!("the private PostgreSQL on port {port} to accept a TLS connection");
        wait_until(&what, Duration::from_secs(60), async || {
            use sqlx::Connection;
            sqlx::PgConnection::connect(&url).await.is_ok()
        })
        .await?;
        Ok(pg)
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres?sslmode=<sslmode>`.
    pub fn url(&self, sslmode: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres?sslmode={sslmode}",
            self.port
        )
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // A SIGKILL of `runuser` would leave the server running: stop the server itself, by
            // its pid file.
            let pid = std::fs::read_to_string(self.dir.path().join("data/postmaster.pid"))
                .ok()
                .and_then(|t| t.lines().next().map(str::to_owned));
            if let Some(pid) = pid.and_then(|p| p.trim().parse::<i32>().ok()) {
                // Immediate shutdown: the cluster is thrown away.
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGQUIT,
                );
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
