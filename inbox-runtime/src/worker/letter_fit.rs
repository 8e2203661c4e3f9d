//! A dead letter within what NATS and JetStream take: the server's `max_payload` for headers
//! and payload together, and JetStream's 64 KiB header block. What gives way, in order: the
//! original's headers (said by `Inbox-Headers-Dropped`), then the payload's tail (said by
//! `Inbox-Truncated`); ours never.

use super::dead_letter::UNREADABLE_HEADERS;
use async_nats::HeaderMap;
use bytes::Bytes;

/// The letter as it fits within the server's `max_payload` (headers and payload together) and
/// JetStream's 64 KiB header block: as it is when it fits; when the original's headers alone
/// are too large for either, without them, and `Inbox-Headers-Dropped: <their size>`; then,
/// if still too large, its payload cut, with `Inbox-Truncated: <original length>` (the letter
/// still names the original's stream and sequence, to fetch it whole).
pub(super) fn fit(headers: HeaderMap, payload: Bytes, max: usize) -> (HeaderMap, Bytes) {
    let limit = MAX_HEADER_BLOCK.min(max);
    let fits = |h: &HeaderMap, payload: usize| wire_len(h) <= limit && wire_len(h) + payload <= max;
    if fits(&headers, payload.len()) {
        return (headers, payload);
    }
    let mut cut = headers;
    // The original's headers go when the block is too large for JetStream...
    if wire_len(&cut) > limit {
        cut = ours(&cut);
    }
    if !fits(&cut, payload.len()) {
        cut.insert(TRUNCATED, payload.len().to_string().as_str());
        // ...or, with the payload cut, leaves no room for any of it.
        let block = wire_len(&cut);
        if (block > limit || block >= max) && cut.get(HEADERS_DROPPED).is_none() {
            cut = ours(&cut);
        }
    }
    let room = max.saturating_sub(wire_len(&cut));
    let payload = payload.slice(..room.min(payload.len()));
    (cut, payload)
}

/// The headers of `letter` that are ours, and `Inbox-Headers-Dropped`: the size of the letter's
/// header block with the original's, which are left out.
fn ours(letter: &HeaderMap) -> HeaderMap {
    let mut ours = letter
        .iter()
        .filter(|(name, _)| is_ours(name))
        .flat_map(|(name, values)| values.iter().map(move |v| (name.clone(), v.clone())))
        .fold(HeaderMap::new(), |mut h, (name, value)| {
            h.append(name, value);
            h
        });
    ours.insert(HEADERS_DROPPED, wire_len(letter).to_string().as_str());
    ours
}

/// Whether a letter's header `name` is one of ours (`Inbox-*` but the original's unreadable
/// header lines, `Nats-Msg-Id`), which a letter keeps when the original's are dropped.
fn is_ours(name: &async_nats::HeaderName) -> bool {
    let name: &str = name.as_ref();
    (name.starts_with("Inbox-") && name != UNREADABLE_HEADERS)
        || name.eq_ignore_ascii_case("Nats-Msg-Id")
}

/// The largest header block JetStream stores (its error 10097 above it).
pub(super) const MAX_HEADER_BLOCK: usize = 65_535;

/// The header a letter whose original's headers were too large to carry has instead: the
/// size on the wire of the header block they were in.
pub(super) const HEADERS_DROPPED: &str = "Inbox-Headers-Dropped";

/// The header block's size on the wire: `NATS/1.0\r\n`, each `name: value\r\n`, `\r\n`.
pub(super) fn wire_len(headers: &HeaderMap) -> usize {
    let mut len = "NATS/1.0\r\n\r\n".len();
    for (name, values) in headers.iter() {
        let name: &str = name.as_ref();
        for value in values {
            len += name.len() + ": \r\n".len() + value.as_str().len();
        }
    }
    len
}

/// The header a truncated letter carries: the original payload's length.
pub(super) const TRUNCATED: &str = "Inbox-Truncated";
