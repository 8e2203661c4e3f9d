//! The audit of a credit run, message by message: every sequence the stream assigned ends applied
//! (its request's marker is committed) or dead-lettered, none neither; every request id applied
//! exactly once (its account's balance is 1 and its marker is committed) and announced once;
//! every other message dead-lettered exactly once (one letter names its stream sequence and
//! carries its payload; an unopened account's letter says it came at delivery `max_deliver`; an
//! unreadable message's carries its header lines); and nothing else in the database, the
//! dead-letter stream or the announcements.

use super::observe::{Letter, Observed};
use super::publish::{Kind, Published};
use super::streams::{CONSUMER, DLQ_SUBJECT, MAX_DELIVER, STREAM};
use std::collections::{BTreeMap, HashMap, HashSet};

#[cfg(test)]
mod tests;

/// How many example messages a finding names.
const EXAMPLES: usize = 5;

/// A way a message can end wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Problem {
    /// A stream sequence neither applied nor dead-lettered (or one chaos never published).
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
    /// A message with more than one letter.
    DeadLetteredTwice,
    /// A message to reject whose marker or effect is there.
    AppliedRejected,
    /// An unopened account's credit dead-lettered before its `max_deliver`-th delivery.
    BeforeMaxDeliver,
    /// An unreadable message's letter without its header lines in `Inbox-Unreadable-Headers`.
    HeadersDropped,
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
            Problem::Lost => "lost: stream sequence neither applied nor dead-lettered",
            Problem::AppliedTwice => "applied twice (balance 2 or more)",
            Problem::MarkerWithoutEffect => "marker committed, effect missing",
            Problem::EffectWithoutMarker => "effect applied, marker missing",
            Problem::WrongBalance => "balance neither 1 nor more",
            Problem::OpenMarker => "marker without processed_at",
            Problem::DeadLetteredRequest => "dead-lettered, expected applied",
            Problem::DeadLetteredTwice => "dead-lettered more than once",
            Problem::AppliedRejected => "applied, expected dead-lettered",
            Problem::BeforeMaxDeliver => "dead-lettered before max_deliver",
            Problem::HeadersDropped => "letter without the unreadable header lines",
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
pub struct Findings {
    /// Requests applied exactly once.
    pub applied_once: usize,
    /// Messages to reject with exactly one letter.
    pub dead_once: usize,
    /// Letters the delivery-limit backstop wrote.
    pub by_backstop: usize,
    /// Applied requests announced by exactly one event.
    pub announced_once: usize,
    /// Every problem, with the messages (labels) it concerns.
    pub problems: BTreeMap<Problem, Vec<String>>,
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

    /// Stream sequences lost, requests applied twice, and messages with any other problem: the
    /// report tables' columns.
    pub fn tally(&self) -> (usize, usize, usize) {
        let (lost, twice) = (self.count(Problem::Lost), self.count(Problem::AppliedTwice));
        let all: usize = self.problems.values().map(Vec::len).sum();
        (lost, twice, all - lost - twice)
    }

    /// Prints each problem with its count and the first few messages it concerns.
    pub fn print_problems(&self) {
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
    f.by_backstop = seen.letters.iter().filter(|l| l.by_backstop()).count();

    // Every sequence the stream assigned: applied (its key's marker committed; an effect without
    // its marker is reported below, as torn) or dead-lettered.
    let last = published.by_seq.keys().copied().max().unwrap_or(0);
    for seq in 1..=seen.stream_last_seq.max(last) {
        match published.by_seq.get(&seq) {
            None => f.add(Problem::Lost, format!("seq {seq} (not published by chaos)")),
            Some(sent) => {
                let applied = sent.key.as_ref().is_some_and(|k| seen.markers.contains(k))
                    || sent.account.is_some_and(|a| seen.balances.contains_key(&a));
                if !applied && letters_of(&seq).is_empty() {
                    f.add(Problem::Lost, format!("{} (seq {seq})", sent.label));
                }
            }
        }
    }

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
            // Lost or dead-lettered: reported by sequence above.
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
            // Lost or applied: reported above.
            0 => {}
            1 => f.dead_once += 1,
            n => f.add(
                Problem::DeadLetteredTwice,
                format!("{} ({n} letters)", sent.label),
            ),
        }
        if sent.kind == Kind::Unreadable {
            for letter in got.iter().filter(|l| !l.carries(&sent.raw_headers)) {
                f.add(
                    Problem::HeadersDropped,
                    format!("{} (letter #{})", sent.label, letter.dlq_seq),
                );
            }
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

/// What a credit run's audit came to, whatever faults it went through: what every report shows.
pub struct Audited {
    /// Messages published in all.
    pub total: usize,
    /// Distinct valid requests.
    pub requests: usize,
    /// Messages that must be dead-lettered.
    pub dead_expected: usize,
    /// The audit's findings.
    pub findings: Findings,
    /// Duplicates the processes that stopped cleanly skipped.
    pub skipped: u64,
}

impl Audited {
    /// Audits `published` against what the run left behind (`seen`).
    pub fn new(published: &Published, seen: &Observed, skipped: u64) -> Audited {
        Audited {
            total: published.by_seq.len(),
            requests: published.requests,
            dead_expected: published.dead_expected,
            findings: audit(published, seen),
            skipped,
        }
    }

    /// Every message ended as it must: each request applied once, each message to reject
    /// dead-lettered once, nothing else.
    pub fn exact(&self) -> bool {
        self.findings.problems.is_empty()
            && self.findings.applied_once == self.requests
            && self.findings.dead_once == self.dead_expected
    }
}
