//! `cargo xtask chaos`: exactly-once under faults, for a user to run.
//!
//! Per backend: a private nats-server, N credit requests each published twice (once with
//! `Nats-Msg-Id`, once without), a few poison and CHECK-violating ones, three `credit`
//! processes; while they work, one of them is SIGKILLed and restarted every two seconds, the
//! nats-server is killed and restarted once, and every database connection is cut once. When the
//! consumer has drained: every request must be applied exactly once and every bad message
//! dead-lettered. Each valid request credits its own account with 1, so a balance of 0 is a lost
//! message and a balance of 2 or more one applied twice.

use crate::nats::PrivateNats;
use async_nats::jetstream::{self, consumer::pull, stream};
use sqlx::any::AnyPoolOptions;
use sqlx::{AnyPool, AssertSqlSafe, SqlSafeStr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::process::{Child, Command};

const POISON: usize = 5;
const OVERDRAWS: usize = 5;
const INSTANCES: usize = 3;
const STREAM: &str = "CHAOS";
const SUBJECT: &str = "chaos.credits";
const DURABLE: &str = "chaos";
/// The runtime's default dead-letter stream, which `credit` uses.
const DLQ_STREAM: &str = "INBOX_DLQ";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backend {
    Postgres,
    MySql,
    Sqlite,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Postgres => "postgres",
            Backend::MySql => "mysql",
            Backend::Sqlite => "sqlite",
        }
    }
}

/// What one backend's run came to.
struct Report {
    backend: Backend,
    published: usize,
    unique: usize,
    applied: i64,
    skipped: u64,
    dead_expected: usize,
    dead_actual: u64,
    lost: i64,
    twice: i64,
    /// Accounts that an overdraw created: a CHECK violation that was applied.
    overdrawn: i64,
    kills: usize,
    db_cut: &'static str,
}

impl Report {
    fn ok(&self) -> bool {
        self.lost == 0
            && self.twice == 0
            && self.overdrawn == 0
            && self.dead_actual == self.dead_expected as u64
    }
}

/// `cargo xtask chaos [--db postgres|mysql|sqlite|all] [--messages N] [--release]`.
pub fn run(args: &[String]) -> Result<(), String> {
    let mut backends = vec![Backend::Postgres, Backend::MySql, Backend::Sqlite];
    let mut messages = 20_000usize;
    let mut release = false;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--db" => {
                backends = match it.next().map(String::as_str) {
                    Some("postgres") => vec![Backend::Postgres],
                    Some("mysql") => vec![Backend::MySql],
                    Some("sqlite") => vec![Backend::Sqlite],
                    Some("all") => backends,
                    other => {
                        return Err(format!(
                            "--db takes postgres, mysql, sqlite or all, not {other:?}"
                        ));
                    }
                }
            }
            "--messages" => {
                messages = it
                    .next()
                    .and_then(|n| n.parse().ok())
                    .filter(|n| *n >= 100)
                    .ok_or("--messages takes a number of at least 100")?;
            }
            "--release" => release = true,
            other => {
                return Err(format!(
                    "unknown chaos option {other:?}; see `cargo xtask help`"
                ));
            }
        }
    }
    let root = crate::workspace_root();
    let mut build = vec![
        "build",
        "--quiet",
        "-p",
        "inbox-examples",
        "--bin",
        "credit",
    ];
    if release {
        build.push("--release");
    }
    crate::cargo_step("building credit", &build)?;
    let credit = root.join(if release {
        "target/release/credit"
    } else {
        "target/debug/credit"
    });
    let logs = root.join("target/chaos");
    std::fs::create_dir_all(&logs).map_err(|e| e.to_string())?;

    let runtime = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    let mut reports = Vec::new();
    for backend in backends {
        println!("\n== chaos on {} ({messages} requests)", backend.name());
        reports.push(runtime.block_on(chaos(backend, messages, &credit, &logs))?);
    }

    println!(
        "\n{:<9} {:>9} {:>7} {:>8} {:>8} {:>13} {:>5} {:>6} {:>6} {:>7}",
        "backend",
        "published",
        "unique",
        "applied",
        "skipped",
        "dead (exp/act)",
        "lost",
        "twice",
        "kills",
        "db cut"
    );
    for r in &reports {
        println!(
            "{:<9} {:>9} {:>7} {:>8} {:>8} {:>13} {:>5} {:>6} {:>6} {:>7}",
            r.backend.name(),
            r.published,
            r.unique,
            r.applied,
            r.skipped,
            format!("{}/{}", r.dead_expected, r.dead_actual),
            r.lost,
            r.twice,
            r.kills,
            r.db_cut
        );
    }
    println!(
        "(skipped: as reported by processes that stopped cleanly; SIGKILLed ones report nothing)"
    );
    let passed = reports.iter().filter(|r| r.ok()).count();
    println!("chaos: {passed} passed, {} failed", reports.len() - passed);
    if passed == reports.len() {
        println!(
            "\nexactly once under faults: nothing lost, nothing applied twice, every dead letter present."
        );
        Ok(())
    } else {
        Err("chaos run FAILED: see the table".into())
    }
}

/// The database of one run: its URL for `credit`, a pool for checking, and how to remove it.
struct ChaosDb {
    url: String,
    admin_url: Option<String>,
    name: String,
    pool: AnyPool,
}

async fn database(backend: Backend, run: &str, logs: &Path) -> Result<ChaosDb, String> {
    sqlx::any::install_default_drivers();
    let name = format!("inbox_chaos_{run}");
    let (url, admin_url) = match backend {
        Backend::Sqlite => (
            format!("sqlite://{}", logs.join(format!("{name}.db")).display()),
            None,
        ),
        Backend::Postgres | Backend::MySql => {
            let admin = match backend {
                Backend::Postgres => "postgres://postgres@127.0.0.1:5432/test",
                _ => "mysql://root@127.0.0.1:3306/test",
            };
            let pool = AnyPoolOptions::new()
                .max_connections(1)
                .connect(admin)
                .await
                .map_err(|e| format!("{} does not answer at {admin}: {e}", backend.name()))?;
            sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {name}")))
                .execute(&pool)
                .await
                .map_err(|e| e.to_string())?;
            pool.close().await;
            (
                admin.replace("/test", &format!("/{name}")),
                Some(admin.to_owned()),
            )
        }
    };
    let pool = AnyPoolOptions::new()
        .max_connections(1)
        .connect_lazy(&url)
        .map_err(|e| e.to_string())?;
    Ok(ChaosDb {
        url,
        admin_url,
        name,
        pool,
    })
}

impl ChaosDb {
    async fn scalar(&self, sql: String) -> Option<i64> {
        sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql).into_sql_str())
            .fetch_one(&self.pool)
            .await
            .ok()
    }

    /// Ends every session on the database but ours; what it did, for the table.
    async fn cut(&self, backend: Backend) -> Result<&'static str, String> {
        let Some(admin_url) = &self.admin_url else {
            return Ok("n/a");
        };
        let admin = AnyPoolOptions::new()
            .max_connections(1)
            .connect(admin_url)
            .await
            .map_err(|e| e.to_string())?;
        let name = &self.name;
        if backend == Backend::Postgres {
            let sql = format!(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE datname = '{name}' AND pid <> pg_backend_pid()) t"
            );
            sqlx::query(AssertSqlSafe(sql))
                .execute(&admin)
                .await
                .map_err(|e| e.to_string())?;
        } else {
            let sql = format!("SELECT id FROM information_schema.processlist WHERE db = '{name}'");
            let ids: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(sql))
                .fetch_all(&admin)
                .await
                .map_err(|e| e.to_string())?;
            for id in ids {
                let _ = sqlx::query(AssertSqlSafe(format!("KILL {id}")))
                    .execute(&admin)
                    .await;
            }
        }
        admin.close().await;
        Ok("yes")
    }

    async fn remove(self) {
        self.pool.close().await;
        if let Some(admin_url) = &self.admin_url
            && let Ok(admin) = AnyPoolOptions::new()
                .max_connections(1)
                .connect(admin_url)
                .await
        {
            let force = if admin_url.starts_with("postgres") {
                " WITH (FORCE)"
            } else {
                ""
            };
            let sql = format!("DROP DATABASE IF EXISTS {}{force}", self.name);
            let _ = sqlx::query(AssertSqlSafe(sql)).execute(&admin).await;
            admin.close().await;
        } else if self.admin_url.is_none() {
            let file = self.url.trim_start_matches("sqlite://").to_owned();
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{file}{suffix}"));
            }
        }
    }
}

async fn chaos(backend: Backend, n: usize, credit: &Path, logs: &Path) -> Result<Report, String> {
    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let mut nats = PrivateNats::start(&run)?;
    let db = database(backend, &run, logs).await?;
    let result = chaos_on(backend, n, credit, logs, &run, &mut nats, &db).await;
    db.remove().await;
    result
}

async fn chaos_on(
    backend: Backend,
    n: usize,
    credit: &Path,
    logs: &Path,
    run: &str,
    nats: &mut PrivateNats,
    db: &ChaosDb,
) -> Result<Report, String> {
    let client = async_nats::connect(&nats.url)
        .await
        .map_err(|e| e.to_string())?;
    let js = jetstream::new(client);
    let stream = js
        .create_stream(stream::Config {
            name: STREAM.into(),
            subjects: vec![SUBJECT.into()],
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    // A short ack_wait: what a killed process held comes back within seconds.
    stream
        .create_consumer(pull::Config {
            durable_name: Some(DURABLE.into()),
            ack_wait: Duration::from_secs(5),
            max_deliver: 10,
            filter_subject: SUBJECT.into(),
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;

    // Every valid request twice: with a msg-id (the broker's dedup window) and without (only the
    // inbox can catch it). Accounts 0..n get +1 each; overdraws go to accounts of their own.
    let mut payloads: Vec<(Vec<u8>, Option<String>)> =
        Vec::with_capacity(2 * n + POISON + OVERDRAWS);
    for pass in 0..2 {
        for i in 0..n {
            let id = format!("c-{run}-{i}");
            let body = serde_json::json!({ "id": id, "account": i, "amount": 1 });
            let msg_id = (pass == 0).then(|| id.clone());
            payloads.push((serde_json::to_vec(&body).unwrap(), msg_id));
            if i % (n / POISON) == 0 && pass == 0 {
                let j = i / (n / POISON);
                if j < POISON {
                    payloads.push((b"{ not json".to_vec(), None));
                }
                if j < OVERDRAWS {
                    let bad = serde_json::json!({ "id": format!("neg-{run}-{j}"), "account": n + j, "amount": -5 });
                    payloads.push((serde_json::to_vec(&bad).unwrap(), None));
                }
            }
        }
    }
    let published = payloads.len();
    println!("publishing {published} messages...");
    for chunk in payloads.chunks(1_000) {
        let mut acks = Vec::with_capacity(chunk.len());
        for (body, msg_id) in chunk {
            let mut headers = async_nats::HeaderMap::new();
            if let Some(id) = msg_id {
                headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
            }
            acks.push(
                js.publish_with_headers(SUBJECT, headers, body.clone().into())
                    .await
                    .map_err(|e| e.to_string())?,
            );
        }
        for ack in acks {
            ack.await.map_err(|e| e.to_string())?;
        }
    }

    let nats_url = nats.url.clone();
    let spawn = |k: usize| {
        let log = logs.join(format!("{}-{run}-{k}.log", backend.name()));
        spawn_credit(credit, &db.url, &nats_url, &log)
    };
    let mut children: Vec<Child> = (0..INSTANCES).map(spawn).collect::<Result<_, _>>()?;
    let started = Instant::now();
    let deadline = Duration::from_secs(300) + Duration::from_millis(20 * n as u64);
    let (mut kills, mut nats_restarted, mut db_cut) = (0, false, "no");
    let mut last_kill = Instant::now();
    let count_inbox = "SELECT count(*) FROM inbox WHERE consumer = 'credit'".to_owned();
    loop {
        let applied = db.scalar(count_inbox.clone()).await.unwrap_or(0);
        let faults_done = nats_restarted && db_cut != "no";
        if faults_done && applied >= n as i64 && drained(&js).await {
            break;
        }
        if started.elapsed() > deadline {
            return Err(format!(
                "{}: not drained within {deadline:?} ({applied} of {n} applied); logs in {}",
                backend.name(),
                logs.display()
            ));
        }
        // Every two seconds, and at least once early on, however fast the run.
        let due =
            last_kill.elapsed() > Duration::from_secs(2) || (kills == 0 && applied >= n as i64 / 6);
        if due && applied < n as i64 {
            let k = (uuid::Uuid::new_v4().as_u128() % INSTANCES as u128) as usize;
            let _ = children[k].start_kill();
            let _ = children[k].wait().await;
            children[k] = spawn(k)?;
            kills += 1;
            last_kill = Instant::now();
        }
        if !nats_restarted && (applied >= n as i64 / 3 || applied >= n as i64) {
            println!("  killing and restarting nats-server ({applied} applied)");
            nats.restart()?;
            nats_restarted = true;
        }
        if nats_restarted && db_cut == "no" && (applied >= 2 * n as i64 / 3 || applied >= n as i64)
        {
            println!("  cutting every database connection ({applied} applied)");
            db_cut = db.cut(backend).await?;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let mut skipped = 0;
    for child in children {
        skipped += stop(child).await?;
    }
    let applied = db.scalar(count_inbox).await.unwrap_or(-1);
    let once = db
        .scalar(format!(
            "SELECT count(*) FROM accounts WHERE id < {n} AND balance = 1"
        ))
        .await
        .unwrap_or(0);
    let twice = db
        .scalar(format!(
            "SELECT count(*) FROM accounts WHERE id < {n} AND balance >= 2"
        ))
        .await
        .unwrap_or(0);
    let overdrawn = db
        .scalar(format!("SELECT count(*) FROM accounts WHERE id >= {n}"))
        .await
        .unwrap_or(0);
    let dead_actual = match js.get_stream(DLQ_STREAM).await {
        Ok(mut s) => s.info().await.map(|i| i.state.messages).unwrap_or(0),
        Err(_) => 0,
    };
    let _ = js.delete_stream(STREAM).await;
    Ok(Report {
        backend,
        published,
        unique: n,
        applied,
        skipped,
        dead_expected: POISON + OVERDRAWS,
        dead_actual,
        overdrawn,
        lost: n as i64 - once - twice,
        twice,
        kills,
        db_cut,
    })
}

async fn drained(js: &jetstream::Context) -> bool {
    let Ok(stream) = js.get_stream(STREAM).await else {
        return false;
    };
    let Ok(mut consumer) = stream.get_consumer::<pull::Config>(DURABLE).await else {
        return false;
    };
    consumer
        .info()
        .await
        .is_ok_and(|i| i.num_pending == 0 && i.num_ack_pending == 0)
}

fn spawn_credit(credit: &Path, db: &str, nats: &str, log: &PathBuf) -> Result<Child, String> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| e.to_string())?;
    Command::new(credit)
        .env("DATABASE_URL", db)
        .env("NATS_URL", nats)
        .env("CREDIT_STREAM", STREAM)
        .env("CREDIT_SUBJECT", SUBJECT)
        .env("CREDIT_CONSUMER", DURABLE)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", credit.display()))
}

/// SIGTERMs `child` and returns the `skipped=` count it reports.
async fn stop(mut child: Child) -> Result<u64, String> {
    use tokio::io::AsyncReadExt;
    if let Some(pid) = child.id() {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
    }
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .map_err(|_| "credit did not stop within 60 s of SIGTERM".to_string())?
        .map_err(|e| e.to_string())?;
    if !status.success() {
        return Err(format!("credit exited with {status}"));
    }
    let mut out = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        let _ = stdout.read_to_string(&mut out).await;
    }
    Ok(out
        .split_whitespace()
        .find_map(|w| w.strip_prefix("skipped="))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0))
}
