//! A batch of deliveries (see [`WorkerBuilder::batch`](super::WorkerBuilder::batch)): decoded and
//! keyed, sorted by key, committed in one transaction (`crate::batch`), then acked one by one.
//! A delivery that cannot be decoded or keyed, that failed inside the batch, or whose batch as a
//! whole failed, is served alone, exactly as without batching (retries, nak, dead letter).

use super::Inner;
use super::serve::with_progress;
use super::verdict::Verdict;
use crate::delivery::Delivery;
use crate::handler::{Handler, Outcome};
use crate::store::Batched;
use async_nats::jetstream::message::Message;
use futures::FutureExt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A delivery waiting in a batch, with the permit it holds.
pub(super) type Waiting = (Message, Option<OwnedSemaphorePermit>);

impl<H> Inner<H>
where
    H: Handler,
{
    /// Processes `batch` and answers each of its deliveries; those served alone run on `tasks`.
    pub(super) async fn serve_batch(
        self: &Arc<Self>,
        batch: Vec<Waiting>,
        shutdown: CancellationToken,
        tasks: TaskTracker,
    ) {
        // Served alone, a message takes a connection like a batch does. Waiting for one, it
        // gets progress acks: its delivery must not end at the server meanwhile (on the last
        // delivery, the backstop would dead-letter it while it is about to commit).
        let every = self.settings.progress_every;
        let alone = |(message, permit): Waiting| {
            let (inner, shutdown) = (self.clone(), shutdown.clone());
            tasks.spawn(async move {
                let waiting = inner.connections.clone().acquire_owned();
                let _connection = with_progress(&[&message], every, waiting).await;
                inner.serve(message, permit, shutdown).await
            });
        };
        let _in_flight = self.metrics.get().map(|m| m.in_flight(batch.len()));
        let held: Vec<&Message> = batch.iter().map(|(message, _)| message).collect();
        let waiting = self.connections.clone().acquire_owned();
        let connection = with_progress(&held, every, waiting).await;
        drop(held);
        let mut keyed = Vec::with_capacity(batch.len());
        for (message, permit) in batch {
            let Ok(info) = message.info() else {
                alone((message, permit));
                continue;
            };
            let delivery = Delivery::of(&message, &info);
            // A panic in the codec or the key expression is this message's: served alone, it
            // is caught there and dead-lettered; the rest of the batch goes on.
            let keyed_one = AssertUnwindSafe(self.decode_and_key(&message, &delivery))
                .catch_unwind()
                .await;
            match keyed_one {
                Ok(Ok((decoded, key))) => keyed.push((key, decoded, (delivery, message, permit))),
                Ok(Err(_)) | Err(_) => alone((message, permit)),
            }
        }
        if keyed.is_empty() {
            return;
        }
        // One order of claims for every instance: twins' batches wait for each other's markers
        // rather than deadlock on them.
        keyed.sort_by(|a, b| a.0.cmp(&b.0));
        let (mut keys, mut decoded, mut deliveries) = (Vec::new(), Vec::new(), Vec::new());
        for (key, message, delivery) in keyed {
            keys.push(key);
            decoded.push(message);
            deliveries.push(delivery);
        }
        let key_refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        // Decoded once; again only for the second try after a failure.
        let decode = |i: usize| super::serve::decode::<H>(&deliveries[i].1).ok();
        let delivery_refs: Vec<&Delivery> = deliveries.iter().map(|(d, _, _)| d).collect();
        let work = self.inbox.process_batch(
            &self.handler,
            &self.state,
            &key_refs,
            &delivery_refs,
            decoded,
            decode,
        );
        let deadline = self.settings.deadline;
        let every = self.settings.progress_every;
        let messages: Vec<&Message> = deliveries.iter().map(|(_, m, _)| m).collect();
        let started = std::time::Instant::now();
        let ended = with_progress(&messages, every, tokio::time::timeout(deadline, work)).await;
        if let Some(m) = self.metrics.get() {
            m.tried(started.elapsed());
        }
        // The connection is free once the batch has committed: answering needs none.
        drop(connection);
        let ended = match ended {
            Ok(ended) => ended,
            Err(_) => {
                tracing::warn!(
                    ?deadline,
                    messages = keys.len(),
                    "batch did not finish within the deadline; its messages are processed alone"
                );
                vec![Batched::Alone; keys.len()]
            }
        };
        for ((delivery, message, permit), ended) in deliveries.into_iter().zip(ended) {
            match ended {
                Batched::Done(outcome) => {
                    let verdict = match outcome {
                        Outcome::Ack => Verdict::Ack,
                        Outcome::Skip => Verdict::Skip,
                    };
                    self.answer(&message, verdict, &delivery, &shutdown).await;
                    drop(permit);
                }
                Batched::Alone => alone((message, permit)),
            }
        }
    }
}
