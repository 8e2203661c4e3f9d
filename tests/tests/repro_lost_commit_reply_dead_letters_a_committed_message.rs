//! The connection is lost while COMMIT's reply is on its way: the commit took effect, but the
//! client only sees an I/O error. The runtime treated that as a failure of the message, so on
//! the last delivery a committed message was dead-lettered (and on earlier ones, redelivered to
//! be skipped). Now it looks the marker up on another connection first: present, the message is
//! done. SQLite is in-process: no reply can be lost on the way.

use inbox_runtime::{Inbox, Outcome};
use inbox_testkit::{Backend, TcpProxy};
use inbox_tests::backends::TestBackend;
use inbox_tests::handlers::{Entry, Probe};

async fn lost_commit_reply_is_looked_up<B: TestBackend>() {
    let db = B::create(2).await;
    Inbox::new(db.pool.clone()).migrate().await.unwrap();
    let mut proxy = TcpProxy::reserve().unwrap();
    let (upstream, url) = inbox_tests::through_proxy(&db.url, proxy.port);
    proxy.start(&upstream).await.unwrap();
    let inbox = Inbox::new(B::connect(&url, 2).await);

    // The statement as it travels: PostgreSQL's simple query ends in NUL; MySQL's COM_QUERY
    // (0x03) is the packet's first byte, after its 3-byte length (7) and sequence number (0):
    // BEGIN's `READ COMMITTED`, and the COMMIT its statement starts with, must not match.
    proxy.lose_reply_to(match B::BACKEND {
        Backend::MySql => b"\x07\x00\x00\x00\x03COMMIT",
        _ => b"COMMIT\0",
    });
    let probe = Probe::open();
    let outcome = inbox
        .process(
            &B::Ledger::default(),
            &probe,
            Entry::new("k", 1, 1),
            &inbox_runtime::Delivery::default(),
        )
        .await;
    assert!(proxy.trap_sprung(), "the COMMIT went through the proxy");
    assert_eq!(
        outcome.expect("the commit landed: the message is done, not failed"),
        Outcome::Ack
    );
    assert_eq!(B::count(&db, "SELECT count(*) FROM ledger").await, 1);
    assert_eq!(B::count(&db, "SELECT count(*) FROM inbox").await, 1);
}

inbox_tests::on_server_backends!(lost_commit_reply_is_looked_up);
