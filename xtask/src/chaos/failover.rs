//! `cargo xtask chaos --failover`: exactly-once across a database failover, audited message by
//! message with the `credit` run's audit (this module is a child of `chaos.rs`, whose
//! publishing, accounts, read-back and audit it reuses unchanged).
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
//! SIGKILLed at once (COMMITs in flight get no answer), the standby is promoted
//! (`pg_promote()`, waited until out of recovery), and only then the proxy is switched to it
//! (before, it would refuse writes). The `credit` processes see their connections lost, wait
//! the outage out, and reconnect through the same address.
//!
//! **Verify** once the consumer has drained, on the new primary itself: every request applied
//! exactly once, every message to reject dead-lettered exactly once, nothing else; every
//! process stopped cleanly.

use super::{
    DURABLE, Findings, LETTERS_WITHIN, Published, STREAM, SUBJECT, applied, audit, create_accounts,
    lift_outage, observe, publish, stored_letters,
};
use async_nats::jetstream;
use inbox_testkit::{
    Backend, CreditConfig, CreditProcess, Poll, PrimaryStandby, PrivateNats, Replication, TcpProxy,
    backlog, unique,
};
use sqlx::AnyPool;
use sqlx::any::AnyPoolOptions;
use std::path::Path;
use std::time::{Duration, Instant};

/// `credit` processes at work.
const INSTANCES: usize = 3;

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

/// What the run came to.
struct Report {
    /// Messages published in all.
    total: usize,
    /// Distinct valid requests.
    requests: usize,
    /// Messages that must be dead-lettered.
    dead_expected: usize,
    /// The audit's findings.
    findings: Findings,
    /// Duplicates the processes skipped.
    skipped: u64,
    /// The failover.
    failover: Failover,
}

impl Report {
    /// Every message ended as it must, and the failover came mid-run.
    fn ok(&self) -> bool {
        self.findings.problems.is_empty()
            && self.findings.applied_once == self.requests
            && self.findings.dead_once == self.dead_expected
            && (self.failover.at as usize) < self.requests
    }

    fn print(&self) {
        let f = &self.findings;
        let (lost, twice, other) = f.tally();
        let mut table = comfy_table::Table::new();
        table.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
        table.set_header([
            "published",
            "applied once",
            "dead",
            "lost",
            "twice",
            "other",
            "failover at",
            "switched after",
            "drained after",
        ]);
        table.add_row([
            self.total.to_string(),
            format!("{}/{}", f.applied_once, self.requests),
            format!("{}/{}", f.dead_once, self.dead_expected),
            lost.to_string(),
            twice.to_string(),
            other.to_string(),
            format!("{} applied", self.failover.at),
            format!("{:.1}s", self.failover.switched.as_secs_f64()),
            format!("{:.1}s", self.failover.drained.as_secs_f64()),
        ]);
        println!("{table}");
        println!(
            "(failover: every process of the primary SIGKILLed, the synchronous standby \
             promoted, the proxy switched to it; skipped by the processes: {})",
            self.skipped
        );
        if self.ok() {
            return;
        }
        println!("\nfailover FAILED:");
        f.print_problems();
        if self.failover.at as usize >= self.requests {
            println!("  every request was applied before the failover: nothing was tested");
        }
    }
}

/// Runs the failover run as `args` say (`--messages`, `--release`, `--nats`; `--db` must include
/// postgres, `--run` does not apply) and prints its table; fails unless every message ended as
/// it must.
pub async fn run(args: &crate::cli::ChaosArgs) -> Result<(), String> {
    if !args.db.0.contains(&Backend::Postgres) {
        return Err("--failover runs on PostgreSQL only: leave --db out or say postgres".into());
    }
    let (n, current_nats) = (
        args.messages as usize,
        args.nats == crate::cli::Nats::Current,
    );
    let credit = crate::build_credit(args.release)?;
    let logs = crate::workspace_root().join("target/chaos");
    std::fs::create_dir_all(&logs).map_err(|e| e.to_string())?;
    sqlx::any::install_default_drivers();
    let (nats_server, version) = if current_nats {
        (crate::nats_current::binary()?, crate::nats_current::VERSION)
    } else {
        (inbox_testkit::nats_server_binary()?, "the machine's")
    };
    println!(
        "\n== chaos, database failover, on a private PostgreSQL primary with a synchronous \
         standby ({n} requests, nats-server {version})"
    );
    let report = failover(n, (&credit, &nats_server), &logs).await?;
    report.print();
    if report.ok() {
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
) -> Result<Report, String> {
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
    let published = publish(&js, n, &run, 1).await?;
    lift_outage(&js).await?;

    let config = CreditConfig {
        binary: credit.to_owned(),
        nats_url: nats.url.clone(),
        database_url: url,
        stream: STREAM.into(),
        subject: SUBJECT.into(),
        consumer: DURABLE.into(),
        rust_log: "warn".into(),
    };
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
                pair.promote_standby().await?;
                // Only now: before its promotion the standby refuses writes (25006).
                proxy.switch_to(&pair.standby().address());
                let switched = killed.elapsed();
                println!(
                    "  standby promoted and the proxy switched to it after {:.1}s",
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
    let mut wait = Poll::new("the letters to be stored", LETTERS_WITHIN);
    while !stored_letters(&js)
        .await
        .is_ok_and(|k| k >= published.dead_expected as u64)
    {
        if wait.tick().await.is_err() {
            break;
        }
    }
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
    Ok(report(
        &published,
        audit(&published, &seen),
        skipped,
        failover,
    ))
}

fn report(published: &Published, findings: Findings, skipped: u64, failover: Failover) -> Report {
    Report {
        total: published.by_seq.len(),
        requests: published.requests,
        dead_expected: published.dead_expected,
        findings,
        skipped,
        failover,
    }
}
