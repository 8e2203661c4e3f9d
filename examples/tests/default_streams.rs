//! The examples on streams that exist before they start, made as `nats stream add` and most
//! producers make them (`max_age` 0: messages kept forever), on every backend: `credit` (and the
//! events stream its outbox relays to), `statements` reading those events, `email` and `orders`
//! each start, process what is published, and exit 0 on SIGTERM. `credit` and `email` clean up
//! their inbox behind such a stream; they used to refuse it at start (exit 1, nothing processed).

use async_nats::jetstream::{self, stream};
use inbox_examples::CreditRequested;
use inbox_examples::email::EmailRequested;
use inbox_examples::orders::OrderPlaced;
use inbox_runtime::Inbox;
use inbox_testkit::{CreditConfig, CreditProcess, EmailConfig, Sink, unique, wait_until};
use inbox_tests::backends::{TestBackend, TestDb};
use inbox_tests::nats_url;
use std::path::{Path, PathBuf};
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(90);

/// Streams made with the defaults, deleted when dropped (also when the test fails).
struct Streams {
    js: jetstream::Context,
    names: Vec<String>,
}

impl Streams {
    /// Creates stream `name` on `subject` with every other setting left at its default.
    async fn create(&mut self, name: &str, subject: &str) {
        self.names.push(name.to_owned());
        let config = stream::Config {
            name: name.to_owned(),
            subjects: vec![subject.to_owned()],
            ..Default::default()
        };
        let made = self.js.create_stream(config).await.unwrap();
        assert!(made.cached_info().config.max_age.is_zero());
    }

    async fn publish(&self, subject: String, payload: Vec<u8>) {
        let ack = self.js.publish(subject, payload.into()).await.unwrap();
        ack.await.unwrap();
    }
}

impl Drop for Streams {
    fn drop(&mut self) {
        let (js, names) = (self.js.clone(), std::mem::take(&mut self.names));
        inbox_testkit::off_runtime(async move {
            for name in names {
                let _ = js.delete_stream(&name).await;
            }
        });
    }
}

/// Where the processes' logs go: kept when the test fails.
struct Logs(PathBuf);

impl Logs {
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(format!("{name}.log"))
    }

    fn all(&self) -> String {
        ["credit", "statements", "email", "orders"]
            .map(|name| {
                let log = std::fs::read_to_string(self.path(name)).unwrap_or_default();
                format!("--- {name}:\n{log}")
            })
            .join("\n")
    }
}

impl Drop for Logs {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("example logs kept in {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn spawn(name: &'static str, binary: &str, env: &[(&str, String)], log: &Path) -> CreditProcess {
    CreditProcess::spawn_with(name, Path::new(binary), env, Some(log))
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn examples_start_and_process_on_default_streams<B: TestBackend>() {
    let client = inbox_testkit::connect(&nats_url())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut streams = Streams {
        js: jetstream::new(client),
        names: Vec::new(),
    };
    let credit_db = database::<B>().await;
    let statements_db = database::<B>().await;
    let email_db = database::<B>().await;
    let orders_db = database::<B>().await;
    let logs = Logs(std::env::temp_dir().join(format!("{}.default-streams", credit_db.name)));
    std::fs::create_dir_all(&logs.0).unwrap();

    // credit, and its events (relayed by its outbox), which statements reads.
    let requests = unique("CREDIT_T_");
    let credit = CreditConfig {
        binary: env!("CARGO_BIN_EXE_credit").into(),
        nats_url: nats_url(),
        database_url: credit_db.url.clone(),
        subject: format!("t.{}", requests.to_lowercase()),
        stream: requests,
        consumer: "credit".into(),
        rust_log: "info".into(),
    };
    streams.create(&credit.stream, &credit.subject).await;
    streams
        .create(&credit.events_stream(), &credit.events_subject())
        .await;
    // email, calling a local sink.
    let emails = unique("EMAIL_T_");
    let email_subject = format!("t.{}", emails.to_lowercase());
    streams.create(&emails, &email_subject).await;
    let sink = Sink::start().await.unwrap_or_else(|e| panic!("{e}"));
    // orders, on every subject under its prefix.
    let (orders, prefix) = (unique("ORDERS_T_"), unique("orders_t_"));
    streams.create(&orders, &format!("{prefix}.>")).await;

    let credit_process =
        CreditProcess::spawn(&credit, Some(&logs.path("credit"))).unwrap_or_else(|e| panic!("{e}"));
    let statements_env = [
        ("NATS_URL", nats_url()),
        ("DATABASE_URL", statements_db.url.clone()),
        ("STATEMENTS_STREAM", credit.events_stream()),
        ("STATEMENTS_SUBJECT", credit.events_subject()),
        ("RUST_LOG", "info".into()),
    ];
    let statements_binary = env!("CARGO_BIN_EXE_statements");
    let statements_log = logs.path("statements");
    let statements = spawn(
        "statements",
        statements_binary,
        &statements_env,
        &statements_log,
    );
    let email = EmailConfig {
        binary: env!("CARGO_BIN_EXE_email").into(),
        nats_url: nats_url(),
        database_url: email_db.url.clone(),
        stream: emails,
        subject: email_subject.clone(),
        consumer: "email".into(),
        api_url: sink.url.clone(),
        lease: Duration::from_secs(10),
        hold_before_call: Duration::ZERO,
        concurrency: None,
        rust_log: "info".into(),
    }
    .spawn(Some(&logs.path("email")))
    .unwrap_or_else(|e| panic!("{e}"));
    let orders_env = [
        ("NATS_URL", nats_url()),
        ("DATABASE_URL", orders_db.url.clone()),
        ("ORDERS_STREAM", orders),
        ("ORDERS_SUBJECT_PREFIX", prefix.clone()),
        ("RUST_LOG", "info".into()),
    ];
    let orders_binary = env!("CARGO_BIN_EXE_orders");
    let orders_process = spawn("orders", orders_binary, &orders_env, &logs.path("orders"));

    // One message each; published before or after the consumers exist, each is delivered.
    let request = CreditRequested {
        id: "r-1".into(),
        account: 1,
        amount: 5,
    };
    let email_request = EmailRequested {
        id: "e-1".into(),
        to: "a@example.com".into(),
        body: "hello".into(),
    };
    let order = OrderPlaced {
        order_id: 1,
        sku: "sku-a".into(),
        quantity: 2,
    };
    let subject = credit.subject.clone();
    streams.publish(subject, to_json(&request)).await;
    streams
        .publish(email_subject, to_json(&email_request))
        .await;
    streams
        .publish(format!("{prefix}.placed"), to_json(&order))
        .await;

    // A finished marker commits with its effect (the statement line, the order, ...).
    let done = "SELECT count(*) FROM inbox WHERE processed_at IS NOT NULL";
    wait_until(
        "every example to process its message",
        DEADLINE,
        async || {
            B::count(&credit_db, done).await == 1
                && B::count(&statements_db, done).await == 1
                && B::count(&email_db, done).await == 1
                && B::count(&orders_db, done).await == 1
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", logs.all()));
    assert_eq!(sink.calls().len(), 1);

    for process in [credit_process, statements, email, orders_process] {
        let summary = process
            .stop(DEADLINE)
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", logs.all()));
        assert_eq!(summary.applied, 1, "{summary:?}\n{}", logs.all());
    }
}

/// A fresh database with the inbox already migrated, so that it can be counted from the start.
async fn database<B: TestBackend>() -> TestDb<B::Db> {
    let db = B::create(2).await;
    Inbox::new(db.pool.clone()).migrate().await.unwrap();
    db
}

fn to_json(message: &impl serde::Serialize) -> Vec<u8> {
    serde_json::to_vec(message).unwrap()
}

inbox_tests::on_all_backends!(examples_start_and_process_on_default_streams);
