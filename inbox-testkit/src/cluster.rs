//! A JetStream cluster of a test's own: three `nats-server` processes on loopback (free client,
//! route and monitoring ports, a temporary store each), routed to one another, so that a test
//! can kill the leader of a replicated stream, or the server a client is connected to, and
//! restart it. Every node is killed, and its store removed, when dropped.

use crate::nats::{PrivateNats, free_port, nats_server_binary};
use crate::wait_until;
use async_nats::jetstream;
use std::path::PathBuf;
use std::time::Duration;

/// How many nodes a [`PrivateCluster`] has.
pub const NODES: usize = 3;

/// Three routed `nats-server` nodes with JetStream, named `n0`, `n1`, `n2`.
#[derive(Debug)]
pub struct PrivateCluster {
    nodes: Vec<PrivateNats>,
    /// Each node's monitoring port (`http`), for `/connz`.
    monitor_ports: Vec<u16>,
}

impl PrivateCluster {
    /// Starts three nodes of [`nats_server_binary`] and waits (up to 60 s) until JetStream has a
    /// meta leader, so that streams can be created at once.
    pub async fn start() -> Result<PrivateCluster, String> {
        Self::start_binary(nats_server_binary()?).await
    }

    /// [`start`](Self::start) with the server `binary`.
    pub async fn start_binary(binary: PathBuf) -> Result<PrivateCluster, String> {
        let routes: Vec<u16> = (0..NODES).map(|_| free_port()).collect::<Result<_, _>>()?;
        let monitor_ports: Vec<u16> = (0..NODES).map(|_| free_port()).collect::<Result<_, _>>()?;
        let route_list = routes
            .iter()
            .map(|p| format!("nats-route://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(", ");
        let mut nodes = Vec::with_capacity(NODES);
        for (i, (route, monitor)) in routes.iter().zip(&monitor_ports).enumerate() {
            let config = format!(
                "server_name: n{i}\nhttp: 127.0.0.1:{monitor}\n\
                 cluster {{\n  name: inbox-test\n  listen: 127.0.0.1:{route}\n  routes: [{route_list}]\n}}\n"
            );
            nodes.push(PrivateNats::start_binary_with_config(binary.clone(), &config).await?);
        }
        let cluster = PrivateCluster {
            nodes,
            monitor_ports,
        };
        cluster.wait_ready().await?;
        Ok(cluster)
    }

    /// Waits (up to 60 s) until JetStream answers account requests through every node: the
    /// cluster has a meta leader and every node knows it.
    pub async fn wait_ready(&self) -> Result<(), String> {
        for node in &self.nodes {
            let url = node.url.clone();
            let what = format!("JetStream of the cluster to answer through {url}");
            wait_until(&what, Duration::from_secs(60), async || {
                let Ok(client) = crate::connect(&url).await else {
                    return false;
                };
                // Asked raw: an answer without an `error` (no "JetStream system temporarily
                // unavailable") means the meta leader is known; typed account info varies by
                // server version.
                let Ok(answer) = client.request("$JS.API.INFO", "".into()).await else {
                    return false;
                };
                serde_json::from_slice::<serde_json::Value>(&answer.payload)
                    .is_ok_and(|v| v.get("error").is_none())
            })
            .await?;
        }
        Ok(())
    }

    /// The nodes' client URLs, comma-separated: what `NATS_URL` takes for a cluster.
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(|n| n.url.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// How many nodes it has (three).
    pub fn nodes(&self) -> usize {
        self.nodes.len()
    }

    /// The client URL of node `i`.
    pub fn url(&self, i: usize) -> &str {
        &self.nodes[i].url
    }

    /// The server name of node `i` (`n<i>`), as stream and consumer cluster info names leaders.
    pub fn name(i: usize) -> String {
        format!("n{i}")
    }

    /// The node named `name` (`n<i>`), if it is one of these.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        (0..self.nodes.len()).find(|&i| Self::name(i) == name)
    }

    /// Connects to the whole cluster (the client fails over between nodes).
    pub async fn connect(&self) -> Result<async_nats::Client, String> {
        let urls: Vec<&str> = self.nodes.iter().map(|n| n.url.as_str()).collect();
        async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .retry_on_initial_connect()
            .connect(urls)
            .await
            .map_err(|e| {
                format!(
                    "the private cluster ({}) is not reachable: {e}",
                    self.urls()
                )
            })
    }

    /// Kills node `i` at once (SIGKILL), as a crash would.
    pub fn kill(&mut self, i: usize) {
        self.nodes[i].kill();
    }

    /// Whether node `i` runs.
    pub fn is_running(&self, i: usize) -> bool {
        self.nodes[i].pid().is_some()
    }

    /// Starts node `i` again (killed first if it runs), on the same ports and store, and waits
    /// until it answers.
    pub async fn restart(&mut self, i: usize) -> Result<(), String> {
        self.nodes[i].restart().await
    }

    /// The node that leads `stream` now, asked through `js`; `None` while it has no leader (an
    /// election).
    pub async fn stream_leader(
        &self,
        js: &jetstream::Context,
        stream: &str,
    ) -> Result<Option<usize>, String> {
        let mut stream = js
            .get_stream(stream)
            .await
            .map_err(|e| format!("stream {stream}: {e}"))?;
        let info = stream
            .info()
            .await
            .map_err(|e| format!("stream info: {e}"))?;
        Ok(info
            .cluster
            .as_ref()
            .and_then(|c| c.leader.as_deref())
            .and_then(|leader| self.index_of(leader)))
    }

    /// Waits (up to 60 s) until `stream` has a leader other than node `not` (after that node
    /// was killed, say) with every replica current, and returns it.
    pub async fn wait_new_leader(
        &self,
        js: &jetstream::Context,
        stream: &str,
        not: Option<usize>,
    ) -> Result<usize, String> {
        let mut leader = None;
        let what = format!("stream {stream} to elect a leader other than {not:?}");
        wait_until(&what, Duration::from_secs(60), async || {
            leader = self
                .stream_leader(js, stream)
                .await
                .ok()
                .flatten()
                .filter(|l| Some(*l) != not);
            leader.is_some()
        })
        .await?;
        leader.ok_or(what)
    }

    /// How many client connections node `i` has now, from its monitoring endpoint (`/connz`).
    pub async fn connections(&self, i: usize) -> Result<u64, String> {
        let body = http_get(self.monitor_ports[i], "/connz").await?;
        let json: serde_json::Value = serde_json::from_str(&body)
            .map_err(|e| format!("node n{i} /connz is not JSON: {e}"))?;
        json["num_connections"]
            .as_u64()
            .ok_or_else(|| format!("node n{i} /connz has no num_connections: {body}"))
    }
}

/// The body of `GET path` on the loopback port `port` (HTTP/1.0, so that the server closes the
/// connection after the answer).
async fn http_get(port: u16, path: &str) -> Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| format!("127.0.0.1:{port} is not reachable: {e}"))?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await
        .map_err(|e| format!("GET {path}: {e}"))?;
    let mut answer = String::new();
    stream
        .read_to_string(&mut answer)
        .await
        .map_err(|e| format!("GET {path}: {e}"))?;
    answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .ok_or_else(|| format!("GET {path}: no HTTP answer: {answer}"))
}
