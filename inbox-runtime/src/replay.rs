//! What a replayed dead letter carries ([`REPLAY_KEY`], [`REPLAY_CONSUMER`]), and the payload
//! hash a marker keeps to tell a key reused with another payload: what a [`Delivery`] reads of
//! them.
//!
//! [`Delivery`]: crate::Delivery

use async_nats::HeaderMap;

/// The header a dead letter replayed by `inbox dlq replay` carries: the key its original was
/// processed under, which stands in for the transport id (`Nats-Msg-Id`, or the stream and
/// sequence) of the replayed message, so that it keeps its key and a replay applied twice is
/// applied once. A handler with a `key` expression keys the replay by that expression, as the
/// original. Honoured only with [`REPLAY_CONSUMER`].
pub const REPLAY_KEY: &str = "Inbox-Replay-Key";

/// The header that addresses a replayed dead letter to the one consumer (a handler's
/// `consumer` name) it was rejected by: every other consumer of the subject, which may have
/// applied the original already, acks the replay as a duplicate without running its handler.
pub const REPLAY_CONSUMER: &str = "Inbox-Replay-Consumer";

/// The hash a marker keeps of its message's payload: the first 16 bytes of its SHA-256, in hex.
pub(crate) fn payload_hash(payload: &[u8]) -> String {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(payload);
    hex::encode(&digest[..16])
}

/// The consumer a replayed dead letter is addressed to, and the key it keeps: [`REPLAY_CONSUMER`]
/// and [`REPLAY_KEY`], both present and not empty.
pub(crate) fn replay_of(headers: Option<&HeaderMap>) -> Option<(String, String)> {
    let value = |name: &str| {
        headers
            .and_then(|h| h.get(name))
            .map(|v| v.as_str())
            .filter(|v| !v.is_empty())
            .map(str::to_owned)
    };
    Some((value(REPLAY_CONSUMER)?, value(REPLAY_KEY)?))
}

#[cfg(test)]
mod tests {
    /// Markers stored by earlier releases keep this hash: its text must not change.
    #[test]
    fn a_payload_hash_is_the_first_16_bytes_of_its_sha256_in_lowercase_hex() {
        assert_eq!(super::payload_hash(b""), "e3b0c44298fc1c149afbf4c8996fb924");
        assert_eq!(
            super::payload_hash(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223"
        );
    }
}
