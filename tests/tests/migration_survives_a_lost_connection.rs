//! A migration whose connection is cut mid-way (a failover, an operator ending sessions, a
//! process starting while it happens) is made again on a new connection. The migrator retried
//! on the same connection, which fails every statement once lost, so all its attempts failed
//! and `credit` exited at start: "while executing migrations: expected to read 4 bytes, got 0
//! bytes at EOF" (CI's chaos run on MariaDB, which cuts every database connection). Here the
//! statement reaches the server, its reply is lost, and then the proxy drops every connection
//! (the server ends the sessions, their locks with them) and forwards new ones. SQLite is
//! in-process: no connection can be cut.

use inbox_runtime::{Inbox, Outbox};
use inbox_testkit::{Backend, TcpProxy, wait_until};
use inbox_tests::backends::TestBackend;
use std::time::Duration;

async fn a_cut_migration_is_made_again<B: TestBackend>() {
    let db = B::create(2).await;
    let mut proxy = TcpProxy::reserve().unwrap();
    let (upstream, url) = inbox_tests::through_proxy(&db.url, proxy.port);
    proxy.start(&upstream).await.unwrap();
    let pool = B::connect(&url, 2).await;
    // The migrator's first look at each table's migrations, and (MySQL) the turn row the
    // outbox's migration writes after its steps.
    let mut cuts = vec![
        (&b"_inbox_migrations"[..], "inbox"),
        (&b"_outbox_migrations"[..], "outbox"),
    ];
    if B::BACKEND == Backend::MySql {
        cuts.push((&b"INSERT INTO outbox_relay"[..], "outbox again"));
    }
    for (needle, what) in cuts {
        proxy.lose_reply_to(needle);
        let pool = pool.clone();
        let migrating = tokio::spawn(async move {
            match what {
                "inbox" => Inbox::new(pool).migrate().await,
                _ => Outbox::new(pool).migrate().await,
            }
        });
        wait_until(what, Duration::from_secs(30), async || proxy.trap_sprung())
            .await
            .unwrap();
        // Every connection dropped, both ways; new ones forwarded as before.
        proxy.switch_to(&upstream);
        migrating
            .await
            .unwrap()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    }
    for table in ["_inbox_migrations", "_outbox_migrations"] {
        let dirty = format!("SELECT count(*) FROM {table} WHERE success = FALSE");
        assert_eq!(B::count(&db, Box::leak(dirty.into_boxed_str())).await, 0);
    }
}

/// The pool's idle connections are lost before the migration starts (a process starting while
/// the database's sessions are ended, as CI's chaos run on MariaDB caught: "while executing
/// migrations: ... got 0 bytes at EOF" when taking the migration lock). The pool tests none on
/// acquire, so the lock is first asked for on a dead connection: it is taken again on another.
async fn a_pool_cut_before_migrating_is_made_again<B: TestBackend>() {
    let db = B::create(3).await;
    let pool = B::connect(&db.url, 3).await;
    for what in ["inbox", "outbox"] {
        // Every connection of the pool open and idle, then ended by the server.
        let held: Vec<_> = futures::future::try_join_all((0..3).map(|_| pool.acquire()))
            .await
            .unwrap();
        drop(held);
        // They go back to the pool in a task of their own.
        wait_until(
            "the pool's connections idle",
            Duration::from_secs(30),
            async || pool.num_idle() == 3,
        )
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"));
        let cut = B::cut_connections(&db).await.expect("a server backend");
        assert!(cut >= 3, "{what}: {cut} sessions ended, not the pool's 3");
        let migrated = match what {
            "inbox" => Inbox::new(pool.clone()).migrate().await,
            _ => Outbox::new(pool.clone()).migrate().await,
        };
        migrated.unwrap_or_else(|e| panic!("{what}: {e}"));
    }
}

inbox_tests::on_server_backends!(
    a_cut_migration_is_made_again,
    a_pool_cut_before_migrating_is_made_again
);
