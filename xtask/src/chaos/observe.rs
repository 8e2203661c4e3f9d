//! Reading back what a credit run left behind once it is over: `credit`'s markers, the
//! balances, the unsent outbox rows, the last sequence of the requests' stream, every letter and
//! every announcement. A query that fails fails the read: nothing counts as 0.

use super::streams::{CONSUMER, DLQ_STREAM, EVENTS_STREAM, STREAM, by_backstop, stored};
use async_nats::jetstream::{self, message::StreamMessage};
use base64::Engine;
use inbox_testkit::Backend;
use sqlx::{AnyPool, AssertSqlSafe, SqlSafeStr};
use std::collections::{HashMap, HashSet};

/// A letter as read back from the dead-letter stream: the headers the audit checks.
#[derive(Debug, Clone, Default)]
pub struct Letter {
    /// Its own sequence in the dead-letter stream.
    pub dlq_seq: u64,
    /// The subject it was published to.
    pub subject: String,
    /// `Inbox-Consumer`: the handler that rejected it.
    pub consumer: Option<String>,
    /// `Inbox-Stream`: the original's stream.
    pub stream: Option<String>,
    /// `Inbox-Stream-Seq`: the original's sequence there.
    pub stream_seq: Option<String>,
    /// `Inbox-Delivered`: the delivery that was rejected.
    pub delivered: Option<String>,
    /// `Inbox-Error`: why.
    pub error: Option<String>,
    /// `Nats-Msg-Id`: `dlq:<consumer>:<stream>:[<created>:]<seq>`.
    pub msg_id: Option<String>,
    /// `Inbox-Original-Msg-Id`: the original's `Nats-Msg-Id`, when it had one.
    pub original_msg_id: Option<String>,
    /// `Inbox-Unreadable-Headers`: the original's header lines no client parses, base64.
    pub unreadable_headers: Option<String>,
    /// The original's payload.
    pub payload: Vec<u8>,
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
            unreadable_headers: header(inbox_runtime::UNREADABLE_HEADERS),
            payload: m.payload.to_vec(),
        }
    }
}

impl Letter {
    /// Whether the delivery-limit backstop wrote it rather than a worker.
    pub fn by_backstop(&self) -> bool {
        by_backstop(self.error.as_deref())
    }

    /// Whether its `Inbox-Unreadable-Headers` carries exactly `lines`, byte for byte (each line
    /// base64, the lines separated by commas).
    pub fn carries(&self, lines: &[Vec<u8>]) -> bool {
        let Some(value) = self.unreadable_headers.as_deref() else {
            return false;
        };
        let decoded: Result<Vec<Vec<u8>>, _> = value
            .split(',')
            .map(|line| base64::engine::general_purpose::STANDARD.decode(line))
            .collect();
        decoded.is_ok_and(|d| d == lines)
    }
}

/// What the run left behind, read back after it.
#[derive(Debug, Default)]
pub struct Observed {
    /// Keys of `credit`'s committed markers (`processed_at` set).
    pub markers: HashSet<String>,
    /// Keys of `credit`'s markers without `processed_at`: an effect never finished.
    pub open_markers: Vec<String>,
    /// Balances by account.
    pub balances: HashMap<i64, i64>,
    /// The last sequence the requests' stream assigned.
    pub stream_last_seq: u64,
    /// Every message of the dead-letter stream.
    pub letters: Vec<Letter>,
    /// Every event of the announcements' stream (`<STREAM>_EVENTS`): (id, account), or why it
    /// does not parse.
    pub events: Vec<Result<(String, i64), String>>,
    /// Outbox rows not marked sent once every process has stopped.
    pub unsent_events: i64,
}

/// Reads back what the run left: markers, balances, letters. Any failed query is an error.
pub async fn observe(
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
    let stream_last_seq = {
        let what = |e: &dyn std::fmt::Display| format!("stream {STREAM}: {e}");
        let mut stream = js.get_stream(STREAM).await.map_err(|e| what(&e))?;
        stream
            .info()
            .await
            .map_err(|e| what(&e))?
            .state
            .last_sequence
    };
    Ok(Observed {
        markers,
        open_markers,
        balances,
        stream_last_seq,
        letters: letters(js).await?,
        events: events(js).await?,
        unsent_events,
    })
}

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
