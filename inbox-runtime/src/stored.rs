//! A message as its stream stores it, read by sequence through JetStream's JSON API
//! (`STREAM.MSG.GET`), with its header block kept as the bytes the producer sent.
//!
//! Why not async-nats's `get_raw_message` or a direct get: both parse the header block with the
//! client's own rules (and a direct get's reply carries the stored headers as the reply's own,
//! which the connection parses), so a header the client cannot read (a non-ASCII or control byte
//! in a name, a value that is not UTF-8: nats-server stores these from any producer) fails the
//! read, or drops the connection. In the JSON API's answer the header block is base64 inside the
//! payload, which nothing parses but us: [`StoredMessage::headers`] keeps what the client can
//! read and sets the rest aside, byte for byte.
//!
//! Public for operators' tools (the `inbox` command reads the dead-letter stream with it): a
//! stream's messages read one after another, whatever header bytes their producers sent.
//!
//! ```no_run
//! # async fn letters(js: async_nats::jetstream::Context) -> Result<(), async_nats::Error> {
//! use inbox_runtime::stored::{Lookup, read};
//! let mut seq = 1;
//! while let Some(message) = read(&js, "INBOX_DLQ", Lookup::NextBySubject(seq, "inbox.dlq.>")).await? {
//!     let headers = message.headers();
//!     println!("{} {} ({} lines unreadable)", message.sequence, message.subject,
//!         headers.unreadable.len());
//!     seq = message.sequence + 1;
//! }
//! # Ok(())
//! # }
//! ```

use async_nats::jetstream::{self, response::Response};
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::time::{Duration, SystemTime};

/// JetStream's error code for "no message found".
const NO_MESSAGE_FOUND: u64 = 10037;
/// JetStream's error code for "stream not found".
const STREAM_NOT_FOUND: u64 = 10059;

/// A stored message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredMessage {
    /// The subject it was published to.
    pub subject: String,
    /// Its stream sequence.
    pub sequence: u64,
    /// Its header block as stored (`NATS/1.0\r\n` and the lines), when it has one.
    pub header_block: Option<Bytes>,
    /// Its payload.
    pub payload: Bytes,
    /// When the stream stored it.
    pub published: SystemTime,
}

/// Which message to read.
#[derive(Debug, Clone, Copy)]
pub enum Lookup<'a> {
    /// The message with this sequence.
    Sequence(u64),
    /// The first message at or after this sequence on a subject matching the filter.
    NextBySubject(u64, &'a str),
}

#[derive(Serialize)]
struct Request<'a> {
    seq: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    next_by_subj: Option<&'a str>,
}

#[derive(Deserialize)]
struct Answer {
    message: Raw,
}

#[derive(Deserialize)]
struct Raw {
    subject: String,
    seq: u64,
    #[serde(default)]
    hdrs: Option<String>,
    #[serde(default)]
    data: Option<String>,
    time: String,
}

/// Reads one message of `stream`; `None` when there is none (deleted, removed by the stream's
/// limits, no later message on the subject, or no such stream any more).
pub async fn read(
    js: &jetstream::Context,
    stream: &str,
    lookup: Lookup<'_>,
) -> Result<Option<StoredMessage>, async_nats::Error> {
    let request = match lookup {
        Lookup::Sequence(seq) => Request {
            seq,
            next_by_subj: None,
        },
        Lookup::NextBySubject(seq, subject) => Request {
            seq,
            next_by_subj: Some(subject),
        },
    };
    let subject = format!("STREAM.MSG.GET.{stream}");
    let answer: Response<Answer> = js.request(subject, &request).await?;
    let raw = match answer {
        Response::Ok(answer) => answer.message,
        Response::Err { error }
            if matches!(error.error_code().0, NO_MESSAGE_FOUND | STREAM_NOT_FOUND) =>
        {
            return Ok(None);
        }
        Response::Err { error } => {
            return Err(format!("reading message of stream {stream:?}: {error}").into());
        }
    };
    let decode = |b64: Option<String>| -> Result<Option<Bytes>, async_nats::Error> {
        match b64 {
            None => Ok(None),
            Some(text) => Ok(Some(Bytes::from(STANDARD.decode(text)?))),
        }
    };
    let published =
        time::OffsetDateTime::parse(&raw.time, &time::format_description::well_known::Rfc3339)
            .map_err(|e| format!("the stored time {:?} of message {}: {e}", raw.time, raw.seq))?;
    let nanos = published.unix_timestamp_nanos();
    let published = match u64::try_from(nanos) {
        Ok(n) => SystemTime::UNIX_EPOCH + Duration::from_nanos(n),
        Err(_) => SystemTime::UNIX_EPOCH,
    };
    Ok(Some(StoredMessage {
        subject: raw.subject,
        sequence: raw.seq,
        header_block: decode(raw.hdrs)?.filter(|h| !h.is_empty()),
        payload: decode(raw.data)?.unwrap_or_default(),
        published,
    }))
}

/// A header block read line by line: what the Rust client can read, and the lines it cannot.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Headers {
    /// The headers the client reads as it would on a delivery.
    pub readable: HeaderMap,
    /// Every header line it cannot read (with its continuation lines), as stored.
    pub unreadable: Vec<Bytes>,
}

impl StoredMessage {
    /// The message's headers, split into what the client can read and what it cannot.
    pub fn headers(&self) -> Headers {
        self.header_block
            .as_deref()
            .map(split_headers)
            .unwrap_or_default()
    }
}

/// Splits a stored header block (`NATS/1.0\r\n`, then `name: value` lines, a line that starts with
/// whitespace continuing the one before) as async-nats reads it (its `connection.rs`): lines
/// split at LF with a trailing CR dropped, a continuation being a line that starts with any
/// Unicode whitespace, the value trimmed at its start before the continuations are appended as
/// they are, and at its end after. A line with a name and value the client accepts is readable;
/// any other is kept as it is stored, and so is a first line that is not the version line.
pub(crate) fn split_headers(block: &[u8]) -> Headers {
    let mut headers = Headers::default();
    let mut lines = block
        .split(|&b| b == b'\n')
        .map(|line| line.strip_suffix(b"\r").unwrap_or(line))
        .peekable();
    // The version line (`NATS/1.0`, with a status on a server's own messages).
    if lines.next_if(|l| l.starts_with(b"NATS/1.0")).is_none() {
        // No version line: the client would read none of it; everything is kept as stored.
        headers
            .unreadable
            .extend(lines.filter(|l| !l.is_empty()).map(Bytes::copy_from_slice));
        return headers;
    }
    while let Some(line) = lines.next() {
        if line.is_empty() {
            continue;
        }
        let mut segments = vec![line];
        while let Some(more) = lines.next_if(|l| continues(l)) {
            segments.push(more);
        }
        match readable(&segments) {
            Some((name, value)) => {
                headers.readable.append(name, value);
            }
            None => headers
                .unreadable
                .push(Bytes::from(segments.join(&b"\r\n"[..]))),
        }
    }
    headers
}

/// Whether `line` continues the header before it, as the client decides: it starts with
/// whitespace (any Unicode whitespace, when the line is UTF-8).
fn continues(line: &[u8]) -> bool {
    match std::str::from_utf8(line) {
        Ok(text) => text.starts_with(char::is_whitespace),
        Err(_) => line.first().is_some_and(u8::is_ascii_whitespace),
    }
}

/// A header line and its continuations as the client reads them, when it can.
fn readable(segments: &[&[u8]]) -> Option<(HeaderName, HeaderValue)> {
    let (first, rest) = segments.split_first()?;
    let text = std::str::from_utf8(first).ok()?;
    let (name, value) = text.split_once(':')?;
    let name: HeaderName = name.parse().ok()?;
    let mut value = value.trim_start().to_owned();
    for more in rest {
        value.push_str(std::str::from_utf8(more).ok()?);
    }
    value.truncate(value.trim_end().len());
    let value: HeaderValue = value.parse().ok()?;
    Some((name, value))
}

/// The unreadable header lines, as one header value: each line base64-encoded, the lines
/// separated by commas.
pub(crate) fn encode_unreadable(lines: &[Bytes]) -> String {
    lines
        .iter()
        .map(|line| STANDARD.encode(line))
        .collect::<Vec<_>>()
        .join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readable_lines_are_read_and_the_others_kept_as_stored() {
        let mut block = b"NATS/1.0\r\nX-Ok: fine\r\nNats-Msg-Id: m-1\r\n".to_vec();
        block.extend_from_slice("Ünïcode: v\r\n".as_bytes());
        block.extend_from_slice(b"X-Bin: \xff\xfe\r\n");
        block.extend_from_slice(b"X\x01Ctl: v\r\n");
        block.extend_from_slice(b"X-Long: a\r\n b\r\n\r\n");
        let h = split_headers(&block);
        assert_eq!(h.readable.get("X-Ok").unwrap().as_str(), "fine");
        assert_eq!(h.readable.get("Nats-Msg-Id").unwrap().as_str(), "m-1");
        assert_eq!(h.readable.get("X-Long").unwrap().as_str(), "a b");
        assert_eq!(h.unreadable.len(), 3, "{:?}", h.unreadable);
        assert_eq!(&h.unreadable[0][..], "Ünïcode: v".as_bytes());
        assert_eq!(&h.unreadable[1][..], b"X-Bin: \xff\xfe");
        assert_eq!(&h.unreadable[2][..], b"X\x01Ctl: v");
        let encoded = encode_unreadable(&h.unreadable);
        let back: Vec<Vec<u8>> = encoded
            .split(',')
            .map(|b| STANDARD.decode(b).unwrap())
            .collect();
        assert_eq!(back[1], b"X-Bin: \xff\xfe");
        // As the client: the value's start trimmed before a continuation, which keeps its own
        // leading whitespace; any Unicode whitespace starts a continuation.
        let h = split_headers(
            "NATS/1.0\r\nNats-Msg-Id:\r\n  id1\r\nX-Nbsp: a\r\n\u{a0}b\r\n\r\n".as_bytes(),
        );
        assert_eq!(h.readable.get("Nats-Msg-Id").unwrap().as_str(), "  id1");
        assert_eq!(h.readable.get("X-Nbsp").unwrap().as_str(), "a\u{a0}b");
        assert!(h.unreadable.is_empty(), "{:?}", h.unreadable);
        // A bare CR inside a value: no header value can hold it.
        let h = split_headers(b"NATS/1.0\r\nX-Cr: a\rb\r\n\r\n");
        assert_eq!(h.unreadable.len(), 1);
        // No version line: nothing is read, nothing lost.
        let h = split_headers(b"X-A: 1\r\nX-B: 2\r\n\r\n");
        assert!(h.readable.is_empty());
        assert_eq!(h.unreadable.len(), 2);
    }

    #[test]
    fn no_header_block_is_no_headers() {
        assert_eq!(split_headers(b""), Headers::default());
        assert_eq!(split_headers(b"NATS/1.0\r\n\r\n"), Headers::default());
    }
}
