//! The faults the single-server credit run goes through, and what each came to: a `credit`
//! process SIGKILLed every two seconds; one frozen with SIGSTOP for twice `ack_wait` (what it
//! holds is redelivered to the others while its transactions stay open) and then let go; the
//! nats-server killed and restarted once; every database connection cut once; the dead-letter
//! stream rejecting every letter until a worker's letter has been rejected on its message's last
//! delivery, which [`LetterWatch`] sees on the wire; and processes SIGKILLed while they hold a
//! message on its last delivery (`CREDIT_TEST_LAST_DELIVERY_HOLD_MS`), which only the
//! delivery-limit backstop can dead-letter.

use super::streams::{DLQ_SUBJECT, MAX_DELIVER, by_backstop};
use futures::StreamExt;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often a `credit` process is SIGKILLed.
pub const KILL_EVERY: Duration = Duration::from_secs(2);
/// How long one `credit` process stays frozen: twice `ack_wait`, so that what it holds is
/// redelivered to the others while it holds it.
pub const PAUSE_FOR: Duration = Duration::from_secs(8);
/// The dead-letter stream's outage ends at the latest after this, whatever it saw: the first
/// letters are rejected at once, and their last delivery comes `9 × ack_wait` later.
pub const OUTAGE_AT_MOST: Duration = Duration::from_secs(90);
/// How long a `credit` process holds a message on its last delivery before its first statement
/// (`CREDIT_TEST_LAST_DELIVERY_HOLD_MS`): long enough for the supervisor, which looks a few
/// times a second, to see the hold in the log and kill the process during it.
pub const LAST_DELIVERY_HOLD: Duration = Duration::from_secs(3);
/// At most this many processes are killed on purpose while they hold a last delivery: the
/// other last deliveries end in a worker's letter.
pub const LAST_DELIVERY_KILLS: usize = 3;

/// Whether every database connection has been cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbCut {
    /// Not yet.
    Pending,
    /// Cut: this many sessions were ended.
    Cut {
        /// Sessions ended.
        sessions: u64,
    },
    /// The backend has no connections to cut (SQLite is in-process).
    NotApplicable,
}

/// The SIGSTOP of one `credit` process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pause {
    /// Not yet.
    Pending,
    /// Process `k` is frozen, since then.
    Frozen {
        /// Which instance.
        k: usize,
        /// When it was frozen.
        since: Instant,
    },
    /// It was frozen for this long, then let go.
    Done {
        /// How long it was frozen.
        held: Duration,
    },
}

/// The dead-letter stream's outage: chaos creates it refusing every letter (`max_bytes` 1,
/// discard new), and lifts the limit once a letter has been rejected on its message's last
/// delivery. Before that, rejected letters are nak'd and tried again at each delivery; that last
/// one can only be parked in the database (JetStream would not redeliver a nak) and relayed
/// once the stream takes letters again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outage {
    /// It rejects every letter, since then.
    Rejecting {
        /// When it began (before any `credit` started).
        since: Instant,
    },
    /// Lifted.
    Lifted {
        /// Letter publishes seen on the wire while it rejected them.
        rejected: usize,
        /// Of those, the distinct messages they were letters of.
        messages: usize,
        /// Of those, the publishes on a message's last delivery (`max_deliver`).
        at_last: usize,
        /// How long it lasted.
        lasted: Duration,
    },
}

/// The kills of processes that held a message on its last delivery when they died.
#[derive(Debug, Clone, Default)]
pub struct LastDeliveryKills {
    /// How many.
    pub kills: usize,
    /// The stream sequences they held: no worker can dead-letter them any more.
    pub held: BTreeSet<u64>,
}

/// The faults one run went through.
#[derive(Debug, Clone)]
pub struct Faults {
    /// `credit` processes SIGKILLed (and restarted), those of [`Self::at_last`] included.
    pub kills: usize,
    /// The kills of processes holding a message on its last delivery.
    pub at_last: LastDeliveryKills,
    /// The SIGSTOP of a `credit` process.
    pub pause: Pause,
    /// Whether the nats-server was killed and restarted.
    pub nats_restarted: bool,
    /// The database connections.
    pub db_cut: DbCut,
    /// The dead-letter stream's outage.
    pub outage: Outage,
}

impl Faults {
    /// Every fault has been carried out (and the frozen process and the dead-letter stream let go).
    pub fn all_done(&self) -> bool {
        self.nats_restarted
            && self.db_cut != DbCut::Pending
            && matches!(self.pause, Pause::Done { .. })
            && matches!(self.outage, Outage::Lifted { .. })
    }

    /// Counts a kill, and a kill during a last delivery when the process held messages there
    /// (`held`) when it died.
    pub fn count_kill(&mut self, held: &BTreeSet<u64>) {
        self.kills += 1;
        if !held.is_empty() {
            self.at_last.kills += 1;
            self.at_last.held.extend(held);
        }
    }

    /// The report's cells: the kills (of them during a last delivery), how long the frozen process
    /// was held, the letter publishes rejected (of them on a last delivery), the sessions cut.
    pub fn cells(&self) -> Vec<String> {
        let paused = match self.pause {
            Pause::Done { held } => format!("{:.1}s", held.as_secs_f64()),
            _ => "no".into(),
        };
        let rejected = match self.outage {
            Outage::Lifted {
                rejected, at_last, ..
            } => format!("{rejected} ({at_last})"),
            Outage::Rejecting { .. } => "no".into(),
        };
        let db_cut = match self.db_cut {
            DbCut::Cut { sessions } => format!("yes ({sessions})"),
            DbCut::NotApplicable => "n/a".into(),
            DbCut::Pending => "no".into(),
        };
        let kills = format!("{} ({})", self.kills, self.at_last.kills);
        vec![kills, paused, rejected, db_cut]
    }

    /// What went missing: a fault that did not bite proves nothing.
    pub fn missing(&self) -> Vec<&'static str> {
        let mut missing = Vec::new();
        if self.kills == 0 {
            missing.push("no credit process was killed");
        }
        if self.at_last.kills == 0 {
            missing.push("no credit process was killed holding a message on its last delivery");
        }
        if let Outage::Lifted {
            rejected, at_last, ..
        } = self.outage
        {
            if rejected == 0 {
                missing.push("the dead-letter stream rejected no letter");
            }
            if at_last == 0 {
                missing.push("no letter was rejected on its message's last delivery");
            }
        }
        missing
    }
}

/// Watches `credit`'s letters on the wire (a core subscription sees every publish, stored by the
/// dead-letter stream or not).
pub struct LetterWatch {
    /// What it saw so far.
    seen: Arc<Mutex<WireCounts>>,
    /// The task counting them; stopped when the watch is dropped.
    task: tokio::task::JoinHandle<()>,
}

/// Letter publishes seen on the wire.
#[derive(Debug, Clone, Default)]
pub struct WireCounts {
    /// Publishes, by the original's stream sequence.
    pub by_seq: HashMap<u64, usize>,
    /// A worker's publishes on the original's last delivery (`Inbox-Delivered` is
    /// `max_deliver`): those it parks when rejected. The backstop's letters do not count.
    pub at_last: usize,
}

impl LetterWatch {
    /// Subscribes (and makes sure the server has the subscription) before any letter exists.
    pub async fn start(client: &async_nats::Client) -> Result<LetterWatch, String> {
        let mut letters = client
            .subscribe(DLQ_SUBJECT)
            .await
            .map_err(|e| format!("subscribe to {DLQ_SUBJECT}: {e}"))?;
        client.flush().await.map_err(|e| format!("flush: {e}"))?;
        let seen = Arc::new(Mutex::new(WireCounts::default()));
        let counts = Arc::clone(&seen);
        let task = tokio::spawn(async move {
            while let Some(letter) = letters.next().await {
                let text = |name: &str| {
                    let value = letter.headers.as_ref().and_then(|h| h.get(name));
                    value.map(|v| v.as_str().to_owned())
                };
                let number = |name: &str| text(name).and_then(|v| v.parse::<i64>().ok());
                let seq = number("Inbox-Stream-Seq").unwrap_or(0) as u64;
                let last = number("Inbox-Delivered") == Some(MAX_DELIVER)
                    && !by_backstop(text("Inbox-Error").as_deref());
                let mut counts = counts.lock().expect("letter counts");
                *counts.by_seq.entry(seq).or_insert(0) += 1;
                counts.at_last += usize::from(last);
            }
        });
        Ok(LetterWatch { seen, task })
    }

    /// What it saw so far.
    pub fn counts(&self) -> WireCounts {
        self.seen.lock().expect("letter counts").clone()
    }
}

impl Drop for LetterWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos::streams::ACK_WAIT;

    #[test]
    fn the_frozen_process_outlasts_ack_wait() {
        assert!(PAUSE_FOR > ACK_WAIT);
    }
}
