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

inbox_tests::on_server_backends!(a_cut_migration_is_made_again);
