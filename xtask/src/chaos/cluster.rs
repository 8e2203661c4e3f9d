//! `cargo xtask chaos --cluster`: the `credit` run on a 3-node JetStream cluster of its own
//! ([`PrivateCluster`]), the stream and its consumer replicated three times.
//!
//! **Publish** as the single-server run does (requests twice, poison payloads, overdraws,
//! unopened accounts last), into an R3 stream; the dead-letter stream, R3 too, stores from the
//! start (this run's faults are the servers').
//!
//! **Supervise**: three `credit` processes, given the server list in `NATS_URL`, work while the
//! servers fail: four times, from a tenth of the requests applied on, a node is SIGKILLed, in
//! turn the stream's leader and the follower with the most client connections (a server
//! processes are connected to; the leader when no follower has any); each is restarted once
//! the stream has a leader again, so that the cluster keeps its quorum for the next, which follows at once, until the consumer drains (the
//! credits to unopened accounts keep it at work for `9 × ack_wait` after the last request is
//! handed out, so the kills do not depend on how fast the processes are; a node kill, unlike a
//! process kill, is safe on a last delivery).
//!
//! **Verify** message by message with the single-server run's audit, and that every process
//! exited 0 when stopped.

use super::audit::Audited;
use super::db::{applied, audit_pool};
use super::observe::observe;
use super::publish::{Published, create_accounts, publish};
use super::report::{Columns, Report, Row};
use super::setup::{self, Common};
use super::streams::{DURABLE, INSTANCES, STREAM, credit_config, lift_outage, wait_for_letters};
use async_nats::jetstream;
use inbox_testkit::{
    Backend, CreditConfig, CreditProcess, Database, Poll, PrivateCluster, backlog, unique,
};
use std::path::Path;
use std::time::{Duration, Instant};

/// The nodes killed, in this order: the first once a tenth of the requests is applied, each
/// next as soon as the one before is back.
const FAULTS: [Target; 4] = [
    Target::Leader,
    Target::Connected,
    Target::Leader,
    Target::Connected,
];

/// `CREDIT_CONCURRENCY` of each process: low, so that the run outlasts its four faults.
const CONCURRENCY: &str = "2";

/// Which node a fault kills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// The stream's leader.
    Leader,
    /// The node with the most client connections.
    Connected,
}

/// One node kill.
#[derive(Debug, Clone)]
struct Kill {
    /// Which node it aimed at.
    target: Target,
    /// The node killed.
    node: usize,
    /// Requests applied when it was killed.
    applied: i64,
    /// How long until the stream had a leader again.
    election: Duration,
}

/// The table's columns: the node kills.
const COLUMNS: Columns = Columns {
    backend: Some("backend (cluster)"),
    announced: false,
    own: &[
        "leader kills",
        "conn. kills",
        "longest election",
        "killed (node@applied)",
    ],
    right_aligned: false,
};

/// Runs the cluster run on each backend asked for and prints the table; fails unless every
/// message ended as it must and every node kill happened.
pub async fn run(options: Common) -> Result<(), String> {
    let credit = crate::workspace::build_credit(options.release)?;
    let setup = setup::prepare(options.current_nats)?;
    let mut rows = Vec::new();
    for &backend in &options.backends {
        let n = options.messages;
        println!(
            "\n== chaos on a 3-node cluster, {} ({n} requests, nats-server {})",
            backend.name(),
            setup.version
        );
        let binaries = (credit.as_path(), setup.nats_server.as_path());
        rows.push(run_on(backend, n, binaries, &setup.logs).await?);
    }
    let report = Report {
        columns: COLUMNS,
        rows,
    };
    report.print_table();
    report.print_failures();
    println!(
        "(node kills happen mid-run, each node restarted after the stream's next election; \
         skipped by the processes: {})",
        report.skipped()
    );
    let failed = report.failed();
    println!(
        "chaos --cluster: {} passed, {failed} failed",
        report.rows.len() - failed
    );
    if failed == 0 {
        println!(
            "\nexactly once through node kills, message by message: every request applied \
             once, every rejected message dead-lettered once, nothing else."
        );
        Ok(())
    } else {
        Err("chaos --cluster FAILED: see the findings above".into())
    }
}

/// The report's row of the run on `backend`: its node kills in its own columns, and a kill that
/// did not happen failing it.
fn row(backend: Backend, audited: Audited, kills: &[Kill]) -> Row {
    let of = |t: Target| kills.iter().filter(|k| k.target == t).count();
    let longest = kills.iter().map(|k| k.election).max().unwrap_or_default();
    let killed: Vec<String> = kills
        .iter()
        .map(|k| format!("n{}@{}", k.node, k.applied))
        .collect();
    let missing = (kills.len() < FAULTS.len()).then(|| {
        format!(
            "only {} of {} node kills happened before the run drained",
            kills.len(),
            FAULTS.len()
        )
    });
    Row {
        backend: backend.name(),
        name: format!("{} (cluster)", backend.name()),
        audited,
        own: vec![
            of(Target::Leader).to_string(),
            of(Target::Connected).to_string(),
            format!("{:.1}s", longest.as_secs_f64()),
            killed.join(" "),
        ],
        missing: missing.into_iter().collect(),
    }
}

/// One backend's cluster run: its own cluster and database, publish, supervise, verify.
async fn run_on(
    backend: Backend,
    n: usize,
    (credit, nats_server): (&Path, &Path),
    logs: &Path,
) -> Result<Row, String> {
    let run = unique("");
    let mut cluster = PrivateCluster::start_binary(nats_server.to_owned()).await?;
    let db = Database::create(backend, "inbox_chaos_cluster_").await?;
    let pool = audit_pool(backend, &db)?;
    let config = credit_config(credit, cluster.urls(), db.url.clone());
    let result = async {
        let js = jetstream::new(cluster.connect().await?);
        create_accounts(backend, &pool, n).await?;
        let published = publish(&js, n, &run, 3, None).await?;
        lift_outage(&js).await?;
        let logs = |k: usize| logs.join(format!("cluster-{}-{run}-{k}.log", backend.name()));
        let (kills, skipped) =
            supervise(&config, logs, n, &mut cluster, &pool, &js, &published).await?;
        let seen = observe(backend, &pool, &js).await?;
        Ok(row(
            backend,
            Audited::new(&published, &seen, skipped),
            &kills,
        ))
    }
    .await;
    pool.close().await;
    db.remove().await?;
    result
}

/// Runs the processes through the node kills until the consumer has drained; every process must
/// stop cleanly. Returns the kills and the duplicates the processes skipped.
async fn supervise(
    config: &CreditConfig,
    log: impl Fn(usize) -> std::path::PathBuf,
    n: usize,
    cluster: &mut PrivateCluster,
    pool: &sqlx::AnyPool,
    js: &jetstream::Context,
    published: &Published,
) -> Result<(Vec<Kill>, u64), String> {
    let env = || {
        let mut env = config.env();
        env.push(("CREDIT_CONCURRENCY", CONCURRENCY.into()));
        env
    };
    let children: Vec<CreditProcess> = (0..INSTANCES)
        .map(|k| CreditProcess::spawn_with("credit", &config.binary, &env(), Some(&log(k))))
        .collect::<Result<_, _>>()?;
    let deadline = Duration::from_secs(300) + Duration::from_millis(40 * n as u64);
    let mut poll = Poll::new("the consumer to drain on the cluster", deadline);
    let mut kills: Vec<Kill> = Vec::new();
    let n = n as i64;
    let mut applied_now = 0;
    loop {
        if let Ok(a) = applied(pool).await {
            applied_now = a;
        }
        let backlog = backlog(js, STREAM, DURABLE).await.ok();
        let drained = backlog.is_some_and(|b| b.drained());
        if drained && kills.len() == FAULTS.len() {
            break;
        }
        // Drained before every kill: the audit still runs, and the report says which are missing.
        if drained && applied_now >= n {
            break;
        }
        // Until the consumer drains: the credits to unopened accounts keep it busy for at least
        // `9 × ack_wait` after the last request is handed out, however fast the processes are.
        // A node kill is safe even on a message's last delivery: the process lives on, and a
        // letter the dying server cannot take is parked in the database and relayed.
        if let Some(&target) = FAULTS.get(kills.len())
            && applied_now >= n / 10
            && !drained
        {
            kills.push(kill_one(cluster, js, target, applied_now).await?);
        }
        poll.tick()
            .await
            .map_err(|e| format!("{e} ({applied_now} of {n} applied, kills {kills:?})"))?;
    }
    // Past the wait, the audit names the letters that are missing.
    let _ = wait_for_letters(js, published.dead_expected as u64).await;
    let mut skipped = 0;
    for (k, child) in children.into_iter().enumerate() {
        let summary = child.stop(Duration::from_secs(60)).await.map_err(|e| {
            format!(
                "credit #{k} did not stop cleanly on the cluster: {e} (log: {})",
                log(k).display()
            )
        })?;
        skipped += summary.skipped;
    }
    Ok((kills, skipped))
}

/// Kills the node `target` names, waits until the stream has a leader again, and restarts it.
async fn kill_one(
    cluster: &mut PrivateCluster,
    js: &jetstream::Context,
    target: Target,
    applied: i64,
) -> Result<Kill, String> {
    let leader = cluster.wait_new_leader(js, STREAM, None).await?;
    let node = match target {
        Target::Leader => leader,
        // A server some process is connected to, other than the leader when one is.
        Target::Connected => {
            let mut busiest = (0, leader);
            for i in (0..cluster.nodes()).filter(|&i| i != leader) {
                let connections = cluster.connections(i).await?;
                if connections > busiest.0 {
                    busiest = (connections, i);
                }
            }
            busiest.1
        }
    };
    println!(
        "  killing node n{node} ({target:?}{}) with {applied} applied",
        if node == leader {
            ", the stream leader"
        } else {
            ""
        }
    );
    cluster.kill(node);
    let since = Instant::now();
    cluster.wait_new_leader(js, STREAM, Some(node)).await?;
    let election = since.elapsed();
    cluster.restart(node).await?;
    cluster.wait_ready().await?;
    println!(
        "  stream {STREAM} led again after {:.1}s; n{node} restarted",
        election.as_secs_f64()
    );
    Ok(Kill {
        target,
        node,
        applied,
        election,
    })
}
