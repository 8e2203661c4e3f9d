//! NATS for tests: a private `nats-server`, connecting with an error that names the server,
//! publishing and awaiting every PubAck (counted, or kept to know where each message was
//! stored), and a consumer's backlog.

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

/// What a raw connection says first: headers on, no `+OK` after every command.
const CONNECT: &str =
    "CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true,\"protocol\":1}\r\n";

/// Publishes `payload` to `subject` with `headers` over the NATS wire protocol itself (`HPUB`),
/// as a producer in another language writes it: header names exactly as given (nats-py sends its
/// dict's keys as written, Go's `nats.Header` canonicalises them, the `nats` CLI passes what it
/// is told), no `Nats-Msg-Id` unless given. Waits for the server's `PONG`, so that the message
/// has been processed by the server (and stored, for a stream's subject) when this returns.
pub async fn publish_raw(
    url: &str,
    subject: &str,
    headers: &[(&str, &str)],
    payload: &[u8],
) -> Result<(), String> {
    let lines: Vec<Vec<u8>> = headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}").into_bytes())
        .collect();
    publish_raw_lines(url, subject, &lines, payload).await
}

/// [`publish_raw`] with each header line given as bytes (`name: value`, without the CRLF): any
/// bytes a raw connection can send, such as a header name with a non-ASCII or control byte, or
/// a value that is not UTF-8, which nats-server stores as they are.
pub async fn publish_raw_lines(
    url: &str,
    subject: &str,
    lines: &[Vec<u8>],
    payload: &[u8],
) -> Result<(), String> {
    publish_frame(url, hpub(subject, None, lines, payload)).await
}

/// [`publish_raw_lines`] with a status after the header block's version (`NATS/1.0 503`, say),
/// as a raw producer can write it: the server stores it as it is, and a client reading the
/// delivery sees a status, as it does on the server's own status messages.
pub async fn publish_raw_status(
    url: &str,
    subject: &str,
    status: &str,
    lines: &[Vec<u8>],
    payload: &[u8],
) -> Result<(), String> {
    let version = format!("NATS/1.0 {status}");
    let frame = hpub_with(version.as_bytes(), subject, None, lines, payload);
    publish_frame(url, frame).await
}

/// Sends `hpub` (a whole `HPUB` frame) on a raw connection of its own, and waits for the
/// server's `PONG` to the `PING` after it.
async fn publish_frame(url: &str, hpub: Vec<u8>) -> Result<(), String> {
    let mut conn = RawConnection::open(url).await?;
    let mut frame = CONNECT.as_bytes().to_vec();
    frame.extend(hpub);
    frame.extend_from_slice(b"PING\r\n");
    conn.send(&frame).await?;
    loop {
        match conn.line().await?.as_str() {
            "PONG" => return Ok(()),
            l if l.starts_with("-ERR") => return Err(format!("NATS refused the HPUB: {l}")),
            _ => {}
        }
    }
}

/// [`publish_raw_lines`] to a stream's subject, returning the stream sequence from JetStream's
/// PubAck.
pub async fn publish_raw_acked(
    url: &str,
    subject: &str,
    lines: &[Vec<u8>],
    payload: &[u8],
) -> Result<u64, String> {
    let inbox = format!("_INBOX.raw.{}", uuid::Uuid::new_v4().simple());
    let mut conn = RawConnection::open(url).await?;
    let mut frame = format!("{CONNECT}SUB {inbox} 1\r\n").into_bytes();
    frame.extend(hpub(subject, Some(&inbox), lines, payload));
    frame.extend_from_slice(b"PING\r\n");
    conn.send(&frame).await?;
    let ack = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let line = conn.line().await?;
            match line.split_whitespace().collect::<Vec<_>>()[..] {
                ["MSG", _, "1", size] | ["MSG", _, "1", _, size] => {
                    let size: usize = size.parse().map_err(|_| format!("NATS sent {line:?}"))?;
                    return conn.exact(size).await;
                }
                ["PING"] => conn.send(b"PONG\r\n").await?,
                [l, ..] if l.starts_with("-ERR") => {
                    return Err(format!("NATS refused the HPUB: {line}"));
                }
                _ => {}
            }
        }
    })
    .await
    .map_err(|_| format!("no PubAck within 10 s for the raw publish to {subject}"))??;
    let ack: serde_json::Value = serde_json::from_slice(&ack)
        .map_err(|e| format!("PubAck {:?}: {e}", String::from_utf8_lossy(&ack)))?;
    ack["seq"]
        .as_u64()
        .filter(|_| ack.get("error").is_none())
        .ok_or_else(|| format!("JetStream did not store the raw publish to {subject}: {ack}"))
}

/// `HPUB <subject> [<reply>] <header bytes> <total bytes>`, the header block (`NATS/1.0`, each
/// line, a blank line) and the payload.
fn hpub(subject: &str, reply: Option<&str>, lines: &[Vec<u8>], payload: &[u8]) -> Vec<u8> {
    hpub_with(b"NATS/1.0", subject, reply, lines, payload)
}

/// [`hpub`] with the header block's first line `version`.
fn hpub_with(
    version: &[u8],
    subject: &str,
    reply: Option<&str>,
    lines: &[Vec<u8>],
    payload: &[u8],
) -> Vec<u8> {
    let mut head = version.to_vec();
    head.extend_from_slice(b"\r\n");
    for line in lines {
        head.extend_from_slice(line);
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(b"\r\n");
    let reply = reply.map_or(String::new(), |r| format!("{r} "));
    let mut frame = format!(
        "HPUB {subject} {reply}{} {}\r\n",
        head.len(),
        head.len() + payload.len()
    )
    .into_bytes();
    frame.extend(head);
    frame.extend_from_slice(payload);
    frame.extend_from_slice(b"\r\n");
    frame
}

/// A NATS connection spoken by hand: the server's `INFO` read, then lines and payloads.
struct RawConnection {
    reader: tokio::io::BufReader<tokio::net::TcpStream>,
    address: String,
}

impl RawConnection {
    /// Connects to `url` (`nats://host:port`) and reads the server's `INFO`.
    async fn open(url: &str) -> Result<RawConnection, String> {
        let address = url.trim_start_matches("nats://").to_owned();
        let stream = tokio::net::TcpStream::connect(&address)
            .await
            .map_err(|e| format!("NATS at {address} is not reachable: {e}"))?;
        let mut conn = RawConnection {
            reader: tokio::io::BufReader::new(stream),
            address,
        };
        let info = conn.line().await?;
        if !info.starts_with("INFO ") {
            return Err(format!(
                "NATS at {} sent {info:?} instead of INFO",
                conn.address
            ));
        }
        Ok(conn)
    }

    /// Writes `bytes`.
    async fn send(&mut self, bytes: &[u8]) -> Result<(), String> {
        use tokio::io::AsyncWriteExt;
        self.reader
            .get_mut()
            .write_all(bytes)
            .await
            .map_err(|e| format!("NATS at {}: {e}", self.address))
    }

    /// The next line the server sends, without its CRLF.
    async fn line(&mut self) -> Result<String, String> {
        use tokio::io::AsyncBufReadExt;
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .await
            .map_err(|e| format!("NATS at {}: {e}", self.address))?;
        if n == 0 {
            return Err(format!("NATS at {} closed the connection", self.address));
        }
        Ok(line.trim_end().to_owned())
    }

    /// The next `size` bytes (a message's payload) and the CRLF after them.
    async fn exact(&mut self, size: usize) -> Result<Vec<u8>, String> {
        use tokio::io::AsyncReadExt;
        let mut payload = vec![0; size + 2];
        self.reader
            .read_exact(&mut payload)
            .await
            .map_err(|e| format!("NATS at {}: {e}", self.address))?;
        payload.truncate(size);
        Ok(payload)
    }
}
