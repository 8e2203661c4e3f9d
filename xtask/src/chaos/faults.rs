//! The faults the single-server credit run goes through, and what each came to: a `credit`
//! process SIGKILLed every two seconds; one frozen with SIGSTOP for twice `ack_wait` (what it
//! holds is redelivered to the others while its transactions stay open) and then let go; the
//! nats-server killed and restarted once; every database connection cut once; and the
//! dead-letter stream rejecting every letter until a letter has been rejected on its message's
//! last delivery, which [`LetterWatch`] sees on the wire.

use super::streams::{DLQ_SUBJECT, MAX_DELIVER};
use futures::StreamExt;
use std::collections::HashMap;
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

/// The faults one run went through.
#[derive(Debug, Clone, Copy)]
pub struct Faults {
    /// `credit` processes SIGKILLed (and restarted).
    pub kills: usize,
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

    /// The report's cells: the kills, how long the frozen process was held, the letter
    /// publishes rejected (of them on a last delivery), the sessions cut.
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
        vec![self.kills.to_string(), paused, rejected, db_cut]
    }

    /// What went missing: a fault that did not bite proves nothing.
    pub fn missing(&self) -> Vec<&'static str> {
        let mut missing = Vec::new();
        if self.kills == 0 {
            missing.push("no credit process was killed");
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
    /// Publishes on the original's last delivery (`Inbox-Delivered` is `max_deliver`).
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
                let header = |name: &str| {
                    let value = letter.headers.as_ref().and_then(|h| h.get(name));
                    value.and_then(|v| v.as_str().parse::<i64>().ok())
                };
                let seq = header("Inbox-Stream-Seq").unwrap_or(0) as u64;
                let last = header("Inbox-Delivered") == Some(MAX_DELIVER);
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
