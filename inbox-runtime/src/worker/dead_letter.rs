//! Dead letters: a rejected message is published, with its payload and headers and the reason,
//! to `<prefix>.<consumer>` in a stream of its own (created on first use). The caller terms the
//! original only once [`DeadLetters::publish`] returns `Ok`, that is once JetStream has stored
//! the letter; on `Err` it naks, so that nothing rejected is ever lost.

use async_nats::jetstream::message::Message;
use async_nats::jetstream::stream;
use tokio::sync::OnceCell;

/// The default dead-letter stream.
pub const DEFAULT_DLQ_STREAM: &str = "INBOX_DLQ";
/// The default dead-letter subject prefix.
pub const DEFAULT_DLQ_PREFIX: &str = "inbox.dlq";

/// Where a worker's dead letters go.
#[derive(Debug)]
pub(crate) struct DeadLetters {
    stream: String,
    prefix: String,
    subject: String,
    ready: OnceCell<()>,
}

/// What is known of a rejected delivery.
pub(crate) struct DeadLetter<'a> {
    pub consumer: &'a str,
    pub stream: &'a str,
    pub stream_seq: u64,
    pub delivered: i64,
    pub error: &'a str,
}

impl DeadLetters {
    pub(crate) fn new(stream: String, prefix: String, consumer: &str) -> Self {
        let subject = format!("{prefix}.{consumer}");
        DeadLetters {
            stream,
            prefix,
            subject,
            ready: OnceCell::new(),
        }
    }

    /// Publishes the dead letter and waits until JetStream has stored it.
    pub(crate) async fn publish(
        &self,
        message: &Message,
        letter: &DeadLetter<'_>,
    ) -> Result<(), async_nats::Error> {
        let js = &message.context;
        self.ready
            .get_or_try_init(|| async {
                js.get_or_create_stream(stream::Config {
                    name: self.stream.clone(),
                    subjects: vec![format!("{}.>", self.prefix)],
                    ..Default::default()
                })
                .await
                .map(|_| ())
            })
            .await?;
        let mut headers = message.headers.clone().unwrap_or_default();
        // Headers carry one line each.
        let error: String = letter
            .error
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        headers.insert("Inbox-Error", error.as_str());
        headers.insert("Inbox-Consumer", letter.consumer);
        headers.insert("Inbox-Stream", letter.stream);
        headers.insert("Inbox-Stream-Seq", letter.stream_seq.to_string().as_str());
        headers.insert("Inbox-Delivered", letter.delivered.to_string().as_str());
        // A dead letter must not be deduplicated away against the original's msg-id.
        headers.insert(
            async_nats::header::NATS_MESSAGE_ID,
            format!("dlq:{}:{}", letter.stream, letter.stream_seq).as_str(),
        );
        js.publish_with_headers(self.subject.clone(), headers, message.payload.clone())
            .await?
            .await?;
        Ok(())
    }
}
