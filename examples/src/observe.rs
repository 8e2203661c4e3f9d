//! What an example exposes for operators when `METRICS_ADDR` is set (`127.0.0.1:9464`, say):
//! `GET /metrics`, the runtime's series (see `inbox_runtime::metrics`) in the Prometheus text
//! format, and `GET /healthz`, 200 when NATS is connected, the database answers and every
//! handler's worker runs, else 503; both with the report as JSON.
//!
//! The HTTP server and the exporter are the crate's `observe` feature (on by default); a build
//! without it refuses `METRICS_ADDR` at start rather than ignore it.

#[cfg(feature = "observe")]
use axum::{Json, extract::State, http::StatusCode, routing::get};
use inbox_runtime::Health;
#[cfg(feature = "observe")]
use inbox_runtime::HealthReport;
#[cfg(feature = "observe")]
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::net::SocketAddr;
#[cfg(feature = "observe")]
use std::sync::OnceLock;

/// Why `METRICS_ADDR` cannot be served by a build without the `observe` feature.
#[cfg(not(feature = "observe"))]
const NO_ENDPOINT: &str = "METRICS_ADDR is set, but this build has no HTTP endpoint: build \
    inbox-examples with its `observe` feature (on by default)";

/// The process's one Prometheus recorder, installed on first use.
#[cfg(feature = "observe")]
fn recorder() -> Result<PrometheusHandle, String> {
    static HANDLE: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let handle = PrometheusBuilder::new()
                .install_recorder()
                .map_err(|e| format!("cannot install the metrics recorder: {e}"))?;
            // Histograms are drained by upkeep (or a scrape); without it, a process nobody
            // scrapes would keep every sample.
            let upkeep = handle.clone();
            tokio::spawn(async move {
                let mut ticks = tokio::time::interval(std::time::Duration::from_secs(5));
                loop {
                    ticks.tick().await;
                    upkeep.run_upkeep();
                }
            });
            Ok(handle)
        })
        .clone()
}

/// `METRICS_ADDR`, parsed; `None` when unset or empty.
pub(crate) fn metrics_addr<F: Fn(&str) -> Option<String>>(
    env: &crate::Vars<F>,
) -> Result<Option<SocketAddr>, String> {
    match env.var("METRICS_ADDR", "").as_str() {
        "" => Ok(None),
        #[cfg(not(feature = "observe"))]
        _ => Err(NO_ENDPOINT.into()),
        #[cfg(feature = "observe")]
        addr => addr.parse().map(Some).map_err(|e| {
            format!("METRICS_ADDR={addr:?} is not an address such as 127.0.0.1:9464: {e}")
        }),
    }
}

/// Installs the recorder and serves `/metrics` and `/healthz` on `addr` until the process
/// ends. A port that cannot be bound is an error at start, naming it.
#[cfg(feature = "observe")]
pub(crate) async fn serve(addr: SocketAddr, health: Health) -> Result<(), crate::Error> {
    let handle = recorder()?;
    let app =
        axum::Router::new()
            .route(
                "/metrics",
                get(
                    |State((handle, _)): State<(PrometheusHandle, Health)>| async move {
                        handle.render()
                    },
                ),
            )
            .route("/healthz", get(healthz))
            .with_state((handle, health));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("METRICS_ADDR {addr}: {e}"))?;
    tracing::info!(%addr, "serving /metrics and /healthz");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "the metrics server stopped");
        }
    });
    Ok(())
}

/// Without the `observe` feature there is nothing to serve; [`metrics_addr`] has refused the
/// address already, so this is never reached with one.
#[cfg(not(feature = "observe"))]
pub(crate) async fn serve(_addr: SocketAddr, _health: Health) -> Result<(), crate::Error> {
    Err(NO_ENDPOINT.into())
}

#[cfg(feature = "observe")]
async fn healthz(
    State((_, health)): State<(PrometheusHandle, Health)>,
) -> (StatusCode, Json<HealthReport>) {
    let report = health.check().await;
    let status = if report.healthy() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(report))
}
