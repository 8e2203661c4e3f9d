//! What a credit run publishes, and the accounts that make some of it fail: N requests each
//! published twice, poison payloads, overdraws, and credits to accounts never opened, last.
//! Every message's stream sequence is kept from its PubAck, for the audit.

use super::db::execute;
use super::streams::{self, STREAM, SUBJECT};
use async_nats::jetstream;
use inbox_testkit::{Backend, Outgoing, publish_acked};
use sqlx::AnyPool;
use std::collections::BTreeMap;

/// Poison payloads: not JSON, dead-lettered at once.
const POISON: usize = 5;
/// Overdraws: a CHECK violation, dead-lettered at once.
const OVERDRAWS: usize = 5;
/// Credits to accounts never opened: a foreign-key violation, dead-lettered at `max_deliver`.
const UNOPENED: usize = 3;
/// The accounts a credit may go to; chaos's `accounts` has a foreign key to it.
const OPEN_ACCOUNTS: &str = "open_accounts";

/// What a published message is, and so what it must come to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
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

/// Creates `accounts` as `credit` would, plus a foreign key to [`OPEN_ACCOUNTS`], which holds
/// every account a request or an overdraw credits (`0..n + OVERDRAWS`), not the unopened ones.
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
pub async fn publish(
    js: &jetstream::Context,
    n: usize,
    run: &str,
    replicas: usize,
) -> Result<Published, String> {
    streams::create(js, replicas).await?;

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
