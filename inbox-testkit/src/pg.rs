//! PostgreSQL servers of a test's own: `initdb` into a temporary directory and a private server
//! on a free loopback port, either accepting only TLS over TCP ([`PrivatePostgres::start_with_tls`])
//! or plain connections and streaming replication ([`PrivatePostgres::start`]); and a primary
//! with a streaming standby made from it by `pg_basebackup` ([`PrimaryStandby`]), to crash the
//! primary and promote the standby. Stopped, and their directories removed, when dropped.

use crate::wait_until;
use sqlx::Connection;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// How long a private server may take to accept connections, a standby to catch up or to be
/// promoted.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// A private PostgreSQL, trust auth, for user `postgres`, database `postgres`: over TLS only
/// ([`start_with_tls`](Self::start_with_tls)), or in clear with replication connections allowed
/// ([`start`](Self::start)).
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

/// The clear-text `pg_hba.conf` of [`PrivatePostgres::start`]: trust for every database and for
/// replication, on the socket and on loopback.
const PLAIN_HBA: &str = "local all all trust\nlocal replication all trust\n\
                         host all all 127.0.0.1/32 trust\nhost replication all 127.0.0.1/32 trust\n";

impl PrivatePostgres {
    /// A temporary directory owned by `postgres` (its `data` is the cluster) and a free port;
    /// nothing runs yet.
    fn unstarted() -> Result<PrivatePostgres, String> {
        let temp = tempfile::Builder::new()
            .prefix("inbox-pg-")
            .tempdir()
            .map_err(|e| format!("a temporary directory for PostgreSQL: {e}"))?;
        let mut chown = Command::new("chown");
        chown.args(["postgres:postgres"]).arg(temp.path());
        run(chown, "chown of the private PostgreSQL's directory")
            .or_else(|e| if is_root() { Err(e) } else { Ok(()) })?;
        Ok(PrivatePostgres {
            port: crate::nats::free_port()?,
            dir: temp,
            child: None,
        })
    }

    /// Its cluster's directory.
    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// `initdb` of its cluster: user `postgres`, trust, UTF-8.
    fn initdb(&self, bin: &Path) -> Result<(), String> {
        let mut initdb = as_postgres(&bin.join("initdb"));
        initdb
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "-D"])
            .arg(self.data());
        run(initdb, "initdb")
    }

    /// Starts the server on its cluster with `settings` (`-c` each) and waits until `url`
    /// accepts a connection.
    async fn serve(&mut self, bin: &Path, settings: &[&str], url: &str) -> Result<(), String> {
        let mut server = as_postgres(&bin.join("postgres"));
        server
            .arg("-D")
            .arg(self.data())
            .args([
                "-p",
                &self.port.to_string(),
                "-c",
                "listen_addresses=127.0.0.1",
            ])
            // Nothing here must survive the machine: a crash of the server's processes loses
            // nothing with fsync off (the page cache keeps it), and the cluster is thrown away.
            .args(["-c", "fsync=off"]);
        for setting in settings {
            server.args(["-c", setting]);
        }
        server
            .arg("-k")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.child = Some(
            server
                .spawn()
                .map_err(|e| format!("cannot start the private PostgreSQL: {e}"))?,
        );
        let what = format!(
            "the private PostgreSQL on port {} to accept a connection",
            self.port
        );
        wait_until(&what, READY_WITHIN, async || {
            sqlx::PgConnection::connect(url).await.is_ok()
        })
        .await
    }

    /// Creates a cluster that accepts clear-text TCP connections on loopback, trust auth, and
    /// replication connections (`wal_level = replica`, WAL senders, hot standby), starts it and
    /// waits (up to 60 s) until it accepts connections. A [`PrimaryStandby`]'s primary.
    ///
    /// ```no_run
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// let pg = inbox_testkit::PrivatePostgres::start().await.unwrap();
    /// let url = pg.url("disable"); // postgres://postgres@127.0.0.1:<port>/postgres?sslmode=disable
    /// # });
    /// ```
    pub async fn start() -> Result<PrivatePostgres, String> {
        let bin = pg_bin()?;
        let mut pg = Self::unstarted()?;
        pg.initdb(&bin)?;
        std::fs::write(pg.data().join("pg_hba.conf"), PLAIN_HBA)
            .map_err(|e| format!("pg_hba.conf: {e}"))?;
        let url = pg.url("disable");
        pg.serve(&bin, REPLICATION_SETTINGS, &url).await?;
        Ok(pg)
    }

    /// Creates the cluster, its certificate (`openssl req -x509`, valid for a day, CN
    /// `localhost`), starts the server with only TLS connections accepted over TCP
    /// (`hostssl` alone in `pg_hba.conf`) and waits (up to 60 s) until it accepts connections.
    pub async fn start_with_tls() -> Result<PrivatePostgres, String> {
        let bin = pg_bin()?;
        let mut pg = Self::unstarted()?;
        pg.initdb(&bin)?;
        let data = pg.data();
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
        let url = pg.url("require");
        pg.serve(&bin, &["ssl=on"], &url).await?;
        Ok(pg)
    }

    /// A hot standby of `primary` (started with [`start`](Self::start)), named `name` (its
    /// `application_name` on the primary and its replication slot): `pg_basebackup -R` (so
    /// `standby.signal` and `primary_conninfo`), WAL streamed during the backup and kept by the
    /// slot after it; started and accepting (read-only) connections.
    async fn standby_of(primary: &PrivatePostgres, name: &str) -> Result<PrivatePostgres, String> {
        let bin = pg_bin()?;
        let mut standby = Self::unstarted()?;
        let mut backup = as_postgres(&bin.join("pg_basebackup"));
        backup
            .arg("-d")
            .arg(format!(
                "host=127.0.0.1 port={} user=postgres application_name={name}",
                primary.port
            ))
            .arg("-D")
            .arg(standby.data())
            .args(["-R", "-X", "stream", "-C", "-S", name, "--checkpoint=fast"]);
        run(backup, "pg_basebackup of the private primary")?;
        let url = standby.url("disable");
        standby.serve(&bin, REPLICATION_SETTINGS, &url).await?;
        Ok(standby)
    }

    /// `postgres://postgres@127.0.0.1:<port>/postgres?sslmode=<sslmode>`.
    pub fn url(&self, sslmode: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/postgres?sslmode={sslmode}",
            self.port
        )
    }

    /// `127.0.0.1:<port>`, for a [`TcpProxy`](crate::TcpProxy) to forward to.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Kills the server at once, as a machine that dies would: SIGKILL to the postmaster and to every
    /// process it forked (backends, WAL writer and senders), at once, so that none of them
    /// answers or sends another byte. Nothing is cleaned up or checkpointed; the cluster is not
    /// started again. Does nothing when it is not running.
    pub fn kill(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Some(postmaster) = self.postmaster_pid() {
            let children = children_of(postmaster);
            for pid in std::iter::once(postmaster).chain(children) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        // `runuser` ends with the postmaster.
        let _ = child.kill();
        let _ = child.wait();
    }

    /// The postmaster's pid, from its pid file.
    fn postmaster_pid(&self) -> Option<i32> {
        std::fs::read_to_string(self.data().join("postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }
}

/// The settings a primary or standby runs with. `wal_level = replica`, WAL senders and hot
/// standby are PostgreSQL's defaults; named so that a change of defaults cannot break them.
const REPLICATION_SETTINGS: &[&str] = &[
    "wal_level=replica",
    "max_wal_senders=4",
    "max_replication_slots=4",
    "hot_standby=on",
];

/// The processes whose parent is `parent` (from `/proc/<pid>/stat`).
fn children_of(parent: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            // `pid (comm) state ppid ...`: comm may hold spaces and parentheses, so read
            // after the last `)`.
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|stat| {
                    let rest = &stat[stat.rfind(')')? + 1..];
                    rest.split_whitespace().nth(1)?.parse::<i32>().ok()
                })
                == Some(parent)
        })
        .collect()
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
            if let Some(pid) = self.postmaster_pid() {
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

/// How a [`PrimaryStandby`]'s primary waits for its standby.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replication {
    /// `synchronous_standby_names` names the standby and `synchronous_commit = on`: a COMMIT is
    /// acknowledged only once the standby has flushed it, so a commit the client heard of
    /// survives the primary's crash. What exactly-once across failover requires.
    Synchronous,
    /// PostgreSQL's default: a COMMIT is acknowledged once the primary has it; the last commits
    /// before a crash may never reach the standby, and are lost on failover.
    Asynchronous,
}

/// A private primary ([`PrivatePostgres::start`]) and a hot standby streaming from it
/// (`pg_basebackup -R`), both on loopback, for failover: crash the primary, promote the standby,
/// point the application at it. Both stopped and removed when dropped.
///
/// ```no_run
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// use inbox_testkit::{PrimaryStandby, Replication, TcpProxy};
/// let mut pair = PrimaryStandby::start(Replication::Synchronous).await.unwrap();
/// let mut proxy = TcpProxy::reserve().unwrap();
/// proxy.start(&pair.primary().address()).await.unwrap();
/// // ... the application works through the proxy, then the primary dies:
/// pair.kill_primary();
/// pair.promote_standby().await.unwrap();
/// proxy.switch_to(&pair.standby().address());
/// # });
/// ```
#[derive(Debug)]
pub struct PrimaryStandby {
    primary: PrivatePostgres,
    standby: PrivatePostgres,
}

impl PrimaryStandby {
    /// The standby's name: its `application_name` on the primary (what
    /// `synchronous_standby_names` names) and its replication slot.
    pub const STANDBY: &'static str = "standby";

    /// Starts the primary, makes the standby from it and starts it, and waits (each step up to
    /// 60 s) until the standby streams and has replayed a change made on the primary after it
    /// connected; with [`Replication::Synchronous`], also until the primary counts it as its
    /// synchronous standby. The standby keeps PostgreSQL's default (asynchronous) settings for
    /// when it is promoted: with no standby of its own, a synchronous setting would make every
    /// COMMIT on it wait forever.
    pub async fn start(replication: Replication) -> Result<PrimaryStandby, String> {
        let primary = PrivatePostgres::start().await?;
        let standby = PrivatePostgres::standby_of(&primary, Self::STANDBY).await?;
        let pair = PrimaryStandby { primary, standby };
        pair.wait_streaming().await?;
        if replication == Replication::Synchronous {
            let mut conn = pair.connect_primary().await?;
            // After the backup, so that the standby's own configuration stays asynchronous.
            for sql in [
                "ALTER SYSTEM SET synchronous_standby_names = 'standby'",
                "ALTER SYSTEM SET synchronous_commit = 'on'",
                "SELECT pg_reload_conf()",
            ] {
                sqlx::raw_sql(sql)
                    .execute(&mut conn)
                    .await
                    .map_err(|e| format!("{sql} on the private primary: {e}"))?;
            }
            let what = "the standby to be the primary's synchronous standby";
            wait_until(what, READY_WITHIN, async || {
                let sql = "SELECT sync_state::text FROM pg_stat_replication \
                           WHERE application_name = 'standby'";
                sqlx::query_scalar::<_, String>(sql)
                    .fetch_optional(&mut conn)
                    .await
                    .ok()
                    .flatten()
                    .is_some_and(|s| s == "sync")
            })
            .await?;
        }
        pair.caught_up().await?;
        Ok(pair)
    }

    /// The primary (crashed after [`kill_primary`](Self::kill_primary)).
    pub fn primary(&self) -> &PrivatePostgres {
        &self.primary
    }

    /// The standby (the primary after [`promote_standby`](Self::promote_standby)).
    pub fn standby(&self) -> &PrivatePostgres {
        &self.standby
    }

    /// Kills the primary at once ([`PrivatePostgres::kill`]): a COMMIT in flight gets no answer, and
    /// the standby's WAL receiver loses its sender.
    pub fn kill_primary(&mut self) {
        self.primary.kill();
    }

    /// Promotes the standby (`SELECT pg_promote()`) and waits (up to 60 s) until it is out of
    /// recovery and accepts writes.
    pub async fn promote_standby(&self) -> Result<(), String> {
        let url = self.standby.url("disable");
        let mut conn = sqlx::PgConnection::connect(&url)
            .await
            .map_err(|e| format!("the private standby at {url}: {e}"))?;
        let promoted: bool = sqlx::query_scalar("SELECT pg_promote(true, 60)")
            .fetch_one(&mut conn)
            .await
            .map_err(|e| format!("pg_promote() on the private standby: {e}"))?;
        if !promoted {
            return Err("pg_promote() on the private standby returned false".into());
        }
        wait_until(
            "the promoted standby to leave recovery",
            READY_WITHIN,
            async || {
                sqlx::query_scalar::<_, bool>("SELECT NOT pg_is_in_recovery()")
                    .fetch_one(&mut conn)
                    .await
                    .unwrap_or(false)
            },
        )
        .await
    }

    async fn connect_primary(&self) -> Result<sqlx::PgConnection, String> {
        let url = self.primary.url("disable");
        sqlx::PgConnection::connect(&url)
            .await
            .map_err(|e| format!("the private primary at {url}: {e}"))
    }

    /// Waits until the primary lists the standby as `streaming`.
    async fn wait_streaming(&self) -> Result<(), String> {
        let mut conn = self.connect_primary().await?;
        wait_until(
            "the standby to stream from the primary",
            READY_WITHIN,
            async || {
                let sql =
                    "SELECT state FROM pg_stat_replication WHERE application_name = 'standby'";
                sqlx::query_scalar::<_, String>(sql)
                    .fetch_optional(&mut conn)
                    .await
                    .ok()
                    .flatten()
                    .is_some_and(|s| s == "streaming")
            },
        )
        .await
    }

    /// Waits until the standby has replayed everything the primary has written so far
    /// (including a change made now: a table created and dropped, so that there is one).
    async fn caught_up(&self) -> Result<(), String> {
        let mut conn = self.connect_primary().await?;
        let sql = "CREATE TABLE inbox_testkit_probe (); DROP TABLE inbox_testkit_probe";
        sqlx::raw_sql(sql)
            .execute(&mut conn)
            .await
            .map_err(|e| format!("a change on the private primary: {e}"))?;
        let lsn: String = sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
            .fetch_one(&mut conn)
            .await
            .map_err(|e| format!("pg_current_wal_lsn() on the private primary: {e}"))?;
        let url = self.standby.url("disable");
        let mut standby = sqlx::PgConnection::connect(&url)
            .await
            .map_err(|e| format!("the private standby at {url}: {e}"))?;
        wait_until(
            "the standby to replay the primary's WAL",
            READY_WITHIN,
            async || {
                sqlx::query_scalar::<_, bool>("SELECT pg_last_wal_replay_lsn() >= $1::pg_lsn")
                    .bind(&lsn)
                    .fetch_one(&mut standby)
                    .await
                    .unwrap_or(false)
            },
        )
        .await
    }
}
