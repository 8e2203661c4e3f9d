//! `inbox`: what an operator does with an inbox's dead letters, claims, markers, parked letters
//! and outbox, from a shell. Configured like the examples: `NATS_URL`, `NATS_CREDS`,
//! `DATABASE_URL` (credentials are never printed). Every read command takes `--json`. Exit code
//! 0 on success, 1 on an error (one line on stderr), 2 on a usage error.

mod db;
mod letters;
mod out;
mod status;

use clap::{Args, Parser, Subcommand};
use std::process::ExitCode;

/// Dead letters, claims, markers, parked letters and the outbox of an inbox.
#[derive(Debug, Parser)]
#[command(name = "inbox", version, about)]
struct Cli {
    #[command(flatten)]
    config: Config,
    #[command(subcommand)]
    command: Command,
}

/// Where the inbox lives.
#[derive(Debug, Args)]
pub struct Config {
    /// The NATS server.
    #[arg(
        long,
        env = "NATS_URL",
        default_value = "nats://127.0.0.1:4222",
        global = true
    )]
    pub nats_url: String,
    /// A NATS credentials file (a user JWT and its NKey seed).
    #[arg(long, env = "NATS_CREDS", global = true)]
    pub nats_creds: Option<std::path::PathBuf>,
    /// The database: `postgres://`, `mysql://` (MariaDB too) or `sqlite:`.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test",
        hide_env_values = true,
        hide_default_value = true,
        global = true
    )]
    pub database_url: String,
    /// The inbox table (its markers; parked letters are in `<table>_dead_letters`).
    #[arg(long, default_value = "inbox", global = true)]
    pub table: String,
    /// The outbox table.
    #[arg(long, default_value = "outbox", global = true)]
    pub outbox_table: String,
    /// The dead-letter stream.
    #[arg(long, default_value = inbox_runtime::DEFAULT_DLQ_STREAM, global = true)]
    pub dlq_stream: String,
    /// The dead-letter subject prefix (letters go to `<prefix>.<consumer>`).
    #[arg(long, default_value = inbox_runtime::DEFAULT_DLQ_PREFIX, global = true)]
    pub dlq_prefix: String,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Per consumer: its durable, markers, dead letters, parked letters, open claims; the outbox.
    Status {
        /// Only this consumer (the handler's `consumer` name).
        #[arg(long)]
        consumer: Option<String>,
        /// The consumer's JetStream durable, when it is not named as the consumer.
        #[arg(long, requires = "consumer")]
        durable: Option<String>,
        /// Only the durables of this stream, and the letters of its messages.
        #[arg(long)]
        stream: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Dead letters in the dead-letter stream.
    #[command(subcommand)]
    Dlq(Dlq),
    /// Open claims of two-phase handlers.
    #[command(subcommand)]
    Claims(Claims),
    /// Removes a marker, so that a message with that key is processed again, on purpose.
    Forget {
        #[command(flatten)]
        marker: Marker,
        /// Yes, remove it.
        #[arg(long, required = true)]
        yes: bool,
    },
    /// The outbox's rows.
    #[command(subcommand)]
    Outbox(Outbox),
    /// Dead letters parked in the database (no stream took them on a last delivery).
    #[command(subcommand)]
    Parked(Parked),
}

/// Which letters a command acts on.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct Selection {
    /// Letters by their sequence in the dead-letter stream.
    pub seqs: Vec<u64>,
    /// Every letter of a group (`inbox dlq groups`).
    #[arg(long)]
    pub group: Option<String>,
    /// Every letter.
    #[arg(long)]
    pub all: bool,
}

/// Which consumer's, and which stream's, letters.
#[derive(Debug, Args)]
pub struct Filter {
    /// Only this consumer's.
    #[arg(long)]
    pub consumer: Option<String>,
    /// Only the letters of messages from this stream.
    #[arg(long)]
    pub stream: Option<String>,
}

#[derive(Debug, Subcommand)]
enum Dlq {
    /// Each letter: sequence, consumer, original subject, stream and sequence, key, error, time.
    List {
        #[command(flatten)]
        filter: Filter,
        /// Only those whose error contains this text.
        #[arg(long)]
        error: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Letters grouped by error kind, with counts and first and last seen.
    Groups {
        #[command(flatten)]
        filter: Filter,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Publishes letters again to their original subject, with their key, so that the handler
    /// runs again once the cause is fixed; each leaves the stream once the publish is stored.
    Replay {
        #[command(flatten)]
        selection: Selection,
        #[command(flatten)]
        filter: Filter,
        /// Say what would be replayed; change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Deletes letters.
    Purge {
        #[command(flatten)]
        selection: Selection,
        #[command(flatten)]
        filter: Filter,
        /// Yes, delete them.
        #[arg(long, required = true)]
        yes: bool,
    },
}

/// The consumer and key that name a marker (or a claim, which is a marker not yet done).
#[derive(Debug, clap::Args)]
struct Marker {
    /// The consumer.
    #[arg(long)]
    consumer: String,
    /// The message key.
    #[arg(long)]
    key: String,
}

#[derive(Debug, Subcommand)]
enum Claims {
    /// Open claims, oldest first.
    List {
        /// Only this consumer's.
        #[arg(long)]
        consumer: Option<String>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Ends a claim's lease now, so that the next delivery takes it over.
    Release {
        #[command(flatten)]
        claim: Marker,
    },
    /// Deletes an open claim, as if the key had never been seen.
    Forget {
        #[command(flatten)]
        claim: Marker,
        /// Yes, delete it.
        #[arg(long, required = true)]
        yes: bool,
    },
}

#[derive(Debug, Subcommand)]
enum Outbox {
    /// Pending rows, oldest first (with `--failed`, the rows NATS refused for good).
    List {
        /// The failed rows instead.
        #[arg(long)]
        failed: bool,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Sends a failed row again (once its cause is fixed); its key's later rows follow it.
    Retry {
        /// The row's id.
        id: i64,
    },
    /// Gives up a failed row for good; its key's later rows go on.
    Discard {
        /// The row's id.
        id: i64,
        /// Yes, give it up.
        #[arg(long, required = true)]
        yes: bool,
    },
}

#[derive(Debug, Subcommand)]
enum Parked {
    /// Parked letters, oldest first.
    List {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Publishes the parked letters to the dead-letter stream now.
    Retry,
}

/// What a command failed with: one line.
pub type Error = String;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("inbox: {}", e.replace('\n', " "));
            ExitCode::from(1)
        }
    }
}

async fn run(cli: Cli) -> Result<(), Error> {
    let config = &cli.config;
    match cli.command {
        Command::Status {
            consumer,
            durable,
            stream,
            json,
        } => {
            let db = db::Db::connect(config).await?;
            let js = letters::connect(config).await?;
            let only = consumer
                .as_deref()
                .map(|c| (c, durable.as_deref().unwrap_or(c)));
            let report = status::report(config, &db, &js, only, stream.as_deref()).await?;
            out::print_one(&report, json, status::text);
        }
        Command::Dlq(dlq) => {
            let js = letters::connect(config).await?;
            let stream = letters::Letters::new(config, js);
            match dlq {
                Dlq::List {
                    filter,
                    error,
                    json,
                } => {
                    let mut all = stream.read(&filter).await?;
                    if let Some(text) = error {
                        all.retain(|l| l.error.contains(&text));
                    }
                    out::print(&all, json, letters::list_text);
                }
                Dlq::Groups { filter, json } => {
                    let groups = letters::groups(&stream.read(&filter).await?);
                    out::print(&groups, json, letters::groups_text);
                }
                Dlq::Replay {
                    selection,
                    filter,
                    dry_run,
                } => {
                    let chosen = stream.select(&selection, &filter).await?;
                    stream.replay(chosen, dry_run).await?;
                }
                Dlq::Purge {
                    selection,
                    filter,
                    yes: _,
                } => {
                    let chosen = stream.select(&selection, &filter).await?;
                    let n = stream.purge(&chosen).await?;
                    println!("purged {n} letters");
                }
            }
        }
        Command::Claims(claims) => {
            let db = db::Db::connect(config).await?;
            match claims {
                Claims::List { consumer, json } => {
                    let open = db.open_claims(consumer.as_deref()).await?;
                    out::print(&open, json, db::claims_text);
                }
                Claims::Release {
                    claim: Marker { consumer, key },
                } => {
                    if !db.release_claim(&consumer, &key).await? {
                        return Err(format!("no open claim of {consumer:?} on key {key:?}"));
                    }
                    println!("released the claim of {consumer:?} on key {key:?}");
                }
                Claims::Forget {
                    claim: Marker { consumer, key },
                    ..
                } => {
                    if !db.forget_claim(&consumer, &key).await? {
                        return Err(format!("no open claim of {consumer:?} on key {key:?}"));
                    }
                    println!("forgot the claim of {consumer:?} on key {key:?}");
                }
            }
        }
        Command::Forget {
            marker: Marker { consumer, key },
            ..
        } => {
            let db = db::Db::connect(config).await?;
            if !db.forget_marker(&consumer, &key).await? {
                return Err(format!("no marker of {consumer:?} with key {key:?}"));
            }
            println!("forgot the marker of {consumer:?} with key {key:?}");
        }
        Command::Outbox(outbox) => {
            let db = db::Db::connect(config).await?;
            match outbox {
                Outbox::List { failed, json } => {
                    let rows = db.outbox_rows(failed).await?;
                    out::print(&rows, json, db::outbox_text);
                }
                Outbox::Retry { id } => {
                    if !db.outbox_retry(id).await? {
                        return Err(format!("no failed outbox row {id}"));
                    }
                    println!("outbox row {id} will be sent again");
                }
                Outbox::Discard { id, .. } => {
                    if !db.outbox_discard(id).await? {
                        return Err(format!("no failed outbox row {id}"));
                    }
                    println!("outbox row {id} discarded");
                }
            }
        }
        Command::Parked(parked) => {
            let db = db::Db::connect(config).await?;
            match parked {
                Parked::List { json } => {
                    let rows = db.parked().await?;
                    out::print(&rows, json, db::parked_text);
                }
                Parked::Retry => {
                    let js = letters::connect(config).await?;
                    let sent = db.relay_parked(config, &js).await?;
                    println!("published {sent} parked letters");
                }
            }
        }
    }
    Ok(())
}
