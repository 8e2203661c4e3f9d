//! The example binaries (`credit`, `email`) as child processes: spawned with its environment, stopped with
//! SIGTERM (and its summary line read), killed with SIGKILL, or paused with SIGSTOP and resumed
//! with SIGCONT.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;
use tokio::io::AsyncReadExt;
use tokio::process::{Child, Command};

/// Where and how to run `credit`: its binary and the environment it reads.
#[derive(Debug, Clone)]
pub struct CreditConfig {
    /// The `credit` binary (`env!("CARGO_BIN_EXE_credit")` in the example's tests).
    pub binary: PathBuf,
    /// `NATS_URL`.
    pub nats_url: String,
    /// `DATABASE_URL`.
    pub database_url: String,
    /// `CREDIT_STREAM`.
    pub stream: String,
    /// `CREDIT_SUBJECT`.
    pub subject: String,
    /// `CREDIT_CONSUMER`: the durable consumer's name.
    pub consumer: String,
    /// `RUST_LOG`.
    pub rust_log: String,
}

/// Where and how to run `email`: its binary and the environment it reads.
#[derive(Debug, Clone)]
pub struct EmailConfig {
    /// The `email` binary (`env!("CARGO_BIN_EXE_email")` in the example's tests).
    pub binary: PathBuf,
    /// `NATS_URL`.
    pub nats_url: String,
    /// `DATABASE_URL`.
    pub database_url: String,
    /// `EMAIL_STREAM`.
    pub stream: String,
    /// `EMAIL_SUBJECT`.
    pub subject: String,
    /// `EMAIL_CONSUMER`: the durable consumer's name.
    pub consumer: String,
    /// `EMAIL_API_URL`.
    pub api_url: String,
    /// `EMAIL_LEASE_MS`.
    pub lease: Duration,
    /// `EMAIL_TEST_HOLD_BEFORE_CALL_MS`.
    pub hold_before_call: Duration,
    /// `EMAIL_CONCURRENCY`, when set.
    pub concurrency: Option<u32>,
    /// `RUST_LOG`.
    pub rust_log: String,
}

impl EmailConfig {
    /// Starts `email` as this says, its log appended to `log` (discarded when `None`).
    pub fn spawn(&self, log: Option<&Path>) -> Result<CreditProcess, String> {
        let mut env = vec![
            ("NATS_URL", self.nats_url.clone()),
            ("DATABASE_URL", self.database_url.clone()),
            ("EMAIL_STREAM", self.stream.clone()),
            ("EMAIL_SUBJECT", self.subject.clone()),
            ("EMAIL_CONSUMER", self.consumer.clone()),
            ("EMAIL_API_URL", self.api_url.clone()),
            ("EMAIL_LEASE_MS", self.lease.as_millis().to_string()),
            (
                "EMAIL_TEST_HOLD_BEFORE_CALL_MS",
                self.hold_before_call.as_millis().to_string(),
            ),
            ("RUST_LOG", self.rust_log.clone()),
        ];
        if let Some(n) = self.concurrency {
            env.push(("EMAIL_CONCURRENCY", n.to_string()));
        }
        CreditProcess::spawn_with("email", &self.binary, &env, log)
    }
}

/// Sends SIGTERM to process `pid`, as an operator stopping it would.
pub fn terminate(pid: u32) -> Result<(), String> {
    signal(pid, "TERM")
}

/// Sends signal `name` (`TERM`, `STOP`, `CONT`, ...: the name without `SIG`) to process `pid`.
pub fn signal(pid: u32, name: &str) -> Result<(), String> {
    use nix::sys::signal::{Signal, kill};
    let signal: Signal = format!("SIG{name}")
        .parse()
        .map_err(|e| format!("signal {name}: {e}"))?;
    kill(nix::unistd::Pid::from_raw(pid as i32), signal)
        .map_err(|e| format!("kill -{name} {pid}: {e}"))
}

/// How many of its log's last lines an error about a process that failed shows.
const TAIL_LINES: usize = 15;

/// A running example process (`credit` or `email`). Its stdout is piped (it prints one summary line there when it
/// stops); its log (stderr) is appended to a file or discarded. Killed if dropped while running.
#[derive(Debug)]
pub struct CreditProcess {
    child: Child,
    name: &'static str,
    /// Where its log goes, if anywhere.
    log: Option<PathBuf>,
}

/// The counts from the last line of `credit` (or `email`): `credit stopped: applied=N skipped=N
/// nacked=N terminated=N`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Summary {
    /// Messages whose effect was committed and acked.
    pub applied: u64,
    /// Duplicates skipped.
    pub skipped: u64,
    /// Messages nak'd for redelivery.
    pub nacked: u64,
    /// Messages dead-lettered and terminated.
    pub terminated: u64,
}

impl Summary {
    /// Parses the last line of `stdout` that starts with `credit stopped:`.
    pub fn parse(stdout: &str) -> Result<Summary, String> {
        Self::parse_of("credit", stdout)
    }

    /// Parses the last line of `stdout` that starts with `<name> stopped:`.
    pub fn parse_of(name: &str, stdout: &str) -> Result<Summary, String> {
        let prefix = format!("{name} stopped:");
        let line = stdout
            .lines()
            .rev()
            .find(|l| l.starts_with(&prefix))
            .ok_or_else(|| format!("no `{prefix}` line in {stdout:?}"))?;
        let count = |name: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| format!("no {name}=N in {line:?}"))
        };
        Ok(Summary {
            applied: count("applied")?,
            skipped: count("skipped")?,
            nacked: count("nacked")?,
            terminated: count("terminated")?,
        })
    }
}

impl CreditConfig {
    /// `CREDIT_EVENTS_STREAM`: derived from the requests' stream, so that every run has its own.
    pub fn events_stream(&self) -> String {
        format!("{}_EVENTS", self.stream)
    }

    /// `CREDIT_EVENTS_SUBJECT`: derived from the requests' subject.
    pub fn events_subject(&self) -> String {
        format!("events.{}", self.subject)
    }

    /// The environment `credit` runs with: add to it for what this config does not say.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("NATS_URL", self.nats_url.clone()),
            ("DATABASE_URL", self.database_url.clone()),
            ("CREDIT_STREAM", self.stream.clone()),
            ("CREDIT_SUBJECT", self.subject.clone()),
            ("CREDIT_CONSUMER", self.consumer.clone()),
            ("CREDIT_EVENTS_STREAM", self.events_stream()),
            ("CREDIT_EVENTS_SUBJECT", self.events_subject()),
            ("RUST_LOG", self.rust_log.clone()),
        ]
    }
}

impl CreditProcess {
    /// Starts `credit` as `config` says, its log appended to `log` (discarded when `None`).
    pub fn spawn(config: &CreditConfig, log: Option<&Path>) -> Result<CreditProcess, String> {
        Self::spawn_with("credit", &config.binary, &config.env(), log)
    }

    /// Starts `binary` (the example `name`) with `env`, its log appended to `log`.
    pub fn spawn_with(
        name: &'static str,
        binary: &Path,
        env: &[(&str, String)],
        log: Option<&Path>,
    ) -> Result<CreditProcess, String> {
        let stderr = match log {
            Some(path) => Stdio::from(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|e| format!("log file {}: {e}", path.display()))?,
            ),
            None => Stdio::null(),
        };
        let child = Command::new(binary)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
        Ok(CreditProcess {
            child,
            name,
            log: log.map(Path::to_owned),
        })
    }

    /// Asks it to stop cleanly (SIGTERM), without waiting.
    pub fn sigterm(&self) -> Result<(), String> {
        self.signal("TERM")
    }

    /// Freezes it (SIGSTOP), as a long GC pause or a stalled VM would: it keeps its connections,
    /// its open transactions and the messages it was handed, and answers nothing until
    /// [`resume`](Self::resume). A paused process still dies of [`kill`](Self::kill) or drop.
    pub fn pause(&self) -> Result<(), String> {
        self.signal("STOP")
    }

    /// Lets a [paused](Self::pause) process go on (SIGCONT).
    pub fn resume(&self) -> Result<(), String> {
        self.signal("CONT")
    }

    /// Sends signal `name` (`TERM`, `STOP`, `CONT`).
    fn signal(&self, name: &str) -> Result<(), String> {
        let pid = self
            .child
            .id()
            .ok_or_else(|| format!("{} has already exited", self.name))?;
        signal(pid, name).map_err(|e| format!("{e} ({})", self.name))
    }

    /// Kills it at once (SIGKILL), as a crash would, and reaps it.
    pub async fn kill(&mut self) -> Result<(), String> {
        self.child
            .kill()
            .await
            .map_err(|e| format!("cannot kill {}: {e}", self.name))
    }

    /// Whether it has exited (on its own, or after a signal).
    pub fn has_exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Where its log is and how it ends (its last [`TAIL_LINES`] lines: a process that failed
    /// says why there), for an error about it; empty when its log is discarded.
    fn log_tail(&self) -> String {
        let Some(log) = &self.log else {
            return String::new();
        };
        let text = match std::fs::read(log) {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(e) => return format!("; its log {}: {e}", log.display()),
        };
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(TAIL_LINES)..].join("\n");
        format!("; its log {} ends:\n{tail}", log.display())
    }

    /// Waits at most `deadline` for it to exit.
    pub async fn wait(&mut self, deadline: Duration) -> Result<ExitStatus, String> {
        tokio::time::timeout(deadline, self.child.wait())
            .await
            .map_err(|_| format!("{} did not exit within {deadline:?}", self.name))?
            .map_err(|e| format!("wait for {}: {e}", self.name))
    }

    /// SIGTERM, then waits at most `deadline`; it must exit 0 and print its summary.
    pub async fn stop(mut self, deadline: Duration) -> Result<Summary, String> {
        self.sigterm()?;
        let status = self.wait(deadline).await?;
        let mut out = String::new();
        if let Some(mut stdout) = self.child.stdout.take() {
            stdout
                .read_to_string(&mut out)
                .await
                .map_err(|e| format!("read {}'s stdout: {e}", self.name))?;
        }
        if !status.success() {
            return Err(format!(
                "{} exited with {status}; stdout: {out:?}{}",
                self.name,
                self.log_tail()
            ));
        }
        Summary::parse_of(self.name, &out)
    }
}

/// What a `credit` process run with `CREDIT_TEST_LAST_DELIVERY_HOLD_MS` holds on its last
/// delivery right now, read from its log as it grows: the stream sequences between its `last
/// delivery held ... stream_seq=N` and `last delivery let go ... stream_seq=N` lines (WARN, so
/// that they show at `RUST_LOG=warn`).
#[derive(Debug)]
pub struct LastDeliveryHolds {
    log: PathBuf,
    /// How far the log has been read.
    read: u64,
    /// The end of the log after its last newline, not yet a whole line.
    partial: Vec<u8>,
    held: std::collections::BTreeSet<u64>,
}

/// The line `credit` logs when it begins holding a last delivery.
const HELD: &str = "last delivery held";
/// The line it logs when the hold ends.
const LET_GO: &str = "last delivery let go";

impl LastDeliveryHolds {
    /// Follows `log` from its current end: what it already holds is an earlier process's.
    pub fn new(log: &Path) -> LastDeliveryHolds {
        let read = std::fs::metadata(log).map_or(0, |m| m.len());
        LastDeliveryHolds {
            log: log.to_owned(),
            read,
            partial: Vec::new(),
            held: Default::default(),
        }
    }

    /// The stream sequences held now, after reading what the log gained since the last look.
    pub fn held(&mut self) -> Result<&std::collections::BTreeSet<u64>, String> {
        use std::io::{Read, Seek, SeekFrom};
        let mut file = match std::fs::File::open(&self.log) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(&self.held),
            Err(e) => return Err(format!("log {}: {e}", self.log.display())),
        };
        let mut grown = Vec::new();
        file.seek(SeekFrom::Start(self.read))
            .and_then(|_| file.read_to_end(&mut grown))
            .map_err(|e| format!("log {}: {e}", self.log.display()))?;
        self.read += grown.len() as u64;
        self.partial.extend_from_slice(&grown);
        let Some(end) = self.partial.iter().rposition(|&b| b == b'\n') else {
            return Ok(&self.held);
        };
        let lines: Vec<u8> = self.partial.drain(..=end).collect();
        for line in String::from_utf8_lossy(&lines).lines() {
            self.apply(line);
        }
        Ok(&self.held)
    }

    /// Forgets everything held and skips what the log holds now: after the process was killed
    /// (and reaped), before the next one appends to the same log.
    pub fn restart(&mut self) {
        *self = LastDeliveryHolds::new(&self.log);
    }

    /// Takes one whole line of the log into account.
    fn apply(&mut self, line: &str) {
        let seq = || {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix("stream_seq=")?.parse::<u64>().ok())
        };
        if line.contains(HELD) {
            self.held.extend(seq());
        } else if line.contains(LET_GO)
            && let Some(seq) = seq()
        {
            self.held.remove(&seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{LastDeliveryHolds, Summary};
    use std::io::Write;

    #[test]
    fn holds_are_followed_through_the_log_and_forgotten_at_a_restart() {
        // As `credit` logs them (tracing's fmt, no colours).
        const WARN: &str = "2025-01-01T00:00:00.000000Z  WARN inbox_examples:";
        let held = |seq: u64| {
            format!(
                "{WARN} last delivery held (CREDIT_TEST_LAST_DELIVERY_HOLD_MS) stream_seq={seq} \
                 delivered=3 hold=1s\n"
            )
        };
        let let_go = |seq: u64| format!("{WARN} last delivery let go stream_seq={seq}\n");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("credit.log");
        let mut log = std::fs::File::create(&path).unwrap();
        write!(log, "{}", held(1)).unwrap();
        let mut holds = LastDeliveryHolds::new(&path);
        assert!(holds.held().unwrap().is_empty(), "an earlier process's");
        write!(log, "{}{}", held(7), held(9)).unwrap();
        let now = |h: &mut LastDeliveryHolds| h.held().unwrap().iter().copied().collect::<Vec<_>>();
        assert_eq!(now(&mut holds), [7, 9]);
        // Half a line counts once it is whole.
        let line = let_go(7);
        let (head, tail) = line.split_at(20);
        write!(log, "{head}").unwrap();
        assert_eq!(now(&mut holds), [7, 9]);
        write!(log, "{tail}").unwrap();
        assert_eq!(now(&mut holds), [9]);
        holds.restart();
        assert!(holds.held().unwrap().is_empty());
        write!(log, "{}", held(11)).unwrap();
        assert_eq!(now(&mut holds), [11]);
        let mut missing = LastDeliveryHolds::new(&dir.path().join("not yet"));
        assert!(missing.held().unwrap().is_empty());
    }

    #[test]
    fn the_last_summary_line_counts() {
        let out = "credit stopped: applied=1 skipped=2 nacked=3 terminated=4\n\
                   credit stopped: applied=10 skipped=20 nacked=30 terminated=40\n";
        let s = Summary::parse(out).unwrap();
        assert_eq!(
            (s.applied, s.skipped, s.nacked, s.terminated),
            (10, 20, 30, 40)
        );
        assert!(Summary::parse("").is_err());
        assert!(Summary::parse("credit stopped: applied=x").is_err());
    }
}
