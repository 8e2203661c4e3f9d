//! Test harness: each test gets its own database (PostgreSQL, MariaDB or SQLite; see
//! [`backends`]) and its own JetStream stream, both removed when the guard drops (also when the
//! test panics). A service that cannot be reached fails the test with a message naming it;
//! nothing here skips. [`suite`] holds the behaviours every backend must show.

use async_nats::jetstream::{self, consumer::pull, stream};
use std::future::Future;
use std::time::{Duration, Instant};

pub mod backends;
pub mod handlers;
pub mod suite;

/// The NATS server tests use: `INBOX_TEST_NATS_URL`, default the machine's.
pub fn nats_url() -> String {
    std::env::var("INBOX_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A short random suffix for names of databases, streams and consumers.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// Logs to the test's output when `RUST_LOG` is set.
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

/// Runs `fut` to completion on a runtime of its own on another thread: for cleanup from `Drop`,
/// which may run inside or outside a runtime.
pub(crate) fn off_runtime<F: Future<Output = ()> + Send + 'static>(fut: F) {
    let _ = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("cleanup runtime")
            .block_on(fut)
    })
    .join();
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

/// The `max_deliver` of the consumers tests create.
pub const MAX_DELIVER: i64 = 5;

impl NatsStream {
    /// Creates a stream with random names on the test server.
    pub async fn create() -> NatsStream {
        Self::create_at(&nats_url()).await
    }

    /// Creates a stream with random names on the server at `url`.
    pub async fn create_at(url: &str) -> NatsStream {
        let client = connect(url).await;
        let js = jetstream::new(client.clone());
        let stream = unique("T_");
        let subject = format!("t.{}", stream.to_lowercase());
        js.create_stream(stream::Config {
            name: stream.clone(),
            subjects: vec![subject.clone()],
            ..Default::default()
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

    /// The same consumer, seen through another connection: a second "instance".
    pub async fn consumer_on_new_connection(
        &self,
        durable: &str,
    ) -> jetstream::consumer::PullConsumer {
        let js = jetstream::new(connect(&self.url).await);
        js.get_stream(&self.stream)
            .await
            .expect("get stream")
            .get_consumer(durable)
            .await
            .expect("get consumer")
    }

    /// Publishes each payload (no `Nats-Msg-Id`, so the broker does not dedup) and waits for every
    /// publish to be stored.
    pub async fn publish_all<I>(&self, payloads: I)
    where
        I: IntoIterator<Item = Vec<u8>>,
    {
        let mut acks = Vec::new();
        for p in payloads {
            acks.push(
                self.js
                    .publish(self.subject.clone(), p.into())
                    .await
                    .expect("publish"),
            );
        }
        for ack in acks {
            ack.await.expect("publish ack");
        }
    }

    /// A worker builder whose dead letters go to this test's own stream.
    pub fn worker<DB: inbox_runtime::InboxBackend>(
        &self,
        inbox: inbox_runtime::Inbox<DB>,
        consumer: jetstream::consumer::PullConsumer,
    ) -> inbox_runtime::WorkerBuilder<DB> {
        inbox_runtime::WorkerBuilder::new(inbox, consumer)
            .dead_letters(self.dlq_stream.clone(), self.dlq_prefix.clone())
    }

    /// The dead letters stored so far: (payload, headers) in order.
    pub async fn dead_letters(&self) -> Vec<(Vec<u8>, async_nats::HeaderMap)> {
        let Ok(stream) = self.js.get_stream(&self.dlq_stream).await else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut seq = 1;
        let last = stream.cached_info().state.last_sequence;
        while seq <= last {
            if let Ok(m) = stream.get_raw_message(seq).await {
                out.push((m.payload.to_vec(), m.headers));
            }
            seq += 1;
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

    /// Waits until the consumer has nothing pending and nothing awaiting ack.
    pub async fn wait_drained(&self, durable: &str) {
        wait_until("the consumer to drain", Duration::from_secs(90), || async {
            let info = self.info(durable).await;
            info.num_pending == 0 && info.num_ack_pending == 0
        })
        .await;
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
            }
        });
    }
}

/// A `nats-server` of the test's own (`/usr/sbin/nats-server` or on `PATH`), with JetStream, on
/// a free loopback port and a temporary store, so that a test can kill and restart it without
/// touching the shared server. Killed when dropped.
pub struct PrivateNats {
    /// `nats://127.0.0.1:<port>`.
    pub url: String,
    port: u16,
    store: std::path::PathBuf,
    child: Option<std::process::Child>,
}

impl PrivateNats {
    /// Starts a server; fails the test when there is no `nats-server` binary.
    pub fn start() -> PrivateNats {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let store = std::env::temp_dir().join(unique("inbox-nats-"));
        let mut nats = PrivateNats {
            url: format!("nats://127.0.0.1:{port}"),
            port,
            store,
            child: None,
        };
        nats.restart();
        nats
    }

    fn binary() -> std::path::PathBuf {
        std::env::var_os("PATH")
            .into_iter()
            .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
            .chain([std::path::PathBuf::from("/usr/sbin")])
            .map(|d| d.join("nats-server"))
            .find(|p| p.is_file())
            .expect("no nats-server binary (Debian: apt-get install nats-server)")
    }

    /// Kills the server at once (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and store, and waits until it answers.
    pub fn restart(&mut self) {
        self.kill();
        let child = std::process::Command::new(Self::binary())
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&self.store)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        let addr = format!("127.0.0.1:{}", self.port);
        while std::net::TcpStream::connect(&addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not start on {addr}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.store);
    }
}

/// A TCP forwarder of the test's own between the code under test and a server: started on a port
/// reserved in advance (so that the code can be pointed at it while it is still down), and cut
/// (every connection dropped) when the test says so or when it is dropped.
pub struct TcpProxy {
    /// The port it listens on.
    pub port: u16,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl TcpProxy {
    /// Reserves a free port; nothing listens there until [`TcpProxy::start`].
    pub fn reserve() -> TcpProxy {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        TcpProxy { port, task: None }
    }

    /// Starts forwarding every connection to `upstream` (`host:port`).
    pub async fn start(&mut self, upstream: &str) {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", self.port))
            .await
            .expect("bind the proxy port");
        let upstream = upstream.to_owned();
        self.task = Some(tokio::spawn(async move {
            let mut links = tokio::task::JoinSet::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                let upstream = upstream.clone();
                links.spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        }));
    }

    /// Stops listening and drops every forwarded connection.
    pub fn cut(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.cut();
    }
}

/// Connects to NATS, failing the test with a message that names the server when it cannot.
pub async fn connect(url: &str) -> async_nats::Client {
    async_nats::ConnectOptions::new()
        .connection_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .unwrap_or_else(|e| {
            panic!("NATS is not reachable at {url}: {e} (start it; see DEVELOPERS.md)")
        })
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

/// Polls `cond` until it holds, failing the test after `deadline`. Never a fixed sleep.
pub async fn wait_until<F, Fut>(what: &str, deadline: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if cond().await {
            return;
        }
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
