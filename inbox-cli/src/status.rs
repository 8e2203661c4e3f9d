//! `inbox status`: per consumer, what JetStream, the inbox table and the dead-letter stream say
//! of it; and the outbox.

use crate::db::{ConsumerRows, Db, OutboxSummary, age};
use crate::letters::Letters;
use crate::{Config, Error};
use async_nats::jetstream;
use futures::TryStreamExt;
use serde::Serialize;

/// The whole report.
#[derive(Debug, Serialize)]
pub struct Report {
    pub consumers: Vec<ConsumerStatus>,
    /// `None` when the database has no outbox table.
    pub outbox: Option<OutboxSummary>,
}

/// One consumer (the handler's `consumer` name).
#[derive(Debug, Serialize)]
pub struct ConsumerStatus {
    #[serde(flatten)]
    pub rows: ConsumerRows,
    /// The JetStream durable of the same name, when one exists.
    pub durable: Option<DurableStatus>,
    pub dead_letters: usize,
    /// When the oldest dead letter was stored (RFC 3339).
    pub oldest_dead_letter: Option<String>,
}

/// A JetStream durable consumer.
#[derive(Debug, Serialize)]
pub struct DurableStatus {
    pub stream: String,
    pub durable: String,
    /// Messages not yet delivered.
    pub pending: u64,
    /// Delivered and not yet acked.
    pub ack_pending: usize,
    pub redelivered: usize,
    /// The stream's oldest stored message (RFC 3339): cleanup removes markers older than it
    /// (less the worker's margin), since no redelivery can reach them.
    pub cleanup_cutoff: Option<String>,
}

/// The status of every consumer (or of `only`: a consumer and its durable's name); with
/// `stream`, its durables and the letters of its messages alone.
pub async fn report(
    config: &Config,
    db: &Db,
    js: &jetstream::Context,
    only: Option<(&str, &str)>,
    stream: Option<&str>,
) -> Result<Report, Error> {
    let mut rows = db.consumers().await?;
    let mut letters = Letters::new(config, js.clone())
        .read_of(only.map(|(c, _)| c))
        .await?;
    if let Some(stream) = stream {
        letters.retain(|l| l.stream.as_deref() == Some(stream));
    }
    for letter in &letters {
        if !rows.iter().any(|r| r.consumer == letter.consumer) {
            rows.push(ConsumerRows {
                consumer: letter.consumer.clone(),
                ..ConsumerRows::default()
            });
        }
    }
    if let Some((only, _)) = only {
        rows.retain(|r| r.consumer == only);
        if rows.is_empty() {
            rows.push(ConsumerRows {
                consumer: only.to_owned(),
                ..ConsumerRows::default()
            });
        }
    }
    let streams: Vec<String> = match stream {
        Some(stream) => vec![stream.to_owned()],
        None => js
            .stream_names()
            .try_collect()
            .await
            .map_err(|e| format!("listing streams: {e}"))?,
    };
    let mut consumers = Vec::new();
    for rows in rows {
        let mine: Vec<_> = letters
            .iter()
            .filter(|l| l.consumer == rows.consumer)
            .collect();
        let name = only.map_or(rows.consumer.as_str(), |(_, durable)| durable);
        consumers.push(ConsumerStatus {
            durable: durable(js, &streams, name).await?,
            dead_letters: mine.len(),
            oldest_dead_letter: mine.first().map(|l| l.time.clone()),
            rows,
        });
    }
    Ok(Report {
        consumers,
        outbox: db.outbox_summary().await?,
    })
}

/// The durable named `name` in any of `streams`, if one exists.
async fn durable(
    js: &jetstream::Context,
    streams: &[String],
    name: &str,
) -> Result<Option<DurableStatus>, Error> {
    for stream_name in streams {
        let Ok(mut stream) = js.get_stream(stream_name).await else {
            continue;
        };
        let Ok(info) = stream.consumer_info(name).await else {
            continue;
        };
        let stream_info = stream
            .info()
            .await
            .map_err(|e| format!("stream {stream_name}: {e}"))?;
        let cutoff = (stream_info.state.messages > 0)
            .then(|| {
                stream_info
                    .state
                    .first_timestamp
                    .format(&time::format_description::well_known::Rfc3339)
                    .ok()
            })
            .flatten();
        return Ok(Some(DurableStatus {
            stream: stream_name.clone(),
            durable: info.name.clone(),
            pending: info.num_pending,
            ack_pending: info.num_ack_pending,
            redelivered: info.num_redelivered,
            cleanup_cutoff: cutoff,
        }));
    }
    Ok(None)
}

/// The report as text.
pub fn text(report: &Report) -> String {
    let mut out = String::new();
    let opt_age = |ms: Option<i64>| ms.map_or("-".to_owned(), age);
    if report.consumers.is_empty() {
        out += "no consumers: no markers, parked or dead letters\n";
    }
    for c in &report.consumers {
        let r = &c.rows;
        out += &format!("consumer {}\n", r.consumer);
        match &c.durable {
            Some(d) => {
                out += &format!(
                    "  durable       {} on stream {}: pending {}, ack pending {}, redelivered {}\n",
                    d.durable, d.stream, d.pending, d.ack_pending, d.redelivered
                );
                out += &format!(
                    "  cleanup       markers older than {} (the stream's oldest message)\n",
                    d.cleanup_cutoff
                        .as_deref()
                        .unwrap_or("now (the stream is empty)")
                );
            }
            None => out += "  durable       none of that name\n",
        }
        out += &format!(
            "  markers       {} (oldest {})\n",
            r.markers,
            opt_age(r.oldest_marker_age_ms)
        );
        out += &format!(
            "  dead letters  {} (oldest {})\n",
            c.dead_letters,
            c.oldest_dead_letter.as_deref().unwrap_or("-")
        );
        out += &format!(
            "  parked        {} (oldest {})\n",
            r.parked_letters,
            opt_age(r.oldest_parked_age_ms)
        );
        out += &format!(
            "  open claims   {} (oldest {})\n",
            r.open_claims,
            opt_age(r.oldest_open_claim_age_ms)
        );
    }
    match &report.outbox {
        Some(o) => {
            out += &format!(
                "outbox: pending {} (oldest {}), failed {}\n",
                o.pending,
                age(o.oldest_pending_age_ms as i64),
                o.failed
            );
        }
        None => out += "outbox: none\n",
    }
    out
}
