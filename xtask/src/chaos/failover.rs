//! `cargo xtask chaos --failover`: exactly-once across a database failover, audited message by
//! message with the `credit` run's audit (it reuses the `credit` run's publishing, accounts,
//! read-back, audit and report unchanged).
//!
//! **Set up**: a private nats-server; a private PostgreSQL primary and a hot standby streaming
//! from it (`pg_basebackup -R`), the standby synchronous (`synchronous_standby_names`, so that a
//! COMMIT is acknowledged only once the standby has it); a TCP proxy in front of the primary,
//! the one address the `credit` processes know (what a virtual IP or a DNS name is in
//! production). sqlx 0.9 takes one host per URL and ignores `target_session_attrs`, so a
//! multi-host URL cannot do it: the address has to move.
//!
//! **Publish** as the `credit` chaos run does (every request twice, poison payloads, overdraws,
//! credits to unopened accounts last); the dead-letter stream stores letters from the start
//! (the failover is this run's one fault).
//!
//! **Fail over**, once a third of the requests are applied: every process of the primary is
//! SIGKILLed at once (COMMITs in flight get no answer), the proxy is switched to the standby
//! while it is still read-only, for [`READ_ONLY_FOR`] (a standby answering before its promotion:
//! every write refused with 25006), and then the standby is promoted (`pg_promote()`, waited
//! until out of recovery). The `credit` processes see their connections lost, then writes
//! refused, wait both out as an outage, and go on through the same address.
//!
//! **Verify** once the consumer has drained, on the new primary itself: every request applied
//! exactly once, every message to reject dead-lettered exactly once, nothing else; every
//! process stopped cleanly.

use super::audit::Audited;
use super::db::applied;
use super::observe::observe;
use super::publish::{create_accounts, publish};
use super::report::{Columns, Report, Row};
use super::setup::{self, Common};
use super::streams::{DURABLE, INSTANCES, STREAM, credit_config, lift_outage, wait_for_letters};
use async_nats::jetstream;
use inbox_testkit::{
    Backend, CreditProcess, Poll, PrimaryStandby, PrivateNats, Replication, TcpProxy, backlog,
    unique,
};
use sqlx::AnyPool;
use sqlx::any::AnyPoolOptions;
use std::path::Path;
use std::time::{Duration, Instant};

/// How long the proxy points at the standby before it is promoted: the processes meet its
/// read-only refusals for longer than a few quick naks would last (`ack_wait` is 4 s).
const READ_ONLY_FOR: Duration = Duration::from_secs(10);

/// The failover, as it went.
#[derive(Debug, Clone, Copy)]
struct Failover {
    /// Requests applied when the primary was killed.
    at: i64,
    /// From the kill until the proxy pointed at the promoted standby.
    switched: Duration,
    /// From the kill until the consumer had drained.
    drained: Duration,
}

/// The table's columns: the failover's timing.
const COLUMNS: Columns = Columns {
    backend: None,
    announced: false,
    own: &["failover at", "switched after", "drained after"],
    right_aligned: false,
};

/// Runs the failover run as `options` say (`backends` must include PostgreSQL, the only one it
/// runs on) and prints its table; fails unless
/// every message ended as it must.
pub async fn run(options: Common) -> Result<(), String> {
    if !options.backends.contains(&Backend::Postgres) {
        return Err("--failover runs on PostgreSQL only: leave --db out or say postgres".into());
    }
    let n = options.messages;
    let credit = crate::workspace::build_credit(options.release)?;
    let setup = setup::prepare(options.current_nats)?;
    println!(
        "\n== chaos, database failover, on a private PostgreSQL primary with a synchronous \
         standby ({n} requests, nats-server {})",
        setup.version
    );
    let row = failover(n, (&credit, &setup.nats_server), &setup.logs).await?;
    let report = Report {
        columns: COLUMNS,
        rows: vec![row],
    };
    report.print_table();
    println!(
        "(failover: every process of the primary SIGKILLed, the synchronous standby \
         promoted, the proxy switched to it; skipped by the processes: {})",
        report.rows[0].audited.skipped
    );
    report.print_failures();
    if report.failed() == 0 {
        println!(
            "\nexactly once across a database failover, message by message: every request \
             applied once on the promoted standby, every rejected message dead-lettered once, \
             nothing else."
        );
        Ok(())
    } else {
        Err("chaos failover run FAILED: see the findings above".into())
    }
}

/// The report's row: the failover's timing in its own columns, and a failover after every
/// request was applied failing it (it tested nothing).
fn row(audited: Audited, failover: Failover) -> Row {
    let missing = (failover.at as usize >= audited.requests)
        .then(|| "every request was applied before the failover: nothing was tested".to_owned());
    Row {
        backend: Backend::Postgres.name(),
        name: "failover".into(),
        audited,
        own: vec![
            format!("{} applied", failover.at),
            format!("{:.1}s", failover.switched.as_secs_f64()),
            format!("{:.1}s", failover.drained.as_secs_f64()),
        ],
        missing: missing.into_iter().collect(),
    }
}

/// A pool of one connection on `url` that gives up fast (the audit's look through an outage
/// fails, and is tried again, rather than waiting 30 s).
fn watch_pool(url: &str) -> Result<AnyPool, String> {
    AnyPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy(url)
        .map_err(|e| format!("{url}: {e}"))
}

/// The run: servers, publish, fail over mid-run, verify on the new primary.
async fn failover(
    n: usize,
    (credit, nats_server): (&Path, &Path),
    logs: &Path,
) -> Result<Row, String> {
    let run = unique("");
    let nats = PrivateNats::start_binary(nats_server.to_owned()).await?;
    let mut pair = PrimaryStandby::start(Replication::Synchronous).await?;
    let mut proxy = TcpProxy::reserve()?;
    proxy.start(&pair.primary().address()).await?;
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable",
        proxy.port
    );
    let pool = watch_pool(&url)?;
    let client = inbox_testkit::connect(&nats.url).await?;
    let js = jetstream::new(client);
    create_accounts(Backend::Postgres, &pool, n).await?;
    let published = publish(&js, n, &run, 1, None).await?;
    lift_outage(&js).await?;

    let config = credit_config(credit, nats.url.clone(), url);
    let log = |k: usize| logs.join(format!("failover-{run}-{k}.log"));
    let mut children: Vec<CreditProcess> = (0..INSTANCES)
        .map(|k| CreditProcess::spawn(&config, Some(&log(k))))
        .collect::<Result<_, _>>()?;

    let deadline = Duration::from_secs(300) + Duration::from_millis(20 * n as u64);
    let mut poll = Poll::new(
        "the failover to be done and the consumer to be drained",
        deadline,
    );
    let mut done: Option<(i64, Instant, Duration)> = None;
    // The last count that could be read: a failed look (the primary is down) is not 0.
    let mut applied_now = 0;
    let failover = loop {
        if let Ok(a) = applied(&pool).await {
            applied_now = a;
        }
        for (k, child) in children.iter_mut().enumerate() {
            if child.has_exited() {
                return Err(format!(
                    "credit #{k} exited during the run; its log: {}",
                    log(k).display()
                ));
            }
        }
        let drained = backlog(&js, STREAM, DURABLE)
            .await
            .is_ok_and(|b| b.drained());
        match done {
            None if applied_now >= n as i64 / 3 => {
                println!("  killing the primary ({applied_now} applied)");
                let killed = Instant::now();
                pair.kill_primary();
                // The address moves to the standby before its promotion, as a failover manager
                // may move it: for a while the processes reach a server that answers but
                // refuses writes (25006), an outage to them, not the messages' fault.
                proxy.switch_to(&pair.standby().address());
                tokio::time::sleep(READ_ONLY_FOR).await;
                pair.promote_standby().await?;
                let switched = killed.elapsed();
                println!(
                    "  the proxy switched to the standby, read-only for {:.0}s, then promoted, \
                     after {:.1}s",
                    READ_ONLY_FOR.as_secs_f64(),
                    switched.as_secs_f64()
                );
                done = Some((applied_now, killed, switched));
            }
            Some((at, killed, switched)) if drained => {
                break Failover {
                    at,
                    switched,
                    drained: killed.elapsed(),
                };
            }
            _ => {}
        }
        poll.tick()
            .await
            .map_err(|e| format!("{e} ({applied_now} of {n} applied)"))?;
    };

    // A letter parked in the database is relayed by the processes: keep them until the stream
    // holds a letter per message to reject, or the wait is over (the audit names what is missing).
    let _ = wait_for_letters(&js, published.dead_expected as u64).await;
    let mut skipped = 0;
    for (k, child) in children.into_iter().enumerate() {
        let summary = child
            .stop(Duration::from_secs(60))
            .await
            .map_err(|e| format!("credit #{k}: {e}; its log: {}", log(k).display()))?;
        skipped += summary.skipped;
    }

    // On the new primary itself, not through the proxy.
    let new_primary = watch_pool(&pair.standby().url("disable"))?;
    let seen = observe(Backend::Postgres, &new_primary, &js).await?;
    new_primary.close().await;
    pool.close().await;
    Ok(row(Audited::new(&published, &seen, skipped), failover))
}
