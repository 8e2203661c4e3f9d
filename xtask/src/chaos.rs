//! `cargo xtask chaos`: exactly-once under faults, for a user to run, audited message by message.
//!
//! Per backend, the `credit` run below, then the `email` run of two-phase claims
//! (`chaos_email.rs`). The `credit` run has three steps.
//!
//! **Publish**, on a private nats-server: N credit requests each published twice (once with
//! `Nats-Msg-Id`, once without); a few to be dead-lettered at once, poison payloads (each a
//! non-JSON text of its own) and overdraws (a CHECK violation); and, last in the stream, a few
//! credits to accounts never opened (a foreign-key violation), which the runtime redelivers with a
//! delay until `max_deliver` and then dead-letters. Every message's stream sequence is kept from
//! its PubAck. `credit`'s own schema has no payload that fails that way (its one upsert fails
//! only with a CHECK violation or a data error, both dead-lettered at once, or transiently), so
//! chaos creates `accounts` itself, as `credit` would plus a foreign key to [`OPEN_ACCOUNTS`].
//!
//! **Supervise**: three `credit` processes work through the [`Faults`]: one of them is SIGKILLed
//! and restarted every two seconds; one is frozen with SIGSTOP for twice `ack_wait` (what it holds
//! is redelivered to the others while its transactions stay open) and then let go with SIGCONT;
//! the nats-server is killed and restarted once; every database connection is cut once; and the
//! dead-letter stream rejects every letter, from the start until a letter has been rejected on
//! its message's last delivery (earlier ones are nak'd and tried again; that one must be parked
//! and relayed later).
//!
//! **Verify**, once the consumer has drained, message by message: every request id applied
//! exactly once (its account's balance is 1 and its marker is committed); every other message
//! dead-lettered exactly once (one letter names its stream sequence and carries its payload, and
//! an unopened account's letter says it came at delivery `max_deliver`); and nothing else in the
//! database or the dead-letter stream. A query that fails fails the run: nothing counts as 0.
//!
//! Crashes stop once every message has been handed out, and the unopened credits come last, so
//! that their last delivery falls after the crash faults: JetStream never redelivers a message
//! after its `max_deliver`-th delivery, so a process that dies during that delivery (or a
//! nats-server that restarts, or a dead-letter stream that rejects its letter then) leaves the
//! message neither applied nor dead-lettered, whatever the runtime does.

mod cluster;

use async_nats::jetstream::stream::{DiscardPolicy, RawMessageErrorKind};
use async_nats::jetstream::{self, consumer::pull, message::StreamMessage, stream};
use futures::StreamExt;
use inbox_testkit::{
    Backend, CreditConfig, CreditProcess, Database, Outgoing, Poll, PrivateNats, backlog,
    publish_acked, unique,
};
use sqlx::any::AnyPoolOptions;
use sqlx::{AnyPool, AssertSqlSafe, SqlSafeStr};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub(crate) mod failover;

/// Poison payloads: not JSON, dead-lettered at once.
const POISON: usize = 5;
/// Overdraws: a CHECK violation, dead-lettered at once.
const OVERDRAWS: usize = 5;
/// Credits to accounts never opened: a foreign-key violation, dead-lettered at `max_deliver`.
const UNOPENED: usize = 3;
/// `credit` processes at work.
const INSTANCES: usize = 3;
/// The stream the requests are published to.
const STREAM: &str = "CHAOS";
/// The requests' subject.
const SUBJECT: &str = "chaos.credits";
/// The durable consumer `credit` works on.
const DURABLE: &str = "chaos";
/// The handler's consumer name: its markers' `consumer`, its letters' `Inbox-Consumer`.
const CONSUMER: &str = "credit";
/// The runtime's default dead-letter stream, which `credit` uses.
const DLQ_STREAM: &str = "INBOX_DLQ";
/// Its subjects, as the runtime creates it.
const DLQ_SUBJECTS: &str = "inbox.dlq.>";
/// Where `credit`'s letters go.
const DLQ_SUBJECT: &str = "inbox.dlq.credit";
/// The accounts a credit may go to; chaos's `accounts` has a foreign key to it.
const OPEN_ACCOUNTS: &str = "open_accounts";
/// The consumer's `max_deliver`.
const MAX_DELIVER: i64 = 10;
/// The consumer's `ack_wait`: what a killed or frozen process held comes back within seconds.
const ACK_WAIT: Duration = Duration::from_secs(4);
/// How often a `credit` process is SIGKILLed.
const KILL_EVERY: Duration = Duration::from_secs(2);
/// How long one `credit` process stays frozen: twice `ack_wait`, so that what it holds is
/// redelivered to the others while it holds it.
const PAUSE_FOR: Duration = Duration::from_secs(8);
/// The dead-letter stream's outage ends at the latest after this, whatever it saw: the first
/// letters are rejected at once, and their last delivery comes `9 × ack_wait` later.
const OUTAGE_AT_MOST: Duration = Duration::from_secs(90);
/// How long, once the consumer has drained, the letters may take to be stored (a letter parked
/// in the database is relayed within seconds); past it, the audit says which are missing.
const LETTERS_WITHIN: Duration = Duration::from_secs(60);
/// How many example messages a finding names.
const EXAMPLES: usize = 5;

/// What `cargo xtask chaos` was asked for.
pub struct Options {
    backends: Vec<Backend>,
    messages: usize,
    release: bool,
    /// Whether the private nats-servers run the current release instead of the machine's.
    pub current_nats: bool,
    /// Which runs: the `credit` run, the `email` run, or both.
    credit: bool,
    email: bool,
    /// The `credit` run on a 3-node cluster instead (`--cluster`, `chaos/cluster.rs`).
    cluster: bool,
}

impl Options {
    /// The short run `cargo xtask test` ends with: every backend, 2,000 requests, debug build.
    pub fn short() -> Options {
        Options {
            backends: Backend::ALL.to_vec(),
            messages: 2_000,
            release: false,
            current_nats: false,
            credit: true,
            email: true,
            cluster: false,
        }
    }

    /// The options `cargo xtask chaos` was given (see `cli.rs`).
    pub fn new(
        backends: Vec<Backend>,
        messages: usize,
        release: bool,
        current_nats: bool,
        (credit, email): (bool, bool),
    ) -> Options {
        Options {
            backends,
            messages,
            release,
            current_nats,
            credit,
            email,
            cluster: false,
        }
    }

    /// The `credit` run on a 3-node cluster of its own, instead of the single-server runs.
    pub fn on_cluster(mut self) -> Options {
        self.cluster = true;
        self
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

/// The SIGSTOP of one `credit` process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pause {
    /// Not yet.
    Pending,
    /// Process `k` is frozen, since then.
    Frozen {
        /// Which instance.
        k: usize,
        /// When it was frozen.
        since: Instant,
    },
    /// It was frozen for this long, then let go.
    Done {
        /// How long it was frozen.
        held: Duration,
    },
}

/// The dead-letter stream's outage: chaos creates it refusing every letter (`max_bytes` 1,
/// discard new), and lifts the limit once a letter has been rejected on its message's last
/// delivery. Before that, rejected letters are nak'd and tried again at each delivery; that last
/// one can only be parked in the database (JetStream would not redeliver a nak) and relayed
/// once the stream takes letters again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outage {
    /// It rejects every letter, since then.
    Rejecting {
        /// When it began (before any `credit` started).
        since: Instant,
    },
    /// Lifted.
    Lifted {
        /// Letter publishes seen on the wire while it rejected them.
        rejected: usize,
        /// Of those, the distinct messages they were letters of.
        messages: usize,
        /// Of those, the publishes on a message's last delivery (`max_deliver`).
        at_last: usize,
        /// How long it lasted.
        lasted: Duration,
    },
}

/// The faults one run went through.
#[derive(Debug, Clone, Copy)]
struct Faults {
    /// `credit` processes SIGKILLed (and restarted).
    kills: usize,
    /// The SIGSTOP of a `credit` process.
    pause: Pause,
    /// Whether the nats-server was killed and restarted.
    nats_restarted: bool,
    /// The database connections.
    db_cut: DbCut,
    /// The dead-letter stream's outage.
    outage: Outage,
}

impl Faults {
    /// Every fault has been carried out (and the frozen process and the dead-letter stream let go).
    fn all_done(&self) -> bool {
        self.nats_restarted
            && self.db_cut != DbCut::Pending
            && matches!(self.pause, Pause::Done { .. })
            && matches!(self.outage, Outage::Lifted { .. })
    }

    /// What went missing: a fault that did not bite proves nothing.
    fn missing(&self) -> Vec<&'static str> {
        let mut missing = Vec::new();
        if self.kills == 0 {
            missing.push("no credit process was killed");
        }
        if let Outage::Lifted {
            rejected, at_last, ..
        } = self.outage
        {
            if rejected == 0 {
                missing.push("the dead-letter stream rejected no letter");
            }
            if at_last == 0 {
                missing.push("no letter was rejected on its message's last delivery");
            }
        }
        missing
    }
}

/// What a published message is, and so what it must come to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// One of a valid request's two copies: the request is applied exactly once.
    Request,
    /// Not JSON: dead-lettered at once.
    Poison,
    /// Takes a balance below zero (a CHECK violation): dead-lettered at once.
    Overdraw,
    /// Credits an account never opened (a foreign-key violation): redelivered with a delay, then
    /// dead-lettered at delivery `max_deliver`.
    Unopened,
}

/// One published message.
#[derive(Debug, Clone)]
struct Sent {
    /// What it is.
    kind: Kind,
    /// How findings name it: the request id, or `poison-<j>`.
    label: String,
    /// Its key (the request id), when it decodes.
    key: Option<String>,
    /// The account it credits, when it decodes.
    account: Option<i64>,
    /// Its `Nats-Msg-Id`, when published with one.
    msg_id: Option<String>,
    /// Its payload.
    payload: Vec<u8>,
}

/// What was published.
struct Published {
    /// Every message, by the stream sequence its PubAck gave.
    by_seq: BTreeMap<u64, Sent>,
    /// Distinct valid requests.
    requests: usize,
    /// Messages that must be dead-lettered.
    dead_expected: usize,
}

/// A letter as read back from the dead-letter stream: the headers the audit checks.
#[derive(Debug, Clone, Default)]
struct Letter {
    /// Its own sequence in the dead-letter stream.
    dlq_seq: u64,
    /// The subject it was published to.
    subject: String,
    /// `Inbox-Consumer`: the handler that rejected it.
    consumer: Option<String>,
    /// `Inbox-Stream`: the original's stream.
    stream: Option<String>,
    /// `Inbox-Stream-Seq`: the original's sequence there.
    stream_seq: Option<String>,
    /// `Inbox-Delivered`: the delivery that was rejected.
    delivered: Option<String>,
    /// `Inbox-Error`: why.
    error: Option<String>,
    /// `Nats-Msg-Id`: `dlq:<consumer>:<stream>:[<created>:]<seq>`.
    msg_id: Option<String>,
    /// `Inbox-Original-Msg-Id`: the original's `Nats-Msg-Id`, when it had one.
    original_msg_id: Option<String>,
    /// The original's payload.
    payload: Vec<u8>,
}

impl From<StreamMessage> for Letter {
    fn from(m: StreamMessage) -> Letter {
        let header = |name: &str| m.headers.get(name).map(|v| v.as_str().to_owned());
        Letter {
            dlq_seq: m.sequence,
            subject: m.subject.to_string(),
            consumer: header("Inbox-Consumer"),
            stream: header("Inbox-Stream"),
            stream_seq: header("Inbox-Stream-Seq"),
            delivered: header("Inbox-Delivered"),
            error: header("Inbox-Error"),
            msg_id: header("Nats-Msg-Id"),
            original_msg_id: header("Inbox-Original-Msg-Id"),
            payload: m.payload.to_vec(),
        }
    }
}

/// What the run left behind, read back after it.
#[derive(Debug, Default)]
struct Observed {
    /// Keys of `credit`'s committed markers (`processed_at` set).
    markers: HashSet<String>,
    /// Keys of `credit`'s markers without `processed_at`: an effect never finished.
    open_markers: Vec<String>,
    /// Balances by account.
    balances: HashMap<i64, i64>,
    /// Every message of the dead-letter stream.
    letters: Vec<Letter>,
    /// Every event of the announcements' stream (`<STREAM>_EVENTS`): (id, account), or why it
    /// does not parse.
    events: Vec<Result<(String, i64), String>>,
    /// Outbox rows not marked sent once every process has stopped.
    unsent_events: i64,
}

/// A way a message can end wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Problem {
    /// A request neither applied nor dead-lettered.
    Lost,
    /// A request applied more than once.
    AppliedTwice,
    /// A request's marker is committed but its effect is not.
    MarkerWithoutEffect,
    /// A request's effect is there but its marker is not.
    EffectWithoutMarker,
    /// A request's balance is neither 1 nor more.
    WrongBalance,
    /// A marker without `processed_at`.
    OpenMarker,
    /// A valid request dead-lettered.
    DeadLetteredRequest,
    /// A message to reject that has no letter.
    NotDeadLettered,
    /// A message with more than one letter.
    DeadLetteredTwice,
    /// A message to reject whose marker or effect is there.
    AppliedRejected,
    /// An unopened account's credit dead-lettered before its `max_deliver`-th delivery.
    BeforeMaxDeliver,
    /// A letter that matches no published message, or not the one it names.
    StrayLetter,
    /// A marker or an account that no published message explains.
    StrayRow,
    /// An applied request without its `credits.applied` event.
    NotAnnounced,
    /// An applied request with more than one event.
    AnnouncedTwice,
    /// An event for a request that was not applied (skipped, rejected, unknown), or that does
    /// not parse, or names another account.
    StrayEvent,
    /// Outbox rows left unsent after every process stopped.
    Unsent,
}

impl Problem {
    /// What it says in the findings.
    fn describe(self) -> &'static str {
        match self {
            Problem::Lost => "lost: neither applied nor dead-lettered",
            Problem::AppliedTwice => "applied twice (balance 2 or more)",
            Problem::MarkerWithoutEffect => "marker committed, effect missing",
            Problem::EffectWithoutMarker => "effect applied, marker missing",
            Problem::WrongBalance => "balance neither 1 nor more",
            Problem::OpenMarker => "marker without processed_at",
            Problem::DeadLetteredRequest => "dead-lettered, expected applied",
            Problem::NotDeadLettered => "not dead-lettered, expected one letter",
            Problem::DeadLetteredTwice => "dead-lettered more than once",
            Problem::AppliedRejected => "applied, expected dead-lettered",
            Problem::BeforeMaxDeliver => "dead-lettered before max_deliver",
            Problem::StrayLetter => "letter matching no published message",
            Problem::StrayRow => "marker or account no message explains",
            Problem::NotAnnounced => "applied, but no event announces it",
            Problem::AnnouncedTwice => "announced more than once",
            Problem::StrayEvent => "event for no applied request",
            Problem::Unsent => "outbox rows never published",
        }
    }
}

/// What the audit found.
#[derive(Debug, Default)]
struct Findings {
    /// Requests applied exactly once.
    applied_once: usize,
    /// Messages to reject with exactly one letter.
    dead_once: usize,
    /// Applied requests announced by exactly one event.
    announced_once: usize,
    /// Every problem, with the messages (labels) it concerns.
    problems: BTreeMap<Problem, Vec<String>>,
}

impl Findings {
    /// Records `problem` for the message `what` names.
    fn add(&mut self, problem: Problem, what: impl Into<String>) {
        self.problems.entry(problem).or_default().push(what.into());
    }

    /// How many messages have `problem`.
    fn count(&self, problem: Problem) -> usize {
        self.problems.get(&problem).map_or(0, Vec::len)
    }

    /// Messages lost, applied twice, and with any other problem: the report tables' columns.
    fn tally(&self) -> (usize, usize, usize) {
        let (lost, twice) = (self.count(Problem::Lost), self.count(Problem::AppliedTwice));
        let all: usize = self.problems.values().map(Vec::len).sum();
        (lost, twice, all - lost - twice)
    }

    /// Prints each problem with its count and the first few messages it concerns.
    fn print_problems(&self) {
        for (problem, labels) in &self.problems {
            let shown = labels.iter().take(EXAMPLES).cloned().collect::<Vec<_>>();
            let more = labels.len().saturating_sub(EXAMPLES);
            let more = if more > 0 {
                format!(", and {more} more")
            } else {
                String::new()
            };
            println!(
                "  {}: {} — {}{more}",
                problem.describe(),
                labels.len(),
                shown.join(", ")
            );
        }
    }
}

/// Checks every published message against what the run left behind.
fn audit(published: &Published, seen: &Observed) -> Findings {
    let mut f = Findings::default();

    // Letters by the stream sequence of the message they carry; those that fit none aside.
    let mut letters: HashMap<u64, Vec<&Letter>> = HashMap::new();
    for letter in &seen.letters {
        match origin(letter, published) {
            Ok(seq) => letters.entry(seq).or_default().push(letter),
            Err(why) => f.add(
                Problem::StrayLetter,
                format!("letter #{}: {why}", letter.dlq_seq),
            ),
        }
    }
    let letters_of = |seq: &u64| letters.get(seq).map_or(&[][..], Vec::as_slice);

    // Requests, by id: both copies share the id and the account.
    let mut requests: BTreeMap<&str, (Option<i64>, Vec<u64>)> = BTreeMap::new();
    for (seq, sent) in &published.by_seq {
        if sent.kind == Kind::Request {
            let entry = requests
                .entry(&sent.label)
                .or_insert((sent.account, Vec::new()));
            entry.1.push(*seq);
        }
    }
    for (id, (account, seqs)) in &requests {
        let lettered: usize = seqs.iter().map(|s| letters_of(s).len()).sum();
        if lettered > 0 {
            f.add(Problem::DeadLetteredRequest, *id);
        }
        let marker = seen.markers.contains(*id);
        match (marker, account.and_then(|a| seen.balances.get(&a).copied())) {
            (_, Some(b)) if b >= 2 => f.add(Problem::AppliedTwice, format!("{id} (balance {b})")),
            (true, Some(1)) => f.applied_once += 1,
            (false, None) if lettered == 0 => f.add(Problem::Lost, *id),
            (false, None) => {}
            (true, None) => f.add(Problem::MarkerWithoutEffect, *id),
            (false, Some(1)) => f.add(Problem::EffectWithoutMarker, *id),
            (_, Some(b)) => f.add(Problem::WrongBalance, format!("{id} (balance {b})")),
        }
    }

    // Messages to reject, by stream sequence.
    for (seq, sent) in &published.by_seq {
        if sent.kind == Kind::Request {
            continue;
        }
        let got = letters_of(seq);
        let applied = sent.key.as_ref().is_some_and(|k| seen.markers.contains(k))
            || sent.account.is_some_and(|a| seen.balances.contains_key(&a));
        if applied {
            f.add(Problem::AppliedRejected, &sent.label);
        }
        match got.len() {
            0 if !applied => f.add(Problem::NotDeadLettered, &sent.label),
            0 => {}
            1 => f.dead_once += 1,
            n => f.add(
                Problem::DeadLetteredTwice,
                format!("{} ({n} letters)", sent.label),
            ),
        }
        if sent.kind == Kind::Unopened {
            let max = MAX_DELIVER.to_string();
            for letter in got.iter().filter(|l| l.delivered.as_deref() != Some(&max)) {
                let at = letter.delivered.as_deref().unwrap_or("?");
                f.add(
                    Problem::BeforeMaxDeliver,
                    format!("{} (delivery {at})", sent.label),
                );
            }
        }
    }

    // What nothing published explains (the rejected messages' rows are reported above).
    let keys: HashSet<&str> = published
        .by_seq
        .values()
        .filter_map(|s| s.key.as_deref())
        .collect();
    let accounts: HashSet<i64> = published
        .by_seq
        .values()
        .filter_map(|s| s.account)
        .collect();
    for key in &seen.markers {
        if !keys.contains(key.as_str()) {
            f.add(Problem::StrayRow, format!("marker {key}"));
        }
    }
    for account in seen.balances.keys() {
        if !accounts.contains(account) {
            f.add(Problem::StrayRow, format!("account {account}"));
        }
    }
    for key in &seen.open_markers {
        f.add(Problem::OpenMarker, key);
    }

    // Announcements: exactly one event per applied request, none for anything else.
    let mut events: HashMap<&str, Vec<i64>> = HashMap::new();
    for event in &seen.events {
        match event {
            Ok((id, account)) => events.entry(id.as_str()).or_default().push(*account),
            Err(why) => f.add(Problem::StrayEvent, why.clone()),
        }
    }
    for (id, (account, _)) in &requests {
        let got = events.remove(*id).unwrap_or_default();
        let applied = seen.markers.contains(*id);
        match (applied, got.len()) {
            (true, 1) if Some(got[0]) == *account => f.announced_once += 1,
            (true, 1) => f.add(Problem::StrayEvent, format!("{id} (account {})", got[0])),
            (true, 0) => f.add(Problem::NotAnnounced, *id),
            (true, n) => f.add(Problem::AnnouncedTwice, format!("{id} ({n} events)")),
            (false, 0) => {}
            (false, n) => f.add(
                Problem::StrayEvent,
                format!("{id} ({n} events, not applied)"),
            ),
        }
    }
    for (id, got) in events {
        f.add(Problem::StrayEvent, format!("{id} ({} events)", got.len()));
    }
    if seen.unsent_events > 0 {
        f.add(Problem::Unsent, format!("{} rows", seen.unsent_events));
    }
    for labels in f.problems.values_mut() {
        labels.sort();
    }
    f
}

/// The stream sequence of the published message `letter` carries, or why it fits none: every
/// header names that message and the payload is its own.
fn origin(letter: &Letter, published: &Published) -> Result<u64, String> {
    if letter.subject != DLQ_SUBJECT {
        return Err(format!("subject {}", letter.subject));
    }
    if letter.consumer.as_deref() != Some(CONSUMER) {
        return Err(format!("Inbox-Consumer {:?}", letter.consumer));
    }
    if letter.stream.as_deref() != Some(STREAM) {
        return Err(format!("Inbox-Stream {:?}", letter.stream));
    }
    let seq: u64 = letter
        .stream_seq
        .as_deref()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("Inbox-Stream-Seq {:?}", letter.stream_seq))?;
    let sent = published
        .by_seq
        .get(&seq)
        .ok_or_else(|| format!("Inbox-Stream-Seq {seq} was never published"))?;
    if letter.payload != sent.payload {
        return Err(format!("payload is not that of {} (seq {seq})", sent.label));
    }
    // `dlq:<consumer>:<stream>:<seq>`, or with the stream's creation time before the sequence
    // when the worker knew it.
    let id = format!("dlq:{CONSUMER}:{STREAM}:{seq}");
    let with_created = letter.msg_id.as_deref().is_some_and(|m| {
        m.strip_prefix(&format!("dlq:{CONSUMER}:{STREAM}:"))
            .and_then(|rest| rest.strip_suffix(&format!(":{seq}")))
            .is_some_and(|created| {
                !created.is_empty() && created.bytes().all(|b| b.is_ascii_digit())
            })
    });
    if letter.msg_id.as_deref() != Some(&id) && !with_created {
        return Err(format!("Nats-Msg-Id {:?}, not {id:?}", letter.msg_id));
    }
    if letter.original_msg_id != sent.msg_id {
        return Err(format!(
            "Inbox-Original-Msg-Id {:?}, not {:?}",
            letter.original_msg_id, sent.msg_id
        ));
    }
    if letter.error.as_deref().is_none_or(str::is_empty) {
        return Err("no Inbox-Error".into());
    }
    if letter
        .delivered
        .as_deref()
        .and_then(|d| d.parse::<i64>().ok())
        .is_none_or(|d| d < 1)
    {
        return Err(format!("Inbox-Delivered {:?}", letter.delivered));
    }
    Ok(seq)
}

/// What one backend's run came to.
struct Report {
    /// The backend it ran on.
    backend: Backend,
    /// Messages published in all.
    total: usize,
    /// Distinct valid requests.
    requests: usize,
    /// Messages that must be dead-lettered.
    dead_expected: usize,
    /// The audit's findings.
    findings: Findings,
    /// Duplicates the processes that stopped cleanly skipped.
    skipped: u64,
    /// The faults it went through.
    faults: Faults,
}

impl Report {
    /// Every message ended as it must, and every fault bit.
    fn ok(&self) -> bool {
        self.findings.problems.is_empty()
            && self.findings.applied_once == self.requests
            && self.findings.dead_once == self.dead_expected
            && self.faults.missing().is_empty()
    }
}

/// Runs chaos on each backend asked for and prints the table.
pub async fn run(options: Options) -> Result<(), String> {
    let credit = crate::build_credit(options.release)?;
    let email = crate::build_example("email", options.release)?;
    run_with(options, &credit, &email).await
}

/// [`run`] with the `credit` and `email` binaries already built.
pub async fn run_with(options: Options, credit: &Path, email: &Path) -> Result<(), String> {
    let logs = crate::workspace_root().join("target/chaos");
    std::fs::create_dir_all(&logs).map_err(|e| e.to_string())?;
    sqlx::any::install_default_drivers();

    let (nats_server, version) = if options.current_nats {
        (crate::nats_current::binary()?, crate::nats_current::VERSION)
    } else {
        (inbox_testkit::nats_server_binary()?, "the machine's")
    };
    if options.cluster {
        let mut reports = Vec::new();
        for &backend in &options.backends {
            let n = options.messages;
            println!(
                "\n== chaos on a 3-node cluster, {} ({n} requests, nats-server {version})",
                backend.name()
            );
            let binaries = (credit, nats_server.as_path());
            reports.push(cluster::run(backend, n, binaries, &logs).await?);
        }
        cluster::ClusterReport::print(&reports);
        let failed = reports.iter().filter(|r| !r.ok()).count();
        println!(
            "chaos --cluster: {} passed, {failed} failed",
            reports.len() - failed
        );
        return if failed == 0 {
            println!(
                "\nexactly once through node kills, message by message: every request applied \
                 once, every rejected message dead-lettered once, nothing else."
            );
            Ok(())
        } else {
            Err("chaos --cluster FAILED: see the findings above".into())
        };
    }
    let mut reports = Vec::new();
    let mut email_reports = Vec::new();
    for &backend in &options.backends {
        let n = options.messages;
        if options.credit {
            println!(
                "\n== chaos on {} ({n} requests, nats-server {version})",
                backend.name()
            );
            let binaries = (credit, nats_server.as_path());
            reports.push(chaos(backend, n, binaries, &logs).await?);
        }
        if !options.email {
            continue;
        }
        let emails = (n / 10).max(100);
        println!(
            "\n== chaos, email (two-phase claims), on {} ({emails} requests, nats-server {version})",
            backend.name()
        );
        let binaries = (email, nats_server.as_path());
        email_reports.push(crate::chaos_email::run(backend, emails, binaries, &logs).await?);
    }
    for r in &email_reports {
        r.print();
    }
    let emails_failed = email_reports.iter().filter(|r| !r.ok()).count();

    if !reports.is_empty() {
        let mut table = comfy_table::Table::new();
        table.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
        table.set_header([
            "backend",
            "published",
            "applied once",
            "announced",
            "dead",
            "lost",
            "twice",
            "other",
            "kills",
            "paused",
            "dlq rej.",
            "db cut",
        ]);
        for r in &reports {
            let db_cut = match r.faults.db_cut {
                DbCut::Cut { sessions } => format!("yes ({sessions})"),
                DbCut::NotApplicable => "n/a".into(),
                DbCut::Pending => "no".into(),
            };
            let paused = match r.faults.pause {
                Pause::Done { held } => format!("{:.1}s", held.as_secs_f64()),
                _ => "no".into(),
            };
            let rejected = match r.faults.outage {
                Outage::Lifted {
                    rejected, at_last, ..
                } => format!("{rejected} ({at_last})"),
                Outage::Rejecting { .. } => "no".into(),
            };
            let f = &r.findings;
            let (lost, twice, other) = f.tally();
            table.add_row([
                r.backend.name().to_owned(),
                r.total.to_string(),
                format!("{}/{}", f.applied_once, r.requests),
                format!("{}/{}", f.announced_once, r.requests),
                format!("{}/{}", f.dead_once, r.dead_expected),
                lost.to_string(),
                twice.to_string(),
                other.to_string(),
                r.faults.kills.to_string(),
                paused,
                rejected,
                db_cut,
            ]);
        }
        for column in 1..12 {
            if let Some(c) = table.column_mut(column) {
                c.set_cell_alignment(comfy_table::CellAlignment::Right);
            }
        }
        println!("{table}");
        println!(
            "(applied once: request ids whose balance is 1 with a committed marker; announced: of \
         them, those with exactly one event in {EVENTS_STREAM} (and no event for anything else); \
         dead: messages to \
         reject with exactly one letter; dlq rej.: letter publishes the dead-letter stream \
         rejected (of them on a last delivery); skipped, by the processes that stopped cleanly: {})",
            reports
                .iter()
                .map(|r| format!("{} {}", r.backend.name(), r.skipped))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    for r in reports.iter().filter(|r| !r.ok()) {
        println!("\n{} FAILED:", r.backend.name());
        r.findings.print_problems();
        for missing in r.faults.missing() {
            println!("  fault missing: {missing}");
        }
    }
    let passed = reports.iter().filter(|r| r.ok()).count();
    println!(
        "chaos: {passed} passed, {} failed; email: {} passed, {emails_failed} failed",
        reports.len() - passed,
        email_reports.len() - emails_failed
    );
    if passed == reports.len() && emails_failed == 0 {
        println!(
            "\nexactly once under faults, message by message: every request applied once and \
             announced once, every rejected message dead-lettered once (and never announced), \
             nothing else; every e-mail done or \
             dead-lettered, called under one idempotency key, never twice at once."
        );
        Ok(())
    } else {
        Err("chaos run FAILED: see the findings above".into())
    }
}

/// One backend's run: its own nats-server and database, publish, supervise, verify.
async fn chaos(
    backend: Backend,
    n: usize,
    (credit, nats_server): (&Path, &Path),
    logs: &Path,
) -> Result<Report, String> {
    let run = unique("");
    let mut nats = PrivateNats::start_binary(nats_server.to_owned()).await?;
    let db = Database::create(backend, "inbox_chaos_").await?;
    // chaos creates the SQLite file itself (with the accounts table, before any `credit`).
    let pool = audit_pool(backend, &db)?;
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
        let client = inbox_testkit::connect(&nats.url).await?;
        let js = jetstream::new(client.clone());
        create_accounts(backend, &pool, n).await?;
        let published = publish(&js, n, &run, 1).await?;
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
        Ok(Report {
            backend,
            total: published.by_seq.len(),
            requests: published.requests,
            dead_expected: published.dead_expected,
            findings: audit(&published, &seen),
            skipped,
            faults,
        })
    }
    .await;
    pool.close().await;
    db.remove().await?;
    result
}

/// A pool of one connection on `db`, to watch and audit it, connected when first used; on
/// SQLite it creates the file if the processes have not yet.
pub(crate) fn audit_pool(backend: Backend, db: &Database) -> Result<AnyPool, String> {
    let url = match backend {
        Backend::Sqlite => format!("{}?mode=rwc", db.url),
        _ => db.url.clone(),
    };
    AnyPoolOptions::new()
        .max_connections(1)
        .connect_lazy(&url)
        .map_err(|e| e.to_string())
}

/// Creates `accounts` as `credit` would, plus a foreign key to [`OPEN_ACCOUNTS`], which holds
/// every account a request or an overdraw credits (`0..n + OVERDRAWS`), not the unopened ones.
async fn create_accounts(backend: Backend, pool: &AnyPool, n: usize) -> Result<(), String> {
    let ddl: &[&str] = match backend {
        Backend::Postgres => &[
            "CREATE TABLE open_accounts (id BIGINT PRIMARY KEY)",
            "CREATE TABLE accounts (id BIGINT PRIMARY KEY REFERENCES open_accounts (id), \
             balance BIGINT NOT NULL CHECK (balance >= 0))",
        ],
        Backend::MySql => &[
            "CREATE TABLE open_accounts (id BIGINT PRIMARY KEY) ENGINE = InnoDB",
            "CREATE TABLE accounts (id BIGINT PRIMARY KEY, balance BIGINT NOT NULL, \
             CHECK (balance >= 0), FOREIGN KEY (id) REFERENCES open_accounts (id)) \
             ENGINE = InnoDB",
        ],
        // WAL first, as `credit` opens it: switching later needs the file to itself.
        Backend::Sqlite => &[
            "PRAGMA journal_mode = WAL",
            "CREATE TABLE open_accounts (id INTEGER PRIMARY KEY)",
            "CREATE TABLE accounts (id INTEGER PRIMARY KEY REFERENCES open_accounts (id), \
             balance INTEGER NOT NULL CHECK (balance >= 0))",
        ],
    };
    for sql in ddl {
        execute(pool, (*sql).to_owned()).await?;
    }
    let ids: Vec<usize> = (0..n + OVERDRAWS).collect();
    for chunk in ids.chunks(1_000) {
        let values: Vec<String> = chunk.iter().map(|id| format!("({id})")).collect();
        let sql = format!(
            "INSERT INTO {OPEN_ACCOUNTS} (id) VALUES {}",
            values.join(", ")
        );
        execute(pool, sql).await?;
    }
    Ok(())
}

/// The consumer's `backoff`: `ack_wait` at every step, one step fewer than `max_deliver` (as the
/// server requires), so that a credit to an unopened account reaches `max_deliver` within
/// `9 × ack_wait` rather than the minutes of the runtime's own growing nak delays.
///
/// Every step is the same on purpose. The runtime naks with the step as an explicit delay, and
/// nats-server 2.9 measures that delay from `now - ack_wait` against the step: the wait is
/// `2 × step - ack_wait`, which for a step under half of `ack_wait` is no wait at all (each
/// redelivery within ~10 ms, max_deliver burnt in a tenth of a second).
fn backoff() -> Vec<Duration> {
    vec![ACK_WAIT; MAX_DELIVER as usize - 1]
}

/// The request id of account `i`.
fn request_id(run: &str, i: usize) -> String {
    format!("c-{run}-{i}")
}

/// A credit request's payload.
fn request(id: &str, account: usize, amount: i64) -> Vec<u8> {
    let body = serde_json::json!({ "id": id, "account": account, "amount": amount });
    serde_json::to_vec(&body).expect("json")
}

/// Creates the stream, the consumer and the dead-letter stream (rejecting every letter), each
/// with `replicas` replicas, and publishes every message, keeping where each was stored.
async fn publish(
    js: &jetstream::Context,
    n: usize,
    run: &str,
    replicas: usize,
) -> Result<Published, String> {
    let stream = js
        .create_stream(stream::Config {
            name: STREAM.into(),
            subjects: vec![SUBJECT.into()],
            num_replicas: replicas,
            // Finite, as `credit`'s cleanup requires.
            max_age: Duration::from_secs(3600),
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    stream
        .create_consumer(pull::Config {
            durable_name: Some(DURABLE.into()),
            ack_wait: ACK_WAIT,
            max_deliver: MAX_DELIVER,
            backoff: backoff(),
            filter_subject: SUBJECT.into(),
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    // The runtime gets the stream it would create; until chaos lifts the limit, no letter fits.
    js.create_stream(stream::Config {
        name: DLQ_STREAM.into(),
        subjects: vec![DLQ_SUBJECTS.into()],
        max_bytes: 1,
        discard: DiscardPolicy::New,
        num_replicas: replicas,
        ..Default::default()
    })
    .await
    .map_err(|e| format!("dead-letter stream {DLQ_STREAM}: {e}"))?;

    // Every valid request twice: with a msg-id (the broker's dedup window) and without (only the
    // inbox can catch it). Accounts 0..n get +1 each; overdraws go to accounts of their own;
    // unopened credits to accounts not in open_accounts, last.
    let mut sent: Vec<Sent> = Vec::with_capacity(2 * n + POISON + OVERDRAWS + UNOPENED);
    let spread = n / POISON.max(OVERDRAWS);
    for pass in 0..2 {
        for i in 0..n {
            let id = request_id(run, i);
            sent.push(Sent {
                kind: Kind::Request,
                payload: request(&id, i, 1),
                key: Some(id.clone()),
                account: Some(i as i64),
                msg_id: (pass == 0).then(|| id.clone()),
                label: id,
            });
            let j = i / spread;
            if pass == 0 && i % spread == 0 {
                if j < POISON {
                    sent.push(Sent {
                        kind: Kind::Poison,
                        label: format!("poison-{j}"),
                        key: None,
                        account: None,
                        msg_id: None,
                        payload: format!("{{ not json {j}").into_bytes(),
                    });
                }
                if j < OVERDRAWS {
                    let (id, account) = (format!("neg-{run}-{j}"), n + j);
                    sent.push(Sent {
                        kind: Kind::Overdraw,
                        payload: request(&id, account, -5),
                        key: Some(id.clone()),
                        account: Some(account as i64),
                        msg_id: None,
                        label: id,
                    });
                }
            }
        }
    }
    for j in 0..UNOPENED {
        let (id, account) = (format!("unopened-{run}-{j}"), n + OVERDRAWS + j);
        sent.push(Sent {
            kind: Kind::Unopened,
            payload: request(&id, account, 1),
            key: Some(id.clone()),
            account: Some(account as i64),
            msg_id: None,
            label: id,
        });
    }
    println!("publishing {} messages...", sent.len());
    let outgoing = sent.iter().map(|s| match &s.msg_id {
        Some(id) => Outgoing::with_msg_id(s.payload.clone(), id),
        None => Outgoing::from(s.payload.clone()),
    });
    let acks = publish_acked(js, SUBJECT, outgoing).await?;
    if acks.len() != sent.len() {
        return Err(format!(
            "{} PubAcks for {} messages",
            acks.len(),
            sent.len()
        ));
    }
    let mut by_seq = BTreeMap::new();
    for (ack, s) in acks.into_iter().zip(sent) {
        if ack.stream != STREAM || ack.duplicate {
            return Err(format!(
                "{} was not stored as a new message: {ack:?}",
                s.label
            ));
        }
        by_seq.insert(ack.sequence, s);
    }
    Ok(Published {
        by_seq,
        requests: n,
        dead_expected: POISON + OVERDRAWS + UNOPENED,
    })
}

/// Watches `credit`'s letters on the wire (a core subscription sees every publish, stored by the
/// dead-letter stream or not).
struct LetterWatch {
    /// What it saw so far.
    seen: Arc<Mutex<WireCounts>>,
    /// The task counting them; stopped when the watch is dropped.
    task: tokio::task::JoinHandle<()>,
}

/// Letter publishes seen on the wire.
#[derive(Debug, Clone, Default)]
struct WireCounts {
    /// Publishes, by the original's stream sequence.
    by_seq: HashMap<u64, usize>,
    /// Publishes on the original's last delivery (`Inbox-Delivered` is `max_deliver`).
    at_last: usize,
}

impl LetterWatch {
    /// Subscribes (and makes sure the server has the subscription) before any letter exists.
    async fn start(client: &async_nats::Client) -> Result<LetterWatch, String> {
        let mut letters = client
            .subscribe(DLQ_SUBJECT)
            .await
            .map_err(|e| format!("subscribe to {DLQ_SUBJECT}: {e}"))?;
        client.flush().await.map_err(|e| format!("flush: {e}"))?;
        let seen = Arc::new(Mutex::new(WireCounts::default()));
        let counts = Arc::clone(&seen);
        let task = tokio::spawn(async move {
            while let Some(letter) = letters.next().await {
                let header = |name: &str| {
                    let value = letter.headers.as_ref().and_then(|h| h.get(name));
                    value.and_then(|v| v.as_str().parse::<i64>().ok())
                };
                let seq = header("Inbox-Stream-Seq").unwrap_or(0) as u64;
                let last = header("Inbox-Delivered") == Some(MAX_DELIVER);
                let mut counts = counts.lock().expect("letter counts");
                *counts.by_seq.entry(seq).or_insert(0) += 1;
                counts.at_last += usize::from(last);
            }
        });
        Ok(LetterWatch { seen, task })
    }

    /// What it saw so far.
    fn counts(&self) -> WireCounts {
        self.seen.lock().expect("letter counts").clone()
    }
}

impl Drop for LetterWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Lets the dead-letter stream store letters again: no byte limit, discard old (as the runtime
/// creates it).
async fn lift_outage(js: &jetstream::Context) -> Result<(), String> {
    let what = |e: &dyn std::fmt::Display| format!("dead-letter stream {DLQ_STREAM}: {e}");
    let mut dlq = js.get_stream(DLQ_STREAM).await.map_err(|e| what(&e))?;
    let mut config = dlq.info().await.map_err(|e| what(&e))?.config.clone();
    config.max_bytes = -1;
    config.discard = DiscardPolicy::Old;
    js.update_stream(config).await.map_err(|e| what(&e))?;
    Ok(())
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
    let spawn = |k: usize| CreditProcess::spawn(config, Some(&log(k)));
    let mut children: Vec<CreditProcess> = (0..INSTANCES).map(spawn).collect::<Result<_, _>>()?;
    let mut started: Vec<Instant> = vec![Instant::now(); INSTANCES];
    let deadline = Duration::from_secs(300) + Duration::from_millis(20 * n as u64);
    let mut poll = Poll::new(
        "every fault to be done and the consumer to be drained",
        deadline,
    );
    let mut faults = Faults {
        kills: 0,
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

        // The dead-letter stream rejects until a letter was rejected on its last delivery.
        if let (Outage::Rejecting { since }, Some(w)) = (faults.outage, &watch) {
            let seen = w.counts();
            if seen.at_last > 0 || since.elapsed() > OUTAGE_AT_MOST {
                match lift_outage(js).await {
                    Ok(()) => {
                        let (rejected, messages) = (seen.by_seq.values().sum(), seen.by_seq.len());
                        let lasted = since.elapsed();
                        println!(
                            "  dead-letter stream stores again after {:.1}s: it rejected \
                             {rejected} letter publishes of {messages} messages, {} on a last \
                             delivery ({applied} applied)",
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
                    Err(e) => println!("  lifting the dead-letter outage failed: {e}"),
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
            children[k].kill().await?;
            children[k] = spawn(k)?;
            started[k] = Instant::now();
            faults.kills += 1;
            last_kill = Instant::now();
        }

        match faults.pause {
            // The process that has run longest: it is the likeliest to hold messages.
            Pause::Pending if applied >= n / 2 => {
                let k = (0..INSTANCES)
                    .min_by_key(|&k| started[k])
                    .expect("instances");
                children[k].pause()?;
                println!("  freezing credit #{k} (SIGSTOP) for {PAUSE_FOR:?} ({applied} applied)");
                faults.pause = Pause::Frozen {
                    k,
                    since: Instant::now(),
                };
            }
            Pause::Frozen { k, since } if since.elapsed() >= PAUSE_FOR => {
                children[k].resume()?;
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
    let mut wait = Poll::new("the letters to be stored", LETTERS_WITHIN);
    loop {
        let stored = stored_letters(js).await;
        if stored.as_ref().is_ok_and(|&k| k >= letters_expected) {
            break;
        }
        if wait.tick().await.is_err() {
            println!(
                "  after {LETTERS_WITHIN:?}, letters stored: {stored:?} of {letters_expected}"
            );
            break;
        }
    }
    let mut skipped = 0;
    for child in children {
        skipped += child.stop(Duration::from_secs(60)).await?.skipped;
    }
    Ok((faults, skipped))
}

/// Reads back what the run left: markers, balances, letters. Any failed query is an error.
async fn observe(
    backend: Backend,
    pool: &AnyPool,
    js: &jetstream::Context,
) -> Result<Observed, String> {
    // MySQL's message_key is VARBINARY (exact keys); read it as text.
    let key = match backend {
        Backend::MySql => "CAST(message_key AS CHAR)",
        _ => "message_key",
    };
    let keys = |done: &str| {
        let sql = format!(
            "SELECT {key} FROM inbox WHERE consumer = '{CONSUMER}' AND processed_at IS {done}"
        );
        async move {
            sqlx::query_scalar::<_, String>(AssertSqlSafe(sql.clone()).into_sql_str())
                .fetch_all(pool)
                .await
                .map_err(|e| format!("{sql}: {e}"))
        }
    };
    let markers = keys("NOT NULL").await?.into_iter().collect();
    let open_markers = keys("NULL").await?;
    let sql = "SELECT id, balance FROM accounts";
    let balances = sqlx::query_as::<_, (i64, i64)>(sql)
        .fetch_all(pool)
        .await
        .map_err(|e| format!("{sql}: {e}"))?
        .into_iter()
        .collect();
    let sql = "SELECT CAST(count(*) AS BIGINT) FROM outbox WHERE sent_at IS NULL";
    let sql = match backend {
        Backend::MySql => "SELECT CAST(count(*) AS SIGNED) FROM outbox WHERE sent_at IS NULL",
        _ => sql,
    };
    let unsent_events = sqlx::query_scalar::<_, i64>(sql)
        .fetch_one(pool)
        .await
        .map_err(|e| format!("{sql}: {e}"))?;
    Ok(Observed {
        markers,
        open_markers,
        balances,
        letters: letters(js).await?,
        events: events(js).await?,
        unsent_events,
    })
}

/// The stream of `credit`'s announcements in a chaos run.
const EVENTS_STREAM: &str = "CHAOS_EVENTS";

/// Every event of [`EVENTS_STREAM`]: (id, account), or why it does not parse. Fails unless all
/// were read.
async fn events(js: &jetstream::Context) -> Result<Vec<Result<(String, i64), String>>, String> {
    let messages = stored(js, EVENTS_STREAM, "events stream").await?;
    Ok(messages
        .into_iter()
        .map(|m| {
            serde_json::from_slice::<serde_json::Value>(&m.payload)
                .ok()
                .and_then(|v| Some((v["id"].as_str()?.to_owned(), v["account"].as_i64()?)))
                .ok_or_else(|| format!("event #{} does not parse", m.sequence))
        })
        .collect())
}

/// Every message of the dead-letter stream, read one by one; fails unless all were read.
async fn letters(js: &jetstream::Context) -> Result<Vec<Letter>, String> {
    let messages = stored(js, DLQ_STREAM, "dead-letter stream").await?;
    Ok(messages.into_iter().map(Letter::from).collect())
}

/// Every message `stream` holds, read one by one; fails unless all were read. `what` names the
/// stream in errors.
async fn stored(
    js: &jetstream::Context,
    stream: &str,
    what: &str,
) -> Result<Vec<StreamMessage>, String> {
    let what = |e: &dyn std::fmt::Display| format!("{what} {stream}: {e}");
    let mut handle = js.get_stream(stream).await.map_err(|e| what(&e))?;
    let state = handle.info().await.map_err(|e| what(&e))?.state.clone();
    let mut messages = Vec::new();
    if state.messages > 0 {
        for seq in state.first_sequence..=state.last_sequence {
            match handle.get_raw_message(seq).await {
                Ok(m) => messages.push(m),
                Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => {}
                Err(e) => return Err(what(&format!("message {seq}: {e}"))),
            }
        }
    }
    if messages.len() as u64 != state.messages {
        return Err(what(&format!(
            "read {} messages, the stream holds {}",
            messages.len(),
            state.messages
        )));
    }
    Ok(messages)
}

/// How many letters the dead-letter stream holds, for following the run's progress.
async fn stored_letters(js: &jetstream::Context) -> Result<u64, String> {
    let what = |e: &dyn std::fmt::Display| format!("dead-letter stream {DLQ_STREAM}: {e}");
    let mut dlq = js.get_stream(DLQ_STREAM).await.map_err(|e| what(&e))?;
    Ok(dlq.info().await.map_err(|e| what(&e))?.state.messages)
}

/// Markers of `credit`'s requests, for following the run's progress.
async fn applied(pool: &AnyPool) -> Result<i64, String> {
    let sql = format!("SELECT count(*) FROM inbox WHERE consumer = '{CONSUMER}'");
    sqlx::query_scalar::<_, i64>(AssertSqlSafe(sql.clone()).into_sql_str())
        .fetch_one(pool)
        .await
        .map_err(|e| format!("{sql}: {e}"))
}

/// Runs one statement.
async fn execute(pool: &AnyPool, sql: String) -> Result<(), String> {
    sqlx::query(AssertSqlSafe(sql.clone()).into_sql_str())
        .execute(pool)
        .await
        .map(drop)
        .map_err(|e| format!("{sql}: {e}"))
}

#[cfg(test)]
mod tests {
    //! The audit on hand-made results: each way a message can end wrong is named, with the
    //! message.
    use super::*;

    /// Two requests (r-0 on account 0, r-1 on account 1, each published twice), one poison and
    /// one unopened credit; sequences 1..=6.
    fn published() -> Published {
        let mut by_seq = BTreeMap::new();
        let request = |i: i64, msg_id: bool| Sent {
            kind: Kind::Request,
            label: format!("r-{i}"),
            key: Some(format!("r-{i}")),
            account: Some(i),
            msg_id: msg_id.then(|| format!("r-{i}")),
            payload: format!("request {i}").into_bytes(),
        };
        by_seq.insert(1, request(0, true));
        by_seq.insert(2, request(1, true));
        by_seq.insert(
            3,
            Sent {
                kind: Kind::Poison,
                label: "poison-0".into(),
                key: None,
                account: None,
                msg_id: None,
                payload: b"{ not json 0".to_vec(),
            },
        );
        by_seq.insert(4, request(0, false));
        by_seq.insert(5, request(1, false));
        by_seq.insert(
            6,
            Sent {
                kind: Kind::Unopened,
                label: "u-0".into(),
                key: Some("u-0".into()),
                account: Some(9),
                msg_id: None,
                payload: b"unopened".to_vec(),
            },
        );
        Published {
            by_seq,
            requests: 2,
            dead_expected: 2,
        }
    }

    fn letter(dlq_seq: u64, seq: u64, payload: &[u8], delivered: i64) -> Letter {
        Letter {
            dlq_seq,
            subject: DLQ_SUBJECT.into(),
            consumer: Some(CONSUMER.into()),
            stream: Some(STREAM.into()),
            stream_seq: Some(seq.to_string()),
            delivered: Some(delivered.to_string()),
            error: Some("boom".into()),
            msg_id: Some(format!("dlq:{CONSUMER}:{STREAM}:{seq}")),
            original_msg_id: None,
            payload: payload.to_vec(),
        }
    }

    /// Everything as it should be.
    fn clean() -> Observed {
        Observed {
            markers: ["r-0", "r-1"].map(String::from).into(),
            open_markers: Vec::new(),
            balances: [(0, 1), (1, 1)].into(),
            letters: vec![
                letter(1, 3, b"{ not json 0", 1),
                letter(2, 6, b"unopened", MAX_DELIVER),
            ],
            events: vec![Ok(("r-0".into(), 0)), Ok(("r-1".into(), 1))],
            unsent_events: 0,
        }
    }

    fn problems(seen: &Observed) -> Vec<(Problem, Vec<String>)> {
        audit(&published(), seen).problems.into_iter().collect()
    }

    #[test]
    fn a_clean_run_has_no_findings() {
        let f = audit(&published(), &clean());
        assert!(f.problems.is_empty(), "{:?}", f.problems);
        assert_eq!((f.applied_once, f.dead_once, f.announced_once), (2, 2, 2));
    }

    #[test]
    fn a_missing_a_doubled_and_a_stray_announcement_are_named() {
        let mut seen = clean();
        seen.events = vec![
            Ok(("r-1".into(), 1)),
            Ok(("r-1".into(), 1)),
            Ok(("u-0".into(), 9)),
            Err("event #4 does not parse".into()),
        ];
        seen.unsent_events = 3;
        assert_eq!(
            problems(&seen),
            [
                (Problem::NotAnnounced, vec!["r-0".to_owned()]),
                (Problem::AnnouncedTwice, vec!["r-1 (2 events)".to_owned()]),
                (
                    Problem::StrayEvent,
                    vec![
                        "event #4 does not parse".to_owned(),
                        "u-0 (1 events)".to_owned()
                    ]
                ),
                (Problem::Unsent, vec!["3 rows".to_owned()]),
            ]
        );
    }

    #[test]
    fn a_lost_request_and_a_double_apply_are_named() {
        let mut seen = clean();
        seen.markers.remove("r-1");
        seen.balances.remove(&1);
        seen.balances.insert(0, 2);
        seen.events.truncate(1);
        assert_eq!(
            problems(&seen),
            [
                (Problem::Lost, vec!["r-1".to_owned()]),
                (Problem::AppliedTwice, vec!["r-0 (balance 2)".to_owned()]),
            ]
        );
    }

    #[test]
    fn torn_requests_are_named() {
        let mut seen = clean();
        seen.markers.remove("r-0");
        seen.balances.remove(&1);
        seen.open_markers.push("r-9".into());
        seen.events.drain(..1);
        assert_eq!(
            problems(&seen),
            [
                (Problem::MarkerWithoutEffect, vec!["r-1".to_owned()]),
                (Problem::EffectWithoutMarker, vec!["r-0".to_owned()]),
                (Problem::OpenMarker, vec!["r-9".to_owned()]),
            ]
        );
    }

    #[test]
    fn letters_are_matched_by_sequence_and_checked() {
        let mut seen = clean();
        // A second letter for the poison, a letter for a request's second copy, the unopened
        // credit's letter written before max_deliver, a letter whose payload is another's.
        seen.letters.push(letter(3, 3, b"{ not json 0", 2));
        seen.letters.push(letter(4, 5, b"request 1", 1));
        seen.letters[1].delivered = Some("3".into());
        seen.letters.push(letter(5, 4, b"{ not json 0", 1));
        assert_eq!(
            problems(&seen),
            [
                (Problem::DeadLetteredRequest, vec!["r-1".to_owned()]),
                (
                    Problem::DeadLetteredTwice,
                    vec!["poison-0 (2 letters)".to_owned()]
                ),
                (
                    Problem::BeforeMaxDeliver,
                    vec!["u-0 (delivery 3)".to_owned()]
                ),
                (
                    Problem::StrayLetter,
                    vec!["letter #5: payload is not that of r-0 (seq 4)".to_owned()]
                ),
            ]
        );
    }

    #[test]
    fn a_missing_letter_an_applied_rejection_and_stray_rows_are_named() {
        let mut seen = clean();
        seen.letters.remove(0);
        seen.letters.remove(0);
        seen.markers.insert("u-0".into());
        seen.markers.insert("ghost".into());
        seen.balances.insert(9, 1);
        seen.balances.insert(42, 1);
        assert_eq!(
            problems(&seen),
            [
                (Problem::NotDeadLettered, vec!["poison-0".to_owned()]),
                (Problem::AppliedRejected, vec!["u-0".to_owned()]),
                (
                    Problem::StrayRow,
                    vec!["account 42".to_owned(), "marker ghost".to_owned()]
                ),
            ]
        );
    }

    #[test]
    fn a_letter_must_name_its_original_everywhere() {
        let p = published();
        let ok = letter(1, 3, b"{ not json 0", 1);
        assert_eq!(origin(&ok, &p), Ok(3));
        let wrong = [
            Letter {
                consumer: Some("other".into()),
                ..ok.clone()
            },
            Letter {
                stream_seq: Some("77".into()),
                ..ok.clone()
            },
            Letter {
                msg_id: None,
                ..ok.clone()
            },
            Letter {
                original_msg_id: Some("x".into()),
                ..ok.clone()
            },
            Letter {
                error: None,
                ..ok.clone()
            },
            Letter {
                subject: "inbox.dlq.other".into(),
                ..ok.clone()
            },
        ];
        for letter in wrong {
            assert!(origin(&letter, &p).is_err(), "{letter:?}");
        }
        let first_copy = Letter {
            original_msg_id: Some("r-0".into()),
            ..letter(9, 1, b"request 0", 1)
        };
        assert_eq!(origin(&first_copy, &p), Ok(1));
    }

    #[test]
    fn the_backoff_fits_max_deliver_and_waits_ack_wait_every_time() {
        let b = backoff();
        assert_eq!(b.len(), MAX_DELIVER as usize - 1);
        assert!(b.iter().all(|&d| d == ACK_WAIT));
        assert!(PAUSE_FOR > ACK_WAIT);
    }
}
