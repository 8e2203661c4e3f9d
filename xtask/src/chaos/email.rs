//! The `email` run of `cargo xtask chaos`: two-phase claims under crashes and a flaky remote.
//!
//! Per backend: a private nats-server, a fresh database, and a local HTTP sink that answers one
//! call in six with a 503 and is slow (longer than a renewal period) on another. E-mail requests
//! are published, one in five twice; three `email` processes consume them while one of them is
//! SIGKILLed and restarted every second, until every message has been handed out. Then it
//! drains and audits, message by message:
//! - every request ends done (its claim committed done) or dead-lettered, never neither;
//! - every call for one request carries one idempotency key, and no other request's;
//! - no two answered calls for one key overlap in time (a call that had not been answered when
//!   the next began would mean two owners at once while a lease was valid: a takeover only
//!   happens once the lease has run out, and a killed owner's call, even a slow one, ends long
//!   before its message is redelivered).

use super::db::audit_pool;
use super::streams::DLQ_STREAM;
use async_nats::jetstream;
use inbox_testkit::{
    Backend, CreditProcess, Database, EmailConfig, Flaky, Poll, PrivateNats, Sink, backlog,
    overlaps, publish_and_wait, unique, why_again,
};
use sqlx::{AnyPool, AssertSqlSafe};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The stream the e-mail requests are published to.
const STREAM: &str = "CHAOS_EMAILS";
/// The requests' subject.
const SUBJECT: &str = "chaos.emails";
/// The durable consumer `email` works on.
const DURABLE: &str = "chaos_email";
/// `email` processes at work.
const INSTANCES: usize = 3;
/// How often an `email` process is SIGKILLed.
const KILL_EVERY: Duration = Duration::from_secs(1);
/// The claims' lease, also how long the sink's slow calls take: a slow call outlasts a renewal
/// period.
const LEASE: Duration = Duration::from_millis(1500);
/// One request in this many is published twice.
const DUPLICATE_EVERY: usize = 5;

/// What one backend's email run found.
pub struct EmailReport {
    /// The backend.
    pub backend: Backend,
    /// Requests published (unique).
    pub requests: usize,
    /// Requests whose claim is done.
    pub done: usize,
    /// Requests dead-lettered (not done).
    pub dead: usize,
    /// Calls the sink received.
    pub calls: usize,
    /// Keys called more than once, by why.
    pub again: BTreeMap<&'static str, usize>,
    /// SIGKILLs.
    pub kills: usize,
    /// What went wrong, one line each.
    pub problems: Vec<String>,
}

impl EmailReport {
    /// Whether the audit found nothing wrong.
    pub fn ok(&self) -> bool {
        self.problems.is_empty() && self.kills > 0
    }

    /// Prints it.
    pub fn print(&self) {
        let again = self
            .again
            .iter()
            .map(|(why, n)| format!("{n} {why}"))
            .collect::<Vec<_>>()
            .join(", ");
        println!(
            "email on {}: {} requests, {} done, {} dead-lettered, {} calls, {} kills; called more than once: {}",
            self.backend.name(),
            self.requests,
            self.done,
            self.dead,
            self.calls,
            self.kills,
            if again.is_empty() {
                "none".into()
            } else {
                again
            }
        );
        for p in self.problems.iter().take(10) {
            println!("  PROBLEM: {p}");
        }
        if self.kills == 0 {
            println!("  PROBLEM: no process was killed");
        }
    }
}

/// Runs the email chaos on `backend` with `n` requests.
pub async fn run(
    backend: Backend,
    n: usize,
    (email, nats_server): (&Path, &Path),
    logs: &Path,
) -> Result<EmailReport, String> {
    let run = unique("")[..8].to_owned();
    let mut nats = PrivateNats::start_binary(nats_server.to_owned()).await?;
    let db = Database::create(backend, "inbox_chaos_email_").await?;
    let sink = Sink::start().await?;
    sink.flaky(Some(Flaky {
        every: 6,
        fail: 2,
        slow: 4,
        slow_for: LEASE,
    }));
    let pool = audit_pool(backend, &db)?;
    let config = EmailConfig {
        binary: email.to_owned(),
        nats_url: nats.url.clone(),
        database_url: db.url.clone(),
        stream: STREAM.into(),
        subject: SUBJECT.into(),
        consumer: DURABLE.into(),
        api_url: sink.url.clone(),
        lease: LEASE,
        hold_before_call: Duration::ZERO,
        // Few calls at a time, so that the run lasts long enough for kills mid-way.
        concurrency: Some(2),
        rust_log: "warn".into(),
    };
    let log = |k: usize| logs.join(format!("email-{}-{run}-{k}.log", backend.name()));
    let result = supervise(backend, n, &config, log, &mut nats, &pool, &sink).await;
    pool.close().await;
    drop(nats);
    db.remove().await?;
    result
}

/// The recipient of request `i`: the audit reads `i` back from a call's body.
fn to(i: usize) -> String {
    format!("user{i}@example.com")
}

/// Publishes the requests, runs the processes through the kills until the consumer drains, and
/// audits every request and every call.
async fn supervise(
    backend: Backend,
    n: usize,
    config: &EmailConfig,
    log: impl Fn(usize) -> PathBuf,
    nats: &mut PrivateNats,
    pool: &AnyPool,
    sink: &Sink,
) -> Result<EmailReport, String> {
    let js = jetstream::new(inbox_testkit::connect(&nats.url).await?);
    let spawn = |k: usize| config.spawn(Some(&log(k)));
    let mut children: Vec<CreditProcess> = (0..INSTANCES).map(spawn).collect::<Result<_, _>>()?;
    let mut poll = Poll::new("the email stream", Duration::from_secs(60));
    while js.get_stream(STREAM).await.is_err() {
        poll.tick().await?;
    }
    let mut requests = Vec::new();
    for i in 0..n {
        let body = serde_json::json!({ "id": format!("e-{i}"), "to": to(i), "body": "receipt" });
        let json = serde_json::to_vec(&body).expect("json");
        if i % DUPLICATE_EVERY == 0 {
            requests.push(json.clone());
        }
        requests.push(json);
    }
    publish_and_wait(&js, SUBJECT, requests).await?;

    let deadline = Duration::from_secs(240) + Duration::from_millis(50 * n as u64);
    let mut poll = Poll::new("the email consumer to drain", deadline);
    let mut kills = 0;
    // The first kill as soon as calls are under way, then one every KILL_EVERY.
    let mut last_kill: Option<Instant> = None;
    let mut victim = 0;
    loop {
        let b = backlog(&js, STREAM, DURABLE).await.ok();
        if b.is_some_and(|b| b.drained()) {
            break;
        }
        // Kills stop once every message has been handed out: a kill during a message's last
        // delivery leaves it neither done nor dead-lettered, whatever the runtime does.
        let undelivered = b.is_none_or(|b| b.pending > 0);
        let due = match last_kill {
            None => !sink.calls().is_empty(),
            Some(at) => at.elapsed() >= KILL_EVERY,
        };
        if undelivered && due {
            children[victim].kill().await?;
            children[victim] = spawn(victim)?;
            kills += 1;
            victim = (victim + 1) % INSTANCES;
            last_kill = Some(Instant::now());
        }
        for (k, child) in children.iter_mut().enumerate() {
            if child.has_exited() {
                return Err(format!(
                    "email process {k} exited on its own; see {}",
                    log(k).display()
                ));
            }
        }
        poll.tick().await?;
    }
    for child in children {
        child.stop(Duration::from_secs(60)).await?;
    }

    // The audit.
    let mut problems = Vec::new();
    // MySQL's message_key is VARBINARY (exact keys); read it as text.
    let key = match backend {
        Backend::MySql => "CAST(message_key AS CHAR)",
        _ => "message_key",
    };
    let done_sql =
        format!("SELECT {key} FROM inbox WHERE consumer = 'email' AND processed_at IS NOT NULL");
    let done: BTreeSet<String> = sqlx::query_scalar::<_, String>(AssertSqlSafe(done_sql))
        .fetch_all(pool)
        .await
        .map_err(|e| format!("reading done claims: {e}"))?
        .into_iter()
        .collect();
    let dead = dead_lettered(&js).await?;
    let by_key = sink.by_key();
    // Which request each idempotency key's calls were for, by the recipient in their body.
    let mut keys_of: BTreeMap<usize, BTreeSet<String>> = BTreeMap::new();
    for (key, calls) in &by_key {
        for call in calls {
            let body: serde_json::Value = serde_json::from_str(&call.body).unwrap_or_default();
            let i = body["to"].as_str().and_then(|t| {
                t.strip_prefix("user")?
                    .strip_suffix("@example.com")?
                    .parse()
                    .ok()
            });
            match i {
                Some(i) => {
                    keys_of.entry(i).or_default().insert(key.clone());
                }
                None => problems.push(format!("a call with an unexpected body: {}", call.body)),
            }
        }
    }
    let mut dead_not_done = 0;
    for i in 0..n {
        let id = format!("e-{i}");
        match (done.contains(&id), dead.contains(&id)) {
            (true, _) => {}
            (false, true) => dead_not_done += 1,
            (false, false) => problems.push(format!("{id}: neither done nor dead-lettered")),
        }
        match keys_of.get(&i).map(BTreeSet::len) {
            None | Some(1) => {}
            Some(k) => problems.push(format!("{id}: called with {k} idempotency keys")),
        }
        if done.contains(&id) && !keys_of.contains_key(&i) {
            problems.push(format!("{id}: done without a call"));
        }
    }
    let mut seen_for: BTreeMap<&String, usize> = BTreeMap::new();
    for (i, keys) in &keys_of {
        for key in keys {
            if let Some(other) = seen_for.insert(key, *i) {
                problems.push(format!(
                    "idempotency key {key} used for e-{other} and e-{i}"
                ));
            }
        }
    }
    for (key, a, b) in overlaps(&by_key) {
        problems.push(format!("calls {a} and {b} for key {key} overlapped"));
    }
    let mut again: BTreeMap<&'static str, usize> = BTreeMap::new();
    for calls in by_key.values().filter(|c| c.len() > 1) {
        *again.entry(why_again(calls)).or_default() += 1;
    }
    let _ = js.delete_stream(STREAM).await;
    Ok(EmailReport {
        backend,
        requests: n,
        done: done.len(),
        dead: dead_not_done,
        calls: by_key.values().map(Vec::len).sum(),
        again,
        kills,
        problems,
    })
}

/// The request ids in the dead-letter stream's letters for consumer `email`.
async fn dead_lettered(js: &jetstream::Context) -> Result<BTreeSet<String>, String> {
    let mut ids = BTreeSet::new();
    let Ok(stream) = js.get_stream(DLQ_STREAM).await else {
        return Ok(ids);
    };
    let last = stream.cached_info().state.last_sequence;
    for seq in 1..=last {
        let Ok(m) = stream.get_raw_message(seq).await else {
            continue;
        };
        if m.subject.as_str() != "inbox.dlq.email" {
            continue;
        }
        let body: serde_json::Value = serde_json::from_slice(&m.payload).unwrap_or_default();
        if let Some(id) = body["id"].as_str() {
            ids.insert(id.to_owned());
        }
    }
    Ok(ids)
}
