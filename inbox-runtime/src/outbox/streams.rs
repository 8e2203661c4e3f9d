//! The streams a relay publishes to, checked before any row goes: the relay marks rows sent on
//! their PubAcks and counts on their duplicate window to keep one copy of a row published twice.

use super::error::RelayError;
use crate::error::unavailable;
use async_nats::jetstream::{self, stream::PersistenceMode};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How long a stream check is trusted before it is made again.
const CHECK_TTL: Duration = Duration::from_secs(60);

/// The streams checked so far, by subject.
#[derive(Default)]
pub(crate) struct Checks {
    by_subject: HashMap<String, (Instant, Result<String, String>)>,
}

impl Checks {
    /// The subjects whose check failed (no stream takes them, or the relay refuses it), while
    /// that answer is trusted: their rows are left out of passes until it is checked again.
    pub(super) fn blocked(&self) -> Vec<String> {
        self.by_subject
            .iter()
            .filter(|(_, (at, checked))| checked.is_err() && at.elapsed() < CHECK_TTL)
            .map(|(subject, _)| subject.clone())
            .collect()
    }

    /// The stream that takes `subject`, if it is safe to relay to; else why not.
    pub(super) async fn stream_for(
        &mut self,
        js: &jetstream::Context,
        subject: &str,
        retention: Duration,
    ) -> Result<String, String> {
        if let Some((at, checked)) = self.by_subject.get(subject)
            && at.elapsed() < CHECK_TTL
        {
            return checked.clone();
        }
        let checked = match js.stream_by_subject(subject).await {
            Ok(stream) => match check_stream(js, &stream, retention).await {
                Ok(()) => Ok(stream),
                Err(e) => Err(e.to_string()),
            },
            Err(e) => {
                use async_nats::jetstream::context::GetStreamByNameErrorKind as K;
                if e.kind() == K::NotFound {
                    Err(RelayError::NoStream {
                        subject: subject.to_owned(),
                    }
                    .to_string())
                } else {
                    // Not cached: asked again at the next pass.
                    return Err(format!("looking up the stream of {subject:?}: {e}"));
                }
            }
        };
        self.by_subject
            .insert(subject.to_owned(), (Instant::now(), checked.clone()));
        checked
    }
}

/// Whether the relay can mark rows sent on `stream`'s PubAcks and keep one copy of a row
/// published twice.
pub(super) async fn check_stream(
    js: &jetstream::Context,
    stream: &str,
    retention: Duration,
) -> Result<(), RelayError> {
    use async_nats::jetstream::context::GetStreamErrorKind;
    let found = js.get_stream(stream).await.map_err(|e| {
        let transient = match e.kind() {
            GetStreamErrorKind::Request => true,
            GetStreamErrorKind::JetStream(e) => unavailable(&e),
            _ => false,
        };
        RelayError::Nats {
            what: format!("relay: cannot get stream {stream:?}"),
            source: e.into(),
            transient,
        }
    })?;
    let config = &found.cached_info().config;
    if config.persist_mode == Some(PersistenceMode::Async) {
        return Err(RelayError::AsyncPersistence {
            stream: stream.to_owned(),
        });
    }
    if config.duplicate_window.is_zero() {
        return Err(RelayError::NoDuplicateWindow {
            stream: stream.to_owned(),
        });
    }
    if config.duplicate_window >= retention {
        return Err(RelayError::Retention {
            stream: stream.to_owned(),
            window: config.duplicate_window,
            retention,
        });
    }
    Ok(())
}
