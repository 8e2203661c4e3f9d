//! The transactional outbox, end to end on a real database and JetStream:
//! - a handler that publishes and then fails publishes nothing, and leaves no row (its failure, a
//!   CHECK violation behind an `#[error(transparent)]` error of its own, is dead-lettered at
//!   once);
//! - a worker's commit wakes the relay (no poll for an hour, and the event still comes);
//! - a row committed where nothing wakes the relay (its writer died after COMMIT) goes at the
//!   next poll;
//! - a relay stopped after its PubAcks and before marking the rows sent (as SIGKILL would stop
//!   it: its transaction never commits) leaves them pending; the next relay publishes them again,
//!   every PubAck says "duplicate", and the stream holds one copy of each;
//! - two relays on one database, one holding its batch while the other runs: every row is
//!   published once (no PubAck ever says "duplicate"), and each order key's rows are stored in
//!   their order;
//! - sent rows go once older than the retention, and a row never sent stays;
//! - the relay refuses a stream whose duplicate window is not shorter than its retention, and
//!   (on servers that have it) one with `persist_mode: async`;
//! - rows NATS refuses (a header or message id it cannot carry, written by another writer; over
//!   `max_payload`; a subject no stream takes, more of them than a pass takes) neither panic the
//!   relay nor stall the other keys: the refused ones are kept as failed, holding back their
//!   key, and `enqueue` refuses such messages up front;
//! - a subject over nats-server's `max_control_line` (written by another writer) is kept as
//!   failed, never published (a publish to it would close the connection), and `enqueue`
//!   refuses one over `MAX_OUTBOX_SUBJECT_LEN`, where the longest it takes is relayed;
//! - rows JetStream refuses for good at the PubAck (an expectation header the stream does not
//!   meet, a header block over 64 KiB) are kept as failed, not tried at every pass, and
//!   `enqueue` refuses such headers up front;
//! - a relay that panics is started again by the App, whose workers go on;
//! - a relay that stops ends its turn (SQLite's lease): the next one takes over at once;
//! - a pass loads no more payload bytes than its budget (`Relay::max_bytes`), one row at least;
//! - a refused row that two relays record as failed (SQLite: a turn that lapsed mid-pass) is
//!   kept once, and neither relay's pass fails.

use super::setup;
use crate::backends::TestBackend;
use crate::handlers::{Announcer, Entry};
use crate::{NatsStream, Running};
use async_nats::jetstream::{self, stream};
use futures::FutureExt;
use inbox_runtime::{Outbox, OutboxMessage, Relay, RelayError};
use inbox_testkit::{Backend, off_runtime, unique, wait_until};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

pub(super) const DEADLINE: Duration = Duration::from_secs(60);

/// A stream of this test's own for the announcements, deleted with the guard.
pub(super) struct Events {
    js: jetstream::Context,
    name: String,
    pub(super) subject: String,
}

impl Events {
    pub(super) async fn create(js: &jetstream::Context) -> Events {
        Events::create_with(js, |c| c).await
    }

    async fn create_with(
        js: &jetstream::Context,
        configure: impl FnOnce(stream::Config) -> stream::Config,
    ) -> Events {
        let name = unique("EV_");
        let subject = format!("ev.{}", name.to_lowercase());
        let config = configure(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            duplicate_window: Duration::from_secs(120),
            ..Default::default()
        });
        js.create_stream(config)
            .await
            .unwrap_or_else(|e| panic!("JetStream cannot create the events stream: {e}"));
        Events {
            js: js.clone(),
            name,
            subject,
        }
    }

    /// Every message stored: (Nats-Msg-Id, payload), in stream order.
    pub(super) async fn messages(&self) -> Vec<(String, Vec<u8>)> {
        let stream = self.js.get_stream(&self.name).await.expect("events stream");
        let last = stream.cached_info().state.last_sequence;
        let mut out = Vec::new();
        for seq in 1..=last {
            if let Ok(m) = stream.get_raw_message(seq).await {
                let id = m
                    .headers
                    .get("Nats-Msg-Id")
                    .map(|v| v.as_str().to_owned())
                    .unwrap_or_default();
                out.push((id, m.payload.to_vec()));
            }
        }
        out
    }

    pub(super) async fn count(&self) -> u64 {
        let mut stream = self.js.get_stream(&self.name).await.expect("events stream");
        stream.info().await.expect("events info").state.messages
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        let (js, name) = (self.js.clone(), self.name.clone());
        off_runtime(async move {
            let _ = js.delete_stream(&name).await;
        });
    }
}

/// A fresh outbox on `db`'s pool, migrated.
pub(super) async fn outbox<DB: inbox_runtime::InboxBackend>(pool: sqlx::Pool<DB>) -> Outbox<DB> {
    let outbox = Outbox::new(pool);
    outbox.migrate().await.expect("migrate the outbox");
    outbox
}

/// A database with a migrated outbox, a NATS connection and a stream of this test's own for the
/// announcements: what a relay test starts from.
pub(super) struct Relaying<B: TestBackend> {
    pub(super) db: crate::backends::TestDb<B::Db>,
    pub(super) outbox: Outbox<B::Db>,
    pub(super) nats: NatsStream,
    pub(super) events: Events,
}

pub(super) async fn relaying<B: TestBackend>() -> Relaying<B> {
    let (db, _) = setup::<B>(4).await;
    let outbox = outbox(db.pool.clone()).await;
    let nats = NatsStream::create().await;
    let events = Events::create(&nats.js).await;
    Relaying {
        db,
        outbox,
        nats,
        events,
    }
}

/// A [`Relay::before_mark`] hook that holds the relay's first pass after its PubAcks, before it
/// records them: `held` is notified once it holds, and it goes on when `release` is notified.
/// Later passes go through.
pub(super) fn hold_first_pass() -> (
    inbox_runtime::RelayHook,
    Arc<tokio::sync::Notify>,
    Arc<tokio::sync::Notify>,
) {
    let (held, release) = (
        Arc::new(tokio::sync::Notify::new()),
        Arc::new(tokio::sync::Notify::new()),
    );
    let (on_hold, on_release) = (Arc::clone(&held), Arc::clone(&release));
    let first_pass = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let hook: inbox_runtime::RelayHook = Arc::new(move || {
        let (held, release) = (Arc::clone(&on_hold), Arc::clone(&on_release));
        let first = first_pass.swap(false, std::sync::atomic::Ordering::SeqCst);
        async move {
            if first {
                held.notify_one();
                release.notified().await;
            }
        }
        .boxed()
    });
    (hook, held, release)
}

/// Asserts that `enqueue` refuses `message`, saying `why`, in a transaction then dropped.
async fn refused_at_enqueue<DB: inbox_runtime::InboxBackend>(
    outbox: &Outbox<DB>,
    message: OutboxMessage,
    why: &str,
) {
    let mut tx = outbox.pool().begin().await.unwrap();
    let refused = outbox.enqueue(&mut tx, message).await.unwrap_err();
    assert!(refused.to_string().contains(why), "{refused}");
}

/// Relays `outbox` (polling every 100 ms) until `events` holds `stored` messages and `failed`
/// rows are kept as failed, then stops the relay: it published `stored` and failed `failed`.
async fn relay_until<DB: inbox_runtime::InboxBackend>(
    outbox: &Outbox<DB>,
    nats: &NatsStream,
    events: &Events,
    stored: u64,
    failed: usize,
) {
    let relay = Relay::new(outbox.clone()).poll_interval(Duration::from_millis(100));
    let (stop, relaying) = run(relay, &nats.js);
    wait_until("the rows JetStream takes", DEADLINE, || async {
        events.count().await == stored
    })
    .await
    .unwrap();
    wait_until(
        "the refused rows to be kept as failed",
        DEADLINE,
        || async { outbox.failed(10).await.unwrap().len() == failed },
    )
    .await
    .unwrap();
    stop.cancel();
    let stats = relaying.await.expect("the relay never panicked");
    let done = (stats.published, stats.failed);
    assert_eq!(done, (stored, failed as u64), "{stats:?}");
}

/// Runs `relay` on a task of its own until the token.
pub(super) fn run<DB: inbox_runtime::InboxBackend>(
    relay: Relay<DB>,
    js: &jetstream::Context,
) -> (
    CancellationToken,
    tokio::task::JoinHandle<inbox_runtime::RelayStats>,
) {
    let (token, js) = (CancellationToken::new(), js.clone());
    let stop = token.clone();
    (
        token,
        tokio::spawn(async move { relay.run_until(&js, stop).await }),
    )
}

/// Commits `messages` to the outbox in one transaction of the test's own (no worker: nothing
/// wakes a relay).
pub(super) async fn commit<DB: inbox_runtime::InboxBackend>(
    outbox: &Outbox<DB>,
    messages: impl IntoIterator<Item = OutboxMessage>,
) -> Vec<String> {
    let mut tx = outbox.pool().begin().await.expect("begin");
    let mut ids = Vec::new();
    for m in messages {
        ids.push(outbox.enqueue(&mut tx, m).await.expect("enqueue"));
    }
    tx.commit().await.expect("commit");
    ids
}

/// A database with the inbox and the outbox, a stream of requests, a stream of events, and a
/// worker of the `announce` handler on consumer `c` (not started).
struct Announcing<B: TestBackend> {
    db: crate::backends::TestDb<B::Db>,
    outbox: Outbox<B::Db>,
    nats: NatsStream,
    events: Events,
    worker: inbox_runtime::Worker<B::Announce>,
}

impl<B: TestBackend> Announcing<B> {
    async fn set_up() -> Self {
        let (db, inbox) = setup::<B>(4).await;
        let outbox = outbox(db.pool.clone()).await;
        let nats = NatsStream::create().await;
        let events = Events::create(&nats.js).await;
        let consumer = nats.consumer("c", Duration::from_secs(30)).await;
        let announcer = Announcer {
            outbox: outbox.clone(),
            subject: events.subject.clone(),
        };
        let worker = nats
            .worker(inbox, consumer)
            .build_with_state(B::Announce::default(), announcer)
            .unwrap();
        Announcing {
            db,
            outbox,
            nats,
            events,
            worker,
        }
    }
}

/// The test.
async fn handler_that_fails_after_publishing_publishes_nothing<B: TestBackend>() {
    let Announcing {
        db,
        outbox,
        nats,
        events,
        worker,
    } = Announcing::<B>::set_up().await;
    let (relay, relaying) = run(Relay::new(outbox.clone()), &nats.js);
    let running = Running::start(&worker);
    // An overdraw: the handler fails permanently after its publish, and the message is
    // dead-lettered (alone, or after its batch is tried again without it).
    nats.publish_all([Entry::new("bad", 1, -5).json()]).await;
    wait_until("the failure to be dead-lettered", DEADLINE, || async {
        worker.stats().terminated == 1
    })
    .await
    .unwrap();
    assert_eq!(B::count(&db, "SELECT count(*) FROM outbox").await, 0);
    // At once: a CHECK violation is permanent, also behind the handler's own error type
    // (`#[error(transparent)]` around sqlx's).
    let letters = nats.dead_letters().await;
    let delivered = letters[0]
        .1
        .get("Inbox-Delivered")
        .map(|v| v.as_str().to_owned());
    assert_eq!(delivered.as_deref(), Some("1"), "{letters:?}");
    // A good message after it goes through the same path: the relay works, and the failed one
    // never comes.
    let good = Entry::new("good", 2, 7);
    nats.publish_all([good.json()]).await;
    wait_until("the good message's event", DEADLINE, || async {
        events.count().await == 1
    })
    .await
    .unwrap();
    nats.wait_drained("c").await;
    running.stop().await;
    relay.cancel();
    let stats = relaying.await.unwrap();
    assert_eq!((stats.published, stats.republished), (1, 0), "{stats:?}");
    let stored = events.messages().await;
    assert_eq!(stored.len(), 1, "{stored:?}");
    let event: Entry = serde_json::from_slice(&stored[0].1).unwrap();
    assert_eq!(event, good);
    let rows = "SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL";
    assert_eq!(B::count(&db, rows).await, 1);
    assert_eq!(B::count(&db, "SELECT count(*) FROM outbox").await, 1);
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 1);
}

/// The test.
async fn commit_wakes_the_relay<B: TestBackend>() {
    let Announcing {
        db,
        outbox,
        nats,
        events,
        worker,
    } = Announcing::<B>::set_up().await;
    // Its first poll is at start, and sends the row committed before; the next poll would be in
    // an hour.
    commit(
        &outbox,
        [OutboxMessage::new(&*events.subject, b"before".to_vec())],
    )
    .await;
    let relay = Relay::new(outbox.clone()).poll_interval(Duration::from_secs(3600));
    let marked = relay.stats_handle();
    let (stop, relaying) = run(relay, &nats.js);
    wait_until("the relay's first poll", DEADLINE, || async {
        marked().marked == 1
    })
    .await
    .unwrap();
    let running = Running::start(&worker);
    let entries: Vec<Entry> = (0..5).map(|i| Entry::new(format!("k{i}"), i, 1)).collect();
    nats.publish_all(entries.iter().map(Entry::json)).await;
    wait_until("every event, without a poll", DEADLINE, || async {
        events.count().await == 6
    })
    .await
    .unwrap();
    running.stop().await;
    stop.cancel();
    let stats = relaying.await.unwrap();
    assert_eq!((stats.published, stats.republished), (6, 0), "{stats:?}");
    let pending = "SELECT count(*) FROM outbox WHERE sent_at IS NULL";
    assert_eq!(B::count(&db, pending).await, 0);
}

/// The test.
async fn poll_sends_a_row_nobody_woke_the_relay_for<B: TestBackend>() {
    let Relaying {
        db: _db,
        outbox,
        nats,
        events,
    } = relaying::<B>().await;
    let relay = Relay::new(outbox.clone()).poll_interval(Duration::from_millis(200));
    let (stop, relaying) = run(relay, &nats.js);
    // Committed as by a process that died right after COMMIT: no wake-up ever comes.
    let ids = commit(
        &outbox,
        [OutboxMessage::new(&*events.subject, b"late".to_vec())],
    )
    .await;
    wait_until("the poll to send the row", DEADLINE, || async {
        events.count().await == 1
    })
    .await
    .unwrap();
    stop.cancel();
    let stats = relaying.await.unwrap();
    assert_eq!((stats.published, stats.republished), (1, 0), "{stats:?}");
    let stored = events.messages().await;
    assert_eq!(stored, [(ids[0].clone(), b"late".to_vec())]);
    let (pending, _) = outbox.pending().await.unwrap();
    assert_eq!(pending, 0);
}

/// The test.
async fn relay_stopped_before_marking_sent_is_republished_once<B: TestBackend>() {
    let Relaying {
        db,
        outbox,
        nats,
        events,
    } = relaying::<B>().await;
    let messages = (0..3).map(|i| OutboxMessage::new(&*events.subject, format!("m{i}")));
    let ids = commit(&outbox, messages).await;
    // The first relay stops for good between its PubAcks and its mark.
    let acked = Arc::new(tokio::sync::Notify::new());
    let on_ack = Arc::clone(&acked);
    let first = Relay::new(outbox.clone())
        .lease(Duration::from_secs(2))
        .before_mark(Arc::new(move || {
            on_ack.notify_one();
            std::future::pending::<()>().boxed()
        }));
    let (_, relaying) = run(first, &nats.js);
    tokio::time::timeout(DEADLINE, acked.notified())
        .await
        .expect("the first relay to get its PubAcks");
    assert_eq!(events.count().await, 3);
    // Killed: its transaction goes with it, never committed.
    relaying.abort();
    let _ = relaying.await;
    let (pending, _) = outbox.pending().await.unwrap();
    assert_eq!(pending, 3, "nothing was marked sent");

    let second = Relay::new(outbox.clone()).lease(Duration::from_secs(2));
    let handle = second.stats_handle();
    let (stop, relaying) = run(second, &nats.js);
    wait_until("the second relay to mark every row", DEADLINE, || async {
        handle().marked == 3
    })
    .await
    .unwrap();
    stop.cancel();
    let stats = relaying.await.unwrap();
    assert_eq!((stats.published, stats.republished), (0, 3), "{stats:?}");
    let stored: Vec<String> = events
        .messages()
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(stored, ids, "one copy of each, in order");
    assert_eq!(outbox.pending().await.unwrap().0, 0);
    let _ = db;
}

/// The test.
async fn two_relays_publish_each_row_once_in_key_order<B: TestBackend>() {
    let (db, _) = setup::<B>(8).await;
    let outbox = outbox(db.pool.clone()).await;
    let nats = NatsStream::create().await;
    let events = Events::create(&nats.js).await;
    // Key "a" fills the first relay's batch; keys b..e come after it, and a few more of "a" at
    // the end, which the second relay must leave until the first has sent the older ones.
    let keyed = |key: &str, n: usize| {
        OutboxMessage::new(&*events.subject, format!("{key}:{n}")).order_key(key)
    };
    let mut messages: Vec<OutboxMessage> = (0..50).map(|n| keyed("a", n)).collect();
    for n in 0..100 {
        messages.push(keyed(["b", "c", "d", "e"][n % 4], n / 4));
    }
    messages.extend((50..60).map(|n| keyed("a", n)));
    let total = messages.len() as u64;
    commit(&outbox, messages).await;

    let (hold, held, release) = hold_first_pass();
    let first = Relay::new(outbox.clone()).batch(50).before_mark(hold);
    let first_stats = first.stats_handle();
    let (stop_first, first_run) = run(first, &nats.js);
    tokio::time::timeout(DEADLINE, held.notified())
        .await
        .expect("the first relay to hold its batch");
    // While the first holds its batch (row locks, or SQLite's lease), the second drains what it
    // may take. On the servers it is an earlier version's relay, which takes no turn (a rolling
    // upgrade): it passes over the rows the first locked, and over every later row of their key.
    let second = Relay::new(outbox.clone()).batch(50).without_turns();
    let during = second.drain(&nats.js).await.unwrap();
    assert_eq!(during.republished, 0, "{during:?}");
    if B::SINGLE_WRITER {
        assert_eq!(
            during.published, 0,
            "one relay at a time on SQLite: {during:?}"
        );
    } else {
        assert_eq!(during.published, 100, "keys b..e, not a's: {during:?}");
    }
    release.notify_one();
    // The relay counts a batch after its commit, so a count that has reached the rest means the
    // rows are committed too (waiting on `pending` alone raced with that count).
    wait_until("the first relay to mark the rest", DEADLINE, || async {
        first_stats().marked >= total - during.marked
    })
    .await
    .unwrap();
    assert_eq!(first_stats().marked, total - during.marked);
    assert_eq!(outbox.pending().await.unwrap().0, 0);
    let after = second.drain(&nats.js).await.unwrap();
    stop_first.cancel();
    let first_done = first_run.await.unwrap();
    assert_eq!(first_done.republished + after.republished, 0);
    assert_eq!(
        first_done.published + during.published + after.published,
        total,
        "{first_done:?} {during:?} {after:?}"
    );
    assert_eq!(outbox.pending().await.unwrap().0, 0);
    let stored = events.messages().await;
    assert_eq!(stored.len() as u64, total);
    assert_in_key_order(stored);
}

/// Asserts that `stored` (payloads `<key>:<n>`, each key's `n` counting from 0) holds each key's
/// messages once and in order.
pub(super) fn assert_in_key_order(stored: Vec<(String, Vec<u8>)>) {
    let mut last: std::collections::HashMap<String, i64> = Default::default();
    for (_, payload) in stored {
        let text = String::from_utf8(payload).unwrap();
        let (key, n) = text.split_once(':').unwrap();
        let n: i64 = n.parse().unwrap();
        let previous = last.insert(key.to_owned(), n).unwrap_or(-1);
        assert_eq!(n, previous + 1, "key {key}: {n} after {previous}");
    }
}

/// The test.
async fn relay_refuses_streams_it_cannot_relay_to_safely<B: TestBackend>() {
    let (db, _) = setup::<B>(2).await;
    let outbox = outbox(db.pool.clone()).await;
    let nats = NatsStream::create().await;
    let events = Events::create(&nats.js).await;
    let relay = Relay::new(outbox.clone())
        .stream(&events.name)
        .retention(Duration::from_secs(60));
    let err = relay.check(&nats.js).await.unwrap_err();
    assert!(
        matches!(&err, RelayError::Retention { window, .. } if *window == Duration::from_secs(120)),
        "{err}"
    );
    assert!(err.to_string().contains("duplicate window"), "{err}");
    let ok = Relay::new(outbox.clone()).stream(&events.name);
    ok.check(&nats.js).await.unwrap();
    let missing = Relay::new(outbox.clone()).stream(unique("NONE_"));
    assert!(matches!(
        missing.check(&nats.js).await,
        Err(RelayError::Nats {
            transient: false,
            ..
        })
    ));
    // persist_mode async: the servers that know it (2.12+) store it, and the relay refuses it.
    let unsafe_events = Events::create_with(&nats.js, |c| stream::Config {
        persist_mode: Some(stream::PersistenceMode::Async),
        ..c
    })
    .await;
    let info = nats
        .js
        .get_stream(&unsafe_events.name)
        .await
        .unwrap()
        .cached_info()
        .config
        .persist_mode;
    let version = nats.client.server_info().version;
    let knows = at_least(&version, (2, 12));
    let checked = Relay::new(outbox)
        .stream(&unsafe_events.name)
        .check(&nats.js)
        .await;
    if knows {
        assert_eq!(info, Some(stream::PersistenceMode::Async), "{version}");
        assert!(
            matches!(checked, Err(RelayError::AsyncPersistence { .. })),
            "{checked:?}"
        );
    } else {
        assert_ne!(info, Some(stream::PersistenceMode::Async), "{version}");
        checked.unwrap();
    }
}

/// The test.
async fn cleanup_deletes_sent_rows_after_the_retention<B: TestBackend>() {
    let (db, _) = setup::<B>(4).await;
    let outbox = outbox(db.pool.clone()).await;
    let nats = NatsStream::create().await;
    let events = Events::create_with(&nats.js, |c| stream::Config {
        duplicate_window: Duration::from_secs(1),
        ..c
    })
    .await;
    // No stream takes this one: it stays pending, and cleanup must leave it.
    let nowhere = format!("nowhere.{}", unique("s").to_lowercase());
    commit(
        &outbox,
        [
            OutboxMessage::new(&*events.subject, b"a".to_vec()),
            OutboxMessage::new(&*events.subject, b"b".to_vec()),
            OutboxMessage::new(&*nowhere, b"c".to_vec()),
        ],
    )
    .await;
    let relay = Relay::new(outbox.clone())
        .retention(Duration::from_secs(2))
        .poll_interval(Duration::from_millis(200));
    let (stop, relaying) = run(relay, &nats.js);
    wait_until("the sent rows to be deleted", DEADLINE, || async {
        B::count(&db, "SELECT count(*) FROM outbox").await == 1
    })
    .await
    .unwrap();
    stop.cancel();
    let stats = relaying.await.unwrap();
    assert_eq!((stats.published, stats.marked), (2, 2), "{stats:?}");
    assert_eq!(
        outbox.pending().await.unwrap().0,
        1,
        "the unsent row is kept"
    );
    assert_eq!(events.count().await, 2);
}

/// The test.
async fn refused_rows_neither_panic_the_relay_nor_stall_other_keys<B: TestBackend>() {
    let Relaying {
        db,
        outbox,
        nats,
        events,
    } = relaying::<B>().await;
    let subject = &*events.subject;
    let max = nats.js.client().server_info().max_payload;
    // Written by another writer (or before the relay told the outbox the server's limit): a
    // header name NATS cannot carry, a message id with a line break, a payload over
    // max_payload. Each of the first two has a later row of its key behind it.
    let ids = commit(
        &outbox,
        [
            OutboxMessage::new(subject, b"bad header".to_vec()).order_key("h"),
            OutboxMessage::new(subject, b"after bad header".to_vec()).order_key("h"),
            OutboxMessage::new(subject, b"bad id".to_vec())
                .msg_id("bad-id")
                .order_key("i"),
            OutboxMessage::new(subject, b"after bad id".to_vec()).order_key("i"),
            OutboxMessage::new(subject, vec![b'x'; max + 1]).order_key("big"),
        ],
    )
    .await;
    // Within max_payload, but over the target stream's own max_msg_size: refused at the PubAck.
    let small = Events::create_with(&nats.js, |c| stream::Config {
        max_message_size: 100,
        ..c
    })
    .await;
    commit(
        &outbox,
        [OutboxMessage::new(&*small.subject, vec![b'y'; 200]).order_key("s")],
    )
    .await;
    let forge = |sql: String| B::exec(&db, Box::leak(sql.into_boxed_str()));
    forge(format!(
        "UPDATE outbox SET headers = '[[\"Ünïcode\",\"v\"]]' WHERE msg_id = '{}'",
        ids[0]
    ))
    .await;
    forge("UPDATE outbox SET msg_id = 'bad\r\nX-Forged: 1' WHERE msg_id = 'bad-id'".into()).await;
    // More rows to a subject no stream takes than a pass takes, each its own key.
    let nowhere = format!("nowhere.{}", unique("s").to_lowercase());
    commit(
        &outbox,
        (0..12).map(|i| OutboxMessage::new(&*nowhere, b"n".to_vec()).order_key(format!("n{i}"))),
    )
    .await;
    let good = commit(
        &outbox,
        (0..3).map(|i| OutboxMessage::new(subject, format!("good {i}")).order_key(format!("g{i}"))),
    )
    .await;
    let relay = Relay::new(outbox.clone())
        .batch(5)
        .poll_interval(Duration::from_millis(100));
    let (stop, relaying) = run(relay, &nats.js);
    wait_until("the good rows past the refused ones", DEADLINE, || async {
        events.count().await == 3
    })
    .await
    .unwrap();
    wait_until(
        "the refused rows to be kept as failed",
        DEADLINE,
        || async { outbox.failed(10).await.unwrap().len() == 4 },
    )
    .await
    .unwrap();
    let stored: Vec<String> = events
        .messages()
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(stored, good, "only the good rows, in order");
    let failed = outbox.failed(10).await.unwrap();
    let why: Vec<&str> = failed.iter().map(|f| f.error.as_str()).collect();
    assert!(why[0].contains("header name"), "{why:?}");
    assert!(why[1].contains("line break"), "{why:?}");
    assert!(why[2].contains("max payload"), "{why:?}");
    assert!(why[3].contains("maximum"), "{why:?}");
    assert_eq!(
        failed
            .iter()
            .map(|f| f.order_key.as_str())
            .collect::<Vec<_>>(),
        ["h", "i", "big", "s"]
    );
    // Now that the relay knows the server's limit, such a message is refused when written.
    let too_large = OutboxMessage::new(subject, vec![b'x'; max + 1]);
    refused_at_enqueue(&outbox, too_large, "max_payload").await;
    // A failed row discarded lets its key's next row go; the other failed keys still wait.
    assert!(outbox.discard_failed(failed[0].id).await.unwrap());
    wait_until(
        "the held row behind the discarded one",
        DEADLINE,
        || async { events.count().await == 4 },
    )
    .await
    .unwrap();
    stop.cancel();
    let stats = relaying.await.expect("the relay never panicked");
    assert_eq!((stats.published, stats.failed), (4, 4), "{stats:?}");
    let stored = events.messages().await;
    assert_eq!(stored[3].1, b"after bad header");
    // Pending: the three failed rows, the row held behind one, and the twelve with no stream.
    assert_eq!(outbox.pending().await.unwrap().0, 16);
}

/// The test.
async fn a_relay_that_panics_is_started_again_and_the_workers_go_on<B: TestBackend>() {
    let Announcing {
        db,
        outbox,
        nats,
        events,
        worker: _,
    } = Announcing::<B>::set_up().await;
    let inbox = B::inbox(db.pool.clone());
    let announcer = Announcer {
        outbox: outbox.clone(),
        subject: events.subject.clone(),
    };
    // The relay's first pass panics between its PubAcks and its mark.
    let panicked = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let first = Arc::clone(&panicked);
    let relay = Relay::new(outbox.clone()).before_mark(Arc::new(move || {
        let first = !first.swap(true, std::sync::atomic::Ordering::SeqCst);
        async move {
            if first {
                panic!("a relay's bug");
            }
        }
        .boxed()
    }));
    let app = inbox_runtime::App::new(inbox, &nats.js)
        .handler_configured(
            B::Announce::default(),
            announcer,
            inbox_runtime::Durable::existing(&nats.stream, "c"),
            |w| w.concurrency(1),
        )
        .relay(relay);
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(app.run_until(shutdown.clone()));
    let entries: Vec<Entry> = (0..4).map(|i| Entry::new(format!("k{i}"), i, 1)).collect();
    nats.publish_all(entries[..2].iter().map(Entry::json)).await;
    wait_until("the relay to panic", DEADLINE, || async {
        panicked.load(std::sync::atomic::Ordering::SeqCst)
    })
    .await
    .unwrap();
    // The workers go on, and the relay, started again, publishes every event once.
    nats.publish_all(entries[2..].iter().map(Entry::json)).await;
    wait_until("every event", DEADLINE, || async {
        events.count().await == 4
    })
    .await
    .unwrap();
    nats.wait_drained("c").await;
    shutdown.cancel();
    let stats = running.await.expect("the app never panicked").unwrap();
    assert_eq!(stats.get("announce").map(|s| s.acked), Some(4), "{stats:?}");
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 4);
    let pending = "SELECT count(*) FROM outbox WHERE sent_at IS NULL";
    assert_eq!(B::count(&db, pending).await, 0);
}

/// The test. Where relays take turns by a lease (SQLite), a relay that stops ends its turn:
/// the next relay takes over at once rather than when the lease (here two minutes, longer than
/// the test's deadline) runs out. Elsewhere it checks that a second relay takes over.
async fn a_relay_that_stops_lets_the_next_one_take_over_at_once<B: TestBackend>() {
    let Relaying {
        db: _db,
        outbox,
        nats,
        events,
    } = relaying::<B>().await;
    let first = Relay::new(outbox.clone())
        .lease(Duration::from_secs(120))
        .poll_interval(Duration::from_millis(100));
    let (stop, relaying) = run(first, &nats.js);
    commit(
        &outbox,
        [OutboxMessage::new(&*events.subject, b"1".to_vec())],
    )
    .await;
    wait_until("the first relay's row", DEADLINE, || async {
        events.count().await == 1
    })
    .await
    .unwrap();
    stop.cancel();
    relaying.await.unwrap();
    let next = Relay::new(outbox.clone())
        .lease(Duration::from_secs(120))
        .poll_interval(Duration::from_millis(100));
    let (stop, relaying) = run(next, &nats.js);
    commit(
        &outbox,
        [OutboxMessage::new(&*events.subject, b"2".to_vec())],
    )
    .await;
    wait_until(
        "the next relay's row, before the lease runs out",
        DEADLINE,
        || async { events.count().await == 2 },
    )
    .await
    .unwrap();
    stop.cancel();
    assert_eq!(relaying.await.unwrap().published, 1);
}

/// The test. A relay whose turn lapses while it holds a pass (SQLite's lease, run out during a
/// pause longer than it) and the relay that takes the turn over both find a row NATS refuses, and
/// both record it as failed: the second record changes nothing. Before, its INSERT broke the
/// failed rows' primary key and failed the first relay's pass. PostgreSQL and MySQL lock the row
/// for the first relay's pass, so the second takes nothing there.
async fn a_refusal_recorded_twice_is_kept_once<B: TestBackend>() {
    let Relaying {
        db,
        outbox,
        nats,
        events,
    } = relaying::<B>().await;
    let max = nats.js.client().server_info().max_payload;
    // Committed before any relay told the outbox the server's limit.
    commit(
        &outbox,
        [OutboxMessage::new(&*events.subject, vec![b'x'; max + 1]).order_key("big")],
    )
    .await;
    let (hold, held, release) = hold_first_pass();
    let first = Relay::new(outbox.clone()).before_mark(hold);
    let js = nats.js.clone();
    let first_run = tokio::spawn(async move { first.drain(&js).await });
    tokio::time::timeout(DEADLINE, held.notified())
        .await
        .expect("the first relay to hold its pass");
    if B::SINGLE_WRITER {
        B::exec(
            &db,
            "UPDATE outbox_relay SET lease_until = '2000-01-01T00:00:00.000Z'",
        )
        .await;
    }
    // On the servers, an earlier version's relay (no turn), which passes over the locked row.
    let second = Relay::new(outbox.clone()).without_turns();
    let second = second.drain(&nats.js).await.unwrap();
    let taken_over = u64::from(B::SINGLE_WRITER);
    assert_eq!(second.failed, taken_over, "{second:?}");
    release.notify_one();
    let first = first_run
        .await
        .unwrap()
        .expect("the first relay's pass, recording a refusal recorded already");
    assert_eq!(first.failed, 1, "{first:?}");
    let failed = outbox.failed(10).await.unwrap();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(failed[0].error.contains("max payload"), "{failed:?}");
    assert_eq!(events.count().await, 0);
}

/// The test. A pass loads the oldest rows that fit its byte budget (and always one): five rows
/// of 600 bytes under a budget of 1,000 go in five passes, in order. Before, a pass loaded its
/// whole batch (100 rows) whatever their size.
async fn a_pass_loads_no_more_than_its_byte_budget<B: TestBackend>() {
    let Relaying {
        db: _db,
        outbox,
        nats,
        events,
    } = relaying::<B>().await;
    let ids = commit(
        &outbox,
        (0..5).map(|i| OutboxMessage::new(&*events.subject, vec![b'0' + i as u8; 600])),
    )
    .await;
    let passes = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = Arc::clone(&passes);
    let relay = Relay::new(outbox.clone())
        .max_bytes(1_000)
        .before_mark(Arc::new(move || {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async {}.boxed()
        }));
    let (stop, relaying) = run(relay, &nats.js);
    wait_until("every row", DEADLINE, || async {
        events.count().await == 5
    })
    .await
    .unwrap();
    stop.cancel();
    let stats = relaying.await.unwrap();
    assert_eq!((stats.published, stats.marked), (5, 5), "{stats:?}");
    assert_eq!(
        passes.load(std::sync::atomic::Ordering::SeqCst),
        5,
        "one row per pass under the budget"
    );
    let stored: Vec<String> = events
        .messages()
        .await
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(stored, ids, "in order");
}

/// Whether nats-server `version` ("2.12.0", "v2.15.1-beta") is at least `(major, minor)`.
fn at_least(version: &str, wanted: (u64, u64)) -> bool {
    let mut parts = version
        .trim_start_matches('v')
        .split(['.', '-'])
        .map(|p| p.parse::<u64>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) >= wanted,
        _ => false,
    }
}

/// SQLite's relay writes a pass's marks and refusals without a transaction (its turn is a
/// lease): when recording a refusal failed, the rows it had just marked sent (sent, and marked in
/// the database) were missing from `RelayStats::marked`. Each write is counted as it lands now.
/// The servers' relays write a pass in one transaction, which the failure rolls back whole: they
/// count nothing, and the row is marked by a later pass.
async fn rows_marked_before_a_failed_record_are_counted<B: TestBackend>() {
    let Relaying {
        db,
        outbox,
        nats,
        events,
    } = relaying::<B>().await;
    let max = nats.js.client().server_info().max_payload;
    // Committed before any relay told the outbox the server's limit: refused at publish.
    commit(
        &outbox,
        [
            OutboxMessage::new(&*events.subject, b"good".to_vec()).order_key("good"),
            OutboxMessage::new(&*events.subject, vec![b'x'; max + 1]).order_key("big"),
        ],
    )
    .await;
    // Recording the refusal fails (as it would on a lost connection).
    let refuse: &[&'static str] = match B::BACKEND {
        Backend::Postgres => &[
            "CREATE FUNCTION no_failed() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$",
            "CREATE TRIGGER no_failed BEFORE INSERT ON outbox_failed \
             FOR EACH ROW EXECUTE FUNCTION no_failed()",
        ],
        Backend::MySql => &["CREATE TRIGGER no_failed BEFORE INSERT ON outbox_failed \
             FOR EACH ROW SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by the test'"],
        Backend::Sqlite => &["CREATE TRIGGER no_failed BEFORE INSERT ON outbox_failed \
             BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"],
    };
    for sql in refuse {
        B::exec(&db, sql).await;
    }
    let relay = Relay::new(outbox.clone()).poll_interval(Duration::from_millis(100));
    let (stop, relaying) = run(relay, &nats.js);
    wait_until("the good row to be published", DEADLINE, || async {
        events.count().await == 1
    })
    .await
    .unwrap();
    let sent = "SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL";
    if B::SINGLE_WRITER {
        wait_until("the good row to be marked sent", DEADLINE, || async {
            B::count(&db, sent).await == 1
        })
        .await
        .unwrap();
    }
    stop.cancel();
    let stats = relaying.await.expect("the relay's task");
    if B::SINGLE_WRITER {
        assert_eq!(
            stats.marked, 1,
            "a row marked sent is not counted: {stats:?}"
        );
    } else {
        assert_eq!(stats.marked, 0, "a rolled-back mark is counted: {stats:?}");
        assert_eq!(B::count(&db, sent).await, 0, "a mark outlived its rollback");
    }
    assert_eq!(stats.failed, 0, "{stats:?}");
}

/// The test.
async fn a_subject_over_the_control_line_is_refused_and_the_connection_kept<B: TestBackend>() {
    let (db, _) = setup::<B>(4).await;
    let outbox = outbox(db.pool.clone()).await;
    let nats = NatsStream::create().await;
    // The stream takes the subjects below its own, however long.
    let events = Events::create_with(&nats.js, |mut c| {
        let below = format!("{}.>", c.subjects[0]);
        c.subjects.push(below);
        c
    })
    .await;
    let under = |len: usize| {
        let prefix = format!("{}.", events.subject);
        format!("{prefix}{}", "x".repeat(len - prefix.len()))
    };
    let longest = under(inbox_runtime::MAX_OUTBOX_SUBJECT_LEN);
    let over = OutboxMessage::new(under(longest.len() + 1), b"over".to_vec());
    refused_at_enqueue(&outbox, over, "max_control_line").await;
    // Written by another writer: a subject no server with the default `max_control_line` takes
    // (4,096 bytes), with a later row of its key behind it.
    let forged = commit(
        &outbox,
        [
            OutboxMessage::new(format!("{}.short", events.subject), b"forged".to_vec())
                .order_key("long"),
            OutboxMessage::new(&*events.subject, b"after forged".to_vec()).order_key("long"),
        ],
    )
    .await;
    let sql = format!(
        "UPDATE outbox SET subject = '{}' WHERE msg_id = '{}'",
        under(4500),
        forged[0]
    );
    B::exec(&db, Box::leak(sql.into_boxed_str())).await;
    commit(
        &outbox,
        [
            OutboxMessage::new(&*longest, b"longest".to_vec()).order_key("longest"),
            OutboxMessage::new(&*events.subject, b"good".to_vec()).order_key("g"),
        ],
    )
    .await;
    let connects = || {
        let stats = nats.js.client().statistics();
        stats.connects.load(std::sync::atomic::Ordering::Relaxed)
    };
    let connected = connects();
    relay_until(&outbox, &nats, &events, 2, 1).await;
    let mut stored: Vec<Vec<u8>> = events
        .messages()
        .await
        .into_iter()
        .map(|(_, p)| p)
        .collect();
    stored.sort();
    assert_eq!(stored, [b"good".to_vec(), b"longest".to_vec()]);
    let failed = outbox.failed(10).await.unwrap();
    assert_eq!(failed[0].order_key, "long");
    assert!(
        failed[0].error.contains("max_control_line"),
        "{:?}",
        failed[0].error
    );
    assert_eq!(
        connects(),
        connected,
        "the NATS connection was closed and made again"
    );
    // The forged row and the row of its key behind it.
    assert_eq!(outbox.pending().await.unwrap().0, 2);
}

/// The test.
async fn rows_jetstream_refuses_for_good_are_kept_failed<B: TestBackend>() {
    let Relaying {
        db,
        outbox,
        nats,
        events,
    } = relaying::<B>().await;
    let subject = &*events.subject;
    let expecting =
        OutboxMessage::new(subject, b"x".to_vec()).header("Nats-Expected-Last-Sequence", "1000");
    refused_at_enqueue(&outbox, expecting, "expectation").await;
    let value = "h".repeat(inbox_runtime::MAX_OUTBOX_HEADERS_LEN);
    let big = OutboxMessage::new(subject, b"x".to_vec()).header("X-Big", value);
    refused_at_enqueue(&outbox, big, "headers are").await;
    // Written by another writer: an expectation the stream does not meet, and a header block
    // over the 64 KiB JetStream takes. JetStream refuses each at every try.
    let ids = commit(
        &outbox,
        [
            OutboxMessage::new(subject, b"expecting".to_vec()).order_key("e"),
            OutboxMessage::new(subject, b"after expecting".to_vec()).order_key("e"),
            OutboxMessage::new(subject, b"big headers".to_vec()).order_key("b"),
            OutboxMessage::new(subject, b"good".to_vec()).order_key("g"),
        ],
    )
    .await;
    let forge = |sql: String| B::exec(&db, Box::leak(sql.into_boxed_str()));
    forge(format!(
        r#"UPDATE outbox SET headers = '[["Nats-Expected-Last-Sequence","1000"]]' WHERE msg_id = '{}'"#,
        ids[0]
    ))
    .await;
    forge(format!(
        r#"UPDATE outbox SET headers = '[["X-Big","{}"]]' WHERE msg_id = '{}'"#,
        "h".repeat(70_000),
        ids[2]
    ))
    .await;
    relay_until(&outbox, &nats, &events, 1, 2).await;
    let failed = outbox.failed(10).await.unwrap();
    let keys: Vec<&str> = failed.iter().map(|f| f.order_key.as_str()).collect();
    assert_eq!(keys, ["e", "b"], "{failed:?}");
    assert_eq!(events.messages().await[0].1, b"good");
    // The two failed rows, and the row held behind one.
    assert_eq!(outbox.pending().await.unwrap().0, 3);
}

super::behaviours!(
    handler_that_fails_after_publishing_publishes_nothing,
    commit_wakes_the_relay,
    poll_sends_a_row_nobody_woke_the_relay_for,
    relay_stopped_before_marking_sent_is_republished_once,
    two_relays_publish_each_row_once_in_key_order,
    relay_refuses_streams_it_cannot_relay_to_safely,
    cleanup_deletes_sent_rows_after_the_retention,
    refused_rows_neither_panic_the_relay_nor_stall_other_keys,
    a_subject_over_the_control_line_is_refused_and_the_connection_kept,
    rows_jetstream_refuses_for_good_are_kept_failed,
    a_relay_that_panics_is_started_again_and_the_workers_go_on,
    a_relay_that_stops_lets_the_next_one_take_over_at_once,
    a_pass_loads_no_more_than_its_byte_budget,
    a_refusal_recorded_twice_is_kept_once,
    rows_marked_before_a_failed_record_are_counted,
);
