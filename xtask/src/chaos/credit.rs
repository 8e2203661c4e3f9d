//! The single-server `credit` run of `cargo xtask chaos`, in three steps.
//!
//! **Publish**, on a private nats-server: N credit requests each published twice (once with
//! `Nats-Msg-Id`, once without); a few to be dead-lettered at once, poison payloads (each a
//! non-JSON text of its own) and overdraws (debits of accounts never credited); three valid requests published
//! over a raw connection with a header block async-nats cannot parse (a non-ASCII byte in a
//! name, a value that is not UTF-8, a control byte in a name), which no worker ever sees and the
//! delivery-limit backstop dead-letters; and, last in the stream, a few credits to accounts never
//! opened (a foreign-key violation), which the runtime redelivers with a delay until
//! `max_deliver` and then dead-letters. Every message's stream sequence is kept from its PubAck.
//! `credit`'s own schema has no payload that fails that way (its statements fail only with a
//! CHECK violation, a data error or a debit of no account, all dead-lettered at once, or
//! transiently), so chaos creates
//! `accounts` itself, as `credit` would plus a foreign key to `open_accounts`.
//!
//! **Supervise**: three `credit` processes (#0 batched, `CREDIT_BATCH`, its batches ordered by
//! the handler's lane) work through the [`Faults`]: one of them is SIGKILLed
//! and restarted every two seconds; one is frozen with SIGSTOP for twice `ack_wait` (what it holds
//! is redelivered to the others while its transactions stay open) and then let go with SIGCONT;
//! the nats-server is killed and restarted once; every database connection is cut once; the
//! dead-letter stream rejects every letter, from the start until a worker's letter has been
//! rejected on its message's last delivery (earlier ones are nak'd and tried again; that one must
//! be parked and relayed later), and is then deleted, so that the processes must create it
//! again for their next letter (parked ones included); and then, up to three times, a process is SIGKILLed while it
//! holds a message on its last delivery. The processes hold every last delivery for
//! [`LAST_DELIVERY_HOLD`] before their first statement (`CREDIT_TEST_LAST_DELIVERY_HOLD_MS`,
//! seen in their logs): the unopened credits and the overdraws and poisons whose letters the
//! outage rejected all reach that delivery. JetStream never delivers such a message again, so
//! only the delivery-limit backstop (its `MAX_DELIVERIES` advisory) can dead-letter it.
//!
//! **Verify**, once the consumer has drained, message by message: every sequence of the stream
//! applied or dead-lettered, none neither; every request id applied exactly once (its account's
//! balance is 1 and its marker is committed); every other message dead-lettered exactly once
//! (one letter names its stream sequence and carries its payload, an unopened account's letter
//! says it came at delivery `max_deliver`, an unreadable message's carries its header lines); and
//! nothing else in the database or the dead-letter stream. A query that fails fails the run:
//! nothing counts as 0.
//!
//! The random kills stop once every message has been handed out; from then on a process dies
//! only on purpose, holding a last delivery.

use super::audit::Audited;
use super::db::{applied, audit_pool};
use super::faults::{
    DbCut, Faults, KILL_EVERY, LAST_DELIVERY_HOLD, LAST_DELIVERY_KILLS, LastDeliveryKills,
    LetterWatch, OUTAGE_AT_MOST, Outage, PAUSE_FOR, Pause,
};
use super::observe::observe;
use super::publish::{create_accounts, publish};
use super::report::{Columns, Row};
use super::streams::{
    DURABLE, EVENTS_STREAM, INSTANCES, STREAM, credit_config, delete_dead_letter_stream,
    wait_for_letters,
};
use async_nats::jetstream;
use inbox_testkit::{
    Backend, CreditConfig, CreditProcess, Database, LastDeliveryHolds, Poll, PrivateNats, backlog,
    unique,
};
use sqlx::AnyPool;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The table's columns: the announcements, and the faults of [`Faults`].
pub const COLUMNS: Columns = Columns {
    backend: Some("backend"),
    announced: true,
    own: &["kills", "paused", "dlq rej.", "db cut"],
    right_aligned: true,
};

/// One backend's run: its own nats-server and database, publish, supervise, verify.
pub async fn run(
    backend: Backend,
    n: usize,
    (credit, nats_server): (&Path, &Path),
    logs: &Path,
) -> Result<Row, String> {
    let run = unique("");
    let mut nats = PrivateNats::start_binary(nats_server.to_owned()).await?;
    let db = Database::create(backend, "inbox_chaos_").await?;
    // chaos creates the SQLite file itself (with the accounts table, before any `credit`).
    let pool = audit_pool(backend, &db)?;
    let config = credit_config(credit, nats.url.clone(), db.url.clone());
    let result = async {
        let client = inbox_testkit::connect(&nats.url).await?;
        let js = jetstream::new(client.clone());
        create_accounts(backend, &pool, n).await?;
        let published = publish(&js, n, &run, 1, Some(&nats.url)).await?;
        let logs = |k: usize| logs.join(format!("{}-{run}-{k}.log", backend.name()));
        let watch = LetterWatch::start(&client).await?;
        let (faults, skipped) = supervise(
            &config,
            logs,
            n,
            &mut nats,
            &db,
            &pool,
            &js,
            watch,
            published.dead_expected as u64,
        )
        .await?;
        let seen = observe(backend, &pool, &js).await?;
        let _ = js.delete_stream(STREAM).await;
        let _ = js.delete_stream(EVENTS_STREAM).await;
        Ok(row(
            backend,
            Audited::new(&published, &seen, skipped),
            &faults,
        ))
    }
    .await;
    pool.close().await;
    db.remove().await?;
    result
}

/// The report's row of the run on `backend`: its faults in its own columns, and each fault that
/// did not bite failing it.
fn row(backend: Backend, audited: Audited, faults: &Faults) -> Row {
    Row {
        backend: backend.name(),
        name: backend.name().to_owned(),
        audited,
        own: faults.cells(),
        missing: faults
            .missing()
            .into_iter()
            .map(|m| format!("fault missing: {m}"))
            .collect(),
    }
}

/// Runs the `credit` processes through the faults until every fault is done and the consumer has
/// drained (every message answered for good); returns the faults and the duplicates the
/// survivors report skipping.
#[allow(clippy::too_many_arguments)]
async fn supervise(
    config: &CreditConfig,
    log: impl Fn(usize) -> PathBuf,
    n: usize,
    nats: &mut PrivateNats,
    db: &Database,
    pool: &AnyPool,
    js: &jetstream::Context,
    watch: LetterWatch,
    letters_expected: u64,
) -> Result<(Faults, u64), String> {
    let mut fleet = Fleet::start(config, &log)?;
    let deadline = Duration::from_secs(300) + Duration::from_millis(20 * n as u64);
    let mut poll = Poll::new(
        "every fault to be done and the consumer to be drained",
        deadline,
    );
    let mut faults = Faults {
        kills: 0,
        at_last: LastDeliveryKills::default(),
        pause: Pause::Pending,
        nats_restarted: false,
        db_cut: DbCut::Pending,
        outage: Outage::Rejecting {
            since: Instant::now(),
        },
    };
    let mut watch = Some(watch);
    let mut last_kill = Instant::now();
    let n = n as i64;
    // The last count that could be read: a failed look (the database is being cut) is not 0.
    let mut applied_now = 0;
    loop {
        let last_error = match applied(pool).await {
            Ok(a) => {
                applied_now = a;
                None
            }
            Err(e) => Some(e),
        };
        let applied = applied_now;
        let backlog = backlog(js, STREAM, DURABLE).await.ok();
        let drained = backlog.is_some_and(|b| b.drained());
        // Once every message was handed out, what is left are redeliveries, among them the
        // unopened credits' last: no more crashes (see the module's doc).
        let undelivered = backlog.is_none_or(|b| b.pending > 0);
        // Drained, nothing is left to deliver: whatever is not applied by now never will be,
        // and the audit says which.
        if faults.all_done() && drained {
            break;
        }

        // The dead-letter stream rejects until a letter was rejected on its last delivery; then
        // it is deleted, and the processes must create it again.
        if let (Outage::Rejecting { since }, Some(w)) = (faults.outage, &watch) {
            let seen = w.counts();
            if seen.at_last > 0 || since.elapsed() > OUTAGE_AT_MOST {
                match delete_dead_letter_stream(js).await {
                    Ok(()) => {
                        let (rejected, messages) = (seen.by_seq.values().sum(), seen.by_seq.len());
                        let lasted = since.elapsed();
                        println!(
                            "  dead-letter stream deleted after {:.1}s (the processes create it \
                             again): it rejected {rejected} letter publishes of {messages} \
                             messages, {} on a last delivery ({applied} applied)",
                            lasted.as_secs_f64(),
                            seen.at_last,
                        );
                        faults.outage = Outage::Lifted {
                            rejected,
                            messages,
                            at_last: seen.at_last,
                            lasted,
                        };
                        watch = None;
                    }
                    // The nats-server may be restarting: try again at the next look.
                    Err(e) => println!("  deleting the dead-letter stream failed: {e}"),
                }
            }
        }

        let frozen = match faults.pause {
            Pause::Frozen { k, .. } => Some(k),
            _ => None,
        };
        // Every two seconds, and at least once early on, however fast the run; never the frozen
        // process, which is let go, not killed.
        let due = last_kill.elapsed() > KILL_EVERY || (faults.kills == 0 && applied >= n / 6);
        if due && applied < n && undelivered {
            let pick = (uuid::Uuid::new_v4().as_u128() % INSTANCES as u128) as usize;
            let k = if Some(pick) == frozen {
                (pick + 1) % INSTANCES
            } else {
                pick
            };
            let held = fleet.kill(k).await?;
            faults.count_kill(&held);
            last_kill = Instant::now();
        }

        // Once the outage has taken its parked letter: a process seen holding a last delivery is
        // killed there, up to LAST_DELIVERY_KILLS times (never the frozen one).
        if matches!(faults.outage, Outage::Lifted { .. })
            && faults.at_last.kills < LAST_DELIVERY_KILLS
        {
            for k in (0..INSTANCES).filter(|&k| Some(k) != frozen) {
                if fleet.holds[k].held()?.is_empty() {
                    continue;
                }
                let held = fleet.kill(k).await?;
                println!(
                    "  killed credit #{k} holding {held:?} on their last delivery ({applied} applied)"
                );
                faults.count_kill(&held);
                break;
            }
        }

        match faults.pause {
            // The process that has run longest: it is the likeliest to hold messages.
            Pause::Pending if applied >= n / 2 => {
                let k = (0..INSTANCES)
                    .min_by_key(|&k| fleet.started[k])
                    .expect("instances");
                fleet.children[k].pause()?;
                println!("  freezing credit #{k} (SIGSTOP) for {PAUSE_FOR:?} ({applied} applied)");
                faults.pause = Pause::Frozen {
                    k,
                    since: Instant::now(),
                };
            }
            Pause::Frozen { k, since } if since.elapsed() >= PAUSE_FOR => {
                fleet.children[k].resume()?;
                let held = since.elapsed();
                println!(
                    "  letting credit #{k} go on (SIGCONT) after {:.1}s ({applied} applied)",
                    held.as_secs_f64()
                );
                faults.pause = Pause::Done { held };
            }
            _ => {}
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
        poll.tick().await.map_err(|e| {
            let last = last_error
                .as_ref()
                .map_or(String::new(), |e| format!("; last look failed: {e}"));
            format!("{e} ({applied} of {n} applied, faults {faults:?}{last})")
        })?;
    }
    // A letter parked on a last delivery is relayed by the processes: keep them until the stream
    // holds a letter per message to reject, or the wait is over (the audit names what is missing).
    if let Err(e) = wait_for_letters(js, letters_expected).await {
        println!("  {e}");
    }
    let mut skipped = 0;
    for child in fleet.children {
        skipped += child.stop(Duration::from_secs(60)).await?.skipped;
    }
    Ok((faults, skipped))
}

/// The batch size of the batched `credit` process (#0).
const BATCH: usize = 16;

/// The `credit` processes of a run, each holding every last delivery for [`LAST_DELIVERY_HOLD`],
/// with what each holds there, read from its log.
struct Fleet<'a> {
    config: &'a CreditConfig,
    log: &'a dyn Fn(usize) -> PathBuf,
    children: Vec<CreditProcess>,
    /// What each process holds on a last delivery.
    holds: Vec<LastDeliveryHolds>,
    /// When each was started.
    started: Vec<Instant>,
}

impl<'a> Fleet<'a> {
    /// Starts [`INSTANCES`] processes.
    fn start(config: &'a CreditConfig, log: &'a dyn Fn(usize) -> PathBuf) -> Result<Self, String> {
        let mut fleet = Fleet {
            config,
            log,
            children: Vec::new(),
            holds: Vec::new(),
            started: Vec::new(),
        };
        for k in 0..INSTANCES {
            fleet.holds.push(LastDeliveryHolds::new(&log(k)));
            fleet.children.push(fleet.spawn(k)?);
            fleet.started.push(Instant::now());
        }
        Ok(fleet)
    }

    /// Starts process `k`, its log appended to `log(k)`. Process 0 commits in batches of
    /// [`BATCH`] (its handler's lane, the account, orders them), among the others' single
    /// messages.
    fn spawn(&self, k: usize) -> Result<CreditProcess, String> {
        let mut env = self.config.env();
        let hold = LAST_DELIVERY_HOLD.as_millis().to_string();
        env.push(("CREDIT_TEST_LAST_DELIVERY_HOLD_MS", hold));
        if k == 0 {
            env.push(("CREDIT_BATCH", BATCH.to_string()));
        }
        CreditProcess::spawn_with("credit", &self.config.binary, &env, Some(&(self.log)(k)))
    }

    /// SIGKILLs process `k` and starts another in its place; returns the stream sequences it held
    /// on their last delivery when it died (its log read to the end once it was reaped).
    async fn kill(&mut self, k: usize) -> Result<BTreeSet<u64>, String> {
        self.children[k].kill().await?;
        let held = self.holds[k].held()?.clone();
        // The next process appends to the same log.
        self.holds[k].restart();
        self.children[k] = self.spawn(k)?;
        self.started[k] = Instant::now();
        Ok(held)
    }
}
