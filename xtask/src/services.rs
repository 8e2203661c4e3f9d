//! The local services the tests need: checked, and started with the machine's own commands
//! (see CONTRIBUTING.md) when they do not answer.

use inbox_testkit::{Backend, wait_until};
use std::process::Command;
use std::time::Duration;
use tokio::net::TcpStream;

/// A service the tests talk to.
pub struct Service {
    name: &'static str,
    addr: &'static str,
    start: &'static str,
}

/// PostgreSQL on 127.0.0.1:5432.
pub const POSTGRES: Service = Service {
    name: "PostgreSQL",
    addr: "127.0.0.1:5432",
    start: "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
};

/// MariaDB on 127.0.0.1:3306.
pub const MARIADB: Service = Service {
    name: "MariaDB",
    addr: "127.0.0.1:3306",
    start: "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
};

/// NATS with JetStream on 127.0.0.1:4222.
pub const NATS: Service = Service {
    name: "NATS",
    addr: "127.0.0.1:4222",
    start: "start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
            -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log",
};

/// The services the tests of `backends` need: NATS, and the server of each backend that has one.
pub fn needed(backends: &[Backend]) -> Vec<Service> {
    let mut services = vec![NATS];
    for b in backends {
        match b {
            Backend::Postgres => services.push(POSTGRES),
            Backend::MySql => services.push(MARIADB),
            Backend::Sqlite => {}
        }
    }
    services
}

/// Whether something accepts TCP connections at `addr` (`host:port`) within a second.
pub async fn answers(addr: &str) -> bool {
    matches!(
        tokio::time::timeout(Duration::from_secs(1), TcpStream::connect(addr)).await,
        Ok(Ok(_))
    )
}

/// Makes sure every service answers, starting those that do not; fails naming the service that
/// still does not answer after 60 s.
pub async fn ensure(services: &[Service]) -> Result<(), String> {
    for s in services {
        if answers(s.addr).await {
            continue;
        }
        eprintln!(
            "xtask: {} does not answer at {}; starting it: {}",
            s.name, s.addr, s.start
        );
        let status = Command::new("sh")
            .args(["-c", s.start])
            .status()
            .map_err(|e| format!("cannot run `{}`: {e}", s.start))?;
        if !status.success() {
            eprintln!("xtask: `{}` exited with {status}", s.start);
        }
        let what = format!("{} to answer at {} after `{}`", s.name, s.addr, s.start);
        wait_until(&what, Duration::from_secs(60), async || {
            answers(s.addr).await
        })
        .await?;
        eprintln!("xtask: {} is up", s.name);
    }
    Ok(())
}
