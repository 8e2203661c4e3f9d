//! A TCP forwarder of the test's own, to put in front of a server and cut.

use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

/// A TCP forwarder between the code under test and a server: started on a port reserved in
/// advance (so that the code can be pointed at it while it is still down), and cut (every
/// connection dropped) when the test says so or when it is dropped.
#[derive(Debug)]
pub struct TcpProxy {
    /// The port it listens on.
    pub port: u16,
    task: Option<JoinHandle<()>>,
}

impl TcpProxy {
    /// Reserves a free port; nothing listens there until [`TcpProxy::start`].
    pub fn reserve() -> Result<TcpProxy, String> {
        Ok(TcpProxy {
            port: crate::nats::free_port()?,
            task: None,
        })
    }

    /// Starts forwarding every connection to `upstream` (`host:port`).
    pub async fn start(&mut self, upstream: &str) -> Result<(), String> {
        let listener = TcpListener::bind(("127.0.0.1", self.port))
            .await
            .map_err(|e| format!("bind the proxy port {}: {e}", self.port))?;
        let upstream = upstream.to_owned();
        self.task = Some(tokio::spawn(async move {
            let mut links = JoinSet::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                let upstream = upstream.clone();
                links.spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        }));
        Ok(())
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
