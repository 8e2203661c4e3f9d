//! What an example exposes for operators when `METRICS_ADDR` is set (`127.0.0.1:9464`, say):
//! `GET /metrics`, the runtime's series (see `inbox_runtime::metrics`) in the Prometheus text
//! format, and `GET /healthz`, 200 when NATS is connected, the database answers and every
//! handler's worker runs, else 503; both with the report as JSON.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use inbox_runtime::{Health, HealthReport};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::net::SocketAddr;
use std::sync::OnceLock;

/// The process's one Prometheus recorder, installed on first use.
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
        addr => addr.parse().map(Some).map_err(|e| {
            format!("METRICS_ADDR={addr:?} is not an address such as 127.0.0.1:9464: {e}")
        }),
    }
}

/// Installs the recorder and serves `/metrics` and `/healthz` on `addr` until the process
/// ends. A port that cannot be bound is an error at start, naming it.
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
