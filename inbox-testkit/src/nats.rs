//! NATS for tests: a private `nats-server`, connecting with an error that names the server,
//! publishing and awaiting every PubAck (counted, or kept to know where each message was
//! stored), whether a process's consumer is ready, and a consumer's backlog.

use crate::wait_until;
use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::PullConsumer, publish::PublishAck};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A `nats-server` of one's own (`nats-server` on `PATH`, in `/usr/sbin` or `/usr/local/sbin`)
/// with JetStream, on a free loopback port and a temporary store, so that it can be killed and
/// restarted without touching the shared server. Killed, and its store removed, when dropped.
#[derive(Debug)]
pub struct PrivateNats {
    /// `nats://127.0.0.1:<port>`.
    pub url: String,
    /// The port it listens on, the same across restarts.
    pub port: u16,
    binary: PathBuf,
    /// Removed when dropped.
    store: tempfile::TempDir,
    /// A configuration file (`-c`), when started with one.
    config: Option<PathBuf>,
    child: Option<Child>,
}

/// The environment variable that names the `nats-server` binary private servers run (`cargo
/// xtask test` sets it to run the tests on a current release too); by default the one on `PATH`,
/// in `/usr/sbin` or in `/usr/local/sbin`.
pub const NATS_SERVER_ENV: &str = "INBOX_NATS_SERVER";

/// The `nats-server` binary private servers run: see [`NATS_SERVER_ENV`].
pub fn nats_server_binary() -> Result<PathBuf, String> {
    if let Some(binary) = std::env::var_os(NATS_SERVER_ENV) {
        let binary = PathBuf::from(binary);
        return if binary.is_file() {
            Ok(binary)
        } else {
            Err(format!(
                "{NATS_SERVER_ENV}={} is not a file",
                binary.display()
            ))
        };
    }
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
        .map(|dir| dir.join("nats-server"))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            "no nats-server binary (Debian: `apt-get install nats-server`; see CONTRIBUTING.md)"
                .to_owned()
        })
}

impl PrivateNats {
    /// Starts a server ([`nats_server_binary`]) and waits until it answers; fails when there is
    /// no `nats-server` binary.
    pub async fn start() -> Result<PrivateNats, String> {
        Self::start_binary(nats_server_binary()?).await
    }

    /// Starts the server `binary` and waits until it answers.
    pub async fn start_binary(binary: PathBuf) -> Result<PrivateNats, String> {
        Self::start_configured(binary, None).await
    }

    /// Starts a server ([`nats_server_binary`]) with the configuration file `config` (its
    /// text: `authorization { .. }`, say) besides the port, store and JetStream.
    pub async fn start_with_config(config: &str) -> Result<PrivateNats, String> {
        Self::start_configured(nats_server_binary()?, Some(config)).await
    }

    /// Starts the server `binary` with the configuration file `config` besides the port, store
    /// and JetStream.
    pub async fn start_binary_with_config(
        binary: PathBuf,
        config: &str,
    ) -> Result<PrivateNats, String> {
        Self::start_configured(binary, Some(config)).await
    }

    async fn start_configured(
        binary: PathBuf,
        config: Option<&str>,
    ) -> Result<PrivateNats, String> {
        let port = free_port()?;
        let store = tempfile::Builder::new()
            .prefix("inbox-nats-")
            .tempdir()
            .map_err(|e| format!("a temporary directory for nats-server: {e}"))?;
        let config = match config {
            None => None,
            Some(text) => {
                let path = store.path().join("nats-server.conf");
                std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
                Some(path)
            }
        };
        let mut nats = PrivateNats {
            url: format!("nats://127.0.0.1:{port}"),
            port,
            binary,
            store,
            config,
            child: None,
        };
        nats.restart().await?;
        Ok(nats)
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Kills the server at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server if it runs, starts it again on the same port and store, and waits (up to
    /// 30 s) until it answers.
    pub async fn restart(&mut self) -> Result<(), String> {
        self.kill();
        let mut command = Command::new(&self.binary);
        if let Some(config) = &self.config {
            command.arg("-c").arg(config);
        }
        let child = command
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            // The store proper, beside the configuration file.
            .arg(self.store.path().join("jetstream"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.binary.display()))?;
        self.child = Some(child);
        let addr = format!("127.0.0.1:{}", self.port);
        let what = format!("the private nats-server to answer on {addr}");
        wait_until(&what, Duration::from_secs(30), async || {
            tokio::net::TcpStream::connect(&addr).await.is_ok()
        })
        .await
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A free loopback port, as the system hands them out.
pub(crate) fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free loopback port: {e}"))
}

/// Connects to the NATS server at `url` (5 s timeout); the error names the server.
pub async fn connect(url: &str) -> Result<async_nats::Client, String> {
    async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .map_err(|e| format!("NATS is not reachable at {url}: {e} (start it; see CONTRIBUTING.md)"))
}

/// Waits (60 s at most) until `durable` exists on `stream`: the sign that a process which gets or
/// creates the stream, then the consumer, has its stream taking messages. The stream alone is not:
/// nats-server before 2.10 answers `STREAM.INFO` for a stream it is still setting up, before it
/// listens on the stream's subjects, and a publish in that window gets no responders.
pub async fn consumer_ready(
    js: &jetstream::Context,
    stream: &str,
    durable: &str,
) -> Result<(), String> {
    wait_until(
        &format!("consumer {durable} on stream {stream}"),
        Duration::from_secs(60),
        async || {
            js.get_consumer_from_stream::<jetstream::consumer::pull::Config, _, _>(durable, stream)
                .await
                .is_ok()
        },
    )
    .await
}

/// One message to publish: a payload and, optionally, headers (such as `Nats-Msg-Id`).
#[derive(Debug, Clone, Default)]
pub struct Outgoing {
    /// The payload.
    pub payload: Vec<u8>,
    /// Headers, when any.
    pub headers: Option<HeaderMap>,
}

impl Outgoing {
    /// `payload` with a `Nats-Msg-Id` header: the broker drops a second copy within its
    /// duplicate window.
    pub fn with_msg_id(payload: Vec<u8>, msg_id: &str) -> Outgoing {
        let mut headers = HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, msg_id);
        Outgoing {
            payload,
            headers: Some(headers),
        }
    }
}

impl From<Vec<u8>> for Outgoing {
    fn from(payload: Vec<u8>) -> Outgoing {
        Outgoing {
            payload,
            headers: None,
        }
    }
}

/// How many publishes are in flight at most before their PubAcks are awaited.
const IN_FLIGHT: usize = 1_000;

/// Publishes every message to `subject`, awaiting every PubAck (so that all are stored when it
/// returns); returns how many were published.
pub async fn publish_and_wait<I>(
    js: &jetstream::Context,
    subject: &str,
    messages: I,
) -> Result<usize, String>
where
    I: IntoIterator,
    I::Item: Into<Outgoing>,
{
    Ok(publish_acked(js, subject, messages).await?.len())
}

/// [`publish_and_wait`], returning every PubAck in the order of `messages`: where each message
/// was stored (stream and sequence) and whether the broker dropped it as a duplicate.
pub async fn publish_acked<I>(
    js: &jetstream::Context,
    subject: &str,
    messages: I,
) -> Result<Vec<PublishAck>, String>
where
    I: IntoIterator,
    I::Item: Into<Outgoing>,
{
    let mut published = Vec::new();
    let mut acks = Vec::with_capacity(IN_FLIGHT);
    for m in messages {
        let m: Outgoing = m.into();
        let subject = subject.to_owned();
        let ack = match m.headers {
            Some(headers) => {
                js.publish_with_headers(subject, headers, m.payload.into())
                    .await
            }
            None => js.publish(subject, m.payload.into()).await,
        };
        acks.push(ack.map_err(|e| format!("publish: {e}"))?);
        if acks.len() == IN_FLIGHT {
            await_acks(&mut acks, &mut published).await?;
        }
    }
    await_acks(&mut acks, &mut published).await?;
    Ok(published)
}

/// Awaits the PubAcks of `acks` in order, appending them to `published`.
async fn await_acks(
    acks: &mut Vec<jetstream::context::PublishAckFuture>,
    published: &mut Vec<PublishAck>,
) -> Result<(), String> {
    for ack in acks.drain(..) {
        published.push(ack.await.map_err(|e| format!("publish ack: {e}"))?);
    }
    Ok(())
}

/// What a consumer still has to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backlog {
    /// Messages not yet delivered.
    pub pending: u64,
    /// Messages delivered and not yet acked.
    pub ack_pending: usize,
}

impl Backlog {
    /// Nothing pending and nothing awaiting an ack.
    pub fn drained(&self) -> bool {
        self.pending == 0 && self.ack_pending == 0
    }
}

/// The backlog of the durable consumer `durable` on `stream`, from the server.
pub async fn backlog(
    js: &jetstream::Context,
    stream: &str,
    durable: &str,
) -> Result<Backlog, String> {
    let stream = js
        .get_stream(stream)
        .await
        .map_err(|e| format!("stream {stream}: {e}"))?;
    let mut consumer: PullConsumer = stream
        .get_consumer(durable)
        .await
        .map_err(|e| format!("consumer {durable}: {e}"))?;
    let info = consumer
        .info()
        .await
        .map_err(|e| format!("consumer {durable} info: {e}"))?;
    Ok(Backlog {
        pending: info.num_pending,
        ack_pending: info.num_ack_pending,
    })
}
