//! The local services the tests need: checked, and restarted with the machine's own commands
//! (see DEVELOPERS.md) when they do not answer.

use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

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

/// Whether something accepts TCP connections at `addr`.
pub fn answers(addr: &str) -> bool {
    let addr: SocketAddr = addr.parse().expect("a socket address");
    TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok()
}

/// Makes sure every service answers, starting those that do not; fails naming the service that
/// still does not answer after 60 s.
pub fn ensure(services: &[Service]) -> Result<(), String> {
    for s in services {
        if answers(s.addr) {
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
        let deadline = Instant::now() + Duration::from_secs(60);
        while !answers(s.addr) {
            if Instant::now() > deadline {
                return Err(format!(
                    "{} does not answer at {} even after `{}`",
                    s.name, s.addr, s.start
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        eprintln!("xtask: {} is up", s.name);
    }
    Ok(())
}
