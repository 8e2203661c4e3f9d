//! Relays take turns: while one relay's pass holds its rows (PostgreSQL, MySQL: with the turn
//! its transaction took; SQLite: with its lease), another relay's pass waits for it (in the
//! database, where the wait shows) rather than taking rows of its own, which it would then
//! hold back behind the first's rows of the same keys; once the first has marked its rows, the
//! rest is relayed. Every row is published once, each key's rows in order.
//!
//! A turn held longer than a relay waits for it (another relay's pass stuck on JetStream, a
//! lease not yet run out) lets the relay's pass go without an error, and it relays once the
//! turn is free. On MySQL, an outbox without the turn table (its newest migration not run)
//! is relayed without turns. On PostgreSQL and MariaDB, a relay frozen mid-pass loses the turn once its
//! transaction has been idle for a minute.

use super::outbox::{
    DEADLINE, Events, Relaying, assert_in_key_order, commit, hold_first_pass, outbox, relaying, run,
};
use super::setup;
use crate::NatsStream;
use crate::backends::TestBackend;
use inbox_runtime::{OutboxMessage, Relay};
use inbox_testkit::{Backend, wait_until};
use std::collections::HashMap;

/// The test.
async fn a_relay_waits_for_the_pass_of_another<B: TestBackend>() {
    let (db, _) = setup::<B>(8).await;
    let outbox = outbox(db.pool.clone()).await;
    let nats = NatsStream::create().await;
    let events = Events::create(&nats.js).await;
    // The first relay's batch: two rows of each of keys k0..k4. Then six of each of k5..k9,
    // which a relay beside it without turns would publish at once.
    let mut next: HashMap<String, usize> = HashMap::new();
    let messages: Vec<OutboxMessage> = (0..40)
        .map(|n| {
            let key = format!("k{}", if n < 10 { n % 5 } else { 5 + n % 5 });
            let seq = next.entry(key.clone()).or_default();
            *seq += 1;
            OutboxMessage::new(&*events.subject, format!("{key}:{}", *seq - 1)).order_key(key)
        })
        .collect();
    commit(&outbox, messages).await;

    let (hold, held, release) = hold_first_pass();
    let first = Relay::new(outbox.clone()).batch(10).before_mark(hold);
    let first_stats = first.stats_handle();
    let (stop_first, first_run) = run(first, &nats.js);
    tokio::time::timeout(DEADLINE, held.notified())
        .await
        .expect("the first relay to hold its batch");
    let mut second = {
        let (relay, js) = (Relay::new(outbox.clone()).batch(50), nats.js.clone());
        tokio::spawn(async move { relay.drain(&js).await })
    };
    if B::SINGLE_WRITER {
        // The lease: the second relay's pass finds it taken and ends at once.
        let during = (&mut second).await.unwrap().unwrap();
        assert_eq!(during.published, 0, "{during:?}");
    } else {
        wait_until(
            "the second relay to wait for its turn",
            DEADLINE,
            async || B::waiting_for_relay_turn(&db).await >= 1,
        )
        .await
        .unwrap();
    }
    // Only the first relay's batch is out.
    assert_eq!(events.count().await, 10);
    release.notify_one();
    wait_until("every row relayed and marked", DEADLINE, async || {
        events.count().await == 40 && outbox.pending().await.unwrap().0 == 0
    })
    .await
    .unwrap();
    stop_first.cancel();
    let first_done = first_run.await.unwrap();
    let published = match B::SINGLE_WRITER {
        true => 0,
        false => {
            let second_done = second.await.unwrap().unwrap();
            assert_eq!(second_done.republished, 0, "{second_done:?}");
            second_done.published
        }
    };
    assert_eq!(first_done.republished, 0, "{first_done:?}");
    assert_eq!(first_done.published + published, 40);
    assert_eq!(first_stats().published, first_done.published);
    assert_in_key_order(events.messages().await);
}

/// A migrated outbox with three rows committed, and a stream for them.
async fn three_rows<B: TestBackend>() -> Relaying<B> {
    let relaying = relaying::<B>().await;
    let events = &relaying.events;
    let rows = (0..3).map(|n| OutboxMessage::new(&*events.subject, format!("{n}")));
    commit(&relaying.outbox, rows).await;
    relaying
}

/// The test.
async fn a_turn_held_too_long_lets_the_pass_go<B: TestBackend>() {
    let Relaying {
        db,
        outbox,
        nats,
        events,
    } = three_rows::<B>().await;
    // Another relay's turn, as the relays take it.
    let holder = match B::BACKEND {
        Backend::Postgres => Some(
            B::hold_in_transaction(
                &db,
                "SELECT pg_advisory_xact_lock(hashtext('inbox-runtime'), \
                 hashtext('outbox-relay-turn:outbox'))",
            )
            .await,
        ),
        Backend::MySql => Some(
            B::hold_in_transaction(&db, "SELECT id FROM outbox_relay WHERE id = 1 FOR UPDATE")
                .await,
        ),
        Backend::Sqlite => {
            B::exec(&db, "DELETE FROM outbox_relay").await;
            B::exec(
                &db,
                "INSERT INTO outbox_relay (id, owner, lease_until) \
                 VALUES (1, 'another relay', '9999-12-31T00:00:00.000Z')",
            )
            .await;
            None
        }
    };
    let relay = Relay::new(outbox.clone());
    let during = relay
        .drain(&nats.js)
        .await
        .expect("a pass let go is no error");
    assert_eq!(during.published, 0, "{during:?}");
    assert_eq!(events.count().await, 0);
    match holder {
        Some(tx) => tx.rollback().await.expect("ROLLBACK"),
        None => B::exec(&db, "DELETE FROM outbox_relay").await,
    }
    let after = relay.drain(&nats.js).await.expect("the relay's turn");
    assert_eq!(after.published, 3, "{after:?}");
    assert_eq!(outbox.pending().await.unwrap().0, 0);
    if B::BACKEND == Backend::MySql {
        // An outbox whose newest migration has not run (no turn table): relays go on, side by
        // side as before turns.
        B::exec(&db, "DROP TABLE outbox_relay").await;
        commit(&outbox, [OutboxMessage::new(&*events.subject, "3")]).await;
        let turnless = relay.drain(&nats.js).await.expect("a pass without turns");
        assert_eq!(turnless.published, 1, "{turnless:?}");
    }
}

super::behaviours!(
    a_relay_waits_for_the_pass_of_another,
    a_turn_held_too_long_lets_the_pass_go
);

/// A relay frozen mid-pass (stopped at its hook, as a process stopped or cut off from the
/// database would be) holds the turn, and the server ends its session once it has been idle in
/// its transaction for a minute (PostgreSQL's `idle_in_transaction_session_timeout`, MariaDB's
/// `idle_transaction_timeout`, set for the pass); then another relay takes the turn and
/// publishes the frozen relay's rows again, which the stream drops as duplicates.
async fn a_frozen_relay_lets_the_turn_go<B: TestBackend>() {
    let Relaying {
        db: _db,
        outbox,
        nats,
        events,
    } = three_rows::<B>().await;
    let (hold, held, _never_released) = hold_first_pass();
    let frozen = {
        let (relay, js) = (
            Relay::new(outbox.clone()).before_mark(hold),
            nats.js.clone(),
        );
        tokio::spawn(async move { relay.drain(&js).await })
    };
    tokio::time::timeout(DEADLINE, held.notified())
        .await
        .expect("the first relay to hold its pass");
    let second = Relay::new(outbox.clone());
    let mut republished = 0;
    wait_until("the frozen relay's turn to end", 3 * DEADLINE, async || {
        republished += second.drain(&nats.js).await.unwrap().republished;
        outbox.pending().await.unwrap().0 == 0
    })
    .await
    .unwrap();
    assert_eq!(republished, 3);
    assert_eq!(events.count().await, 3);
    frozen.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_relay_lets_the_turn_go_on_postgres() {
    a_frozen_relay_lets_the_turn_go::<crate::backends::Postgres>().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_relay_lets_the_turn_go_on_mysql() {
    a_frozen_relay_lets_the_turn_go::<crate::backends::MySql>().await;
}

/// MariaDB's bound on an idle transaction is the pass's alone: the pass gives the session its
/// setting back, so that a connection of the application's pool does not have its own idle
/// transactions ended after a minute. The pool has one connection, the relay's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_pass_gives_the_session_its_idle_bound_back_on_mysql() {
    type B = crate::backends::MySql;
    let db = B::create(1).await;
    let outbox = outbox(db.pool.clone()).await;
    let nats = NatsStream::create().await;
    let events = Events::create(&nats.js).await;
    let rows = (0..3).map(|n| OutboxMessage::new(&*events.subject, format!("{n}")));
    commit(&outbox, rows).await;
    let relayed = Relay::new(outbox.clone()).drain(&nats.js).await.unwrap();
    assert_eq!(relayed.published, 3, "{relayed:?}");
    let (session, global): (i64, i64) = sqlx::query_as(
        "SELECT CAST(@@SESSION.idle_transaction_timeout AS SIGNED), \
         CAST(@@GLOBAL.idle_transaction_timeout AS SIGNED)",
    )
    .fetch_one(&db.pool)
    .await
    .unwrap();
    assert_eq!(
        session, global,
        "the pass's setting was left on the connection"
    );
}
