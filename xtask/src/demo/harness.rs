//! What every part of the demo does with its processes and its figures: start a few with a log
//! each, wait for them, stop them, count rows, and print a summary.

use async_nats::jetstream;
use inbox_testkit::{CreditConfig, CreditProcess, Poll};
use sqlx::{AnyPool, AssertSqlSafe};
use std::path::Path;
use std::time::Duration;

/// What every part of the demo runs on.
#[derive(Clone, Copy)]
pub struct Part<'a> {
    /// `credit`'s configuration: the NATS and the database every part uses.
    pub credit: &'a CreditConfig,
    /// The run's id, which every part's streams, keys and ids carry.
    pub run: &'a str,
    /// JetStream on that NATS.
    pub js: &'a jetstream::Context,
    /// A pool on that database, to count what the processes did.
    pub pool: &'a AnyPool,
    /// Where the processes' logs go.
    pub logs: &'a Path,
}

/// One message in this many is published a second time, in every part.
pub const DUPLICATE_EVERY: usize = 3;
/// How long any one wait of a part may take.
pub const DEADLINE: Duration = Duration::from_secs(300);

/// Starts `count` processes, the n-th (from 1) logging afresh to `<logs>/<name>-<n>.log`;
/// `spawn` starts one, given `n` and its log.
pub fn spawn_logged(
    logs: &Path,
    name: &str,
    count: usize,
    mut spawn: impl FnMut(usize, &Path) -> Result<CreditProcess, String>,
) -> Result<Vec<CreditProcess>, String> {
    let mut children = Vec::new();
    for n in 1..=count {
        let log = logs.join(format!("{name}-{n}.log"));
        let _ = std::fs::remove_file(&log);
        children.push(spawn(n, &log)?);
    }
    Ok(children)
}

/// The JSON payloads of `bodies`, every [`DUPLICATE_EVERY`]-th (from the first) twice in a row,
/// as a producer retrying after a lost ack would publish them.
pub fn with_copies(bodies: impl IntoIterator<Item = serde_json::Value>) -> Vec<Vec<u8>> {
    let mut payloads = Vec::new();
    for (i, body) in bodies.into_iter().enumerate() {
        let json = serde_json::to_vec(&body).expect("json");
        if i % DUPLICATE_EVERY == 0 {
            payloads.push(json.clone());
        }
        payloads.push(json);
    }
    payloads
}

/// Creates the stream a `credit` run of `config` consumes, kept an hour: what a run leaves goes
/// by itself, and the markers behind it with it.
pub async fn create_credit_stream(
    js: &jetstream::Context,
    config: &CreditConfig,
) -> Result<(), String> {
    js.get_or_create_stream(jetstream::stream::Config {
        name: config.stream.clone(),
        subjects: vec![config.subject.clone()],
        max_age: Duration::from_secs(3600),
        ..Default::default()
    })
    .await
    .map(|_| ())
    .map_err(|e| format!("cannot create stream {}: {e}", config.stream))
}

/// Deletes `stream` and the delivery-limit backstop's advisory stream for it, if there.
pub async fn delete_stream(js: &jetstream::Context, stream: &str) {
    let _ = js.delete_stream(stream).await;
    let _ = js
        .delete_stream(inbox_runtime::advisory_stream_name(stream))
        .await;
}

/// Waits until stream `name` exists (the processes create it), failing if one of `children`
/// exits first.
pub async fn stream_created(
    js: &jetstream::Context,
    name: &str,
    children: &mut [CreditProcess],
    logs: &Path,
) -> Result<(), String> {
    let mut poll = Poll::new(&format!("stream {name}"), DEADLINE);
    while js.get_stream(name).await.is_err() {
        if children.iter_mut().any(CreditProcess::has_exited) {
            return Err(format!("a process exited; see {}", logs.display()));
        }
        poll.tick().await?;
    }
    Ok(())
}

/// Polls `done` until it holds (`true`), a child exits or the deadline passes (`false`).
pub async fn until_done(
    what: &str,
    children: &mut [CreditProcess],
    mut done: impl AsyncFnMut() -> bool,
) -> bool {
    let mut poll = Poll::new(what, DEADLINE);
    loop {
        if done().await {
            return true;
        }
        if children.iter_mut().any(CreditProcess::has_exited) || poll.tick().await.is_err() {
            return false;
        }
    }
}

/// Stops every child with SIGTERM; what they applied and skipped, added up.
pub async fn stop_all(children: Vec<CreditProcess>) -> Result<(u64, u64), String> {
    let (mut applied, mut skipped) = (0, 0);
    for child in children {
        let summary = child.stop(Duration::from_secs(30)).await?;
        applied += summary.applied;
        skipped += summary.skipped;
    }
    Ok((applied, skipped))
}

/// The number `sql` counts (0 when it fails).
pub async fn count(pool: &AnyPool, sql: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(sql.to_owned()))
        .fetch_one(pool)
        .await
        .unwrap_or(0)
}

/// A progress bar of `total` `what` (drawn only on a terminal).
pub fn progress(total: usize, what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(total as u64);
    let style = indicatif::ProgressStyle::with_template(&format!(
        "  {{bar:40}} {{pos:>5}}/{{len}} {what}, {{msg}}"
    ))
    .expect("a valid template");
    bar.set_style(style);
    bar
}

/// Prints `rows` (label, value, note) as a table.
pub fn summary(rows: &[(&str, String, &str)]) {
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::NOTHING);
    for (label, value, note) in rows {
        table.add_row([label.to_string(), value.clone(), note.to_string()]);
    }
    if let Some(c) = table.column_mut(1) {
        c.set_cell_alignment(comfy_table::CellAlignment::Right);
    }
    println!("\n{table}");
}
