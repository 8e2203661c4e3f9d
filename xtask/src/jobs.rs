//! CI's test run as a queue of jobs: each test binary that `cargo test --workspace --no-run`
//! built (the behaviour suite cut by backend), once on the machine's nats-server, once batched
//! (the behaviour suite), once on a current nats-server, and the chaos runs, taken longest first
//! by a fixed number of slots.
//!
//! Running the built binaries ourselves, as `cargo test` would (working directory and
//! `CARGO_MANIFEST_DIR` of their package), keeps every slot busy to the end: passes of `cargo
//! test` run their binaries one after another, so a pass waited on its slowest binaries while
//! the other slot sat idle, and a `cargo test` with another package selection rebuilds the
//! behaviour suite (its package's `CARGO_PRIMARY_PACKAGE` changes).

use crate::workspace::{cargo_output, root, without_cargos_own_env};
use crate::{chaos, nats_current};
use futures::FutureExt;
use inbox_testkit::Backend;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Jobs running at once. Each test binary runs two tests at a time (libtest's default on this
/// 2-core machine) and spends most of it waiting on servers; more slots made the passes that
/// already ran side by side slower, not the whole run shorter.
const SLOTS: usize = 2;

/// A job that has not finished by then is stopped and counts as failed: a hung test must not
/// hold CI until its own limit.
const JOB_LIMIT: Duration = Duration::from_secs(20 * 60);

/// A test binary `cargo test --no-run` built.
#[derive(Clone, Debug)]
pub struct TestBinary {
    /// The target's name (`inbox_tests`, `credit_processes`, ...).
    name: String,
    /// Its kind as cargo names it (`lib`, `bin`, `test`).
    kind: String,
    /// Its package's directory: its working directory and `CARGO_MANIFEST_DIR`.
    dir: PathBuf,
    /// The executable.
    exe: PathBuf,
}

/// Which nats-server a job talks to, and how the behaviour suite's workers run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// The machine's nats-server, message by message.
    Machine,
    /// The machine's nats-server, every worker of the behaviour suite batched
    /// ([`crate::test::BATCHED_ENV`]).
    Batched,
    /// A private current nats-server ([`nats_current::VERSION`]).
    Current,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Machine => "machine",
            Mode::Batched => "batched",
            Mode::Current => "current",
        }
    }
}

/// What a job does.
enum Work {
    /// Runs a test binary with libtest `args`.
    Binary {
        binary: TestBinary,
        mode: Mode,
        args: Vec<String>,
    },
    /// Runs cargo (the doc tests, which `--no-run` does not build).
    Cargo(Vec<&'static str>),
    /// A short chaos run on one backend and one nats-server.
    Chaos { backend: Backend, current: bool },
}

/// One unit of the run.
struct Job {
    label: String,
    /// Its expected length relative to the others (seconds, roughly, alone on this machine):
    /// the queue starts the longest first, so that no long job starts last.
    weight: u32,
    work: Work,
}

impl Job {
    fn is_chaos(&self) -> bool {
        matches!(self.work, Work::Chaos { .. })
    }
}

/// The jobs not started yet, longest first.
struct Queue {
    jobs: Vec<Job>,
    /// Whether a chaos run is going: one at a time (each keeps three `credit` processes, a
    /// nats-server and a database busy), so that they do not crowd out the tests beside them.
    chaos_running: bool,
}

impl Queue {
    /// The next job a free slot may start: the first, or the first that is not a chaos run
    /// while one is going. None when nothing is left for this slot (the chaos runs left wait for
    /// the one going, in its slot).
    fn take(queue: &std::sync::Mutex<Queue>) -> Option<Job> {
        let mut queue = queue.lock().expect("the queue is never poisoned");
        let chaos_running = queue.chaos_running;
        let at = queue
            .jobs
            .iter()
            .position(|job| !(chaos_running && job.is_chaos()))?;
        let job = queue.jobs.remove(at);
        queue.chaos_running |= job.is_chaos();
        Some(job)
    }
}

/// How a job ended.
struct Outcome {
    label: String,
    took: Duration,
    result: Result<(), String>,
}

/// Runs every job of CI's test run, with `credit` and `email` the binaries the test build made
/// for the chaos runs. Every job runs to its end, so that one failure shows all the others.
pub async fn run_all(
    binaries: &[TestBinary],
    credit: PathBuf,
    email: PathBuf,
) -> Result<(), String> {
    let jobs = plan(binaries)?;
    eprintln!(
        "xtask: {} jobs over {} test binaries, {SLOTS} at a time; logs in {}",
        jobs.len(),
        binaries.len(),
        logs_dir().display()
    );
    std::fs::create_dir_all(logs_dir()).map_err(|e| format!("{}: {e}", logs_dir().display()))?;
    let started = Instant::now();
    let queue = std::sync::Arc::new(std::sync::Mutex::new(Queue {
        jobs,
        chaos_running: false,
    }));
    let lanes = (0..SLOTS).map(|_| {
        let queue = std::sync::Arc::clone(&queue);
        let (credit, email) = (credit.clone(), email.clone());
        async move {
            let mut outcomes = Vec::new();
            while let Some(job) = Queue::take(&queue) {
                let chaos = job.is_chaos();
                let label = job.label.clone();
                // A panic is this job's failure, not the run's end.
                let run = std::panic::AssertUnwindSafe(run_job(job, credit.clone(), email.clone()));
                outcomes.push(run.catch_unwind().await.unwrap_or_else(|_| Outcome {
                    label,
                    took: Duration::ZERO,
                    result: Err("xtask panicked running it".into()),
                }));
                if chaos {
                    queue
                        .lock()
                        .expect("the queue is never poisoned")
                        .chaos_running = false;
                }
            }
            outcomes
        }
    });
    let outcomes: Vec<Outcome> = futures::future::join_all(lanes)
        .await
        .into_iter()
        .flatten()
        .collect();
    summarise(&outcomes, started.elapsed())
}

/// Builds every test of the workspace (`cargo test --workspace --no-run`) and returns the test
/// binaries it made.
pub fn build_tests() -> Result<Vec<TestBinary>, String> {
    let out = cargo_output(
        "building the tests",
        &[
            "test",
            "--workspace",
            "--no-run",
            "--quiet",
            "--message-format=json-render-diagnostics",
        ],
    )?;
    let mut binaries = Vec::new();
    for line in out.lines() {
        let Ok(message) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if message["reason"] != "compiler-artifact" || message["profile"]["test"] != true {
            continue;
        }
        let (Some(exe), Some(manifest), Some(name)) = (
            message["executable"].as_str(),
            message["manifest_path"].as_str(),
            message["target"]["name"].as_str(),
        ) else {
            continue;
        };
        let kind = message["target"]["kind"][0].as_str().unwrap_or("test");
        binaries.push(TestBinary {
            name: name.to_owned(),
            kind: kind.to_owned(),
            dir: Path::new(manifest)
                .parent()
                .ok_or_else(|| format!("cargo named a manifest without a directory: {manifest}"))?
                .to_owned(),
            exe: PathBuf::from(exe),
        });
    }
    if binaries.is_empty() {
        return Err(
            "cargo listed no test binary: `cargo test --workspace --no-run` built none".into(),
        );
    }
    Ok(binaries)
}

/// The jobs, longest first.
fn plan(binaries: &[TestBinary]) -> Result<Vec<Job>, String> {
    let suite_dir = root().join("tests");
    let ui_dir = root().join("ui-tests");
    // Told apart by their package's directory: a build that made neither would leave the
    // batched mode with nothing to run, silently.
    for (dir, what) in [
        (&suite_dir, "the behaviour suite"),
        (&ui_dir, "the UI tests"),
    ] {
        if !binaries.iter().any(|b| b.dir == *dir) {
            return Err(format!(
                "the test build made no binary of {what} (package in {})",
                dir.display()
            ));
        }
    }
    let mut jobs = Vec::new();
    for current in [false, true] {
        for backend in Backend::ALL {
            let nats = if current { "current" } else { "machine" };
            jobs.push(Job {
                label: format!("chaos {nats}: {}", backend.name()),
                weight: 100,
                work: Work::Chaos { backend, current },
            });
        }
    }
    for mode in [Mode::Machine, Mode::Batched, Mode::Current] {
        for binary in binaries {
            let in_suite = binary.dir == suite_dir;
            let skipped = match mode {
                Mode::Machine => false,
                // Batched changes only the behaviour suite's workers.
                Mode::Batched => !in_suite,
                // What talks to NATS: the integration and process tests and the suite; not the
                // unit tests, nor the UI tests (which only compile).
                Mode::Current => binary.dir == ui_dir || (binary.kind != "test" && !in_suite),
            };
            if skipped {
                continue;
            }
            let label = format!("{}: {} {}", mode.name(), binary.kind, binary.name);
            if in_suite && binary.kind == "lib" {
                // The behaviour suite: its tests are named `suite::<behaviour>::<backend>::<test>`.
                for (part, args) in suite_parts() {
                    jobs.push(Job {
                        label: format!("{label} ({part})"),
                        weight: 90,
                        work: Work::Binary {
                            binary: binary.clone(),
                            mode,
                            args,
                        },
                    });
                }
                continue;
            }
            jobs.push(Job {
                label,
                weight: weight(binary, &ui_dir),
                work: Work::Binary {
                    binary: binary.clone(),
                    mode,
                    args: Vec::new(),
                },
            });
        }
    }
    jobs.push(Job {
        label: "machine: doc tests".into(),
        weight: 10,
        work: Work::Cargo(vec!["test", "--workspace", "--doc"]),
    });
    // Stable: among equals, the order above (chaos, then the machine's, batched, current).
    jobs.sort_by_key(|job| std::cmp::Reverse(job.weight));
    Ok(jobs)
}

/// The behaviour suite cut by backend: one part per backend's tests, one for the rest.
fn suite_parts() -> Vec<(String, Vec<String>)> {
    let backends = ["postgres", "postgres_partitioned", "mysql", "sqlite"];
    let mut parts: Vec<(String, Vec<String>)> = backends
        .iter()
        .map(|b| ((*b).to_owned(), vec![format!("::{b}::")]))
        .collect();
    let rest = backends
        .iter()
        .flat_map(|b| ["--skip".to_owned(), format!("::{b}::")])
        .collect();
    parts.push(("the rest".to_owned(), rest));
    parts
}

/// A binary's expected length (seconds alone, roughly): the UI tests compile; the examples'
/// process tests start processes; unit tests take no time.
fn weight(binary: &TestBinary, ui_dir: &Path) -> u32 {
    if binary.kind != "test" {
        1
    } else if binary.dir == *ui_dir {
        100
    } else {
        30
    }
}

/// Where each job's output is kept.
fn logs_dir() -> PathBuf {
    root().join("target/xtask-test")
}

/// Runs `job`, prints its output when it has ended (all of it when it failed, its results when
/// it passed), and says how it went.
async fn run_job(job: Job, credit: PathBuf, email: PathBuf) -> Outcome {
    let started = Instant::now();
    let file_name: String = job
        .label
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let log = logs_dir().join(format!("{file_name}.log"));
    eprintln!("xtask: [{}] started", job.label);
    let result = match job.work {
        Work::Chaos { backend, current } => {
            // In this process: its report goes to our output as it comes.
            let mut options = chaos::Options::short();
            options.common.backends = vec![backend];
            options.common.current_nats = current;
            match tokio::time::timeout(JOB_LIMIT, chaos::run_with(options, &credit, &email)).await {
                Ok(result) => result,
                // Dropped: its processes and servers are killed with their handles.
                Err(_) => Err(format!("still running after {JOB_LIMIT:?}, stopped")),
            }
        }
        Work::Cargo(args) => {
            let mut command = tokio::process::Command::new(crate::workspace::cargo());
            command.args(&args).current_dir(root());
            without_cargos_own_env(command.as_std_mut());
            run_logged(command, &log, &job.label).await
        }
        Work::Binary { binary, mode, args } => {
            run_binary(&binary, mode, &args, &log, &job.label).await
        }
    };
    let took = started.elapsed();
    match &result {
        Ok(()) => eprintln!("xtask: [{}] passed in {took:.1?}", job.label),
        Err(e) => eprintln!("xtask: [{}] FAILED in {took:.1?}: {e}", job.label),
    }
    Outcome {
        label: job.label,
        took,
        result,
    }
}

/// Runs `binary` with libtest `args` in `mode`, as `cargo test` would run it.
async fn run_binary(
    binary: &TestBinary,
    mode: Mode,
    args: &[String],
    log: &Path,
    label: &str,
) -> Result<(), String> {
    let mut command = tokio::process::Command::new(&binary.exe);
    command.args(args).current_dir(&binary.dir);
    without_cargos_own_env(command.as_std_mut());
    command
        .env("CARGO_MANIFEST_DIR", &binary.dir)
        .env("CARGO", crate::workspace::cargo());
    let mut server = None;
    match mode {
        Mode::Machine => {}
        Mode::Batched => {
            let (name, value) = crate::test::BATCHED_ENV;
            command.env(name, value);
        }
        Mode::Current => {
            let (nats, env) = nats_current::private_server().await?;
            command.envs(env);
            server = Some(nats);
        }
    }
    let result = run_logged(command, log, label).await;
    drop(server);
    result
}

/// Runs `command` with its output in `log`, then prints that output (whole when it failed).
async fn run_logged(
    mut command: tokio::process::Command,
    log: &Path,
    label: &str,
) -> Result<(), String> {
    let file = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = file
        .try_clone()
        .map_err(|e| format!("{}: {e}", log.display()))?;
    command
        .stdin(std::process::Stdio::null())
        .stdout(file)
        .stderr(err)
        .kill_on_drop(true);
    let mut child = command
        .spawn()
        .map_err(|e| format!("cannot start {label}: {e}"))?;
    let status = match tokio::time::timeout(JOB_LIMIT, child.wait()).await {
        Ok(status) => Some(status.map_err(|e| format!("waiting for {label}: {e}"))?),
        Err(_) => {
            // With what it started (servers, example processes), which would hold ports and
            // CPU for the rest of the run.
            if let Some(pid) = child.id() {
                kill_tree(pid);
            }
            let _ = child.kill().await;
            None
        }
    };
    // Lossy: one byte that is not UTF-8 must not hide a failure's output.
    let output = String::from_utf8_lossy(&std::fs::read(log).unwrap_or_default()).into_owned();
    let passed = status.is_some_and(|s| s.success());
    let shown: String = if passed {
        output
            .lines()
            .filter(|l| l.starts_with("test result:") || l.starts_with("running "))
            .map(|l| format!("{l}\n"))
            .collect()
    } else {
        output
    };
    // One write, so that the jobs beside it do not cut into it.
    print!("\n==== {label}\n{shown}");
    match status {
        Some(s) if s.success() => Ok(()),
        Some(s) => Err(format!("{s}; its output is above and in {}", log.display())),
        None => Err(format!(
            "still running after {JOB_LIMIT:?}, stopped; its output is above and in {}",
            log.display()
        )),
    }
}

/// Kills `pid` and every process under it (Linux: read from `/proc`; elsewhere only `pid`,
/// which the caller kills).
fn kill_tree(pid: u32) {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    // Each process's parent: the fourth field of /proc/PID/stat, after the command's ")".
    let parents: Vec<(u32, u32)> = entries
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            let after = &stat[stat.rfind(')')? + 1..];
            let parent = after.split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, parent))
        })
        .collect();
    let mut tree = vec![pid];
    let mut at = 0;
    while at < tree.len() {
        let parent = tree[at];
        tree.extend(
            parents
                .iter()
                .filter(|(_, p)| *p == parent)
                .map(|(c, _)| *c),
        );
        at += 1;
    }
    let pids: Vec<String> = tree.iter().map(u32::to_string).collect();
    let _ = std::process::Command::new("kill")
        .arg("-KILL")
        .args(&pids)
        .status();
}

/// Prints each job's time, longest first, and the failures; fails when any job failed.
fn summarise(outcomes: &[Outcome], took: Duration) -> Result<(), String> {
    let mut by_time: Vec<&Outcome> = outcomes.iter().collect();
    by_time.sort_by_key(|o| std::cmp::Reverse(o.took));
    println!("\n==== jobs, longest first ({took:.0?} in all)");
    for o in &by_time {
        let state = if o.result.is_ok() { "ok" } else { "FAILED" };
        println!("{:>8.1?}  {state:6}  {}", o.took, o.label);
    }
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| o.result.is_err()).collect();
    if failed.is_empty() {
        return Ok(());
    }
    println!("\n==== failed jobs");
    for o in &failed {
        println!(
            "{}: {}",
            o.label,
            o.result.as_ref().err().map_or("", String::as_str)
        );
    }
    Err(format!(
        "{} of {} jobs failed: {}",
        failed.len(),
        outcomes.len(),
        failed
            .iter()
            .map(|o| o.label.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;

    /// Whether `pid` is gone or dead (a zombie nobody reaped yet).
    fn dead(pid: u32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
            stat[stat.rfind(')').map_or(0, |i| i + 1)..]
                .split_whitespace()
                .next()
                .is_some_and(|state| state == "Z" || state == "X")
        })
    }

    #[test]
    fn kill_tree_kills_what_the_process_started() {
        let mut shell = std::process::Command::new("sh")
            .args(["-c", "sleep 300 & echo $!; wait"])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("sh");
        let mut line = String::new();
        std::io::BufReader::new(shell.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("the sleep's pid");
        let sleep: u32 = line.trim().parse().expect("a pid");
        assert!(!dead(sleep), "the sleep runs");
        kill_tree(shell.id());
        assert!(!shell.wait().expect("sh ends").success());
        let deadline = Instant::now() + Duration::from_secs(30);
        while !dead(sleep) {
            assert!(Instant::now() < deadline, "the sleep {sleep} still runs");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    #[test]
    fn the_suite_parts_cover_each_backend_once_and_the_rest() {
        let parts = suite_parts();
        let matched = |name: &str| {
            parts
                .iter()
                .filter(|(_, args)| {
                    let skips: Vec<&String> = args
                        .iter()
                        .skip_while(|a| *a != "--skip")
                        .filter(|a| *a != "--skip")
                        .collect();
                    let filters: Vec<&String> =
                        args.iter().take_while(|a| *a != "--skip").collect();
                    (filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str())))
                        && !skips.iter().any(|s| name.contains(s.as_str()))
                })
                .count()
        };
        for name in [
            "suite::outbox::postgres::commit_wakes_the_relay",
            "suite::outbox::postgres_partitioned::commit_wakes_the_relay",
            "suite::outbox::mysql::commit_wakes_the_relay",
            "suite::outbox::sqlite::commit_wakes_the_relay",
            "backends::tests::something_else",
        ] {
            assert_eq!(matched(name), 1, "{name}");
        }
    }
}
