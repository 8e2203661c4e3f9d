//! Pins the Rust client's behaviour that the runtime works around: async-nats (0.51) cannot
//! parse a header block with a non-ASCII byte in a name, a value that is not UTF-8 or a control
//! byte in a name (nats-server accepts and stores these from any producer): it treats the
//! delivery as a read error, drops its connection and never hands the message over. So each
//! handler of an `App` pulls on a connection of its own, stored messages are read through the
//! JSON API (`stored.rs`), and the delivery-limit backstop dead-letters such messages.
//!
//! When an async-nats upgrade reads such messages, this test fails: revisit those workarounds
//! (the worker could then dead-letter them itself, at once).

use futures::StreamExt;
use inbox_testkit::{publish_raw_lines, unique, wait_until};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

#[tokio::test]
async fn the_client_drops_its_connection_on_an_unreadable_header() {
    let url = inbox_tests::nats_url();
    let drops = Arc::new(AtomicUsize::new(0));
    let client = {
        let drops = drops.clone();
        async_nats::ConnectOptions::new()
            .event_callback(move |event| {
                let drops = drops.clone();
                async move {
                    if matches!(event, async_nats::Event::Disconnected) {
                        drops.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
            .connect(&url)
            .await
            .unwrap_or_else(|e| panic!("NATS is not reachable at {url}: {e}"))
    };
    let subject = unique("pin.");
    for bad in [
        "X-Ünïcode: v".as_bytes().to_vec(),
        b"X-Bin: \xff\xfe".to_vec(),
        b"X\x01Ctl: v".to_vec(),
    ] {
        let mut subscription = client.subscribe(subject.clone()).await.unwrap();
        client.flush().await.unwrap();
        let before = drops.load(Ordering::SeqCst);
        // Sent up to three times: one full run (2.15.1, beside other suites) saw no drop within
        // 20 s of the first; the client reading such a header would survive all three.
        let mut dropped = Err(String::new());
        for _ in 0..3 {
            publish_raw_lines(&url, &subject, std::slice::from_ref(&bad), b"payload")
                .await
                .unwrap();
            dropped = wait_until(
                "the client to drop its connection",
                Duration::from_secs(20),
                async || drops.load(Ordering::SeqCst) > before,
            )
            .await;
            if dropped.is_ok() {
                break;
            }
        }
        dropped.unwrap_or_else(|e| {
            panic!(
                "{e}, three times: async-nats now reads a header line {:?}; revisit the workarounds named at the top of this file",
                String::from_utf8_lossy(&bad)
            )
        });
        // The message is not handed over: whatever the subscription still gets is not it.
        let next = tokio::time::timeout(Duration::from_millis(200), subscription.next()).await;
        if let Ok(Some(message)) = next {
            assert_ne!(
                &message.payload[..],
                b"payload",
                "the unreadable message was delivered"
            );
        }
    }
}

/// A bare CR inside a header value is worse: async-nats 0.51 panics in the task that reads its
/// connection (`HeaderValue::from(String)` asserts), and the client never recovers. Why the
/// delivery-limit backstop of an `App` reads on the app's own connection, which is never
/// delivered a stored message. One of the full runs saw a client answer for 20 s after such a
/// message (once in some thirty runs, beside another test; never alone): so a client that
/// survives is given up on, and a fresh client is sent the header again, up to three times.
/// What is pinned is that the client can die of it; only when none of three does, it no longer
/// does.
#[tokio::test]
async fn the_client_dies_on_a_carriage_return_in_a_header_value() {
    let url = inbox_tests::nats_url();
    let mut survived = 0;
    for _ in 0..3 {
        if client_dies_of_a_carriage_return(&url).await {
            return;
        }
        survived += 1;
    }
    panic!(
        "{survived} clients in a row survived a CR in a header value for 20 s: async-nats now \
         survives it; revisit the backstop's connection"
    );
}

/// Whether a client of its own, sent a message with a bare CR in a header value, stops answering
/// within 20 s. Either way, the message must not have been handed over.
async fn client_dies_of_a_carriage_return(url: &str) -> bool {
    let client = async_nats::connect(url)
        .await
        .unwrap_or_else(|e| panic!("NATS is not reachable at {url}: {e}"));
    let subject = unique("pin.");
    let mut subscription = client.subscribe(subject.clone()).await.unwrap();
    client.flush().await.unwrap();
    publish_raw_lines(url, &subject, &[b"X-Cr: a\rb".to_vec()], b"payload")
        .await
        .unwrap();
    // A client that recovers answers a flush again soon; this one never does.
    let dead = async || {
        tokio::time::timeout(Duration::from_secs(2), client.flush())
            .await
            .map_or(true, |flushed| flushed.is_err())
    };
    let died = wait_until(
        "the client to stop answering",
        Duration::from_secs(20),
        dead,
    )
    .await
    .is_ok();
    let next = tokio::time::timeout(Duration::from_millis(200), subscription.next()).await;
    assert!(
        !matches!(next, Ok(Some(ref m)) if &m.payload[..] == b"payload"),
        "the message was delivered"
    );
    died
}
