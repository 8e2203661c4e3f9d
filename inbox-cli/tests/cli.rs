//! The `inbox` command driven from outside, as an operator would, against real services on
//! every backend: status, groups, replay (dry run, once, again, interrupted by SIGKILL), forget.

use inbox_testkit::{Poll, wait_until};
use inbox_tests::backends::{TestBackend, TestDb};
use inbox_tests::handlers::{Entry, Failure, Probe};
use inbox_tests::{NatsStream, Running};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// `inbox args..` on `db` and `nats`, waited for.
fn inbox<DB: sqlx::Database>(db: &TestDb<DB>, nats: &NatsStream, args: &[&str]) -> Output {
    command(db, nats, args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run inbox: {e}"))
}

fn command<DB: sqlx::Database>(db: &TestDb<DB>, nats: &NatsStream, args: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_inbox"));
    command
        .env("DATABASE_URL", &db.url)
        .env("NATS_URL", nats.url())
        .env_remove("NATS_CREDS")
        .args([
            "--dlq-stream",
            &nats.dlq_stream,
            "--dlq-prefix",
            &nats.dlq_prefix,
        ])
        .args(args);
    command
}

/// Its stdout, once it exited 0.
fn ok(output: Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "inbox failed ({}): {stdout}{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

fn json(output: Output) -> serde_json::Value {
    serde_json::from_str(&ok(output)).expect("inbox --json prints JSON")
}

/// Five messages whose handler fails for good the first five times: five dead letters of one
/// kind. `status` and `groups` say so; a dry run changes nothing; a replay, once the cause is
/// gone, applies each once and empties the stream; a second replay replays nothing; `forget`
/// removes a marker, and says so when there is none. Another consumer of the same stream
/// (transport-keyed), which applied the originals, acks the replays without applying them again:
/// a replay is addressed to the consumer whose letter it was.
async fn five_letters_replayed_are_applied_once<B: TestBackend>() {
    let db = B::create(4).await;
    B::inbox(db.pool.clone()).migrate().await.unwrap();
    let nats = NatsStream::create().await;
    let consumer = nats.consumer("ledger", Duration::from_secs(30)).await;
    let worker = nats
        .worker(B::inbox(db.pool.clone()), consumer)
        .build_with_state(B::Ledger::default(), Probe::failing(5, Failure::Permanent))
        .unwrap();
    let run = Running::start(&worker);
    let other = nats
        .worker(
            B::inbox(db.pool.clone()),
            nats.consumer("other", Duration::from_secs(30)).await,
        )
        .build_with_state(B::ProbedByTransportId::default(), Probe::open())
        .unwrap();
    let other_run = Running::start(&other);
    nats.publish_all((0..5).map(|i| Entry::new(format!("m-{i}"), i, 1).json()))
        .await;
    wait_until("five dead letters", Duration::from_secs(60), async || {
        worker.stats().terminated == 5 && other.stats().acked == 5
    })
    .await
    .unwrap();
    // The other consumer's rows.
    let ledger = "SELECT count(*) FROM ledger";
    assert_eq!(B::count(&db, ledger).await, 5);

    let status = json(inbox(
        &db,
        &nats,
        &["status", "--json", "--stream", &nats.stream],
    ));
    let ledger_status = status["consumers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["consumer"] == "ledger")
        .unwrap_or_else(|| panic!("no consumer ledger in {status}"));
    assert_eq!(ledger_status["dead_letters"], 5, "{status}");
    assert_eq!(ledger_status["markers"], 0, "{status}");
    assert_eq!(
        ledger_status["durable"]["stream"],
        nats.stream.as_str(),
        "{status}"
    );
    let text = ok(inbox(&db, &nats, &["status"]));
    assert!(text.contains("dead letters  5"), "{text}");

    let groups = json(inbox(&db, &nats, &["dlq", "groups", "--json"]));
    let groups = groups.as_array().unwrap();
    assert_eq!(groups.len(), 1, "{groups:?}");
    assert_eq!(groups[0]["count"], 5);
    assert!(
        groups[0]["kind"]
            .as_str()
            .unwrap()
            .contains("handler failed"),
        "{groups:?}"
    );
    let letters = json(inbox(&db, &nats, &["dlq", "list", "--json"]));
    let letters = letters.as_array().unwrap();
    assert_eq!(letters.len(), 5);
    assert_eq!(letters[0]["subject"], nats.subject.as_str());
    let mut keys: Vec<&str> = letters.iter().map(|l| l["key"].as_str().unwrap()).collect();
    keys.sort();
    assert_eq!(keys, ["m-0", "m-1", "m-2", "m-3", "m-4"]);

    let dry = ok(inbox(&db, &nats, &["dlq", "replay", "--all", "--dry-run"]));
    assert!(dry.contains("would replay 5 letters"), "{dry}");
    assert_eq!(
        json(inbox(&db, &nats, &["dlq", "list", "--json"]))
            .as_array()
            .unwrap()
            .len(),
        5
    );
    assert_eq!(B::count(&db, ledger).await, 5);

    let group = groups[0]["id"].as_str().unwrap();
    let replayed = ok(inbox(&db, &nats, &["dlq", "replay", "--group", group]));
    assert!(replayed.contains("replayed 5 letters"), "{replayed}");
    wait_until(
        "the replays to be applied",
        Duration::from_secs(60),
        async || B::count(&db, ledger).await == 10,
    )
    .await
    .unwrap();
    assert!(
        json(inbox(&db, &nats, &["dlq", "list", "--json"]))
            .as_array()
            .unwrap()
            .is_empty()
    );
    let again = ok(inbox(&db, &nats, &["dlq", "replay", "--all"]));
    assert!(again.contains("replayed 0 letters"), "{again}");
    nats.wait_drained("ledger").await;
    nats.wait_drained("other").await;
    let other_stats = other_run.stop().await;
    assert_eq!(
        (other_stats.acked, other_stats.skipped),
        (5, 5),
        "the other consumer applied replays addressed to ledger: {other_stats:?}"
    );
    assert_eq!(B::count(&db, ledger).await, 10);
    let distinct = "SELECT count(DISTINCT msg_key) FROM ledger";
    assert_eq!(B::count(&db, distinct).await, 5);

    ok(inbox(
        &db,
        &nats,
        &["forget", "--consumer", "ledger", "--key", "m-0", "--yes"],
    ));
    let markers = "SELECT count(*) FROM inbox WHERE consumer = 'ledger'";
    assert_eq!(B::count(&db, markers).await, 4);
    let none = inbox(
        &db,
        &nats,
        &["forget", "--consumer", "ledger", "--key", "m-0", "--yes"],
    );
    assert_eq!(none.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&none.stderr).contains("no marker"));
    let stats = run.stop().await;
    assert_eq!((stats.acked, stats.terminated), (5, 5), "{stats:?}");
}

/// A replay killed between a publish and the deletion of its letter, run again after the
/// stream's duplicate window: the letter is published twice, and applied once. And a replay
/// keeps the original's key (here its transport id: no key in the payload): a letter whose key
/// was applied meanwhile (the producer sent the message again under its id, say) is skipped.
async fn replay_killed_midway_applies_each_once<B: TestBackend>() {
    let db = B::create(4).await;
    B::inbox(db.pool.clone()).migrate().await.unwrap();
    let window = Duration::from_secs(1);
    let nats = NatsStream::create_with(async_nats::jetstream::stream::Config {
        duplicate_window: window,
        max_age: Duration::from_secs(3600),
        ..Default::default()
    })
    .await;
    let durable = "probed_by_transport_id";
    let consumer = nats.consumer(durable, Duration::from_secs(30)).await;
    let worker = nats
        .worker(B::inbox(db.pool.clone()), consumer)
        .build_with_state(
            B::ProbedByTransportId::default(),
            Probe::failing(3, Failure::Permanent),
        )
        .unwrap();
    let run = Running::start(&worker);
    nats.publish_all((0..3).map(|i| Entry::new(format!("m-{i}"), i, 1).json()))
        .await;
    wait_until("three dead letters", Duration::from_secs(60), async || {
        worker.stats().terminated == 3
    })
    .await
    .unwrap();

    // The third letter's key applied meanwhile.
    let letters = json(inbox(&db, &nats, &["dlq", "list", "--json"]));
    let third = letters[2]["key"]
        .as_str()
        .expect("the letter names its key")
        .to_owned();
    assert!(third.starts_with(&format!("{}:", nats.stream)), "{third}");
    let marker =
        format!("INSERT INTO inbox (consumer, message_key) VALUES ('{durable}', '{third}')");
    B::exec(&db, marker.leak()).await;

    // Held after its second publish, before that letter is deleted; then killed.
    let mut held = command(&db, &nats, &["dlq", "replay", "--all"])
        .env("INBOX_CLI_TEST_HOLD_AFTER_PUBLISH", "2")
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut stderr = held.stderr.take().unwrap();
    let said = tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let mut line = [0u8; 256];
        let n = stderr.read(&mut line).unwrap_or(0);
        String::from_utf8_lossy(&line[..n]).into_owned()
    })
    .await
    .unwrap();
    assert!(said.contains("held after publishing"), "{said}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(held.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    held.wait().unwrap();
    wait_until("two replays applied", Duration::from_secs(60), async || {
        B::count(&db, "SELECT count(*) FROM ledger").await == 2
    })
    .await
    .unwrap();
    // Past the duplicate window, a second publish of the same replay is stored again.
    let mut poll = Poll::new("the duplicate window to pass", window * 30);
    while poll.elapsed() < window * 2 {
        poll.tick().await.unwrap();
    }
    let again = ok(inbox(&db, &nats, &["dlq", "replay", "--all"]));
    assert!(again.contains("replayed 2 letters"), "{again}");
    // The second letter again, and the third: both skipped.
    wait_until(
        "the second replay to be served",
        Duration::from_secs(60),
        async || {
            let s = worker.stats();
            s.acked == 2 && s.skipped == 2
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}: {:?}", worker.stats()));
    nats.wait_drained(durable).await;
    run.stop().await;
    inbox_tests::backends::assert_applied_once::<B>(&db, 2).await;
}

/// The exit code and stderr of a command that must fail with exit code 1 and say `why`.
fn fails(output: Output, why: &str) {
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(why), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
}

/// Runs `sql` (built at run time) on `db`.
async fn exec<B: TestBackend>(db: &TestDb<B::Db>, sql: String) {
    B::exec(db, sql.leak()).await;
}

/// `dlq purge`, `claims list|release|forget`, `outbox list|retry|discard`, `parked
/// list|retry`, each on a state the test set up in the tables (as another version or an
/// operator's SQL would leave it), and usage errors exiting 2.
async fn the_other_commands_do_what_they_say<B: TestBackend>() {
    let db = B::create(4).await;
    let inbox_handle = B::inbox(db.pool.clone());
    inbox_handle.migrate().await.unwrap();
    let outbox = inbox_runtime::Outbox::new(db.pool.clone());
    outbox.migrate().await.unwrap();
    let nats = NatsStream::create().await;

    // Usage errors: exit 2.
    assert_eq!(
        inbox(&db, &nats, &["dlq", "purge", "--all"]).status.code(),
        Some(2)
    );
    assert_eq!(
        inbox(&db, &nats, &["claims", "release"]).status.code(),
        Some(2)
    );
    assert_eq!(inbox(&db, &nats, &["nonsense"]).status.code(), Some(2));

    // Claims: an open one (no processed_at, a lease) and a done one.
    exec::<B>(
        &db,
        "INSERT INTO inbox (consumer, message_key, fence, attempts) \
                    VALUES ('remote', 'open-1', 1, 1), ('remote', 'done-1', 1, 1)"
            .into(),
    )
    .await;
    exec::<B>(
        &db,
        "UPDATE inbox SET lease_until = received_at WHERE consumer = 'remote'".into(),
    )
    .await;
    exec::<B>(
        &db,
        "UPDATE inbox SET processed_at = received_at WHERE message_key = 'done-1'".into(),
    )
    .await;
    let claims = json(inbox(&db, &nats, &["claims", "list", "--json"]));
    let claims = claims.as_array().unwrap();
    assert_eq!(claims.len(), 1, "{claims:?}");
    assert_eq!(claims[0]["key"], "open-1");
    ok(inbox(
        &db,
        &nats,
        &[
            "claims",
            "release",
            "--consumer",
            "remote",
            "--key",
            "open-1",
        ],
    ));
    fails(
        inbox(
            &db,
            &nats,
            &[
                "claims",
                "release",
                "--consumer",
                "remote",
                "--key",
                "done-1",
            ],
        ),
        "no open claim",
    );
    ok(inbox(
        &db,
        &nats,
        &[
            "claims",
            "forget",
            "--consumer",
            "remote",
            "--key",
            "open-1",
            "--yes",
        ],
    ));
    assert!(
        json(inbox(&db, &nats, &["claims", "list", "--json"]))
            .as_array()
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        B::count(&db, "SELECT count(*) FROM inbox WHERE consumer = 'remote'").await,
        1
    );

    // The outbox: two rows of one order key, the first refused for good.
    let mut tx = db.pool.begin().await.unwrap();
    for n in 0..2 {
        let message = inbox_runtime::OutboxMessage::new(format!("{}.out", nats.subject), vec![n])
            .order_key("k");
        outbox.enqueue(&mut tx, message).await.unwrap();
    }
    tx.commit().await.unwrap();
    let first = B::count(&db, "SELECT min(id) FROM outbox").await;
    exec::<B>(&db, format!(
        "INSERT INTO outbox_failed (id, order_key, error) VALUES ({first}, 'k', 'no stream for the subject')"
    )).await;
    let pending = json(inbox(&db, &nats, &["outbox", "list", "--json"]));
    assert_eq!(pending.as_array().unwrap().len(), 1, "{pending}");
    let failed = json(inbox(&db, &nats, &["outbox", "list", "--failed", "--json"]));
    assert_eq!(failed[0]["id"], first, "{failed}");
    assert_eq!(failed[0]["error"], "no stream for the subject");
    let status = json(inbox(&db, &nats, &["status", "--json"]));
    assert_eq!(status["outbox"]["failed"], 1, "{status}");
    ok(inbox(&db, &nats, &["outbox", "retry", &first.to_string()]));
    fails(
        inbox(&db, &nats, &["outbox", "retry", &first.to_string()]),
        "no failed outbox row",
    );
    exec::<B>(
        &db,
        format!("INSERT INTO outbox_failed (id, order_key, error) VALUES ({first}, 'k', 'again')"),
    )
    .await;
    ok(inbox(
        &db,
        &nats,
        &["outbox", "discard", &first.to_string(), "--yes"],
    ));
    assert!(
        json(inbox(&db, &nats, &["outbox", "list", "--failed", "--json"]))
            .as_array()
            .unwrap()
            .is_empty()
    );

    // A parked letter: listed, then published to the dead-letter stream, where `dlq` sees it,
    // and `dlq purge` deletes it.
    let payload = match B::BACKEND {
        inbox_testkit::Backend::Postgres => "decode('7b7d', 'hex')",
        inbox_testkit::Backend::MySql => "UNHEX('7B7D')",
        inbox_testkit::Backend::Sqlite => "X'7B7D'",
    };
    let headers = format!(
        r#"[["Inbox-Error","handler failed: parked"],["Inbox-Consumer","ledger"],["Inbox-Stream","{}"],["Inbox-Stream-Seq","3"]]"#,
        nats.stream
    );
    exec::<B>(&db, format!(
        "INSERT INTO inbox_dead_letters (consumer, headers, payload) VALUES ('ledger', '{headers}', {payload})"
    )).await;
    let parked = json(inbox(&db, &nats, &["parked", "list", "--json"]));
    assert_eq!(parked.as_array().unwrap().len(), 1, "{parked}");
    assert_eq!(parked[0]["error"], "handler failed: parked");
    let status = json(inbox(
        &db,
        &nats,
        &["status", "--consumer", "ledger", "--json"],
    ));
    assert_eq!(status["consumers"][0]["parked_letters"], 1, "{status}");
    let sent = ok(inbox(&db, &nats, &["parked", "retry"]));
    assert!(sent.contains("published 1 parked letters"), "{sent}");
    assert!(
        json(inbox(&db, &nats, &["parked", "list", "--json"]))
            .as_array()
            .unwrap()
            .is_empty()
    );
    let letters = json(inbox(&db, &nats, &["dlq", "list", "--json"]));
    assert_eq!(letters.as_array().unwrap().len(), 1, "{letters}");
    let seq = letters[0]["seq"].as_u64().unwrap().to_string();
    fails(
        inbox(&db, &nats, &["dlq", "purge", "999999", "--yes"]),
        "no dead letter",
    );
    let purged = ok(inbox(&db, &nats, &["dlq", "purge", &seq, "--yes"]));
    assert!(purged.contains("purged 1 letters"), "{purged}");
    assert!(
        json(inbox(&db, &nats, &["dlq", "list", "--json"]))
            .as_array()
            .unwrap()
            .is_empty()
    );

    // A letter of a message published without a reply subject to a subject of 4,080 bytes,
    // which nats-server takes (`PUB <subject> 2` is under 4,096 bytes): its replay, which waits
    // for a PubAck, would pass the limit. It is refused and kept, and no replay was published.
    let long = format!(
        "{}.{}",
        nats.subject,
        "x".repeat(4080 - nats.subject.len() - 1)
    );
    let headers = format!(
        r#"[["Inbox-Error","handler failed: long"],["Inbox-Consumer","ledger"],["Inbox-Stream","{}"],["Inbox-Stream-Seq","4"],["Inbox-Subject","{long}"],["Inbox-Key","long-1"]]"#,
        nats.stream
    );
    exec::<B>(&db, format!(
        "INSERT INTO inbox_dead_letters (consumer, headers, payload) VALUES ('ledger', '{headers}', {payload})"
    )).await;
    let sent = ok(inbox(&db, &nats, &["parked", "retry"]));
    assert!(sent.contains("published 1 parked letters"), "{sent}");
    // The stream takes the long subject too, so that only the limit stands in the way.
    let mut config = nats
        .js
        .get_stream(&nats.stream)
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    config.subjects.push(format!("{}.>", nats.subject));
    nats.js
        .update_stream(config)
        .await
        .expect("the stream takes the long subject");
    let messages = async || {
        let mut stream = nats.js.get_stream(&nats.stream).await.unwrap();
        stream.info().await.unwrap().state.messages
    };
    let stored = messages().await;
    fails(
        inbox(&db, &nats, &["dlq", "replay", "--all"]),
        "over the 3840 a publish can carry",
    );
    assert_eq!(messages().await, stored, "a replay was published");
    let letters = json(inbox(&db, &nats, &["dlq", "list", "--json"]));
    assert_eq!(
        letters.as_array().unwrap().len(),
        1,
        "the letter is kept: {letters}"
    );
    assert_eq!(letters[0]["subject"], long.as_str());

    // A letter another client stored with a header line async-nats cannot read (a value that is
    // not UTF-8), beside the one above: both are listed, the raw one with what can be read of
    // it, where async-nats's own read of the stream failed the whole listing.
    let raw = [
        b"Inbox-Error: handler failed: raw".to_vec(),
        b"Inbox-Consumer: ledger".to_vec(),
        b"X-Bin: \xff\xfe".to_vec(),
    ];
    let subject = format!("{}.ledger", nats.dlq_prefix);
    inbox_testkit::publish_raw_acked(nats.url(), &subject, &raw, b"{}")
        .await
        .expect("the raw letter is stored");
    let letters = json(inbox(&db, &nats, &["dlq", "list", "--json"]));
    let letters = letters.as_array().unwrap();
    assert_eq!(letters.len(), 2, "{letters:?}");
    assert_eq!(letters[1]["error"], "handler failed: raw", "{letters:?}");
    assert_eq!(letters[1]["consumer"], "ledger", "{letters:?}");
    assert_eq!(letters[1]["unreadable_headers"], 1, "{letters:?}");
    assert_eq!(letters[0]["unreadable_headers"], 0, "{letters:?}");
    let text = ok(inbox(&db, &nats, &["dlq", "list"]));
    assert!(
        text.contains("handler failed: raw (header lines async-nats cannot read, left out: 1)"),
        "{text}"
    );
}

/// A letter cut to fit (`Inbox-Truncated`: its payload and subject left out) is replayed from
/// its stored original, read by sequence; an original stored by another client with a header
/// line async-nats cannot parse is replayed with the headers it can, where async-nats's own
/// read of it refused the replay.
async fn a_cut_letter_is_replayed_from_an_original_no_client_parses<B: TestBackend>() {
    let db = B::create(2).await;
    let nats = NatsStream::create().await;
    let lines = [b"X-Ok: fine".to_vec(), b"X-Bin: \xff\xfe".to_vec()];
    let seq = inbox_testkit::publish_raw_acked(nats.url(), &nats.subject, &lines, b"original")
        .await
        .expect("the original is stored");
    let created = nats
        .js
        .get_stream(&nats.stream)
        .await
        .unwrap()
        .cached_info()
        .created
        .unix_timestamp_nanos();
    let stream = &nats.stream;
    let letter = [
        b"Inbox-Error: handler failed: cut".to_vec(),
        b"Inbox-Consumer: ledger".to_vec(),
        format!("Inbox-Stream: {stream}").into_bytes(),
        format!("Inbox-Stream-Seq: {seq}").into_bytes(),
        b"Inbox-Truncated: payload".to_vec(),
        format!("Nats-Msg-Id: dlq:ledger:{stream}:{created}:{seq}").into_bytes(),
    ];
    nats.js
        .create_stream(async_nats::jetstream::stream::Config {
            name: nats.dlq_stream.clone(),
            subjects: vec![format!("{}.>", nats.dlq_prefix)],
            ..Default::default()
        })
        .await
        .expect("the dead-letter stream is created");
    let subject = format!("{}.ledger", nats.dlq_prefix);
    inbox_testkit::publish_raw_acked(nats.url(), &subject, &letter, b"")
        .await
        .expect("the letter is stored");

    let replayed = ok(inbox(&db, &nats, &["dlq", "replay", "--all"]));
    assert!(replayed.contains("replayed 1 letters"), "{replayed}");
    let replay = nats
        .js
        .get_stream(stream)
        .await
        .unwrap()
        .get_raw_message(seq + 1)
        .await
        .expect("the replay is stored after its original");
    assert_eq!(replay.subject.as_str(), nats.subject.as_str());
    assert_eq!(&replay.payload[..], b"original");
    assert_eq!(replay.headers.get("X-Ok").map(|v| v.as_str()), Some("fine"));
    assert_eq!(
        replay
            .headers
            .get(inbox_runtime::REPLAY_KEY)
            .map(|v| v.as_str().to_owned()),
        Some(format!("{stream}:{created}:{seq}"))
    );
    assert!(
        json(inbox(&db, &nats, &["dlq", "list", "--json"]))
            .as_array()
            .unwrap()
            .is_empty(),
        "the replayed letter is deleted"
    );

    // A letter whose line of ours cannot be read (here `Inbox-Truncated`) would be replayed
    // as if it were absent: refused, and kept.
    let unreadable = [
        b"Inbox-Error: handler failed: cut".to_vec(),
        b"Inbox-Consumer: ledger".to_vec(),
        format!("Inbox-Subject: {}", nats.subject).into_bytes(),
        b"Inbox-Truncated: \xff".to_vec(),
    ];
    inbox_testkit::publish_raw_acked(nats.url(), &subject, &unreadable, b"")
        .await
        .expect("the letter is stored");
    fails(
        inbox(&db, &nats, &["dlq", "replay", "--all"]),
        "\"Inbox-Truncated\" cannot be read",
    );
    let kept = json(inbox(&db, &nats, &["dlq", "list", "--json"]));
    assert_eq!(kept.as_array().unwrap().len(), 1, "{kept}");
}

inbox_tests::on_all_backends!(
    five_letters_replayed_are_applied_once,
    replay_killed_midway_applies_each_once,
    the_other_commands_do_what_they_say,
    a_cut_letter_is_replayed_from_an_original_no_client_parses,
);
