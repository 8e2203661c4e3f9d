//! `credit` never prints a credential: with a password or token in `NATS_URL` or `DATABASE_URL`,
//! neither its log (stderr, at `debug`, where async-nats writes server addresses with their
//! password) nor its stdout holds the secret, while the messages name the URL with the secret
//! masked. The services are down (closed ports) or the URL is malformed, so that `credit` says
//! what it cannot reach or parse: the place a URL is most likely to be echoed.

use inbox_testkit::{PrivateNats, unique, wait_until};
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;
use tokio::process::{Child, Command};

/// A loopback port nothing listens on (a privileged one, never bound in tests).
const CLOSED: &str = "127.0.0.1:1";
/// How long `credit` may take to log, or to exit.
const DEADLINE: Duration = Duration::from_secs(60);

/// A secret that cannot appear in a log by chance.
fn secret() -> String {
    unique("s3cret")
}

/// A `credit` process whose stdout and stderr go to files of its own, removed on drop.
struct Credit {
    child: Child,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl Credit {
    /// Starts `credit` on `nats_url` and `database_url`, logging at `debug`.
    fn spawn(nats_url: &str, database_url: &str) -> Credit {
        Credit::spawn_with(nats_url, database_url, |c| c)
    }

    /// [`Credit::spawn`], its command changed by `adjust` first.
    fn spawn_with(
        nats_url: &str,
        database_url: &str,
        adjust: impl FnOnce(&mut Command) -> &mut Command,
    ) -> Credit {
        let name = unique("credit-redacts-");
        let stdout = std::env::temp_dir().join(format!("{name}.out"));
        let stderr = std::env::temp_dir().join(format!("{name}.err"));
        let file = |path: &PathBuf| {
            std::fs::File::create(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        };
        let mut command = Command::new(env!("CARGO_BIN_EXE_credit"));
        command
            .env("NATS_URL", nats_url)
            .env("DATABASE_URL", database_url)
            .env("CREDIT_STREAM", unique("REDACT_"))
            .env("CREDIT_SUBJECT", format!("{}.credits", unique("redact")))
            .env("CREDIT_CONSUMER", "redact")
            .env("RUST_LOG", "debug")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::from(file(&stdout)))
            .stderr(Stdio::from(file(&stderr)))
            .kill_on_drop(true);
        let child = adjust(&mut command).spawn().expect("start credit");
        Credit {
            child,
            stdout,
            stderr,
        }
    }

    /// What it wrote to stderr so far.
    fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// What it wrote to stdout so far.
    fn out(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
    }

    /// Waits until its log holds `text`.
    async fn logged(&self, text: &str) {
        wait_until(&format!("credit to log {text:?}"), DEADLINE, async || {
            self.log().contains(text)
        })
        .await
        .unwrap_or_else(|e| panic!("{e}; its log:\n{}", self.log()));
    }

    /// SIGTERM, as an operator stops it.
    fn sigterm(&self) {
        let pid = self.child.id().expect("credit has already exited");
        inbox_testkit::terminate(pid).unwrap_or_else(|e| panic!("{e}"));
    }

    /// Waits for it to exit.
    async fn exited(&mut self) -> ExitStatus {
        tokio::time::timeout(DEADLINE, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("credit did not exit within {DEADLINE:?}:\n{}", self.log()))
            .expect("wait for credit")
    }

    /// Asserts that none of `secrets` is in its stdout or stderr, and that its log shows `shown`.
    fn assert_redacted(&self, secrets: &[&str], shown: &str) {
        let (out, log) = (self.out(), self.log());
        for secret in secrets {
            assert!(
                !out.contains(secret) && !log.contains(secret),
                "credit printed the secret {secret:?}; stdout:\n{out}\nstderr:\n{log}"
            );
        }
        assert!(
            log.contains(shown),
            "the log does not name {shown:?}:\n{log}"
        );
    }
}

impl Drop for Credit {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.stdout);
        let _ = std::fs::remove_file(&self.stderr);
    }
}

/// NATS down, its URL with a user and password, then with a token: the retry line names the
/// server with the credential masked; after SIGTERM, `credit` exits cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_password_and_token_are_never_printed() {
    let db_password = secret();
    let database_url = format!("postgres://postgres:{db_password}@{CLOSED}/test");
    let (password, token) = (secret(), secret());
    let cases = [
        (
            format!("nats://credit:{password}@{CLOSED}"),
            &password,
            format!("nats://credit:***@{CLOSED}"),
        ),
        (
            format!("nats://{token}@{CLOSED}"),
            &token,
            format!("nats://***@{CLOSED}"),
        ),
    ];
    for (nats_url, secret, shown) in cases {
        let mut credit = Credit::spawn(&nats_url, &database_url);
        credit.logged("NATS is not reachable").await;
        credit.sigterm();
        let status = credit.exited().await;
        assert!(status.success(), "{status}:\n{}", credit.log());
        assert!(credit.out().contains("credit stopped:"), "{}", credit.out());
        credit.assert_redacted(&[secret, &db_password], &shown);
    }
}

/// The database down (NATS up, a private server), its password in the user info or in the
/// query: the retry line names the database with the password masked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_password_is_never_printed() {
    let nats = PrivateNats::start().await.unwrap_or_else(|e| panic!("{e}"));
    let password = secret();
    let cases = [
        (
            format!("postgres://postgres:{password}@{CLOSED}/test"),
            format!("postgres://postgres:***@{CLOSED}/test"),
        ),
        (
            format!("mysql://root:{password}@{CLOSED}/test"),
            format!("mysql://root:***@{CLOSED}/test"),
        ),
        (
            format!("postgres://postgres@{CLOSED}/test?password={password}"),
            format!("postgres://postgres@{CLOSED}/test?password=***"),
        ),
    ];
    for (database_url, shown) in cases {
        let mut credit = Credit::spawn(&nats.url, &database_url);
        credit.logged("the database is not reachable").await;
        credit.sigterm();
        let status = credit.exited().await;
        assert!(status.success(), "{status}:\n{}", credit.log());
        credit.assert_redacted(&[&password], &shown);
    }
}

/// A URL that does not parse (a port that is not a number): `credit` stops with an error naming
/// what follows the last `@` only, since where the password ends cannot be told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_urls_are_never_printed_with_their_secret() {
    let nats = PrivateNats::start().await.unwrap_or_else(|e| panic!("{e}"));
    let password = secret();
    let cases = [
        (
            nats.url.clone(),
            format!("postgres://postgres:{password}@127.0.0.1:notaport/test"),
            "DATABASE_URL postgres://***@127.0.0.1:notaport/test".to_owned(),
        ),
        (
            format!("nats://credit:{password}@127.0.0.1:notaport"),
            format!("postgres://postgres@{CLOSED}/test"),
            "NATS at nats://***@127.0.0.1:notaport".to_owned(),
        ),
    ];
    for (nats_url, database_url, shown) in cases {
        let mut credit = Credit::spawn(&nats_url, &database_url);
        let status = credit.exited().await;
        assert!(!status.success(), "credit accepted a malformed URL");
        credit.assert_redacted(&[&password], &shown);
    }
}

/// A log that goes to a file (or a pipe, a log collector) holds no ANSI colour codes, also
/// without `NO_COLOR`: only a terminal gets colours.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_to_a_file_has_no_colour_codes() {
    let database_url = format!("postgres://postgres@{CLOSED}/test");
    let mut credit = Credit::spawn_with(&format!("nats://{CLOSED}"), &database_url, |c| {
        c.env_remove("NO_COLOR")
    });
    credit.logged("NATS is not reachable").await;
    credit.sigterm();
    let status = credit.exited().await;
    assert!(status.success(), "{status}:\n{}", credit.log());
    let log = credit.log();
    assert!(
        !log.contains('\u{1b}'),
        "the log holds ANSI escape codes:\n{}",
        log.escape_debug()
    );
}
