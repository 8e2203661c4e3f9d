//! The dead-letter stream: letters read by sequence, grouped by error kind, replayed to their
//! original subject with their key, purged.
//!
//! A letter (see the runtime's `worker/dead_letter.rs`) is the original's payload and headers,
//! less its JetStream control headers, with ours: `Inbox-Error`, `Inbox-Consumer`,
//! `Inbox-Stream`, `Inbox-Stream-Seq`, `Inbox-Delivered`, `Inbox-Subject` and `Inbox-Key` (the
//! last two from this version on), `Inbox-Original-Msg-Id`, and its own `Nats-Msg-Id`
//! (`dlq:<consumer>:<stream>[:<created>]:<seq>`).

use crate::{Config, Error, Filter, Selection};
use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream::Stream};
use bytes::Bytes;
use inbox_runtime::stored::{Headers as StoredHeaders, Lookup};
use serde::Serialize;
use sha2::{Digest, Sha256};

/// Connects to NATS as `NATS_URL` and `NATS_CREDS` say.
pub async fn connect(config: &Config) -> Result<jetstream::Context, Error> {
    let mut options = async_nats::ConnectOptions::new().name("inbox-cli");
    if let Some(path) = &config.nats_creds {
        options = options
            .credentials_file(path)
            .await
            .map_err(|e| format!("NATS_CREDS {}: {e}", path.display()))?;
    }
    let client = options
        .connect(&config.nats_url)
        .await
        .map_err(|e| format!("cannot connect to NATS: {e}"))?;
    Ok(jetstream::new(client))
}

/// One dead letter.
#[derive(Debug, Clone, Serialize)]
pub struct Letter {
    /// Its sequence in the dead-letter stream.
    pub seq: u64,
    /// When it was stored (RFC 3339).
    pub time: String,
    pub consumer: String,
    /// The original's subject, when the letter names it (or its stored original does).
    pub subject: Option<String>,
    pub stream: Option<String>,
    pub stream_seq: Option<u64>,
    /// The key the original was processed under, when known.
    pub key: Option<String>,
    pub error: String,
    /// Its group (`inbox dlq groups`).
    pub group: String,
    /// Header lines of the letter async-nats cannot read (a letter published by another
    /// client): left out of what is shown and of a replay.
    pub unreadable_headers: usize,
    #[serde(skip)]
    headers: HeaderMap,
    #[serde(skip)]
    payload: Bytes,
    /// The names of those lines, as stored (up to the first colon).
    #[serde(skip)]
    unreadable_names: Vec<Bytes>,
}

/// Letters of one error kind.
#[derive(Debug, Clone, Serialize)]
pub struct Group {
    /// Its id, for `--group`.
    pub id: String,
    /// The error kind: the error's first line, numbers as `N`.
    pub kind: String,
    pub count: usize,
    pub first_seen: String,
    pub last_seen: String,
    pub consumers: Vec<String>,
}

/// The dead-letter stream of `Config`.
pub struct Letters {
    js: jetstream::Context,
    name: String,
    prefix: String,
}

fn header(headers: &HeaderMap, name: &str) -> Option<String> {
    headers.get(name).map(|v| v.as_str().to_owned())
}

/// The error kind of `error`: its first line, each run of digits as `N` (an account number or
/// a delivery count does not make another kind).
fn kind_of(error: &str) -> String {
    let first = error.lines().next().unwrap_or_default();
    let mut kind = String::with_capacity(first.len());
    let mut in_digits = false;
    for c in first.chars() {
        if c.is_ascii_digit() {
            if !in_digits {
                kind.push('N');
            }
            in_digits = true;
        } else {
            kind.push(c);
            in_digits = false;
        }
    }
    kind
}

fn group_id(kind: &str) -> String {
    let digest = Sha256::digest(kind.as_bytes());
    hex::encode(&digest[..4])
}

impl Letters {
    /// The dead-letter stream `config` names, on `js`.
    pub fn new(config: &Config, js: jetstream::Context) -> Self {
        Letters {
            js,
            name: config.dlq_stream.clone(),
            prefix: config.dlq_prefix.clone(),
        }
    }

    async fn stream(&self) -> Result<Option<Stream>, Error> {
        match self.js.get_stream(&self.name).await {
            Ok(stream) => Ok(Some(stream)),
            Err(e) => match e.kind() {
                jetstream::context::GetStreamErrorKind::JetStream(js)
                    if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND =>
                {
                    Ok(None)
                }
                _ => Err(format!("dead-letter stream {}: {e}", self.name)),
            },
        }
    }

    /// Every letter `filter` lets through, in stream order.
    pub async fn read(&self, filter: &Filter) -> Result<Vec<Letter>, Error> {
        let mut letters = self.read_of(filter.consumer.as_deref()).await?;
        if let Some(stream) = &filter.stream {
            letters.retain(|l| l.stream.as_ref() == Some(stream));
        }
        Ok(letters)
    }

    /// Every letter (of `consumer`'s alone, with one), in stream order.
    pub async fn read_of(&self, consumer: Option<&str>) -> Result<Vec<Letter>, Error> {
        if self.stream().await?.is_none() {
            return Ok(Vec::new());
        }
        let filter = match consumer {
            Some(c) => format!("{}.{c}", self.prefix),
            None => format!("{}.>", self.prefix),
        };
        let mut letters = Vec::new();
        let mut seq = 1;
        // Read through JetStream's JSON API, the header block parsed by the runtime: a letter
        // stored with a header line async-nats cannot read (published by another client) is
        // listed with what can be read, where async-nats's own read failed the whole listing.
        loop {
            let lookup = Lookup::NextBySubject(seq, &filter);
            let message = match inbox_runtime::stored::read(&self.js, &self.name, lookup).await {
                Ok(Some(message)) => message,
                Ok(None) => break,
                Err(e) => return Err(format!("reading dead-letter stream {}: {e}", self.name)),
            };
            seq = message.sequence + 1;
            let StoredHeaders {
                readable: headers,
                unreadable,
            } = message.headers();
            let error = header(&headers, "Inbox-Error").unwrap_or_default();
            let kind = kind_of(&error);
            letters.push(Letter {
                seq: message.sequence,
                time: time::OffsetDateTime::from(message.published)
                    .format(&time::format_description::well_known::Rfc3339)
                    .unwrap_or_default(),
                unreadable_headers: unreadable.len(),
                unreadable_names: unreadable
                    .iter()
                    .map(|line| {
                        let name = line.split(|&b| b == b':').next().unwrap_or_default();
                        line.slice_ref(name)
                    })
                    .collect(),
                consumer: header(&headers, "Inbox-Consumer").unwrap_or_else(|| {
                    message
                        .subject
                        .strip_prefix(&format!("{}.", self.prefix))
                        .unwrap_or_default()
                        .to_owned()
                }),
                subject: header(&headers, "Inbox-Subject"),
                stream: header(&headers, "Inbox-Stream"),
                stream_seq: header(&headers, "Inbox-Stream-Seq").and_then(|s| s.parse().ok()),
                key: header(&headers, "Inbox-Key"),
                error,
                group: group_id(&kind),
                headers,
                payload: message.payload,
            });
        }
        Ok(letters)
    }

    /// The letters `selection` names, of those `filter` lets through. A sequence that names no
    /// such letter is an error.
    pub async fn select(
        &self,
        selection: &Selection,
        filter: &Filter,
    ) -> Result<Vec<Letter>, Error> {
        let all = self.read(filter).await?;
        if selection.all {
            return Ok(all);
        }
        if let Some(group) = &selection.group {
            let chosen: Vec<Letter> = all.into_iter().filter(|l| l.group == *group).collect();
            if chosen.is_empty() {
                return Err(format!(
                    "no letter in group {group:?} (see `inbox dlq groups`)"
                ));
            }
            return Ok(chosen);
        }
        let mut chosen = Vec::new();
        for seq in &selection.seqs {
            match all.iter().find(|l| l.seq == *seq) {
                Some(letter) => chosen.push(letter.clone()),
                None => return Err(format!("no dead letter with sequence {seq}")),
            }
        }
        Ok(chosen)
    }

    /// Publishes each letter again to its original subject with its key, and deletes it from
    /// the stream once the publish is stored; with `dry_run`, says what it would do.
    pub async fn replay(&self, letters: Vec<Letter>, dry_run: bool) -> Result<(), Error> {
        let Some(stream) = self.stream().await? else {
            println!("replayed 0 letters");
            return Ok(());
        };
        // A test hook: stop (for a SIGKILL) after the n-th publish, before its letter is deleted.
        let hold_after: Option<usize> = std::env::var("INBOX_CLI_TEST_HOLD_AFTER_PUBLISH")
            .ok()
            .and_then(|n| n.parse().ok());
        let bar = indicatif::ProgressBar::new(letters.len() as u64);
        if letters.len() < 50 {
            bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        }
        let (mut replayed, mut failed) = (0usize, Vec::new());
        for letter in letters {
            bar.inc(1);
            let message = match self.replayed_message(&letter).await {
                Ok(message) => message,
                Err(e) => {
                    failed.push(format!("letter {}: {e}", letter.seq));
                    continue;
                }
            };
            let (subject, headers, payload) = message;
            if dry_run {
                bar.suspend(|| {
                    println!(
                        "would replay letter {} of {} to {subject} (key {})",
                        letter.seq,
                        letter.consumer,
                        headers
                            .get(inbox_runtime::REPLAY_KEY)
                            .map_or("from the payload", |k| k.as_str())
                    )
                });
                replayed += 1;
                continue;
            }
            let stored = async {
                let ack = self
                    .js
                    .publish_with_headers(subject.clone(), headers, payload)
                    .await?
                    .await?;
                Ok::<_, async_nats::Error>(ack)
            };
            let ack = match stored.await {
                Ok(ack) => ack,
                Err(e) => {
                    failed.push(format!(
                        "letter {}: publishing to {subject}: {e}",
                        letter.seq
                    ));
                    continue;
                }
            };
            // Stored where the consumer does not read (the subject moved to another stream):
            // the letter is kept.
            if let Some(original) = &letter.stream
                && ack.stream != *original
            {
                failed.push(format!(
                    "letter {}: the replay was stored in stream {}, not in {original}, where its consumer reads; the letter is kept (purge it once the replay is seen to)",
                    letter.seq, ack.stream
                ));
                continue;
            }
            if hold_after == Some(replayed + 1) {
                eprintln!("inbox: held after publishing letter {}", letter.seq);
                std::future::pending::<()>().await;
            }
            if let Err(e) = stream.delete_message(letter.seq).await {
                failed.push(format!(
                    "letter {}: replayed, but not deleted from the stream: {e}",
                    letter.seq
                ));
                continue;
            }
            replayed += 1;
        }
        bar.finish_and_clear();
        match dry_run {
            true => println!("would replay {replayed} letters"),
            false => println!("replayed {replayed} letters"),
        }
        if failed.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{} not replayed: {}",
                failed.len(),
                failed.join("; ")
            ))
        }
    }

    /// The subject, headers and payload `letter` is replayed as: the original's payload and
    /// headers (the letter's, less ours; the stored original's when the letter was cut to fit),
    /// with the key it keeps ([`inbox_runtime::REPLAY_KEY`]) and a message id of the replay's
    /// own, so that a replay published twice (a crash before its letter was deleted) is stored
    /// once within the stream's duplicate window, and applied once after it.
    async fn replayed_message(&self, letter: &Letter) -> Result<(String, HeaderMap, Bytes), Error> {
        // A line of ours (`Inbox-*`) or JetStream's (`Nats-*`) that cannot be read would be
        // replayed as if absent: a cut letter taken for whole, another key than the original's.
        if let Some(name) = letter.unreadable_names.iter().find(|name| {
            let lower = name.to_ascii_lowercase();
            lower.starts_with(b"inbox-") || lower.starts_with(b"nats-")
        }) {
            return Err(format!(
                "its header {:?} cannot be read (bytes async-nats refuses): replay it by hand",
                String::from_utf8_lossy(name)
            ));
        }
        let truncated = letter.headers.get("Inbox-Truncated").is_some();
        let original = match (
            truncated || letter.subject.is_none(),
            &letter.stream,
            letter.stream_seq,
        ) {
            (true, Some(stream), Some(seq)) => {
                let stream = self
                    .js
                    .get_stream(stream)
                    .await
                    .map_err(|e| format!("its original's stream {stream}: {e}"))?;
                // A stream deleted and created again numbers its messages from 1 again: its
                // message `seq` is another one.
                let created = stream.cached_info().created.unix_timestamp_nanos();
                match letter_created(letter) {
                    Some(then) if then == created => {}
                    Some(_) => {
                        return Err(format!(
                            "its original's stream {} was created again since: the original is gone",
                            stream.cached_info().config.name
                        ));
                    }
                    None => {
                        return Err("it does not say when its original's stream was created, so its original cannot be told from a later message".into());
                    }
                }
                // Read as the letters are: an original stored with header lines async-nats
                // cannot parse is replayed with those it can.
                let name = &stream.cached_info().config.name;
                let read = inbox_runtime::stored::read(&self.js, name, Lookup::Sequence(seq))
                    .await
                    .map_err(|e| format!("its original (sequence {seq}): {e}"))?;
                Some(read.ok_or_else(|| {
                    format!("its original (sequence {seq}) is no longer in stream {name}")
                })?)
            }
            (true, _, _) => {
                return Err("it names neither its subject nor its original's place".into());
            }
            (false, _, _) => None,
        };
        let subject = match (&letter.subject, &original) {
            (Some(subject), _) => subject.clone(),
            (None, Some(original)) => original.subject.to_string(),
            (None, None) => return Err("it does not name its subject".into()),
        };
        // Its original may have come without a reply subject, where a replay has one (for its
        // PubAck): the control line would pass nats-server's `max_control_line`, and the server
        // would close the connection, every later letter's publish with it.
        if subject.len() > inbox_runtime::MAX_OUTBOX_SUBJECT_LEN {
            return Err(format!(
                "its subject is {} bytes, over the {} a publish can carry within nats-server's \
                 default max_control_line (4,096 bytes); publish it again by hand",
                subject.len(),
                inbox_runtime::MAX_OUTBOX_SUBJECT_LEN
            ));
        }
        let (source, payload) = match (&original, truncated) {
            (Some(original), true) => (original.headers().readable, original.payload.clone()),
            _ => (letter.headers.clone(), letter.payload.clone()),
        };
        let mut headers = HeaderMap::new();
        for (name, values) in source.iter() {
            let n: &str = name.as_ref();
            let ours = n.len() >= 6 && n[..6].eq_ignore_ascii_case("inbox-");
            let control = n.len() >= 5 && n[..5].eq_ignore_ascii_case("nats-");
            if ours || control {
                continue;
            }
            for value in values {
                headers.append(name.clone(), value.clone());
            }
        }
        // Addressed to the letter's consumer alone: every other consumer of the subject acks
        // it as a duplicate (it may have applied the original).
        headers.insert(inbox_runtime::REPLAY_CONSUMER, letter.consumer.as_str());
        if let Some(key) = self.key_of(letter) {
            headers.insert(inbox_runtime::REPLAY_KEY, key.as_str());
        }
        let id = format!("inbox-replay:{}:{}:{}", self.name, letter.seq, letter.time);
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
        Ok((subject, headers, payload))
    }

    /// The key a replay of `letter` keeps: the letter's `Inbox-Key`; for a letter of an older
    /// version, the original's message id, else its transport id from the letter's own id
    /// (`dlq:<consumer>:<stream>:<created>:<seq>`).
    fn key_of(&self, letter: &Letter) -> Option<String> {
        if let Some(key) = &letter.key {
            return Some(key.clone());
        }
        if let Some(id) = header(&letter.headers, "Inbox-Original-Msg-Id") {
            return Some(id);
        }
        let id = header(
            &letter.headers,
            async_nats::header::NATS_MESSAGE_ID.as_ref(),
        )?;
        let rest = id.strip_prefix(&format!("dlq:{}:", letter.consumer))?;
        let parts: Vec<&str> = rest.rsplitn(3, ':').collect();
        // seq, created, stream; without the creation time the transport id cannot be told.
        match parts.as_slice() {
            [seq, created, stream] => Some(format!("{stream}:{created}:{seq}")),
            _ => None,
        }
    }

    /// Deletes `letters` from the stream; how many went.
    pub async fn purge(&self, letters: &[Letter]) -> Result<usize, Error> {
        let Some(stream) = self.stream().await? else {
            return Ok(0);
        };
        let mut purged = 0;
        for letter in letters {
            stream
                .delete_message(letter.seq)
                .await
                .map_err(|e| format!("deleting letter {}: {e}", letter.seq))?;
            purged += 1;
        }
        Ok(purged)
    }
}

/// The creation time (Unix nanoseconds) of the original's stream, from the letter's id
/// (`dlq:<consumer>:<stream>:<created>:<seq>`), when it names one.
fn letter_created(letter: &Letter) -> Option<i128> {
    let id = header(
        &letter.headers,
        async_nats::header::NATS_MESSAGE_ID.as_ref(),
    )?;
    let stream = letter.stream.as_deref()?;
    let seq = letter.stream_seq?;
    let rest = id.strip_prefix(&format!("dlq:{}:{stream}:", letter.consumer))?;
    let created = rest.strip_suffix(&format!(":{seq}"))?;
    created.parse().ok()
}

/// `letters` by error kind, largest group first.
pub fn groups(letters: &[Letter]) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    for letter in letters {
        match groups.iter_mut().find(|g| g.id == letter.group) {
            Some(group) => {
                group.count += 1;
                group.last_seen.clone_from(&letter.time);
                if !group.consumers.contains(&letter.consumer) {
                    group.consumers.push(letter.consumer.clone());
                }
            }
            None => groups.push(Group {
                id: letter.group.clone(),
                kind: kind_of(&letter.error),
                count: 1,
                first_seen: letter.time.clone(),
                last_seen: letter.time.clone(),
                consumers: vec![letter.consumer.clone()],
            }),
        }
    }
    groups.sort_by(|a, b| b.count.cmp(&a.count).then(a.first_seen.cmp(&b.first_seen)));
    groups
}

/// `dlq list` as text.
pub fn list_text(letters: &[Letter]) -> String {
    if letters.is_empty() {
        return "no dead letters\n".into();
    }
    let mut out = String::from("SEQ\tCONSUMER\tSUBJECT\tSTREAM:SEQ\tKEY\tTIME\tERROR\n");
    for l in letters {
        out += &format!(
            "{}\t{}\t{}\t{}:{}\t{}\t{}\t{}\n",
            l.seq,
            l.consumer,
            l.subject.as_deref().unwrap_or("-"),
            l.stream.as_deref().unwrap_or("-"),
            l.stream_seq.map_or("-".to_owned(), |s| s.to_string()),
            l.key.as_deref().unwrap_or("-"),
            l.time,
            l.error
        );
        if l.unreadable_headers > 0 {
            out.pop();
            out += &format!(
                " (header lines async-nats cannot read, left out: {})\n",
                l.unreadable_headers
            );
        }
    }
    out
}

/// `dlq groups` as text.
pub fn groups_text(groups: &[Group]) -> String {
    if groups.is_empty() {
        return "no dead letters\n".into();
    }
    let mut out = String::from("GROUP\tCOUNT\tFIRST SEEN\tLAST SEEN\tCONSUMERS\tERROR\n");
    for g in groups {
        out += &format!(
            "{}\t{}\t{}\t{}\t{}\t{}\n",
            g.id,
            g.count,
            g.first_seen,
            g.last_seen,
            g.consumers.join(","),
            g.kind
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_kinds_ignore_numbers_and_later_lines() {
        assert_eq!(
            kind_of("handler failed: account 7 is closed\nmore"),
            "handler failed: account N is closed"
        );
        assert_eq!(
            kind_of("handler failed: account 12 is closed"),
            kind_of("handler failed: account 7 is closed")
        );
        assert_ne!(group_id("a"), group_id("b"));
    }
}
