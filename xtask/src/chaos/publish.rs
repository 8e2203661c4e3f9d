//! What a credit run publishes, and the accounts that make some of it fail: N requests each
//! published twice, poison payloads, overdraws, valid requests whose header block no client can
//! parse (over a raw connection, when asked), and credits to accounts never opened, last.
//! Every message's stream sequence is kept from its PubAck, for the audit.

use super::db::execute;
use super::streams::{self, STREAM, SUBJECT};
use async_nats::jetstream;
use inbox_testkit::{Backend, Outgoing, publish_acked, publish_raw_acked};
use sqlx::AnyPool;
use std::collections::BTreeMap;

/// Poison payloads: not JSON, dead-lettered at once.
const POISON: usize = 5;
/// Overdraws: debits of accounts never credited, refused for good, dead-lettered at once.
const OVERDRAWS: usize = 5;
/// Credits to accounts never opened: a foreign-key violation, dead-lettered at `max_deliver`.
const UNOPENED: usize = 3;
/// The header lines no client library parses back, one message each (see [`Kind::Unreadable`]):
/// a non-ASCII byte in a name, a value that is not UTF-8, a control byte in a name.
const UNREADABLE: [&[u8]; 3] = [b"Ch\xc3\xa9que: 1", b"X-Latin1: caf\xe9", b"X-\x01Ctl: 1"];
/// The accounts a credit may go to; chaos's `accounts` has a foreign key to it.
const OPEN_ACCOUNTS: &str = "open_accounts";

/// What a published message is, and so what it must come to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// One of a valid request's two copies: the request is applied exactly once.
    Request,
    /// Not JSON: dead-lettered at once.
    Poison,
    /// Debits an account never credited (`credit` refuses it for good, `NoSuchAccount`):
    /// dead-lettered at once.
    Overdraw,
    /// Credits an account never opened (a foreign-key violation): redelivered with a delay, then
    /// dead-lettered at delivery `max_deliver`, by the worker or, when the process holding that
    /// delivery is killed, by the delivery-limit backstop.
    Unopened,
    /// A valid request (an open account of its own) published over a raw connection with a
    /// header block async-nats cannot parse: the worker never sees it (the client drops its
    /// connection at each delivery), and the delivery-limit backstop dead-letters it, payload
    /// intact, the header lines carried in `Inbox-Unreadable-Headers`.
    Unreadable,
}

/// One published message.
#[derive(Debug, Clone)]
pub struct Sent {
    /// What it is.
    pub kind: Kind,
    /// How findings name it: the request id, or `poison-<j>`.
    pub label: String,
    /// Its key (the request id), when it decodes.
    pub key: Option<String>,
    /// The account it credits, when it decodes.
    pub account: Option<i64>,
    /// Its `Nats-Msg-Id`, when published with one.
    pub msg_id: Option<String>,
    /// Its payload.
    pub payload: Vec<u8>,
    /// The header lines it was published with over a raw connection ([`Kind::Unreadable`]);
    /// empty for the others.
    pub raw_headers: Vec<Vec<u8>>,
}

/// What was published.
pub struct Published {
    /// Every message, by the stream sequence its PubAck gave.
    pub by_seq: BTreeMap<u64, Sent>,
    /// Distinct valid requests.
    pub requests: usize,
    /// Messages that must be dead-lettered.
    pub dead_expected: usize,
}

/// The accounts, in order: a request's `0..n`, then the overdraws', the unopened credits', the
/// unreadable requests'.
fn unopened_account(n: usize, j: usize) -> usize {
    n + OVERDRAWS + j
}

/// The account of the unreadable request `j`.
fn unreadable_account(n: usize, j: usize) -> usize {
    n + OVERDRAWS + UNOPENED + j
}

/// Creates `accounts` as `credit` would, plus a foreign key to [`OPEN_ACCOUNTS`], which holds
/// every account a request, an overdraw or an unreadable request credits, not the unopened ones.
pub async fn create_accounts(backend: Backend, pool: &AnyPool, n: usize) -> Result<(), String> {
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
    let unreadable = (0..UNREADABLE.len()).map(|j| unreadable_account(n, j));
    let ids: Vec<usize> = (0..n + OVERDRAWS).chain(unreadable).collect();
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
/// with `replicas` replicas, and publishes every message, keeping where each was stored. With
/// `raw_url`, the [`Kind::Unreadable`] requests are among them, published over a raw connection
/// to that server. The cluster and failover runs pass none: they keep to their own fault, and
/// on a cluster the server may lose a `MAX_DELIVERIES` advisory around a leader change, which
/// no backstop can make up for.
pub async fn publish(
    js: &jetstream::Context,
    n: usize,
    run: &str,
    replicas: usize,
    raw_url: Option<&str>,
) -> Result<Published, String> {
    streams::create(js, replicas).await?;
    let sent = messages(n, run, raw_url.is_some());
    println!("publishing {} messages...", sent.len());
    let mut by_seq = BTreeMap::new();
    // In stream order: each run of ordinary messages through the client, each unreadable one
    // over a raw connection of its own.
    let mut rest = &sent[..];
    while let Some(first) = rest.first() {
        if first.kind == Kind::Unreadable {
            let url = raw_url.ok_or("an unreadable message without a raw connection")?;
            let seq = publish_raw_acked(url, SUBJECT, &first.raw_headers, &first.payload).await?;
            by_seq.insert(seq, first.clone());
            rest = &rest[1..];
            continue;
        }
        let k = rest
            .iter()
            .position(|s| s.kind == Kind::Unreadable)
            .unwrap_or(rest.len());
        let (ordinary, after) = rest.split_at(k);
        let outgoing = ordinary.iter().map(|s| match &s.msg_id {
            Some(id) => Outgoing::with_msg_id(s.payload.clone(), id),
            None => Outgoing::from(s.payload.clone()),
        });
        let acks = publish_acked(js, SUBJECT, outgoing).await?;
        if acks.len() != ordinary.len() {
            return Err(format!(
                "{} PubAcks for {} messages",
                acks.len(),
                ordinary.len()
            ));
        }
        for (ack, s) in acks.into_iter().zip(ordinary) {
            if ack.stream != STREAM || ack.duplicate {
                return Err(format!(
                    "{} was not stored as a new message: {ack:?}",
                    s.label
                ));
            }
            by_seq.insert(ack.sequence, s.clone());
        }
        rest = after;
    }
    let dead_expected = sent.iter().filter(|s| s.kind != Kind::Request).count();
    Ok(Published {
        by_seq,
        requests: n,
        dead_expected,
    })
}

/// Every message of a run, in the order published: each valid request twice (with a msg-id, the
/// broker's dedup window, and without, which only the inbox can catch); poisons, overdraws and,
/// when `unreadable`, the unreadable requests spread among the first copies; the unopened
/// credits last.
fn messages(n: usize, run: &str, unreadable: bool) -> Vec<Sent> {
    let mut sent: Vec<Sent> = Vec::with_capacity(2 * n + POISON + OVERDRAWS + UNOPENED + 3);
    let plain = |kind: Kind, label: String, payload: Vec<u8>| Sent {
        kind,
        label,
        key: None,
        account: None,
        msg_id: None,
        payload,
        raw_headers: Vec::new(),
    };
    let credit = |kind: Kind, id: String, account: usize, amount: i64| Sent {
        payload: request(&id, account, amount),
        key: Some(id.clone()),
        account: Some(account as i64),
        ..plain(kind, id, Vec::new())
    };
    let spread = n / POISON.max(OVERDRAWS);
    for pass in 0..2 {
        for i in 0..n {
            let id = request_id(run, i);
            sent.push(Sent {
                msg_id: (pass == 0).then(|| id.clone()),
                ..credit(Kind::Request, id, i, 1)
            });
            let j = i / spread;
            if pass == 0 && i % spread == 0 {
                if j < POISON {
                    let payload = format!("{{ not json {j}").into_bytes();
                    sent.push(plain(Kind::Poison, format!("poison-{j}"), payload));
                }
                if j < OVERDRAWS {
                    sent.push(credit(Kind::Overdraw, format!("neg-{run}-{j}"), n + j, -5));
                }
            }
            // Half-way between two poisons.
            if unreadable && pass == 0 && i % spread == spread / 2 && j < UNREADABLE.len() {
                let id = format!("unreadable-{run}-{j}");
                sent.push(Sent {
                    raw_headers: vec![UNREADABLE[j].to_vec()],
                    ..credit(Kind::Unreadable, id, unreadable_account(n, j), 1)
                });
            }
        }
    }
    for j in 0..UNOPENED {
        let id = format!("unopened-{run}-{j}");
        sent.push(credit(Kind::Unopened, id, unopened_account(n, j), 1));
    }
    sent
}
