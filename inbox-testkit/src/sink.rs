//! A local HTTP sink standing in for an e-mail API: `POST /send` with a JSON body and an
//! `Idempotency-Key` header. It records every call (key, when it started and ended, what it
//! answered), can hold calls until released, and can be flaky (some 503s, some slow answers), so
//! that tests and `cargo xtask demo` / `chaos` can count calls per idempotency key and check
//! that no two calls for one key overlapped.

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// One call the sink received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SinkCall {
    /// Its `Idempotency-Key` header (empty when missing).
    pub idempotency_key: String,
    /// The body, as received.
    pub body: String,
    /// When it arrived.
    pub started: Instant,
    /// When it was answered (`None` while held or when the caller went away first).
    pub ended: Option<Instant>,
    /// The status it was answered with (`None` while held).
    pub status: Option<u16>,
}

/// How a flaky sink misbehaves: of every `every` calls, the `fail`th answers 503 and the `slow`th
/// takes `slow_for` (counting calls from 0; `every = 0` is never).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flaky {
    /// The period.
    pub every: u64,
    /// Which call of a period answers 503.
    pub fail: u64,
    /// Which call of a period is slow.
    pub slow: u64,
    /// How long a slow call takes.
    pub slow_for: Duration,
}

#[derive(Debug, Default)]
struct Shared {
    calls: Mutex<Vec<SinkCall>>,
    hold: AtomicBool,
    status: std::sync::atomic::AtomicU16,
    flaky: Mutex<Option<Flaky>>,
    count: AtomicU64,
    entered: Notify,
    release: Notify,
}

/// A running sink; stops when dropped.
#[derive(Debug)]
pub struct Sink {
    /// `http://127.0.0.1:<port>/send`.
    pub url: String,
    shared: Arc<Shared>,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.server.abort();
    }
}

impl Sink {
    /// Starts a sink on a free loopback port.
    pub async fn start() -> Result<Sink, String> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| format!("cannot bind the HTTP sink: {e}"))?;
        let port = listener.local_addr().map_err(|e| e.to_string())?.port();
        let shared = Arc::new(Shared::default());
        let app = Router::new()
            .route("/send", post(receive))
            .with_state(shared.clone());
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Sink {
            url: format!("http://127.0.0.1:{port}/send"),
            shared,
            server,
        })
    }

    /// Holds every call (unanswered) until [`Sink::release`].
    pub fn hold(&self) {
        self.shared.hold.store(true, Ordering::SeqCst);
    }

    /// Answers held calls and stops holding.
    pub fn release(&self) {
        self.shared.hold.store(false, Ordering::SeqCst);
        self.shared.release.notify_waiters();
    }

    /// Waits until a call is held.
    pub async fn entered(&self) {
        self.shared.entered.notified().await
    }

    /// Answers every call with `status` (200 by default).
    pub fn answer(&self, status: u16) {
        self.shared.status.store(status, Ordering::SeqCst);
    }

    /// Misbehaves as `flaky` says from now on (`None`: behaves).
    pub fn flaky(&self, flaky: Option<Flaky>) {
        *self.shared.flaky.lock().unwrap() = flaky;
    }

    /// The calls so far, in the order they arrived.
    pub fn calls(&self) -> Vec<SinkCall> {
        self.shared.calls.lock().unwrap().clone()
    }

    /// The calls so far by idempotency key.
    pub fn by_key(&self) -> BTreeMap<String, Vec<SinkCall>> {
        let mut keys: BTreeMap<String, Vec<SinkCall>> = BTreeMap::new();
        for call in self.calls() {
            keys.entry(call.idempotency_key.clone())
                .or_default()
                .push(call);
        }
        keys
    }
}

/// Of each key's calls, the pairs that overlapped in time (the later one started before the
/// earlier was answered), as (key, index of the earlier, index of the later) within that key's
/// calls. A call never answered (its caller went away, and the server dropped it) is left out:
/// when its caller stopped holding the lease is not known here.
pub fn overlaps(by_key: &BTreeMap<String, Vec<SinkCall>>) -> Vec<(String, usize, usize)> {
    let mut found = Vec::new();
    for (key, calls) in by_key {
        for (i, a) in calls.iter().enumerate() {
            for (j, b) in calls.iter().enumerate().skip(i + 1) {
                if a.ended.is_some_and(|end| b.started < end) {
                    found.push((key.clone(), i, j));
                }
            }
        }
    }
    found
}

/// Why a key was called more than once, from what the sink answered its earlier calls: "retried
/// after a 503" when an earlier call failed, "called again after a success" (a takeover after a
/// crash, or a zombie) when one had succeeded, "called again after a call went unanswered (its
/// caller died mid-call)" otherwise.
pub fn why_again(calls: &[SinkCall]) -> &'static str {
    let earlier = &calls[..calls.len().saturating_sub(1)];
    if earlier.iter().any(|c| c.status.is_some_and(|s| s < 300)) {
        "called again after a success"
    } else if earlier.iter().any(|c| c.status.is_some_and(|s| s >= 500)) {
        "retried after a 503"
    } else {
        "called again after a call went unanswered (its caller died mid-call)"
    }
}

async fn receive(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: String,
) -> StatusCode {
    let n = shared.count.fetch_add(1, Ordering::SeqCst);
    let index = {
        let mut calls = shared.calls.lock().unwrap();
        calls.push(SinkCall {
            idempotency_key: headers
                .get("Idempotency-Key")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned(),
            body,
            started: Instant::now(),
            ended: None,
            status: None,
        });
        calls.len() - 1
    };
    if shared.hold.load(Ordering::SeqCst) {
        let released = shared.release.notified();
        shared.entered.notify_one();
        if shared.hold.load(Ordering::SeqCst) {
            released.await;
        }
    }
    let flaky = *shared.flaky.lock().unwrap();
    let mut status = match shared.status.load(Ordering::SeqCst) {
        0 => 200,
        s => s,
    };
    if let Some(f) = flaky.filter(|f| f.every > 0) {
        if n % f.every == f.slow {
            tokio::time::sleep(f.slow_for).await;
        }
        if n % f.every == f.fail {
            status = 503;
        }
    }
    // Recorded when answered: a caller that went away first leaves `ended` unset, and the task
    // is dropped with its connection before reaching this.
    let mut calls = shared.calls.lock().unwrap();
    calls[index].ended = Some(Instant::now());
    calls[index].status = Some(status);
    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}
