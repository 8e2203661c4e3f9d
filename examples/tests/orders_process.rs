//! The `orders` binary as users run it: two handlers on one `App` in one process.
//! - orders keyed on the payload's integer `order_id` (published twice by async-nats) and stock
//!   adjustments keyed on the `Idempotency-Key` header, written by other producers over the
//!   wire protocol (nats-py's `idempotency-key` as given, Go's canonical `Idempotency-Key`):
//!   each applied once, and a message without the header dead-lettered naming the key;
//! - SIGTERM while both handlers hold a message in their transactions: both finish and commit,
//!   and the process exits 0.

use inbox_examples::orders::{OrderPlaced, StockAdjusted};
use inbox_testkit::{Backend, CreditProcess, Summary, publish_raw, unique, wait_until};
use inbox_tests::backends::{TestBackend, TestDb};
use inbox_tests::nats_url;
use std::path::PathBuf;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(90);

struct Setup<B: TestBackend> {
    db: TestDb<B::Db>,
    stream: String,
    prefix: String,
    js: async_nats::jetstream::Context,
    logs: PathBuf,
}

impl<B: TestBackend> Setup<B> {
    async fn new() -> Self {
        let db = B::create(2).await;
        let client = inbox_testkit::connect(&nats_url())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let logs = std::env::temp_dir().join(format!("{}.orders-logs", db.name));
        std::fs::create_dir_all(&logs).unwrap();
        Setup {
            db,
            stream: unique("ORDERS_T_"),
            prefix: unique("orders_t_"),
            js: async_nats::jetstream::new(client),
            logs,
        }
    }

    fn spawn(&self, name: &str, hold: Duration) -> CreditProcess {
        let env = [
            ("NATS_URL", nats_url()),
            ("DATABASE_URL", self.db.url.clone()),
            ("ORDERS_STREAM", self.stream.clone()),
            ("ORDERS_SUBJECT_PREFIX", self.prefix.clone()),
            ("ORDERS_TEST_HOLD_MS", hold.as_millis().to_string()),
            ("RUST_LOG", "info".into()),
        ];
        let log = self.logs.join(format!("{name}.log"));
        let binary = PathBuf::from(env!("CARGO_BIN_EXE_orders"));
        CreditProcess::spawn_with("orders", &binary, &env, Some(&log)).expect("spawn orders")
    }

    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.logs.join(format!("{name}.log"))).unwrap_or_default()
    }

    /// Waits until the process has created the stream and both consumers.
    async fn wait_started(&self) {
        wait_until("the orders stream and consumers", DEADLINE, async || {
            let Ok(stream) = self.js.get_stream(&self.stream).await else {
                return false;
            };
            let mut found = 0;
            for name in ["orders", "inventory"] {
                if stream.consumer_info(name).await.is_ok() {
                    found += 1;
                }
            }
            found == 2
        })
        .await
        .unwrap();
    }

    async fn order(&self, order_id: i64, sku: &str, quantity: i64) {
        let msg = OrderPlaced {
            order_id,
            sku: sku.into(),
            quantity,
        };
        let subject = format!("{}.placed", self.prefix);
        let ack = self
            .js
            .publish(subject, serde_json::to_vec(&msg).unwrap().into())
            .await
            .unwrap();
        ack.await.unwrap();
    }

    async fn stock(&self, headers: &[(&str, &str)], sku: &str, delta: i64) {
        let msg = StockAdjusted {
            sku: sku.into(),
            delta,
        };
        let subject = format!("{}.stock", self.prefix);
        let payload = serde_json::to_vec(&msg).unwrap();
        publish_raw(&nats_url(), &subject, headers, &payload)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// Whether durable `name` has nothing left to deliver or to hear an ack for.
    async fn drained(&self, name: &str) -> bool {
        inbox_testkit::backlog(&self.js, &self.stream, name)
            .await
            .is_ok_and(|b| b.drained())
    }

    async fn count(&self, sql: &'static str) -> i64 {
        B::count(&self.db, sql).await
    }
}

impl<B: TestBackend> Drop for Setup<B> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("orders logs kept in {}", self.logs.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.logs);
        }
        let (js, stream) = (self.js.clone(), self.stream.clone());
        inbox_testkit::off_runtime(async move {
            let _ = js.delete_stream(&stream).await;
        });
    }
}

inbox_tests::on_all_backends!(two_handlers_on_one_app_apply_each_message_once_and_drain_on_sigterm);

async fn two_handlers_on_one_app_apply_each_message_once_and_drain_on_sigterm<B: TestBackend>() {
    let s = Setup::<B>::new().await;
    let first = s.spawn("first", Duration::ZERO);
    s.wait_started().await;

    // Orders keyed on the payload's integer, each published twice (no Nats-Msg-Id).
    for _ in 0..2 {
        for id in 1..=10 {
            s.order(id, "sku-a", 1).await;
        }
    }
    // Stock keyed on a header, from other producers: the same key twice in nats-py's spelling,
    // one in Go's canonical one, and one message without the header.
    s.stock(&[("idempotency-key", "s-1")], "sku-a", 5).await;
    s.stock(&[("idempotency-key", "s-1")], "sku-a", 5).await;
    s.stock(
        &[("Idempotency-Key", "s-2"), ("Nats-Msg-Id", "x")],
        "sku-a",
        3,
    )
    .await;
    s.stock(&[("X-Tenant", "t-1")], "sku-a", 1000).await;

    // Every marker, and every duplicate answered too: both consumers drained.
    wait_until("both handlers' markers", DEADLINE, async || {
        s.count("SELECT count(*) FROM inbox WHERE processed_at IS NOT NULL")
            .await
            == 12
            && s.drained("orders").await
            && s.drained("inventory").await
    })
    .await
    .unwrap();
    let summary = first.stop(DEADLINE).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        summary,
        Summary {
            applied: 12,
            skipped: 11,
            nacked: 0,
            terminated: 1
        },
        "{}",
        s.log("first")
    );
    assert_eq!(s.count("SELECT count(*) FROM orders").await, 10);
    assert_eq!(
        s.count("SELECT on_hand FROM stock WHERE sku = 'sku-a'")
            .await,
        8
    );
    assert_eq!(
        s.count("SELECT reserved FROM stock WHERE sku = 'sku-a'")
            .await,
        10
    );
    let log = s.log("first");
    assert!(
        log.contains("Idempotency-Key") && log.contains("gave None"),
        "the keyless message's dead letter should name the key expression: {log}"
    );
    // The App split the pool between the two handlers: 8 connections, or SQLite's 2.
    let share = match B::BACKEND {
        Backend::Sqlite => "concurrency=1",
        _ => "concurrency=4",
    };
    let shares = log
        .lines()
        .filter(|l| l.contains("handler registered") && l.contains(share))
        .count();
    assert_eq!(shares, 2, "{log}");

    // Both handlers hold a message inside their transactions when SIGTERM comes (on SQLite, one
    // writer at a time, the second once the first has committed): both finish.
    let second = s.spawn("second", Duration::from_secs(3));
    s.order(100, "sku-b", 2).await;
    s.stock(&[("Idempotency-Key", "s-3")], "sku-b", 7).await;
    wait_until("both handlers holding a message", DEADLINE, async || {
        s.log("second").matches("holding the transaction").count() == 2
    })
    .await
    .unwrap();
    let summary = second
        .stop(DEADLINE)
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", s.log("second")));
    assert_eq!(summary.applied, 2, "{}", s.log("second"));
    assert_eq!(s.count("SELECT count(*) FROM orders").await, 11);
    assert_eq!(
        s.count("SELECT on_hand FROM stock WHERE sku = 'sku-b'")
            .await,
        7
    );
}
