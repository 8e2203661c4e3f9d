//! A batch of deliveries (see [`WorkerBuilder::batch`](super::WorkerBuilder::batch)): decoded and
//! keyed, sorted by key, committed in one transaction (`crate::batch`), then acked one by one.
//! A delivery that cannot be decoded or keyed, that failed inside the batch, or whose batch as a
//! whole failed, is served alone, exactly as without batching (retries, nak, dead letter).

use super::Inner;
use super::delivery::Delivery;
use super::verdict::Verdict;
use crate::batch::Batched;
use crate::handler::{Handler, Outcome};
use async_nats::jetstream::AckKind;
use async_nats::jetstream::message::Message;
use serde::de::DeserializeOwned;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A delivery waiting in a batch, with the permit it holds.
pub(super) type Waiting = (Message, Option<OwnedSemaphorePermit>);

impl<H> Inner<H>
where
    H: Handler,
    H::Message: DeserializeOwned,
{
    /// Processes `batch` and answers each of its deliveries; those served alone run on `tasks`.
    pub(super) async fn serve_batch(
        self: &Arc<Self>,
        batch: Vec<Waiting>,
        shutdown: CancellationToken,
        tasks: TaskTracker,
    ) {
        let alone = |(message, permit): Waiting| {
            let (inner, shutdown) = (self.clone(), shutdown.clone());
            tasks.spawn(async move { inner.serve(message, permit, shutdown).await });
        };
        let mut keyed = Vec::with_capacity(batch.len());
        for (message, permit) in batch {
            let Ok(info) = message.info() else {
                alone((message, permit));
                continue;
            };
            let delivery = Delivery::of(&message, &info);
            match self.decode_and_key(&message, &delivery).await {
                Ok((_, key)) => keyed.push((key, delivery, message, permit)),
                Err(_) => alone((message, permit)),
            }
        }
        if keyed.is_empty() {
            return;
        }
        // One order of claims for every instance: twins' batches wait for each other's markers
        // rather than deadlock on them.
        keyed.sort_by(|a, b| a.0.cmp(&b.0));
        let keys: Vec<&str> = keyed.iter().map(|(k, ..)| k.as_str()).collect();
        let decode = |i: usize| super::delivery::decode::<H>(&keyed[i].2).ok();
        let work = self
            .inbox
            .process_batch(&self.handler, &self.state, &keys, decode);
        let deadline = self.settings.deadline;
        let every = self.settings.progress_every;
        let messages: Vec<&Message> = keyed.iter().map(|(_, _, m, _)| m).collect();
        let ended = progress_all(&messages, every, tokio::time::timeout(deadline, work)).await;
        let ended = match ended {
            Ok(ended) => ended,
            Err(_) => {
                tracing::warn!(
                    ?deadline,
                    messages = keyed.len(),
                    "batch did not finish within the deadline; its messages are processed alone"
                );
                vec![Batched::Alone; keyed.len()]
            }
        };
        for ((_, delivery, message, permit), ended) in keyed.into_iter().zip(ended) {
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

/// Runs `work`, sending a progress ack for every message of the batch every `every`.
async fn progress_all<T>(
    messages: &[&Message],
    every: Duration,
    work: impl Future<Output = T>,
) -> T {
    tokio::pin!(work);
    let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    loop {
        tokio::select! {
            result = &mut work => return result,
            _ = ticks.tick() => {
                for message in messages {
                    if let Err(e) = message.ack_with(AckKind::Progress).await {
                        tracing::debug!(error = %e, "progress ack failed");
                    }
                }
            }
        }
    }
}
