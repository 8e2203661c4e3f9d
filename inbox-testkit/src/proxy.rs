//! A TCP forwarder of the test's own, to put in front of a server, cut, or switch to another
//! server (a failover's virtual IP moving to the promoted standby).

use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

/// A TCP forwarder between the code under test and a server: started on a port reserved in
/// advance (so that the code can be pointed at it while it is still down), cut (every
/// connection dropped) when the test says so or when it is dropped, or switched to another
/// server ([`TcpProxy::switch_to`]).
#[derive(Debug)]
pub struct TcpProxy {
    /// The port it listens on.
    pub port: u16,
    task: Option<JoinHandle<()>>,
    /// A request to lose the reply to; see [`TcpProxy::lose_reply_to`].
    trap: Arc<Mutex<Option<Vec<u8>>>>,
    /// Where new connections go (`host:port`).
    upstream: Arc<Mutex<String>>,
    /// Bumped by [`TcpProxy::switch_to`]: every connection forwarded before it is dropped.
    switched: tokio::sync::watch::Sender<u64>,
    /// While set, nothing is forwarded either way; see [`TcpProxy::freeze`].
    frozen: tokio::sync::watch::Sender<bool>,
    /// Bytes of the server's replies replaced on their way; see [`TcpProxy::rewrite_replies`].
    rewrite: Rewrite,
}

/// What [`TcpProxy::rewrite_replies`] replaces, and with what.
type Rewrite = Arc<Mutex<Option<(Vec<u8>, Vec<u8>)>>>;

impl TcpProxy {
    /// Reserves a free port; nothing listens there until [`TcpProxy::start`].
    pub fn reserve() -> Result<TcpProxy, String> {
        Ok(TcpProxy {
            port: crate::nats::free_port()?,
            task: None,
            trap: Arc::default(),
            upstream: Arc::default(),
            switched: tokio::sync::watch::Sender::new(0),
            frozen: tokio::sync::watch::Sender::new(false),
            rewrite: Arc::default(),
        })
    }

    /// Starts forwarding every connection to `upstream` (`host:port`).
    pub async fn start(&mut self, upstream: &str) -> Result<(), String> {
        let listener = TcpListener::bind(("127.0.0.1", self.port))
            .await
            .map_err(|e| format!("bind the proxy port {}: {e}", self.port))?;
        *self.upstream.lock().expect("the upstream lock") = upstream.to_owned();
        let (upstream, trap) = (self.upstream.clone(), self.trap.clone());
        let switched = self.switched.clone();
        let frozen = self.frozen.clone();
        let rewrite = self.rewrite.clone();
        self.task = Some(tokio::spawn(async move {
            let mut links = JoinSet::new();
            while let Ok((inbound, _)) = listener.accept().await {
                // Subscribed before the upstream is read: a switch in between severs the link
                // rather than leaving it on the old server.
                let mut switched = switched.subscribe();
                let upstream = upstream.lock().expect("the upstream lock").clone();
                let trap = trap.clone();
                let frozen = frozen.subscribe();
                let rewrite = rewrite.clone();
                links.spawn(async move {
                    if let Ok(outbound) = TcpStream::connect(&upstream).await {
                        tokio::select! {
                            () = forward(inbound, outbound, (trap, rewrite), frozen) => {}
                            _ = switched.changed() => {}
                        }
                    }
                });
            }
        }));
        Ok(())
    }

    /// Sends every new connection to `upstream` (`host:port`) from now on, and drops every
    /// connection forwarded so far, as a virtual IP moved to another server would: the client
    /// sees its connections lost and reconnects to the new server through the same address.
    pub fn switch_to(&self, upstream: &str) {
        *self.upstream.lock().expect("the upstream lock") = upstream.to_owned();
        self.switched.send_modify(|n| *n += 1);
    }

    /// Arms a one-shot trap: the next client message that contains `needle` (a statement's
    /// text, such as `COMMIT`) is delivered to the server, and then that client's connection is
    /// dropped before the server's reply reaches it. The server side stays open, so the server
    /// finishes the statement: the client sees a lost connection for a statement that took
    /// effect. The needle is looked for in clear: the client must not use TLS.
    pub fn lose_reply_to(&self, needle: &[u8]) {
        *self.trap.lock().expect("the trap lock") = Some(needle.to_vec());
    }

    /// From now on, replaces `from` with `to` (of the same length, so that the protocol's
    /// lengths still hold) in what the server sends, as a server that says something else would
    /// (an older version, say). Only occurrences within one read are seen: for short values in
    /// small replies, such as a version string.
    pub fn rewrite_replies(&self, from: &[u8], to: &[u8]) {
        assert_eq!(from.len(), to.len(), "a rewrite keeps the length");
        *self.rewrite.lock().expect("the rewrite lock") = Some((from.to_vec(), to.to_vec()));
    }

    /// Whether the trap of [`TcpProxy::lose_reply_to`] has sprung.
    pub fn trap_sprung(&self) -> bool {
        self.trap.lock().expect("the trap lock").is_none()
    }

    /// Freezes every link, present and future: bytes are read but not passed on either way,
    /// and connections stay open, as behind a network partition that drops packets (a
    /// statement hangs rather than failing) until [`TcpProxy::thaw`].
    pub fn freeze(&self) {
        self.frozen.send_replace(true);
    }

    /// Ends [`TcpProxy::freeze`]: what was held back is passed on, and forwarding goes on.
    pub fn thaw(&self) {
        self.frozen.send_replace(false);
    }

    /// Stops listening and drops every forwarded connection.
    pub fn cut(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Copies both ways between `client` and `server` until either closes, or until the trap
/// springs: then the statement goes to the server, and once the server has answered it (so the
/// statement took effect) the client is dropped without the answer; the server's side is held
/// open (its replies unread) until the proxy is cut.
async fn forward(
    client: TcpStream,
    server: TcpStream,
    (trap, rewrite): (Arc<Mutex<Option<Vec<u8>>>>, Rewrite),
    frozen: tokio::sync::watch::Receiver<bool>,
) {
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    let losing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Aborted when this ends or is dropped (a cut, a switch), so that no half of either socket
    // outlives the link.
    let mut replies = AbortOnDrop(tokio::spawn({
        let losing = losing.clone();
        let mut frozen = frozen.clone();
        async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = match server_rx.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if losing.load(std::sync::atomic::Ordering::SeqCst) {
                    // The answer to the trapped statement: lost. The client sees its connection
                    // close; the server's side stays open, read and ignored.
                    drop(client_tx);
                    while matches!(server_rx.read(&mut buf).await, Ok(n) if n > 0) {}
                    std::future::pending::<()>().await;
                    return;
                }
                if frozen.wait_for(|f| !*f).await.is_err() {
                    return;
                }
                if let Some((from, to)) = &*rewrite.lock().expect("the rewrite lock") {
                    replace_all(&mut buf[..n], from, to);
                }
                if client_tx.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    }));
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match client_rx.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let sprung = {
            let mut armed = trap.lock().expect("the trap lock");
            let hit = armed
                .as_deref()
                .is_some_and(|needle| buf[..n].windows(needle.len()).any(|w| w == needle));
            if hit {
                *armed = None;
            }
            hit
        };
        if sprung {
            // Armed before the statement leaves, so that its answer is the one lost.
            losing.store(true, std::sync::atomic::Ordering::SeqCst);
            if server_tx.write_all(&buf[..n]).await.is_ok() {
                let _ = (&mut replies.0).await;
            }
            return;
        }
        if frozen.clone().wait_for(|f| !*f).await.is_err() {
            break;
        }
        if server_tx.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
}

/// Replaces every `from` in `bytes` with `to`, of the same length.
fn replace_all(bytes: &mut [u8], from: &[u8], to: &[u8]) {
    if from.is_empty() {
        return;
    }
    let mut at = 0;
    while at + from.len() <= bytes.len() {
        if &bytes[at..at + from.len()] == from {
            bytes[at..at + from.len()].copy_from_slice(to);
            at += from.len();
        } else {
            at += 1;
        }
    }
}

/// A task aborted when its handle is dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.cut();
    }
}
