//! Test harness: each test gets its own database (PostgreSQL, MariaDB or SQLite; see
//! [`backends`]) and its own JetStream stream, both removed when the guard drops (also when the
//! test panics). A service that cannot be reached fails the test with a message naming it;
//! nothing here skips (see CONTRIBUTING.md). The conformance suite (`src/suite/`, the behaviours
//! every backend must show) is compiled into this crate's own tests: `cargo test -p inbox-tests
//! --lib`.

use async_nats::jetstream::{self, consumer::pull, stream};
use inbox_testkit::{Outgoing, off_runtime, unique, wait_until};
use std::time::Duration;

pub mod backends;
pub mod handlers;
#[cfg(test)]
mod suite;

/// The environment variable that runs every worker of the suite batched: the most messages per
/// transaction (`cargo xtask test --batched` sets it); unset or 1, one transaction per message.
pub const BATCH_ENV: &str = "INBOX_TEST_BATCH";

/// The batch size [`BATCH_ENV`] asks for (1: no batching).
pub fn test_batch() -> usize {
    std::env::var(BATCH_ENV)
        .ok()
        .and_then(|b| b.parse().ok())
        .unwrap_or(1)
}

/// The NATS server tests use: `INBOX_TEST_NATS_URL`, default the machine's.
pub fn nats_url() -> String {
    std::env::var("INBOX_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// For a server database at `url` (`scheme://user@host:port/db`), the address to forward to
/// (`host:port`) and the same URL through a proxy on loopback port `proxy_port`, with TLS off:
/// the proxy's traps read the protocol in clear, and sqlx, built with TLS, would otherwise take
/// the TLS the machine's PostgreSQL offers (`sslmode=prefer`).
pub fn through_proxy(url: &str, proxy_port: u16) -> (String, String) {
    let (head, rest) = url.split_once('@').expect("a URL with a user");
    let (addr, path) = rest.split_once('/').expect("a URL with a database");
    let plain = match head.split_once(':').map(|(scheme, _)| scheme) {
        Some("postgres" | "postgresql") => "sslmode=disable",
        _ => "ssl-mode=DISABLED",
    };
    let sep = if path.contains('?') { '&' } else { '?' };
    (
        addr.to_owned(),
        format!("{head}@127.0.0.1:{proxy_port}/{path}{sep}{plain}"),
    )
}

/// A pool of `max` connections to `db` through `proxy` (started here on `db`), all open and
/// idle before it is handed over, failing fast to acquire, as a production pool would: for the
/// fault tests that freeze or cut the proxy.
pub async fn pool_through<B: backends::TestBackend>(
    db: &backends::TestDb<B::Db>,
    proxy: &mut inbox_testkit::TcpProxy,
    max: u32,
) -> sqlx::Pool<B::Db> {
    let (upstream, url) = through_proxy(&db.url, proxy.port);
    proxy.start(&upstream).await.unwrap();
    let pool = sqlx::pool::PoolOptions::<B::Db>::new()
        .max_connections(max)
        .min_connections(max)
        .acquire_timeout(Duration::from_millis(300))
        .test_before_acquire(false)
        .connect(&url)
        .await
        .expect("connect through the proxy");
    let ready = async || pool.num_idle() == max as usize;
    wait_until("the pool's connections", Duration::from_secs(30), ready)
        .await
        .unwrap();
    pool
}

/// The first delivery of `consumer`, pulled by a request that waits for it (a fetch answers at
/// once, and a consumer that has not yet seen a message just stored may answer with nothing).
/// The batch it came in is dropped: the message is left unanswered.
pub async fn first_delivery(
    consumer: &async_nats::jetstream::consumer::PullConsumer,
) -> async_nats::jetstream::Message {
    use futures::StreamExt;
    let mut batch = consumer
        .batch()
        .max_messages(1)
        .expires(Duration::from_secs(30))
        .messages()
        .await
        .expect("pull");
    batch.next().await.expect("a delivery").expect("a delivery")
}

/// Turns generic async test fns into a `#[tokio::test]` each on the server backends (PostgreSQL
/// and MariaDB), in modules named after them: for the fault tests that put something between the
/// code and the database server (SQLite is in-process; the conformance suite has its own list).
#[macro_export]
macro_rules! on_server_backends {
    ($($test:ident),+ $(,)?) => {
        $crate::on_server_backends!(@one postgres, $crate::backends::Postgres; $($test),+);
        $crate::on_server_backends!(@one mysql, $crate::backends::MySql; $($test),+);
    };
    (@one $name:ident, $backend:ty; $($test:ident),+) => {
        mod $name {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test::<$backend>().await
                }
            )+
        }
    };
}

/// Turns generic async test fns into a `#[tokio::test]` each on every backend (PostgreSQL,
/// MariaDB, SQLite), in modules named after them: for tests of the example binaries.
#[macro_export]
macro_rules! on_all_backends {
    ($($test:ident),+ $(,)?) => {
        $crate::on_server_backends!($($test),+);
        $crate::on_server_backends!(@one sqlite, $crate::backends::Sqlite; $($test),+);
    };
}

/// Logs to the test's output when `RUST_LOG` is set.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// A fresh JetStream stream with one subject, deleted with the guard.
pub struct NatsStream {
    /// The client.
    pub client: async_nats::Client,
    /// JetStream on it.
    pub js: jetstream::Context,
    /// The stream's name.
    pub stream: String,
    /// The stream's only subject.
    pub subject: String,
    /// This test's dead-letter stream (created by the worker on first use).
    pub dlq_stream: String,
    /// This test's dead-letter subject prefix.
    pub dlq_prefix: String,
    url: String,
}

/// A consumer and, when it has one of its own, the connection (JetStream context) it was looked
/// up on: see [`NatsStream::worker`].
pub struct OnConnection(
    pub Option<jetstream::Context>,
    pub jetstream::consumer::PullConsumer,
);

impl From<jetstream::consumer::PullConsumer> for OnConnection {
    fn from(consumer: jetstream::consumer::PullConsumer) -> Self {
        OnConnection(None, consumer)
    }
}

/// The `max_deliver` of the consumers tests create.
pub const MAX_DELIVER: i64 = 5;

impl NatsStream {
    /// Creates a stream with random names on the test server.
    pub async fn create() -> NatsStream {
        Self::create_at(&nats_url()).await
    }

    /// Creates a stream with random names on the server at `url`.
    pub async fn create_at(url: &str) -> NatsStream {
        let config = stream::Config {
            // An hour outlives every test, and bounds what a test that failed leaves behind.
            max_age: Duration::from_secs(3600),
            ..Default::default()
        };
        Self::create_with_at(url, config).await
    }

    /// Creates a stream with random names and `config`'s settings (its name and subjects are
    /// replaced) on the test server: `stream::Config::default()` for one made as `nats stream
    /// add` makes it, keeping messages forever.
    pub async fn create_with(config: stream::Config) -> NatsStream {
        Self::create_with_at(&nats_url(), config).await
    }

    /// [`NatsStream::create_with`] on the server at `url`.
    pub async fn create_with_at(url: &str, config: stream::Config) -> NatsStream {
        let client = inbox_testkit::connect(url)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let js = jetstream::new(client.clone());
        let stream = unique("T_");
        let subject = format!("t.{}", stream.to_lowercase());
        js.create_stream(stream::Config {
            name: stream.clone(),
            subjects: vec![subject.clone()],
            ..config
        })
        .await
        .unwrap_or_else(|e| panic!("JetStream at {url} cannot create a stream: {e}"));
        let dlq_stream = format!("DLQ_{stream}");
        let dlq_prefix = format!("dlq.{}", stream.to_lowercase());
        NatsStream {
            client,
            js,
            stream,
            subject,
            dlq_stream,
            dlq_prefix,
            url: url.to_owned(),
        }
    }

    /// Creates (or gets) a durable pull consumer with explicit acks.
    pub async fn consumer(
        &self,
        durable: &str,
        ack_wait: Duration,
    ) -> jetstream::consumer::PullConsumer {
        self.js
            .get_stream(&self.stream)
            .await
            .expect("get stream")
            .get_or_create_consumer(
                durable,
                pull::Config {
                    durable_name: Some(durable.to_owned()),
                    ack_wait,
                    max_deliver: MAX_DELIVER,
                    ..Default::default()
                },
            )
            .await
            .expect("create consumer")
    }

    /// Creates a durable pull consumer with explicit acks and the given `max_deliver`.
    pub async fn consumer_with(
        &self,
        durable: &str,
        ack_wait: Duration,
        max_deliver: i64,
    ) -> jetstream::consumer::PullConsumer {
        self.js
            .get_stream(&self.stream)
            .await
            .expect("get stream")
            .create_consumer(pull::Config {
                durable_name: Some(durable.to_owned()),
                ack_wait,
                max_deliver,
                ..Default::default()
            })
            .await
            .expect("create consumer")
    }

    /// The test server's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The same consumer, seen through another connection: a second "instance".
    pub async fn consumer_on_new_connection(&self, durable: &str) -> OnConnection {
        let client = inbox_testkit::connect(&self.url)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let js = jetstream::new(client);
        let consumer = js
            .get_stream(&self.stream)
            .await
            .expect("get stream")
            .get_consumer(durable)
            .await
            .expect("get consumer");
        OnConnection(Some(js), consumer)
    }

    /// Publishes each message to the stream's subject (payloads without `Nats-Msg-Id` are not
    /// deduplicated by the broker) and waits for every publish to be stored.
    pub async fn publish_all<I>(&self, messages: I)
    where
        I: IntoIterator,
        I::Item: Into<Outgoing>,
    {
        inbox_testkit::publish_and_wait(&self.js, &self.subject, messages)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// A worker builder whose dead letters go to this test's own stream, pulling on the
    /// consumer's own connection when it comes with one ([`Self::consumer_on_new_connection`]),
    /// else on the test's; batched when [`BATCH_ENV`] says so, so that the whole suite runs in
    /// both modes.
    pub fn worker<DB: inbox_runtime::InboxBackend>(
        &self,
        inbox: inbox_runtime::Inbox<DB>,
        consumer: impl Into<OnConnection>,
    ) -> inbox_runtime::WorkerBuilder<DB> {
        let OnConnection(js, consumer) = consumer.into();
        let js = js.as_ref().unwrap_or(&self.js);
        inbox_runtime::WorkerBuilder::new(inbox, js, consumer)
            .dead_letters(self.dlq_stream.clone(), self.dlq_prefix.clone())
            .batch(test_batch(), Duration::from_millis(20))
    }

    /// The dead letters stored so far: (payload, headers) in order.
    pub async fn dead_letters(&self) -> Vec<(Vec<u8>, async_nats::HeaderMap)> {
        let Ok(stream) = self.js.get_stream(&self.dlq_stream).await else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let last = stream.cached_info().state.last_sequence;
        for seq in 1..=last {
            if let Ok(m) = stream.get_raw_message(seq).await {
                out.push((m.payload.to_vec(), m.headers));
            }
        }
        out
    }

    /// The consumer's current state from the server.
    pub async fn info(&self, durable: &str) -> async_nats::jetstream::consumer::Info {
        let mut c: jetstream::consumer::PullConsumer = self
            .js
            .get_stream(&self.stream)
            .await
            .expect("get stream")
            .get_consumer(durable)
            .await
            .expect("get consumer");
        c.info().await.expect("consumer info").clone()
    }

    /// Waits (up to 90 s) until the consumer has nothing pending and nothing awaiting ack.
    pub async fn wait_drained(&self, durable: &str) {
        wait_until(
            "the consumer to drain",
            Duration::from_secs(90),
            async || {
                inbox_testkit::backlog(&self.js, &self.stream, durable)
                    .await
                    .unwrap_or_else(|e| panic!("{e}"))
                    .drained()
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

impl Drop for NatsStream {
    fn drop(&mut self) {
        let (url, stream, dlq) = (
            self.url.clone(),
            self.stream.clone(),
            self.dlq_stream.clone(),
        );
        off_runtime(async move {
            if let Ok(client) = async_nats::connect(&url).await {
                let js = jetstream::new(client);
                let _ = js.delete_stream(&stream).await;
                let _ = js.delete_stream(&dlq).await;
                // The delivery-limit backstop's, when a worker ran one.
                let _ = js
                    .delete_stream(inbox_runtime::advisory_stream_name(&stream))
                    .await;
            }
        });
    }
}

/// A worker running in the background until [`Running::stop`].
pub struct Running {
    shutdown: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<inbox_runtime::Stats>,
}

impl Running {
    /// Starts `worker` (a clone of it: clones share counters and state) on a task of its own.
    pub fn start<H>(worker: &inbox_runtime::Worker<H>) -> Running
    where
        H: inbox_runtime::Handler,
        H::Message: serde::de::DeserializeOwned,
    {
        let shutdown = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn({
            let (worker, shutdown) = (worker.clone(), shutdown.clone());
            async move { worker.run_until(shutdown).await }
        });
        Running { shutdown, task }
    }

    /// Asks the worker to stop, without waiting.
    pub fn cancel(&self) {
        self.shutdown.cancel();
    }

    /// Whether the worker has returned.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Waits (up to 60 s) for the worker to return, after a [`Running::cancel`].
    pub async fn join(self) -> inbox_runtime::Stats {
        tokio::time::timeout(Duration::from_secs(60), self.task)
            .await
            .expect("the worker did not stop within 60 s")
            .expect("the worker panicked")
    }

    /// Stops the worker and returns what it did.
    pub async fn stop(self) -> inbox_runtime::Stats {
        self.cancel();
        self.join().await
    }
}
