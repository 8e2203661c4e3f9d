//! What `cargo xtask bench` is asked for: the sizes, and which contenders run.

use inbox_testkit::Backend;

/// What `cargo xtask bench` was asked.
#[derive(Debug, Clone)]
pub struct Options {
    /// The backends, one after the other.
    pub backends: Vec<Backend>,
    /// Messages in each backlog.
    pub messages: usize,
    /// The consumers' concurrency (SQLite's is 1).
    pub concurrency: usize,
    /// Rounds, alternating the contenders.
    pub rounds: usize,
    /// Messages per transaction of the batched contender.
    pub batch: usize,
    /// Paced messages for the latency measurement.
    pub latency_messages: usize,
    /// Their rate, per second.
    pub rate: u32,
    /// Marker counts at which the claim is also timed.
    pub inbox_rows: Vec<u64>,
    /// The contenders that run.
    pub contenders: Vec<Contender>,
    /// The workloads, each a number of accounts the credits spread over.
    pub workloads: Vec<Workload>,
    /// How many consumer processes share the durable consumer (the loop runs at that many
    /// times the concurrency instead).
    pub processes: Vec<usize>,
    /// The delay each way between every contender and the database server (`latency.rs`);
    /// zero: none.
    pub db_latency: std::time::Duration,
    /// Whether the results are also written to `docs/bench/`.
    pub save: bool,
}

/// One contender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Contender {
    /// A hand-written sqlx loop, no NATS: the database's limit.
    Loop,
    /// A hand-written async-nats + sqlx consumer.
    Handwritten,
    /// `credit`, a transaction per message.
    Inbox,
    /// `credit` with `CREDIT_BATCH`.
    InboxBatched,
}

impl Contender {
    /// The contender named `word` (`loop`, `handwritten`, `inbox`, `inbox-batched`).
    pub fn parse(word: &str) -> Result<Contender, String> {
        Contender::ALL
            .into_iter()
            .find(|c| c.name() == word)
            .ok_or_else(|| {
                format!("no contender {word:?}: loop, handwritten, inbox or inbox-batched")
            })
    }

    /// Every contender, in the order they run and are charted.
    pub const ALL: [Contender; 4] = [
        Contender::Loop,
        Contender::Handwritten,
        Contender::Inbox,
        Contender::InboxBatched,
    ];

    /// Its name on the command line and in the results.
    pub fn name(self) -> &'static str {
        match self {
            Contender::Loop => "loop",
            Contender::Handwritten => "handwritten",
            Contender::Inbox => "inbox",
            Contender::InboxBatched => "inbox-batched",
        }
    }

    /// Its line in the results table.
    pub fn describe(self) -> &'static str {
        match self {
            Contender::Loop => "1. sqlx loop, no NATS (the database's limit)",
            Contender::Handwritten => "2. hand-written async-nats + sqlx consumer",
            Contender::Inbox => "3. inbox, a transaction per message",
            Contender::InboxBatched => "4. inbox, batched",
        }
    }
}

/// How many accounts the credits spread over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// 40 accounts: a popular merchant, a hot wallet; concurrent batches meet on the same rows.
    Hot,
    /// 1,000 accounts: batches rarely meet.
    Spread,
}

impl Workload {
    /// The workload named `word` (`hot`, `spread`).
    pub fn parse(word: &str) -> Result<Workload, String> {
        match word {
            "hot" => Ok(Workload::Hot),
            "spread" => Ok(Workload::Spread),
            _ => Err(format!("no workload {word:?}: hot or spread")),
        }
    }

    /// Its name on the command line and in the results.
    pub fn name(self) -> &'static str {
        match self {
            Workload::Hot => "hot",
            Workload::Spread => "spread",
        }
    }

    /// The accounts the credits spread over.
    pub fn accounts(self) -> usize {
        match self {
            Workload::Hot => 40,
            Workload::Spread => 1000,
        }
    }
}
