//! Publishing over the NATS wire protocol itself, as producers in other languages (or raw
//! connections) write it: header names exactly as given, status lines, bytes async-nats would refuse.

use std::time::Duration;

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
