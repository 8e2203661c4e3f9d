//! `cargo xtask chaos`: exactly-once under faults, for a user to run.
//!
//! Per backend, three steps. **Publish**: on a private nats-server, N credit requests each
//! published twice (once with `Nats-Msg-Id`, once without), plus a few poison and
//! CHECK-violating ones. **Supervise**: three `credit` processes work while one of them is
//! SIGKILLed and restarted every two seconds, the nats-server is killed and restarted once, and
//! every database connection is cut once (the [`Faults`]). **Verify**, once the consumer has
//! drained: every request applied exactly once and every bad message dead-lettered. Each valid
//! request credits its own account with 1, so a balance of 0 is a lost message and a balance of
//! 2 or more one applied twice.

use async_nats::jetstream::{self, consumer::pull, stream};
use inbox_testkit::{
    Backend, CreditConfig, CreditProcess, Database, Outgoing, Poll, PrivateNats, backlog,
    publish_and_wait, unique,
};
use sqlx::any::AnyPoolOptions;
use sqlx::{AnyPool, AssertSqlSafe, SqlSafeStr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const POISON: usize = 5;
const OVERDRAWS: usize = 5;
const INSTANCES: usize = 3;
const STREAM: &str = "CHAOS";
const SUBJECT: &str = "chaos.credits";
const DURABLE: &str = "chaos";
/// The runtime's default dead-letter stream, which `credit` uses.
const DLQ_STREAM: &str = "INBOX_DLQ";
/// How often a `credit` process is SIGKILLed.
const KILL_EVERY: Duration = Duration::from_secs(2);

/// What `cargo xtask chaos` was asked for.
pub struct Options {
    backends: Vec<Backend>,
    messages: usize,
    release: bool,
}

impl Options {
    /// The short run `cargo xtask test` ends with: every backend, 2,000 requests, debug build.
    pub fn short() -> Options {
        Options {
            backends: Backend::ALL.to_vec(),
            messages: 2_000,
            release: false,
        }
    }

    /// `[--db postgres|mysql|sqlite|all] [--messages N] [--release]`.
    pub fn parse(args: &[String]) -> Result<Options, String> {
        let mut options = Options {
            messages: 20_000,
            ..Options::short()
        };
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--db" => {
                    options.backends = match it.next().map(String::as_str) {
                        Some("all") => Backend::ALL.to_vec(),
                        Some(word) if Backend::parse(word).is_some() => {
                            Backend::parse(word).into_iter().collect()
                        }
                        other => {
                            return Err(format!(
                                "--db takes postgres, mysql, sqlite or all, not {other:?}"
                            ));
                        }
                    }
                }
                "--messages" => {
                    options.messages = it
                        .next()
                        .and_then(|n| n.parse().ok())
                        .filter(|n| *n >= 100)
                        .ok_or("--messages takes a number of at least 100")?;
                }
                "--release" => options.release = true,
                other => {
                    return Err(format!(
                        "unknown chaos option {other:?}; see `cargo xtask help`"
                    ));
                }
            }
        }
        Ok(options)
    }
}

/// Whether every database connection has been cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DbCut {
    /// Not yet.
    Pending,
    /// Cut: this many sessions were ended.
    Cut {
        /// Sessions ended.
        sessions: u64,
    },
    /// The backend has no connections to cut (SQLite is in-process).
    NotApplicable,
}

/// The faults one run went through.
#[derive(Debug, Clone, Copy)]
struct Faults {
    /// `credit` processes SIGKILLed (and restarted).
    kills: usize,
    /// Whether the nats-server was killed and restarted.
    nats_restarted: bool,
    /// The database connections.
    db_cut: DbCut,
}

impl Faults {
    fn all_done(&self) -> bool {
        self.nats_restarted && self.db_cut != DbCut::Pending
    }
}

/// What was published.
struct Published {
    /// Messages in all.
    total: usize,
    /// Distinct valid requests.
    unique: usize,
    /// Messages that must be dead-lettered.
    dead_expected: usize,
}

/// What one backend's run came to.
struct Report {
    backend: Backend,
    published: Published,
    applied: i64,
    skipped: u64,
    dead_actual: u64,
    lost: i64,
    twice: i64,
    /// Accounts that an overdraw created: a CHECK violation that was applied.
    overdrawn: i64,
    faults: Faults,
}

impl Report {
    fn ok(&self) -> bool {
        self.lost == 0
            && self.twice == 0
            && self.overdrawn == 0
            && self.dead_actual == self.published.dead_expected as u64
    }
}

/// Runs chaos on each backend asked for and prints the table.
pub async fn run(options: Options) -> Result<(), String> {
    let credit = crate::build_credit(options.release)?;
    let logs = crate::workspace_root().join("target/chaos");
    std::fs::create_dir_all(&logs).map_err(|e| e.to_string())?;
    sqlx::any::install_default_drivers();

    let mut reports = Vec::new();
    for &backend in &options.backends {
        let n = options.messages;
        println!("\n== chaos on {} ({n} requests)", backend.name());
        reports.push(chaos(backend, n, &credit, &logs).await?);
    }

    let row = |cells: [&str; 10]| {
        let [b, p, u, a, s, d, l, t, k, c] = cells;
        println!("{b:<9} {p:>9} {u:>7} {a:>8} {s:>8} {d:>14} {l:>5} {t:>6} {k:>6} {c:>9}");
    };
    row([
        "backend",
        "published",
        "unique",
        "applied",
        "skipped",
        "dead (exp/act)",
        "lost",
        "twice",
        "kills",
        "db cut",
    ]);
    for r in &reports {
        let db_cut = match r.faults.db_cut {
            DbCut::Cut { sessions } => format!("yes ({sessions})"),
            DbCut::NotApplicable => "n/a".into(),
            DbCut::Pending => "no".into(),
        };
        row([
            r.backend.name(),
            &r.published.total.to_string(),
            &r.published.unique.to_string(),
            &r.applied.to_string(),
            &r.skipped.to_string(),
            &format!("{}/{}", r.published.dead_expected, r.dead_actual),
            &r.lost.to_string(),
            &r.twice.to_string(),
            &r.faults.kills.to_string(),
            &db_cut,
        ]);
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

/// One backend's run: its own nats-server and database, publish, supervise, verify.
async fn chaos(backend: Backend, n: usize, credit: &Path, logs: &Path) -> Result<Report, String> {
    let run = unique("");
    let mut nats = PrivateNats::start().await?;
    let db = Database::create(backend, "inbox_chaos_").await?;
    // Lazy: for SQLite the file appears when the first `credit` starts.
    let pool = AnyPoolOptions::new()
        .max_connections(1)
        .connect_lazy(&db.url)
        .map_err(|e| e.to_string())?;
    let config = CreditConfig {
        binary: credit.to_owned(),
        nats_url: nats.url.clone(),
        database_url: db.url.clone(),
        stream: STREAM.into(),
        subject: SUBJECT.into(),
        consumer: DURABLE.into(),
        rust_log: "warn".into(),
    };
    let result = async {
        let js = jetstream::new(inbox_testkit::connect(&nats.url).await?);
        let published = publish(&js, n, &run).await?;
        let logs = |k: usize| logs.join(format!("{}-{run}-{k}.log", backend.name()));
        let (faults, skips) = supervise(&config, logs, n, &mut nats, &db, &pool, &js).await?;
        verify(backend, published, faults, skips, &pool, &js).await
    }
    .await;
    pool.close().await;
    db.remove().await?;
    result
}

/// Creates the stream and consumer and publishes every message, awaiting every PubAck.
async fn publish(js: &jetstream::Context, n: usize, run: &str) -> Result<Published, String> {
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
    let mut messages: Vec<Outgoing> = Vec::with_capacity(2 * n + POISON + OVERDRAWS);
    for pass in 0..2 {
        for i in 0..n {
            let id = format!("c-{run}-{i}");
            let body = serde_json::json!({ "id": id, "account": i, "amount": 1 });
            let body = serde_json::to_vec(&body).expect("json");
            messages.push(match pass {
                0 => Outgoing::with_msg_id(body, &id),
                _ => body.into(),
            });
            let j = i / (n / POISON);
            if pass == 0 && i % (n / POISON) == 0 {
                if j < POISON {
                    messages.push(b"{ not json".to_vec().into());
                }
                if j < OVERDRAWS {
                    let bad = serde_json::json!({ "id": format!("neg-{run}-{j}"), "account": n + j, "amount": -5 });
                    messages.push(serde_json::to_vec(&bad).expect("json").into());
                }
            }
        }
    }
    println!("publishing {} messages...", messages.len());
    let total = publish_and_wait(js, SUBJECT, messages).await?;
    Ok(Published {
        total,
        unique: n,
        dead_expected: POISON + OVERDRAWS,
    })
}

/// Runs the `credit` processes through the faults until every request is applied and the
/// consumer has drained; returns the faults and the duplicates the survivors report skipping.
async fn supervise(
    config: &CreditConfig,
    log: impl Fn(usize) -> PathBuf,
    n: usize,
    nats: &mut PrivateNats,
    db: &Database,
    pool: &AnyPool,
    js: &jetstream::Context,
) -> Result<(Faults, u64), String> {
    let spawn = |k: usize| CreditProcess::spawn(config, Some(&log(k)));
    let mut children: Vec<CreditProcess> = (0..INSTANCES).map(spawn).collect::<Result<_, _>>()?;
    let deadline = Duration::from_secs(300) + Duration::from_millis(20 * n as u64);
    let mut poll = Poll::new(
        "every request to be applied and the consumer drained",
        deadline,
    );
    let mut faults = Faults {
        kills: 0,
        nats_restarted: false,
        db_cut: DbCut::Pending,
    };
    let mut last_kill = Instant::now();
    let n = n as i64;
    loop {
        let applied = applied(pool).await.unwrap_or(0);
        let drained = backlog(js, STREAM, DURABLE)
            .await
            .is_ok_and(|b| b.drained());
        if faults.all_done() && applied >= n && drained {
            break;
        }
        // Every two seconds, and at least once early on, however fast the run.
        let due = last_kill.elapsed() > KILL_EVERY || (faults.kills == 0 && applied >= n / 6);
        if due && applied < n {
            let k = (uuid::Uuid::new_v4().as_u128() % INSTANCES as u128) as usize;
            children[k].kill().await?;
            children[k] = spawn(k)?;
            faults.kills += 1;
            last_kill = Instant::now();
        }
        if !faults.nats_restarted && applied >= n / 3 {
            println!("  killing and restarting nats-server ({applied} applied)");
            nats.restart().await?;
            faults.nats_restarted = true;
        }
        if faults.nats_restarted && faults.db_cut == DbCut::Pending && applied >= 2 * n / 3 {
            println!("  cutting every database connection ({applied} applied)");
            faults.db_cut = match db.cut().await? {
                Some(sessions) => DbCut::Cut { sessions },
                None => DbCut::NotApplicable,
            };
        }
        poll.tick()
            .await
            .map_err(|e| format!("{e} ({applied} of {n} applied)"))?;
    }
    let mut skipped = 0;
    for child in children {
        skipped += child.stop(Duration::from_secs(60)).await?.skipped;
    }
    Ok((faults, skipped))
}

/// Counts what the run came to from the database and the dead-letter stream.
async fn verify(
    backend: Backend,
    published: Published,
    faults: Faults,
    skipped: u64,
    pool: &AnyPool,
    js: &jetstream::Context,
) -> Result<Report, String> {
    let n = published.unique;
    let accounts = |filter: String| {
        scalar(
            pool,
            format!("SELECT count(*) FROM accounts WHERE {filter}"),
        )
    };
    let once = accounts(format!("id < {n} AND balance = 1")).await?;
    let twice = accounts(format!("id < {n} AND balance >= 2")).await?;
    let overdrawn = accounts(format!("id >= {n}")).await?;
    // A failed audit is a failure, never a count of 0: the run always dead-letters, so the
    // stream must exist.
    let dead_actual = js
        .get_stream(DLQ_STREAM)
        .await
        .map_err(|e| format!("dead-letter stream {DLQ_STREAM}: {e}"))?
        .info()
        .await
        .map_err(|e| format!("dead-letter stream {DLQ_STREAM} info: {e}"))?
        .state
        .messages;
    let _ = js.delete_stream(STREAM).await;
    Ok(Report {
        backend,
        applied: applied(pool).await?,
        skipped,
        dead_actual,
        overdrawn,
        lost: n as i64 - once - twice,
        twice,
        faults,
        published,
    })
}

/// Markers of `credit`'s requests.
async fn applied(pool: &AnyPool) -> Result<i64, String> {
    scalar(
        pool,
        "SELECT count(*) FROM inbox WHERE consumer = 'credit'".into(),
    )
    .await
}

async fn scalar(pool: &AnyPool, sql: String) -> Result<i64, String> {
    sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql.clone()).into_sql_str())
        .fetch_one(pool)
        .await
        .map_err(|e| format!("{sql}: {e}"))
}
