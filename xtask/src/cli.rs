//! The command line, with clap: `cargo xtask <task> [options]`; `cargo xtask help <task>` says
//! what each does. Each task takes options of its own; this file turns the arguments into them,
//! so that no task depends on the command line.

use crate::{bench, chaos, inbox_scale, test};
use clap::{Parser, Subcommand, ValueEnum};
use inbox_testkit::Backend;

/// Project tasks (matklad's xtask convention): the demo, the tests CI runs, the chaos run and
/// the benchmark.
#[derive(Debug, Parser)]
#[command(
    name = "cargo xtask",
    bin_name = "cargo xtask",
    disable_version_flag = true
)]
pub struct Cli {
    /// The task.
    #[command(subcommand)]
    pub task: Task,
}

/// `cargo xtask demo` options.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Only this part.
    #[arg(long, value_enum)]
    pub only: Option<crate::demo::Only>,
    /// Pass `--timings` to the demo's build: cargo writes where the build's time went to
    /// target/cargo-timings/.
    #[arg(long)]
    pub timings: bool,
}

/// One task.
#[derive(Debug, Subcommand)]
pub enum Task {
    /// The end-to-end demo: credit, email and orders, each checked exact.
    ///
    /// Publish a few thousand credits (many duplicated), consume them with two `credit`
    /// processes at once, and check that every balance is exact; then e-mails through two
    /// `email` processes (two-phase claims) to a flaky local HTTP sink, counting calls per
    /// idempotency key; then orders and stock adjustments (keyed on a header) through two
    /// `orders` processes (two handlers on one App each), their /metrics sampled. SQLite under
    /// target/ unless DATABASE_URL is set, and a private nats-server if none answers at NATS_URL.
    /// Last, debits dead-lettered are replayed with the `inbox` command once their cause is
    /// fixed. `--only PART` runs one part (`chain` runs `credit` first, whose outbox it reads).
    Demo(DemoArgs),
    /// What CI runs (no options), or the tests the options select.
    ///
    /// With no options: make sure NATS, PostgreSQL and MariaDB answer (starting
    /// them if they are down), check formatting and clippy, run every test in the workspace,
    /// run the behaviour tests again batched and on a current nats-server, then a short chaos
    /// run on every backend with each nats-server. With options, only the tests they select,
    /// nothing else.
    ///
    /// Examples: `cargo xtask test --db sqlite`; `cargo xtask test -- held_race`;
    /// `cargo xtask test --db postgres -- held_race_commit`; `cargo xtask test --nats current
    /// --db mysql`.
    Test(TestArgs),
    /// Exactly once under faults, audited message by message.
    ///
    /// Three `credit` processes, one
    /// SIGKILLed every 2 s, one frozen (SIGSTOP) for twice ack_wait then let go, the
    /// nats-server restarted once, every database connection cut once, the dead-letter stream
    /// rejecting letters until one is retried and then deleted, and messages that fail until
    /// max_deliver; fails,
    /// naming example ids, unless every request id is applied exactly once and every rejected
    /// message dead-lettered exactly once. Then an email run (three `email` processes,
    /// SIGKILLs, a sink answering some 503s and some slow calls) audited for one idempotency
    /// key per e-mail, no overlapping calls, every e-mail done or dead-lettered.
    Chaos(ChaosArgs),
    /// The framework side by side with what it replaces, ratios measured in one run.
    ///
    /// A plain
    /// sqlx loop (the database's limit), a hand-written async-nats + sqlx consumer, `credit` per
    /// message and `credit` batched, each draining a backlog on a private nats-server,
    /// alternating for some rounds; then paced messages for publish-to-commit latency. Prints a
    /// table of medians and ratios; writes target/bench/results.{json,md} and chart.svg.
    Bench(BenchArgs),
}

/// Which nats-server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Nats {
    /// The machine's, at 127.0.0.1:4222 (Debian's 2.9).
    Machine,
    /// A current release (2.15), installed from PyPI into target/nats/ when missing.
    Current,
}

/// One backend.
fn backend(word: &str) -> Result<Backend, String> {
    Backend::parse(word).ok_or_else(|| format!("{word:?} is not postgres, mysql or sqlite"))
}

/// The backends of `--db`: one, or `all`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backends(pub Vec<Backend>);

/// One backend, or `all`.
fn backends(word: &str) -> Result<Backends, String> {
    match word {
        "all" => Ok(Backends(Backend::ALL.to_vec())),
        word => backend(word).map(|b| Backends(vec![b])),
    }
}

/// `cargo xtask test`'s options.
#[derive(Debug, clap::Args)]
pub struct TestArgs {
    /// Only this backend's tests (postgres, mysql or sqlite): those named `<backend>::..`.
    #[arg(long, value_parser = backend)]
    pub db: Option<Backend>,
    /// Run them against this nats-server.
    #[arg(long, value_enum)]
    pub nats: Option<Nats>,
    /// Run the behaviour suite with every worker batched (8 messages per transaction).
    #[arg(long)]
    pub batched: bool,
    /// Only the tests whose name contains one of these; with --db, the start of the name after
    /// the backend.
    #[arg(last = true)]
    pub filters: Vec<String>,
}

impl TestArgs {
    /// Whether nothing was asked for: CI's whole run.
    pub fn everything(&self) -> bool {
        self.db.is_none() && self.nats.is_none() && !self.batched && self.filters.is_empty()
    }
}

/// `cargo xtask chaos`'s options.
#[derive(Debug, clap::Args)]
pub struct ChaosArgs {
    /// postgres, mysql, sqlite or all.
    #[arg(long, value_parser = backends, default_value = "all")]
    pub db: Backends,
    /// Credit requests per backend (at least 100).
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(100..))]
    pub messages: u64,
    /// Build the examples in release mode.
    #[arg(long)]
    pub release: bool,
    /// Run the private nats-servers on this release.
    #[arg(long, value_enum, default_value = "machine")]
    pub nats: Nats,
    /// Which runs: credit, email or all.
    #[arg(long, value_enum, default_value = "all")]
    pub run: Runs,
    /// Instead: the credit run on a 3-node JetStream cluster of its own (R3 streams), its
    /// stream leader and a server the processes are connected to killed mid-run, twice each.
    #[arg(long, conflicts_with = "run")]
    pub cluster: bool,
    /// Instead, the database failover run (PostgreSQL): a private primary with a synchronous
    /// standby, the primary killed mid-run, `credit` pointed at the standby while it still
    /// refuses writes (10 s), then the standby promoted; audited message by message.
    #[arg(long, conflicts_with = "cluster")]
    pub failover: bool,
}

/// Which chaos runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Runs {
    /// The `credit` run.
    Credit,
    /// The `email` run.
    Email,
    /// Both.
    All,
}

impl From<&ChaosArgs> for chaos::Common {
    fn from(args: &ChaosArgs) -> chaos::Common {
        chaos::Common {
            backends: args.db.0.clone(),
            messages: args.messages as usize,
            release: args.release,
            current_nats: args.nats == Nats::Current,
        }
    }
}

impl From<&ChaosArgs> for chaos::Options {
    fn from(args: &ChaosArgs) -> chaos::Options {
        chaos::Options {
            common: args.into(),
            credit: matches!(args.run, Runs::Credit | Runs::All),
            email: matches!(args.run, Runs::Email | Runs::All),
        }
    }
}

/// `cargo xtask bench`'s options.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// postgres, mysql, sqlite or all.
    #[arg(long, value_parser = backends, default_value = "all")]
    pub db: Backends,
    /// Messages in each backlog.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub messages: u64,
    /// Concurrency (SQLite: 1).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    pub concurrency: u64,
    /// Rounds, alternating the contenders.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..))]
    pub rounds: u64,
    /// Messages per transaction of the batched contender.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    pub batch: u64,
    /// Paced messages for the latency measurement.
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub latency_messages: u64,
    /// Their rate, per second.
    #[arg(long, default_value_t = 400, value_parser = clap::value_parser!(u32).range(1..))]
    pub rate: u32,
    /// Also time the claim with this many markers already in the inbox (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub inbox_rows: Vec<u64>,
    /// Only these contenders (comma-separated): loop, handwritten, inbox, inbox-batched.
    #[arg(long, value_delimiter = ',', value_parser = bench::Contender::parse)]
    pub only: Vec<bench::Contender>,
    /// The workloads (comma-separated): hot (40 accounts), spread (1,000 accounts).
    #[arg(long, value_delimiter = ',', value_parser = bench::Workload::parse, default_value = "hot,spread")]
    pub workloads: Vec<bench::Workload>,
    /// Consumer processes on the one durable consumer (comma-separated counts).
    #[arg(long, value_delimiter = ',', default_value = "1,3", value_parser = clap::value_parser!(u64).range(1..=8))]
    pub processes: Vec<u64>,
    /// Microseconds each way between every contender and the database server, by a
    /// forwarder of the bench's own (a database across a network; not SQLite). 0: none.
    #[arg(long, default_value_t = 0)]
    pub db_latency_us: u64,
    /// Also write the results to docs/bench/.
    #[arg(long)]
    pub save: bool,
    /// Instead of the contenders: the PostgreSQL inbox at scale, unpartitioned (cleanup by
    /// DELETE) against partitioned (cleanup by dropping partitions), at each `--markers` count.
    #[arg(long)]
    pub inbox_scale: bool,
    /// With --inbox-scale: the marker counts to load (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "0,1000000")]
    pub markers: Vec<u64>,
    /// With --inbox-scale: claims timed per layout and count.
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub claims: u64,
}

impl From<&BenchArgs> for bench::Options {
    fn from(args: &BenchArgs) -> bench::Options {
        bench::Options {
            backends: args.db.0.clone(),
            messages: args.messages as usize,
            concurrency: args.concurrency as usize,
            rounds: args.rounds as usize,
            batch: args.batch as usize,
            latency_messages: args.latency_messages as usize,
            rate: args.rate,
            inbox_rows: args.inbox_rows.clone(),
            contenders: match args.only.as_slice() {
                [] => bench::Contender::ALL.to_vec(),
                only => only.to_vec(),
            },
            workloads: args.workloads.clone(),
            processes: args.processes.iter().map(|&p| p as usize).collect(),
            db_latency: std::time::Duration::from_micros(args.db_latency_us),
            save: args.save,
        }
    }
}

impl From<&BenchArgs> for inbox_scale::Options {
    fn from(args: &BenchArgs) -> inbox_scale::Options {
        inbox_scale::Options {
            markers: args.markers.clone(),
            claims: args.claims as usize,
        }
    }
}

impl From<&TestArgs> for test::Options {
    fn from(args: &TestArgs) -> test::Options {
        if args.everything() {
            return test::Options::Everything;
        }
        test::Options::Only(test::Selection {
            db: args.db,
            current_nats: args.nats == Some(Nats::Current),
            batched: args.batched,
            filters: args.filters.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(line: &str) -> Result<Task, String> {
        Cli::try_parse_from(std::iter::once("cargo-xtask").chain(line.split_whitespace()))
            .map(|cli| cli.task)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn options_parse_and_bad_ones_are_named() {
        let Ok(Task::Bench(b)) = parse("bench --db sqlite --messages 1000 --inbox-rows 0,1000")
        else {
            panic!("bench options did not parse");
        };
        let o = bench::Options::from(&b);
        assert_eq!(b.db, Backends(vec![Backend::Sqlite]));
        assert_eq!((b.messages, b.inbox_rows.clone()), (1000, vec![0, 1000]));
        assert_eq!((o.messages, o.contenders.len()), (1000, 4));
        assert_eq!(
            o.workloads,
            vec![bench::Workload::Hot, bench::Workload::Spread]
        );
        assert_eq!(o.processes, vec![1, 3]);
        let Ok(Task::Bench(b)) = parse("bench --workloads hot --processes 2") else {
            panic!("bench workloads did not parse");
        };
        let o = bench::Options::from(&b);
        assert_eq!(
            (o.workloads, o.processes),
            (vec![bench::Workload::Hot], vec![2])
        );
        let Ok(Task::Bench(b)) = parse("bench --inbox-scale --markers 0,10000000 --claims 50")
        else {
            panic!("inbox-scale options did not parse");
        };
        assert!(b.inbox_scale);
        assert_eq!((b.markers.clone(), b.claims), (vec![0, 10_000_000], 50));
        for (line, named) in [
            ("bench --messages 0", "--messages"),
            ("bench --db oracle", "oracle"),
            ("bench --only fast", "fast"),
            ("bench --workloads cold", "cold"),
            ("bench --processes 0", "--processes"),
            ("chaos --messages 5", "--messages"),
            ("chaos --run everything", "everything"),
            ("test --nats newest", "newest"),
            ("test --db db2", "db2"),
        ] {
            let e = parse(line).unwrap_err();
            assert!(e.contains(named), "{line}: {e}");
        }
        let Ok(Task::Test(t)) = parse("test --db mysql -- held_race") else {
            panic!("test options did not parse");
        };
        assert_eq!(
            (t.db, t.filters.as_slice()),
            (Some(Backend::MySql), &["held_race".to_owned()][..])
        );
        assert!(!t.everything());
        let Ok(Task::Test(t)) = parse("test") else {
            panic!("test did not parse");
        };
        assert!(t.everything());
    }
}
