//! The demo's email part (two-phase claims): two `email` processes calling a flaky local HTTP
//! sink, which counts calls per `Idempotency-Key`.

use super::harness::{
    DEADLINE, Part, count, spawn_logged, stop_all, stream_created, summary, until_done, with_copies,
};
use inbox_testkit::{EmailConfig, Flaky, Sink, backlog, publish_and_wait, why_again};
use std::collections::BTreeMap;
use std::time::Duration;

/// E-mail requests in the email part.
const EMAILS: usize = 300;

/// The email part: two `email` processes, a flaky sink, duplicates; every request called under
/// one idempotency key, done once.
pub async fn run(part: Part<'_>) -> Result<(), String> {
    let Part { run, js, .. } = part;
    println!("\n--- two-phase claims: the email example ---");
    let binary = crate::workspace::demo_binary("email");
    let sink = Sink::start().await?;
    sink.flaky(Some(Flaky {
        every: 8,
        fail: 3,
        slow: 5,
        slow_for: Duration::from_millis(300),
    }));
    let config = EmailConfig {
        binary,
        nats_url: part.credit.nats_url.clone(),
        database_url: part.credit.database_url.clone(),
        stream: format!("EMAILS_DEMO_{run}"),
        subject: format!("demo.{run}.emails"),
        consumer: format!("email_demo_{run}"),
        api_url: sink.url.clone(),
        lease: Duration::from_secs(2),
        hold_before_call: Duration::ZERO,
        concurrency: None,
        rust_log: "info".into(),
    };
    let requests = with_copies((0..EMAILS).map(|i| {
        serde_json::json!({
            "id": format!("email-{run}-{i}"),
            "to": format!("user{i}@example.com"),
            "body": "your receipt",
        })
    }));
    println!(
        "starting 2 email processes (lease {:?}) calling a local HTTP sink at {} that answers one call in 8 with a 503 ...",
        config.lease, sink.url
    );
    let mut children = spawn_logged(part.logs, "email", 2, |_, log| config.spawn(Some(log)))?;
    // The processes create the stream; publish once it exists.
    stream_created(js, &config.stream, &mut children, part.logs).await?;
    let published = requests.len();
    println!(
        "publishing {published} e-mail requests to {} ({EMAILS} unique, {} re-published copies)...",
        config.subject,
        published - EMAILS
    );
    publish_and_wait(js, &config.subject, requests).await?;
    let done_sql = format!(
        "SELECT count(*) FROM inbox WHERE consumer = 'email' AND processed_at IS NOT NULL \
         AND message_key LIKE 'email-{run}-%'"
    );
    let finished = until_done("the e-mails to be sent", &mut children, async || {
        count(part.pool, &done_sql).await == EMAILS as i64
            && backlog(js, &config.stream, &config.consumer)
                .await
                .is_ok_and(|b| b.drained())
    })
    .await;
    let (applied, skipped) = stop_all(children).await?;
    let _ = js.delete_stream(&config.stream).await;
    let _ = js
        .delete_stream(inbox_runtime::advisory_stream_name(&config.stream))
        .await;
    if !finished {
        return Err(format!(
            "the e-mails were not all sent within {DEADLINE:?} (or a process exited); see {}",
            part.logs.display()
        ));
    }
    let by_key = sink.by_key();
    let calls: usize = by_key.values().map(Vec::len).sum();
    let mut again: BTreeMap<&'static str, usize> = BTreeMap::new();
    for calls in by_key.values().filter(|c| c.len() > 1) {
        *again.entry(why_again(calls)).or_default() += 1;
    }
    let overlapping = inbox_testkit::overlaps(&by_key);
    let succeeded = by_key
        .values()
        .filter(|c| c.iter().any(|c| c.status == Some(200)))
        .count();
    let whys: Vec<String> = again.iter().map(|(why, n)| format!("{n} {why}")).collect();
    summary(&[
        ("messages published", published.to_string(), ""),
        ("unique requests", EMAILS.to_string(), ""),
        ("sent (claims done)", applied.to_string(), ""),
        ("duplicates skipped", skipped.to_string(), ""),
        ("calls to the API", calls.to_string(), ""),
        ("distinct idempotency keys", by_key.len().to_string(), ""),
        ("keys answered 200", succeeded.to_string(), ""),
        (
            "keys called more than once",
            again.values().sum::<usize>().to_string(),
            &whys.join("; "),
        ),
        (
            "overlapping calls for a key",
            overlapping.len().to_string(),
            "",
        ),
    ]);
    if by_key.len() != EMAILS || succeeded != EMAILS || applied != EMAILS as u64 {
        return Err("calls, keys and sent e-mails do not add up".into());
    }
    if !overlapping.is_empty() || again.contains_key("called again after a success") {
        return Err(format!(
            "a key was called twice at once or after a success: {overlapping:?}"
        ));
    }
    println!(
        "\nonce per key: every request sent under one idempotency key, retried only after a 503, never twice at once."
    );
    Ok(())
}
