//! A batch of deliveries (see [`WorkerBuilder::batch`](super::WorkerBuilder::batch)): decoded and
//! keyed, sorted by lane then key, committed in one transaction (`crate::batch`), then acked one
//! by one. A laned handler's batch first takes its slot's turn (`slots`).
//! A delivery that cannot be decoded or keyed, that failed inside the batch, or whose batch as a
//! whole failed, is served alone, exactly as without batching (retries, nak, dead letter).

use super::Inner;
use super::requests::Held;
use super::serve::with_progress;
use super::slots::{Connection, Turn};
use super::verdict::Verdict;
use crate::delivery::Delivery;
use crate::error::ProcessError;
use crate::handler::{Handler, Outcome};
use crate::lane::Lane;
use crate::store::Batched;
use async_nats::jetstream::message::Message;
use futures::FutureExt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A delivery waiting in a batch, with what it holds.
pub(super) type Waiting = (Message, Held);

impl<H> Inner<H>
where
    H: Handler,
{
    /// The lane of `message` (laned handlers), read before it joins a batch; `None` when it has
    /// none, or cannot be decoded (it is then served alone, and its lane does not matter).
    pub(super) fn lane(&self, message: &Message) -> Option<Lane> {
        let info = message.info().ok()?;
        let delivery = Delivery::of(message, &info);
        std::panic::catch_unwind(AssertUnwindSafe(|| {
            let decoded = super::serve::decode::<H>(message).ok()?;
            self.handler.lane(&decoded, &delivery, &self.state)
        }))
        .ok()
        .flatten()
    }

    /// Processes `batch` and answers each of its deliveries; those served alone run on `tasks`.
    /// With `turn` (a laned handler's slot), the batch runs only while it holds it.
    pub(super) async fn serve_batch(
        self: &Arc<Self>,
        batch: Vec<Waiting>,
        turn: Option<Arc<Mutex<()>>>,
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
                let freed = inner.turns.freed.clone();
                let waiting = inner.connections.clone().acquire_owned();
                let _connection = with_progress(&[&message], every, waiting)
                    .await
                    .map(|permit| Connection::new(permit, freed));
                inner.serve(message, permit, shutdown).await
            });
        };
        let _in_flight = self.metrics.get().map(|m| m.in_flight(batch.len()));
        let held: Vec<&Message> = batch.iter().map(|(message, _)| message).collect();
        // The slot's turn first (the batch before it in the slot may hold its lanes' rows),
        // then a connection.
        let waiting = async {
            let turn = match turn {
                Some(turn) => Some(Turn::take(turn, self.turns.freed.clone()).await),
                None => None,
            };
            let connection = self.connections.clone().acquire_owned().await;
            let freed = self.turns.freed.clone();
            (
                turn,
                connection.map(|permit| Connection::new(permit, freed)),
            )
        };
        let (turn, connection) = with_progress(&held, every, waiting).await;
        drop(held);
        let mut keyed = Vec::with_capacity(batch.len());
        for (message, permit) in batch {
            let Ok(info) = message.info() else {
                alone((message, permit));
                continue;
            };
            let delivery = Delivery::of(&message, &info);
            // A replay addressed to another consumer: acked as a duplicate, alone.
            if delivery.replay_not_for(H::CONSUMER) {
                alone((message, permit));
                continue;
            }
            // A panic in the codec or the key expression is this message's: served alone, it
            // is caught there and dead-lettered; the rest of the batch goes on.
            let keyed_one = AssertUnwindSafe(self.decode_and_key(&message, &delivery))
                .catch_unwind()
                .await;
            match keyed_one {
                Ok(Ok((decoded, key))) => {
                    let lane = match H::LANED {
                        true => std::panic::catch_unwind(AssertUnwindSafe(|| {
                            self.handler.lane(&decoded, &delivery, &self.state)
                        }))
                        .ok()
                        .flatten(),
                        false => None,
                    };
                    keyed.push(((lane, key), decoded, (delivery, message, permit)));
                }
                Ok(Err(_)) | Err(_) => alone((message, permit)),
            }
        }
        if keyed.is_empty() {
            return;
        }
        // One order of claims and of handlers for every batch of every instance: by lane (what
        // the handlers lock), then by key. A key always has the same lane, so twins' batches
        // wait for each other's markers rather than deadlock on them, and batches take the
        // lanes' rows in one order.
        keyed.sort_by(|a, b| a.0.cmp(&b.0));
        let (mut keys, mut decoded, mut deliveries) = (Vec::new(), Vec::new(), Vec::new());
        for ((_, key), message, delivery) in keyed {
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
        // The connection and the slot are free once the batch has committed: answering needs
        // neither.
        drop((connection, turn));
        let ended = match ended {
            Ok(end) => {
                if end.conflicts > 0 {
                    self.counters
                        .conflicts
                        .fetch_add(u64::from(end.conflicts), Relaxed);
                    self.counters
                        .batch_retries
                        .fetch_add(u64::from(end.retries), Relaxed);
                    if let Some(m) = self.metrics.get() {
                        m.batch_conflicts(end.conflicts, end.retries);
                    }
                    tracing::debug!(
                        conflicts = end.conflicts,
                        retries = end.retries,
                        messages = keys.len(),
                        "batch met conflicts with other transactions"
                    );
                }
                end.ended
            }
            Err(_) => {
                tracing::warn!(
                    ?deadline,
                    messages = keys.len(),
                    "batch did not finish within the deadline; its messages are processed alone"
                );
                vec![Batched::Alone; keys.len()]
            }
        };
        for (((delivery, message, permit), ended), key) in
            deliveries.into_iter().zip(ended).zip(&keys)
        {
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
                Batched::TransactionEnded => {
                    let err = ProcessError::TransactionEnded { key: key.clone() };
                    let verdict = Verdict::Keep(super::letter_text::letter_text(&err));
                    self.answer(&message, verdict, &delivery, &shutdown).await;
                    drop(permit);
                }
            }
        }
    }
}
