//! Where the delivery-limit backstop keeps its advisories: the advisory stream (created when
//! missing, or checked to take a consumer's advisories) and the backstop's durable consumer on it.

use async_nats::jetstream::consumer::{self, AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::context::CreateStreamError;
use async_nats::jetstream::{self, stream};
use std::time::Duration;

/// Which stream keeps a consumer's delivery-limit advisories.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AdvisoryStream {
    /// `INBOX_ADVISORIES_<stream>` (see [`advisory_stream_name`]), created when missing with
    /// the subjects of the stream's consumers only: one per stream, so that two never overlap.
    PerStream,
    /// A stream of the operator's, which must take
    /// `$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>` (an existing stream of
    /// every `$JS.EVENT.>`, say); created when missing as a per-stream one would be.
    Named(String),
}

/// The stream that keeps the delivery-limit advisories of `stream`'s consumers, by default:
/// `INBOX_ADVISORIES_<stream>`.
pub fn advisory_stream_name(stream: &str) -> String {
    format!("INBOX_ADVISORIES_{stream}")
}

/// The subject prefix of the advisories: `.<stream>.<consumer>` follows.
const ADVISORY_PREFIX: &str = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES";

/// How long the advisory stream keeps an advisory: long enough for every instance to be down
/// over a long weekend and still find it.
const ADVISORY_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);

/// Creates the advisory stream of `durable` of `stream` if it is missing (with as many replicas
/// as `stream`, so that advisories are as safe as the messages they stand for), or checks that
/// the existing one takes its advisories. Returns its name.
pub(crate) async fn ensure_stream(
    js: &jetstream::Context,
    which: &AdvisoryStream,
    stream: &str,
    durable: &str,
) -> Result<String, async_nats::Error> {
    let replicas = js
        .get_stream(stream)
        .await?
        .cached_info()
        .config
        .num_replicas;
    // A named stream may serve the consumers of several streams: made, it takes them all.
    let (name, subject) = match which {
        AdvisoryStream::PerStream => (
            advisory_stream_name(stream),
            format!("{ADVISORY_PREFIX}.{stream}.*"),
        ),
        AdvisoryStream::Named(name) => (name.clone(), format!("{ADVISORY_PREFIX}.>")),
    };
    let ours = format!("{ADVISORY_PREFIX}.{stream}.{durable}");
    let config = stream::Config {
        name: name.clone(),
        subjects: vec![subject],
        max_age: ADVISORY_MAX_AGE,
        num_replicas: replicas.max(1),
        ..Default::default()
    };
    // Instances starting together create it together: one that loses the race may be told
    // the subjects overlap (with the stream the other is creating), and finds it when it asks
    // again.
    let mut tries = 0;
    let found = loop {
        match js.get_or_create_stream(config.clone()).await {
            Ok(found) => break found,
            Err(_) if tries < 3 => {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(100 * tries)).await;
            }
            Err(source) => {
                // Created with another configuration (a named stream set up by hand): found
                // by a plain lookup, where `get_or_create_stream`'s lookup may have met a
                // cluster's spurious "not found" and then been refused the creation.
                if let Ok(found) = js.get_stream(&name).await {
                    break found;
                }
                return Err(Box::new(CreateAdvisoryStream {
                    name,
                    stream: stream.into(),
                    durable: durable.into(),
                    ours,
                    source,
                }));
            }
        }
    };
    // What the lookup or the creation answered: asking again would ask a cluster that may be
    // electing a leader, whose answer can be a spurious "stream not found".
    let subjects = &found.cached_info().config.subjects;
    if !subjects.iter().any(|s| covers(s, &ours)) {
        return Err(format!(
            "stream {name:?} exists but does not take the delivery-limit advisories {ours:?} (its subjects: {subjects:?})"
        )
        .into());
    }
    Ok(name)
}

/// Creating an advisory stream failed; its source is kept so that a caller can tell JetStream
/// not answering yet from a refusal.
#[derive(Debug, thiserror::Error)]
#[error(
    "creating stream {name:?} for the delivery-limit advisories of {stream}/{durable}: {source} (a stream that already takes {ours:?} can be named instead: WorkerBuilder::backstop, App::backstop)"
)]
struct CreateAdvisoryStream {
    name: String,
    stream: String,
    durable: String,
    ours: String,
    source: CreateStreamError,
}

/// The error [`ensure_stream`] returns when JetStream refuses to create the advisory stream
/// with `source`.
#[cfg(test)]
pub(crate) fn create_stream_failed(source: CreateStreamError) -> async_nats::Error {
    Box::new(CreateAdvisoryStream {
        name: "inbox_backstop_S".into(),
        stream: "S".into(),
        durable: "d".into(),
        ours: format!("{ADVISORY_PREFIX}.S.d"),
        source,
    })
}

/// Whether subject filter `pattern` matches every subject `filter` matches (`>` and `*`
/// wildcards).
fn covers(pattern: &str, filter: &str) -> bool {
    let mut p = pattern.split('.');
    let mut f = filter.split('.');
    loop {
        match (p.next(), f.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(t)) if t != ">" => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// The backstop's durable consumer for `durable` of `stream`, on advisory stream `advisories`.
pub(super) async fn backstop_consumer(
    js: &jetstream::Context,
    advisories: &str,
    stream: &str,
    durable: &str,
) -> Result<PullConsumer, async_nats::Error> {
    let name = format!("inbox_backstop_{stream}_{durable}");
    let filter = format!("{ADVISORY_PREFIX}.{stream}.{durable}");
    let consumer = js
        .get_stream(advisories)
        .await?
        .get_or_create_consumer(
            &name,
            consumer::pull::Config {
                durable_name: Some(name.clone()),
                filter_subject: filter.clone(),
                ack_policy: AckPolicy::Explicit,
                deliver_policy: DeliverPolicy::All,
                ack_wait: Duration::from_secs(60),
                // An advisory is never given up: its message would be lost.
                max_deliver: -1,
                ..Default::default()
            },
        )
        .await?;
    let config = &consumer.cached_info().config;
    if config.filter_subject != filter {
        return Err(format!(
            "consumer {name:?} of stream {advisories:?} filters {:?}, not {filter:?}",
            config.filter_subject
        )
        .into());
    }
    Ok(consumer)
}

#[cfg(test)]
mod tests {
    use super::covers;

    #[test]
    fn covering_filters() {
        let ours = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.S.c";
        assert!(covers(ours, ours));
        assert!(covers(">", ours));
        assert!(covers("$JS.EVENT.>", ours));
        assert!(covers("$JS.EVENT.ADVISORY.*.MAX_DELIVERIES.>", ours));
        assert!(covers(
            "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.S.*",
            ours
        ));
        assert!(!covers(
            "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.T.*",
            ours
        ));
        assert!(!covers("$JS.EVENT.ADVISORY.CONSUMER.*", ours));
        assert!(!covers("orders.>", ours));
    }
}
