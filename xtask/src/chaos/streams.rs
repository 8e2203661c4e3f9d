//! The credit runs' streams on the NATS side: their names, the consumer's settings, creating
//! them, the dead-letter stream's outage, and reading back what a stream holds.
//!
//! Every credit run (single server, cluster, failover) and every step of it (publish, watch,
//! read back, audit) uses these, so they sit below all of them.

use async_nats::jetstream::stream::{DiscardPolicy, RawMessageErrorKind};
use async_nats::jetstream::{self, consumer::pull, message::StreamMessage, stream};
use inbox_runtime::BACKSTOP_ERROR;
use inbox_testkit::{CreditConfig, Poll};
use std::path::Path;
use std::time::Duration;

/// `credit` processes at work on the consumer.
pub const INSTANCES: usize = 3;
/// The stream the requests are published to.
pub const STREAM: &str = "CHAOS";
/// The requests' subject.
pub const SUBJECT: &str = "chaos.credits";
/// The durable consumer `credit` works on.
pub const DURABLE: &str = "chaos";
/// The handler's consumer name: its markers' `consumer`, its letters' `Inbox-Consumer`.
pub const CONSUMER: &str = "credit";
/// The runtime's default dead-letter stream, which `credit` uses.
pub const DLQ_STREAM: &str = "INBOX_DLQ";
/// Its subjects, as the runtime creates it.
pub const DLQ_SUBJECTS: &str = "inbox.dlq.>";
/// Where `credit`'s letters go.
pub const DLQ_SUBJECT: &str = "inbox.dlq.credit";
/// The consumer's `max_deliver`.
pub const MAX_DELIVER: i64 = 10;
/// The consumer's `ack_wait`: what a killed or frozen process held comes back within seconds.
pub const ACK_WAIT: Duration = Duration::from_secs(4);
/// The stream of `credit`'s announcements in a chaos run.
pub const EVENTS_STREAM: &str = "CHAOS_EVENTS";
/// How long, once the consumer has drained, the letters may take to be stored (a letter parked
/// in the database is relayed within seconds); past it, the audit says which are missing.
pub const LETTERS_WITHIN: Duration = Duration::from_secs(60);

/// Whether a letter whose `Inbox-Error` is `error` was written by the delivery-limit backstop
/// (the message reached `max_deliver` with no verdict: its holder died, or no client could read
/// it) rather than by a worker.
pub fn by_backstop(error: Option<&str>) -> bool {
    error.is_some_and(|e| e.starts_with(BACKSTOP_ERROR))
}

/// The consumer's `backoff`: `ack_wait` at every step, one step fewer than `max_deliver` (as the
/// server requires), so that a credit to an unopened account reaches `max_deliver` within
/// `9 × ack_wait` rather than the minutes of the runtime's own growing nak delays.
///
/// Every step is the same on purpose. The runtime naks with the step as an explicit delay, and
/// nats-server 2.9 measures that delay from `now - ack_wait` against the step: the wait is
/// `2 × step - ack_wait`, which for a step under half of `ack_wait` is no wait at all (each
/// redelivery within ~10 ms, max_deliver burnt in a tenth of a second).
pub fn backoff() -> Vec<Duration> {
    vec![ACK_WAIT; MAX_DELIVER as usize - 1]
}

/// How `credit` (the binary at `binary`) is started on these streams, on `nats_url` and
/// `database_url`, logging warnings only.
pub fn credit_config(binary: &Path, nats_url: String, database_url: String) -> CreditConfig {
    CreditConfig {
        binary: binary.to_owned(),
        nats_url,
        database_url,
        stream: STREAM.into(),
        subject: SUBJECT.into(),
        consumer: DURABLE.into(),
        rust_log: "warn".into(),
    }
}

/// Creates the stream, the consumer and the dead-letter stream, each with `replicas` replicas;
/// the dead-letter stream rejects every letter until [`lift_outage`].
pub async fn create(js: &jetstream::Context, replicas: usize) -> Result<(), String> {
    let stream = js
        .create_stream(stream::Config {
            name: STREAM.into(),
            subjects: vec![SUBJECT.into()],
            num_replicas: replicas,
            // An hour: what a run leaves goes by itself, and the markers behind it with it.
            max_age: Duration::from_secs(3600),
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    stream
        .create_consumer(pull::Config {
            durable_name: Some(DURABLE.into()),
            ack_wait: ACK_WAIT,
            max_deliver: MAX_DELIVER,
            backoff: backoff(),
            filter_subject: SUBJECT.into(),
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    // The runtime gets the stream it would create; until chaos lifts the limit, no letter fits.
    js.create_stream(stream::Config {
        name: DLQ_STREAM.into(),
        subjects: vec![DLQ_SUBJECTS.into()],
        max_bytes: 1,
        discard: DiscardPolicy::New,
        num_replicas: replicas,
        ..Default::default()
    })
    .await
    .map_err(|e| format!("dead-letter stream {DLQ_STREAM}: {e}"))?;
    Ok(())
}

/// Lets the dead-letter stream store letters again: no byte limit, discard old (as the runtime
/// creates it).
pub async fn lift_outage(js: &jetstream::Context) -> Result<(), String> {
    let what = |e: &dyn std::fmt::Display| format!("dead-letter stream {DLQ_STREAM}: {e}");
    let mut dlq = js.get_stream(DLQ_STREAM).await.map_err(|e| what(&e))?;
    let mut config = dlq.info().await.map_err(|e| what(&e))?.config.clone();
    config.max_bytes = -1;
    config.discard = DiscardPolicy::Old;
    js.update_stream(config).await.map_err(|e| what(&e))?;
    Ok(())
}

/// Ends the dead-letter outage by deleting the stream (it stored nothing: a byte limit of 1,
/// discard new), as an operator cleaning up would: the processes must create it again for
/// their next letter, parked letters included. Refuses if it holds a letter.
pub async fn delete_dead_letter_stream(js: &jetstream::Context) -> Result<(), String> {
    let what = |e: &dyn std::fmt::Display| format!("dead-letter stream {DLQ_STREAM}: {e}");
    let mut dlq = js.get_stream(DLQ_STREAM).await.map_err(|e| what(&e))?;
    let held = dlq.info().await.map_err(|e| what(&e))?.state.messages;
    if held > 0 {
        return Err(format!(
            "dead-letter stream {DLQ_STREAM} holds {held} letters during its outage: not deleted"
        ));
    }
    js.delete_stream(DLQ_STREAM).await.map_err(|e| what(&e))?;
    Ok(())
}

/// Every message `stream` holds, read one by one; fails unless all were read. `what` names the
/// stream in errors.
pub async fn stored(
    js: &jetstream::Context,
    stream: &str,
    what: &str,
) -> Result<Vec<StreamMessage>, String> {
    let what = |e: &dyn std::fmt::Display| format!("{what} {stream}: {e}");
    let mut handle = js.get_stream(stream).await.map_err(|e| what(&e))?;
    let state = handle.info().await.map_err(|e| what(&e))?.state.clone();
    let mut messages = Vec::new();
    if state.messages > 0 {
        for seq in state.first_sequence..=state.last_sequence {
            match handle.get_raw_message(seq).await {
                Ok(m) => messages.push(m),
                Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => {}
                Err(e) => return Err(what(&format!("message {seq}: {e}"))),
            }
        }
    }
    if messages.len() as u64 != state.messages {
        return Err(what(&format!(
            "read {} messages, the stream holds {}",
            messages.len(),
            state.messages
        )));
    }
    Ok(messages)
}

/// How many letters the dead-letter stream holds, for following the run's progress.
pub async fn stored_letters(js: &jetstream::Context) -> Result<u64, String> {
    let what = |e: &dyn std::fmt::Display| format!("dead-letter stream {DLQ_STREAM}: {e}");
    let mut dlq = js.get_stream(DLQ_STREAM).await.map_err(|e| what(&e))?;
    Ok(dlq.info().await.map_err(|e| what(&e))?.state.messages)
}

/// Waits until the dead-letter stream holds `expected` letters: a letter parked on a last delivery
/// is relayed by the processes, so they are kept until then. Gives up after [`LETTERS_WITHIN`]
/// (the audit names what is missing), saying what it last read.
pub async fn wait_for_letters(js: &jetstream::Context, expected: u64) -> Result<(), String> {
    let mut wait = Poll::new("the letters to be stored", LETTERS_WITHIN);
    loop {
        let stored = stored_letters(js).await;
        if stored.as_ref().is_ok_and(|&k| k >= expected) {
            return Ok(());
        }
        if wait.tick().await.is_err() {
            return Err(format!(
                "after {LETTERS_WITHIN:?}, letters stored: {stored:?} of {expected}"
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_fits_max_deliver_and_waits_ack_wait_every_time() {
        let b = backoff();
        assert_eq!(b.len(), MAX_DELIVER as usize - 1);
        assert!(b.iter().all(|&d| d == ACK_WAIT));
    }
}
