//! The demo's chain part: what `credit` announced through its outbox, consumed by `statements`
//! with an inbox of its own.

use super::credit::UNIQUE;
use super::harness::{
    DEADLINE, DUPLICATE_EVERY, Part, count, spawn_logged, stop_all, summary, until_done,
};
use inbox_testkit::{CreditProcess, backlog, publish_and_wait};

/// The chain part: what `credit` announced through its outbox, consumed by `statements` with an
/// inbox of its own; a third of the events published again (as a producer retrying after the
/// duplicate window would), which `statements` must skip.
pub async fn run(part: Part<'_>) -> Result<(), String> {
    let Part { run, js, .. } = part;
    let (events, subject) = (part.credit.events_stream(), part.credit.events_subject());
    println!(
        "\n--- a chain: credit's outbox -> {subject} -> the statements example (an inbox of its own) ---"
    );
    let binary = crate::workspace::demo_binary("statements");
    let what = |e: &dyn std::fmt::Display| format!("events stream {events}: {e}");
    let mut stream = js.get_stream(&events).await.map_err(|e| what(&e))?;
    let announced = stream.info().await.map_err(|e| what(&e))?.state.messages;
    let mut copies = Vec::new();
    for seq in (1..=announced).step_by(DUPLICATE_EVERY) {
        let m = stream.get_raw_message(seq).await.map_err(|e| what(&e))?;
        copies.push(m.payload.to_vec());
    }
    println!(
        "credit announced {announced} credits in {events} (one event per applied request, published by its relay with the outbox row's id as Nats-Msg-Id)"
    );
    println!(
        "publishing {} of them again without a Nats-Msg-Id, as a retry after the duplicate window would...",
        copies.len()
    );
    let republished = copies.len();
    publish_and_wait(js, &subject, copies).await?;
    let durable = format!("statements_demo_{run}");
    let env = [
        ("NATS_URL", part.credit.nats_url.clone()),
        ("DATABASE_URL", part.credit.database_url.clone()),
        ("STATEMENTS_STREAM", events.clone()),
        ("STATEMENTS_SUBJECT", subject.clone()),
        ("STATEMENTS_CONSUMER", durable.clone()),
        ("RUST_LOG", "info".to_owned()),
    ];
    println!("starting 2 statements processes on durable consumer {durable}...");
    let mut children = spawn_logged(part.logs, "statements", 2, |_, log| {
        CreditProcess::spawn_with("statements", &binary, &env, Some(log))
    })?;
    let lines_sql =
        format!("SELECT count(*) FROM statement_lines WHERE request_id LIKE 'demo-{run}-%'");
    let finished = until_done("the statement lines", &mut children, async || {
        count(part.pool, &lines_sql).await == UNIQUE as i64
            && backlog(js, &events, &durable)
                .await
                .is_ok_and(|b| b.drained())
    })
    .await;
    let (applied, skipped) = stop_all(children).await?;
    if !finished {
        return Err(format!(
            "the statement lines were not all written within {DEADLINE:?} (or a process exited); see {}",
            part.logs.display()
        ));
    }
    let lines = count(part.pool, &lines_sql).await;
    // Each account's statement adds up to its balance.
    let differ_sql = format!(
        "SELECT count(*) FROM (SELECT account, SUM(amount) AS total FROM statement_lines \
         WHERE request_id LIKE 'demo-{run}-%' GROUP BY account) s \
         JOIN accounts a ON a.id = s.account WHERE a.balance <> s.total"
    );
    let differ = count(part.pool, &differ_sql).await;
    summary(&[
        (
            "announced",
            announced.to_string(),
            "events credit's relay published",
        ),
        (
            "re-published",
            republished.to_string(),
            "copies without a Nats-Msg-Id",
        ),
        ("statement lines", lines.to_string(), ""),
        (
            "duplicates skipped",
            skipped.to_string(),
            "by the statements inbox",
        ),
        (
            "statements match balances",
            if differ == 0 { "yes" } else { "NO" }.to_owned(),
            "each account's lines add up to its balance",
        ),
    ]);
    if announced != UNIQUE as u64 || lines != UNIQUE as i64 || applied != UNIQUE as u64 {
        return Err(format!(
            "announced {announced}, statement lines {lines}, applied {applied}: each should be {UNIQUE}"
        ));
    }
    if skipped != republished as u64 || differ != 0 {
        return Err(format!(
            "skipped {skipped} of {republished} copies; {differ} accounts' statements differ from their balances"
        ));
    }
    println!(
        "\nexactly once along the chain: every applied credit announced once, and written once downstream."
    );
    Ok(())
}
