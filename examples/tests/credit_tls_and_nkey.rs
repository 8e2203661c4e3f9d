//! `credit` against servers that demand more than loopback trust: a private PostgreSQL that
//! accepts TCP connections only over TLS (a throwaway self-signed certificate), reached with
//! `sslmode=require`, and a private nats-server that admits one NKey user, reached with
//! `NATS_NKEY`. Without TLS, or without the key, `credit` is refused and says so.

use inbox_examples::CreditRequested;
use inbox_testkit::{
    CreditProcess, PrivateNats, PrivatePostgres, Summary, consumer_ready, unique, wait_until,
};
use std::path::{Path, PathBuf};
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(90);

fn spawn(env: &[(&str, String)], log: &Path) -> CreditProcess {
    let binary = PathBuf::from(env!("CARGO_BIN_EXE_credit"));
    CreditProcess::spawn_with("credit", &binary, env, Some(log)).expect("spawn credit")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credit_reaches_postgres_over_tls_and_nats_with_an_nkey() {
    let pg = PrivatePostgres::start_with_tls()
        .await
        .unwrap_or_else(|e| panic!("private PostgreSQL with TLS: {e}"));
    let user = nkeys::KeyPair::new_user();
    let seed = user.seed().unwrap();
    let config = format!(
        "authorization {{ users = [ {{ nkey: {} }} ] }}\n",
        user.public_key()
    );
    let nats = PrivateNats::start_with_config(&config)
        .await
        .unwrap_or_else(|e| panic!("private nats-server with an NKey user: {e}"));
    let dir = std::env::temp_dir().join(unique("inbox-tls-"));
    std::fs::create_dir_all(&dir).unwrap();
    let seed_file = dir.join("user.nk");
    std::fs::write(&seed_file, &seed).unwrap();
    let stream = unique("TLS_");
    let subject = unique("tls.");
    let env = |database_url: String, nkey: bool| {
        let mut env = vec![
            ("NATS_URL", nats.url.clone()),
            ("DATABASE_URL", database_url),
            ("CREDIT_STREAM", stream.clone()),
            ("CREDIT_SUBJECT", subject.clone()),
            ("CREDIT_EVENTS_STREAM", format!("{stream}_EVENTS")),
            ("CREDIT_EVENTS_SUBJECT", format!("events.{subject}")),
            ("CREDIT_CONCURRENCY", "2".to_owned()),
        ];
        if nkey {
            env.push(("NATS_NKEY", seed_file.display().to_string()));
        }
        env
    };

    // Without the key, the server refuses the connection and `credit` stops, saying why.
    let log = dir.join("no-key.log");
    let mut refused = spawn(&env(pg.url("require"), false), &log);
    let status = refused.wait(DEADLINE).await.unwrap();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!status.success(), "{text}");
    assert!(text.to_lowercase().contains("authorization"), "{text}");

    // Without TLS, PostgreSQL refuses the connection (only `hostssl` is allowed).
    let log = dir.join("no-tls.log");
    let mut refused = spawn(&env(pg.url("disable"), true), &log);
    let status = refused.wait(DEADLINE).await.unwrap();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!status.success(), "{text}");
    assert!(text.contains("no encryption"), "{text}");

    // With both, it consumes.
    let log = dir.join("ok.log");
    let credit = spawn(&env(pg.url("require"), true), &log);
    let client = async_nats::ConnectOptions::new()
        .nkey(seed.clone())
        .connect(nats.url.as_str())
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client);
    consumer_ready(&js, &stream, "credit").await.unwrap();
    for (i, amount) in [1i64, 2, 3].into_iter().enumerate() {
        let msg = CreditRequested {
            id: format!("tls-{i}"),
            account: 1,
            amount,
        };
        let payload = serde_json::to_vec(&msg).unwrap();
        js.publish(subject.clone(), payload.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let pool = sqlx::PgPool::connect(&pg.url("require")).await.unwrap();
    wait_until("the credits over TLS", DEADLINE, async || {
        sqlx::query_scalar::<_, i64>("SELECT balance FROM accounts WHERE id = 1")
            .fetch_optional(&pool)
            .await
            .ok()
            .flatten()
            == Some(6)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", std::fs::read_to_string(&log).unwrap_or_default()));
    let summary = credit.stop(DEADLINE).await.unwrap();
    assert_eq!(
        summary,
        Summary {
            applied: 3,
            skipped: 0,
            nacked: 0,
            terminated: 0
        }
    );
    // The server saw TLS: every connection of ours is encrypted.
    let plain: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_ssl JOIN pg_stat_activity USING (pid) \
         WHERE NOT ssl AND client_addr IS NOT NULL",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(plain, 0);
    pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}
