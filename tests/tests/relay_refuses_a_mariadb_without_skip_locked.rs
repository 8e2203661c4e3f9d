//! MariaDB before 10.6 and MySQL before 8.0.1 have no `FOR UPDATE SKIP LOCKED`: every relay
//! pass failed there with a syntax error, for ever, with only warnings. `Relay::check` (which
//! `App::run` calls before it starts) now refuses such a server with an error naming its
//! version. No such server can be installed here, so a proxy of the test's own makes this
//! MariaDB report an older version (in its handshake and in `SELECT VERSION()`): the same text
//! with the minor version put before 10.6 (MySQL: the major before 8), of the same length.

use inbox_runtime::{Outbox, Relay, RelayError};
use inbox_testkit::TcpProxy;
use inbox_tests::NatsStream;
use inbox_tests::backends::{MySql, TestBackend};

/// `version` made older than SKIP LOCKED, keeping its length: MariaDB `10.11.19-MariaDB` →
/// `10.05.19-MariaDB`, MySQL `8.0.36` → `5.0.36`.
fn older_version(version: &str) -> String {
    let mariadb = version.to_ascii_lowercase().contains("mariadb");
    let (major, rest) = version.split_once('.').expect("a version with a dot");
    if mariadb {
        let (minor, rest) = rest.split_once('.').unwrap_or((rest, ""));
        let minor = format!("{:0>width$}", 5, width = minor.len());
        format!("{major}.{minor}.{rest}")
    } else {
        format!("{:0>width$}.{rest}", 5, width = major.len())
    }
}

async fn version_of(pool: &sqlx::MySqlPool) -> String {
    sqlx::query_scalar("SELECT VERSION()")
        .fetch_one(pool)
        .await
        .expect("SELECT VERSION()")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_refuses_a_mariadb_without_skip_locked() {
    let db = MySql::create(2).await;
    let nats = NatsStream::create().await;
    let version = version_of(&db.pool).await;
    let older = older_version(&version);
    assert_eq!(older.len(), version.len());
    let mut proxy = TcpProxy::reserve().unwrap();
    let (upstream, url) = inbox_tests::through_proxy(&db.url, proxy.port);
    proxy.start(&upstream).await.unwrap();

    // Through the proxy as it is, the relay checks out on this server.
    let pool = MySql::connect(&url, 2).await;
    let outbox = Outbox::new(pool.clone());
    outbox.migrate().await.expect("migrate the outbox");
    Relay::new(outbox)
        .check(&nats.js)
        .await
        .unwrap_or_else(|e| panic!("the relay refuses {version}: {e}"));
    pool.close().await;

    // The same server, saying it is older.
    proxy.rewrite_replies(version.as_bytes(), older.as_bytes());
    let pool = MySql::connect(&url, 2).await;
    assert_eq!(
        version_of(&pool).await,
        older,
        "the proxy rewrites the version"
    );
    let refused = Relay::new(Outbox::new(pool.clone())).check(&nats.js).await;
    let Err(e @ RelayError::Unsupported(_)) = refused else {
        panic!("the relay accepts a server that says it is {older}: {refused:?}");
    };
    let text = e.to_string();
    assert!(
        text.contains(&older) && text.contains("SKIP LOCKED") && text.contains("10.6"),
        "the error does not name the version, what it lacks and what has it: {text}"
    );
    pool.close().await;
}

#[test]
fn older_versions_keep_their_length() {
    assert_eq!(
        older_version("10.11.19-MariaDB-0+deb12u1"),
        "10.05.19-MariaDB-0+deb12u1"
    );
    assert_eq!(older_version("10.6.4-MariaDB"), "10.5.4-MariaDB");
    assert_eq!(older_version("8.0.36"), "5.0.36");
}
