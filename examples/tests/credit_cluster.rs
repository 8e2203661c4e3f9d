//! `credit` on a 3-node JetStream cluster (the test kit's [`PrivateCluster`]), as users outgrow one
//! nats-server: an R3 stream and consumer, three processes given the server list in `NATS_URL`,
//! and the stream leader killed twice mid-run (each restarted after a new leader is elected);
//! during the second election one process is SIGKILLed and started again, so that its start-up
//! meets the election. The dead-letter stream gets the stream's three replicas. Every request is applied exactly once, and every process exits 0 when
//! stopped: a leader election is a transient state the runtime waits out.
//!
//! Run with whichever `nats-server` the pass selects (`INBOX_NATS_SERVER`): Debian's on the
//! first pass of `cargo xtask test`, the current release on the second.

use async_nats::jetstream::{self, consumer::pull, stream};
use inbox_examples::CreditRequested;
use inbox_runtime::Inbox;
use inbox_testkit::{
    CreditConfig, CreditProcess, PrivateCluster, backlog, publish_acked, publish_and_wait, unique,
    wait_until,
};
use inbox_tests::backends::{Postgres, TestBackend, TestDb};
use std::collections::BTreeMap;
use std::time::Duration;

const DURABLE: &str = "credit_cluster";
/// Unique requests, each published twice; half before the first kill, half after the second.
const REQUESTS: i64 = 6_000;
/// How long a stopped `credit` may take to exit.
const STOP: Duration = Duration::from_secs(60);

fn requests(range: std::ops::Range<i64>) -> Vec<CreditRequested> {
    range
        .map(|i| CreditRequested {
            id: format!("req-{i}"),
            account: i % 25,
            amount: i % 7 + 1,
        })
        .collect()
}

/// Each request twice, as a producer retrying a publish would send it.
fn twice(requests: &[CreditRequested]) -> Vec<Vec<u8>> {
    requests
        .iter()
        .flat_map(|r| {
            let json = serde_json::to_vec(r).unwrap();
            [json.clone(), json]
        })
        .collect()
}

async fn applied(db: &TestDb<<Postgres as TestBackend>::Db>) -> i64 {
    Postgres::count(db, "SELECT count(*) FROM inbox").await
}

/// Waits until at least `n` requests have their marker.
async fn wait_applied(db: &TestDb<<Postgres as TestBackend>::Db>, n: i64, what: &str) {
    wait_until(what, Duration::from_secs(240), async || {
        applied(db).await >= n
    })
    .await
    .unwrap();
}

/// How many letters the dead-letter stream holds (0 while it does not exist or does not answer).
async fn dead_letters(js: &jetstream::Context) -> u64 {
    match js.get_stream(inbox_runtime::DEFAULT_DLQ_STREAM).await {
        Ok(mut dlq) => dlq.info().await.map_or(0, |i| i.state.messages),
        Err(_) => 0,
    }
}

/// What the server says of the durable consumer and of the poison message (at `poison`), for a
/// failure's message.
async fn consumer_state(js: &jetstream::Context, stream: &str, poison: u64) -> String {
    let Ok(stream) = js.get_stream(stream).await else {
        return "the stream did not answer".into();
    };
    let held = stream.get_raw_message(poison).await.is_ok();
    let consumer = match stream.get_consumer::<pull::Config>(DURABLE).await {
        Ok(mut c) => match c.info().await {
            Ok(i) => format!(
                "delivered stream seq {}, ack floor stream seq {}, ack pending {}, redelivered {}, pending {}",
                i.delivered.stream_sequence,
                i.ack_floor.stream_sequence,
                i.num_ack_pending,
                i.num_redelivered,
                i.num_pending
            ),
            Err(e) => format!("consumer info failed: {e}"),
        },
        Err(e) => format!("consumer lookup failed: {e}"),
    };
    format!("poison message (seq {poison}) still in the stream: {held}; consumer: {consumer}")
}

/// The lines of the processes' logs about letters, dead-lettering and terms (they log at warn).
fn letter_lines(logs: &[std::path::PathBuf]) -> String {
    let mut lines = Vec::new();
    for (k, log) in logs.iter().enumerate() {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        for line in text.lines() {
            let lower = line.to_lowercase();
            if ["letter", "term", "creation time"]
                .iter()
                .any(|w| lower.contains(w))
            {
                lines.push(format!("credit {k}: {line}"));
            }
        }
    }
    lines.join("\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_ride_out_two_leader_kills() {
    let mut cluster = PrivateCluster::start().await.expect("a private cluster");
    let db = Postgres::create(2).await;
    Inbox::new(db.pool.clone()).migrate().await.unwrap();

    let client = cluster.connect().await.unwrap();
    let js = jetstream::new(client);
    let name = unique("CLUSTER_");
    let subject = format!("cluster.{}", name.to_lowercase());
    let created = js
        .create_stream(stream::Config {
            name: name.clone(),
            subjects: vec![subject.clone()],
            num_replicas: 3,
            max_age: Duration::from_secs(3600),
            ..Default::default()
        })
        .await
        .expect("an R3 stream");
    created
        .create_consumer(pull::Config {
            durable_name: Some(DURABLE.into()),
            ack_wait: Duration::from_secs(5),
            max_deliver: 10,
            filter_subject: subject.clone(),
            ..Default::default()
        })
        .await
        .expect("an R3 durable consumer");

    let all = requests(0..REQUESTS);
    let (first, second) = all.split_at(all.len() / 2);
    publish_and_wait(&js, &subject, twice(first)).await.unwrap();
    // One that is not JSON: dead-lettered, into a stream with the source's three replicas.
    let poison = publish_acked(&js, &subject, [b"not json".to_vec()])
        .await
        .unwrap()[0]
        .sequence;

    let config = CreditConfig {
        binary: env!("CARGO_BIN_EXE_credit").into(),
        nats_url: cluster.urls(),
        database_url: db.url.clone(),
        stream: name.clone(),
        subject: subject.clone(),
        consumer: DURABLE.into(),
        rust_log: "warn".into(),
    };
    let logs: Vec<_> = (0..3)
        .map(|k| std::env::temp_dir().join(format!("{name}-credit-{k}.log")))
        .collect();
    let mut processes: Vec<CreditProcess> = logs
        .iter()
        .map(|log| CreditProcess::spawn(&config, Some(log)).expect("spawn credit"))
        .collect();

    // Kill the stream leader twice while the processes work; restart each once a new leader is
    // elected, so that the cluster keeps its quorum for the second kill.
    let mut killed = Vec::new();
    for (round, at) in [(1, REQUESTS / 10), (2, REQUESTS / 3)] {
        wait_applied(&db, at, "credit to be applying messages").await;
        let leader = cluster
            .wait_new_leader(&js, &name, None)
            .await
            .expect("a stream leader");
        let before = applied(&db).await;
        cluster.kill(leader);
        killed.push((round, leader, before));
        if round == 2 {
            // A process that crashes now is restarted during the election: its start-up (stream
            // and consumer lookups) must wait the election out, not exit.
            processes[0].kill().await.unwrap();
            processes[0] = CreditProcess::spawn(&config, Some(&logs[0])).expect("respawn credit");
        }
        cluster
            .wait_new_leader(&js, &name, Some(leader))
            .await
            .expect("a new leader after the kill");
        if round == 2 {
            // The rest arrives after the second election.
            publish_and_wait(&js, &subject, twice(second))
                .await
                .unwrap();
        }
        cluster.restart(leader).await.expect("restart the node");
        cluster.wait_ready().await.expect("the cluster back");
    }
    assert!(
        killed.iter().all(|&(_, _, before)| before < REQUESTS),
        "a kill came after every request was applied: {killed:?}"
    );

    wait_applied(&db, REQUESTS, "every request to be applied").await;
    wait_until(
        "the consumer to have nothing pending",
        Duration::from_secs(120),
        async || {
            backlog(&js, &name, DURABLE)
                .await
                .is_ok_and(|b| b.drained())
        },
    )
    .await
    .unwrap();

    // The poison message's letter: in the dead-letter stream, or parked in the database on its
    // last delivery and relayed every few seconds. Polled while the processes still run, so that
    // a parked letter gets there; what each process logged of letters is shown if it does not.
    let lettered = wait_until(
        "the poison message's dead letter",
        Duration::from_secs(60),
        async || dead_letters(&js).await >= 1,
    )
    .await;
    if let Err(e) = lettered {
        let parked = Postgres::count(&db, "SELECT count(*) FROM inbox_dead_letters").await;
        panic!(
            "{e}: {} in the stream, {parked} parked in the database; {}; what the processes logged of letters:\n{}",
            dead_letters(&js).await,
            consumer_state(&js, &name, poison).await,
            letter_lines(&logs)
        );
    }

    // Process 0 was SIGKILLed once: what its first life applied is not in any summary.
    let mut total = 0;
    for (k, p) in processes.into_iter().enumerate() {
        let summary = p.stop(STOP).await.unwrap_or_else(|e| {
            let log = std::fs::read_to_string(&logs[k]).unwrap_or_default();
            panic!("credit {k} did not stop cleanly: {e}\n{log}")
        });
        total += summary.applied;
    }
    let mut dlq = js
        .get_stream(inbox_runtime::DEFAULT_DLQ_STREAM)
        .await
        .expect("the dead-letter stream");
    let info = dlq.info().await.unwrap().clone();
    assert_eq!(info.config.num_replicas, 3, "dead-letter stream replicas");
    // On a mismatch, what each letter says (its Nats-Msg-Id above all): seen once with two.
    let mut letters = Vec::new();
    for seq in 1..=info.state.messages {
        let headers = dlq.get_raw_message(seq).await.map(|m| m.headers);
        letters.push(format!("{seq}: {headers:?}"));
    }
    assert_eq!(
        info.state.messages,
        1,
        "dead letters:\n{}\n{}\nwhat the processes logged of letters:\n{}",
        letters.join("\n"),
        consumer_state(&js, &name, poison).await,
        letter_lines(&logs)
    );

    let mut expected = BTreeMap::new();
    for r in &all {
        *expected.entry(r.account).or_insert(0i64) += r.amount;
    }
    assert_eq!(
        Postgres::balances(&db).await,
        expected,
        "a request was lost or applied twice"
    );
    assert_eq!(applied(&db).await, REQUESTS, "markers");
    assert!(
        total <= REQUESTS as u64,
        "the processes say they applied {total} of {REQUESTS}"
    );
    for log in &logs {
        let _ = std::fs::remove_file(log);
    }
}
