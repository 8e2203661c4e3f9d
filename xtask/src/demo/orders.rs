//! The demo's orders part: two handlers on one `App` per process, two processes, duplicates of
//! both, `/metrics` sampled while they work.

use super::harness::{
    DEADLINE, DUPLICATE_EVERY, Part, count, spawn_logged, stop_all, stream_created, until_done,
    with_copies,
};
use inbox_testkit::{CreditProcess, TcpProxy, publish_and_wait};
use sqlx::AssertSqlSafe;

/// Orders in the orders part.
const ORDERS: usize = 600;
/// Stock adjustments in the orders part.
const ADJUSTMENTS: usize = 200;

/// The orders part: two handlers on one `App` per process (orders keyed on an integer in the
/// payload, stock adjustments on an `Idempotency-Key` header sent as other producers send it),
/// two processes, duplicates of both; `/metrics` sampled while they work; then SIGTERM drains.
pub async fn run(part: Part<'_>) -> Result<(), String> {
    let Part { run, js, .. } = part;
    println!("\n--- two handlers in one process: the orders example ---");
    let binary = crate::workspace::demo_binary("orders");
    let stream = format!("ORDERS_DEMO_{run}");
    let prefix = format!("demo.{run}.orders");
    let metrics_port = TcpProxy::reserve()?.port;
    let metrics = format!("http://127.0.0.1:{metrics_port}/metrics");
    let base: i64 = i64::from_str_radix(&run[..6], 16).map_err(|e| e.to_string())? * 10_000;
    let mut children = spawn_logged(part.logs, "orders", 2, |n, log| {
        let mut env = vec![
            ("NATS_URL", part.credit.nats_url.clone()),
            ("DATABASE_URL", part.credit.database_url.clone()),
            ("ORDERS_STREAM", stream.clone()),
            ("ORDERS_SUBJECT_PREFIX", prefix.clone()),
            ("RUST_LOG", "info".to_owned()),
        ];
        if n == 1 {
            env.push(("METRICS_ADDR", format!("127.0.0.1:{metrics_port}")));
        }
        CreditProcess::spawn_with("orders", &binary, &env, Some(log))
    })?;
    println!(
        "starting 2 orders processes (handlers `orders` and `inventory` on one App each); metrics of the first at {metrics}"
    );
    stream_created(js, &stream, &mut children, part.logs).await?;
    let sku = |i: usize| format!("sku-{run}-{}", i % 10);
    let orders =
        with_copies((0..ORDERS).map(
            |i| serde_json::json!({ "order_id": base + i as i64, "sku": sku(i), "quantity": 1 }),
        ));
    let published_orders = orders.len();
    println!(
        "publishing {published_orders} orders ({ORDERS} unique) and {} stock adjustments ({ADJUSTMENTS} unique, keyed on an Idempotency-Key header, half as nats-py spells it)...",
        ADJUSTMENTS + ADJUSTMENTS.div_ceil(DUPLICATE_EVERY)
    );
    publish_and_wait(js, &format!("{prefix}.placed"), orders).await?;
    let stock_subject = format!("{prefix}.stock");
    for i in 0..ADJUSTMENTS {
        let key = format!("adj-{run}-{i}");
        let header = if i % 2 == 0 {
            "idempotency-key"
        } else {
            "Idempotency-Key"
        };
        let body = serde_json::json!({ "sku": sku(i), "delta": 2 });
        let json = serde_json::to_vec(&body).expect("json");
        let copies = if i % DUPLICATE_EVERY == 0 { 2 } else { 1 };
        for _ in 0..copies {
            inbox_testkit::publish_raw(
                &part.credit.nats_url,
                &stock_subject,
                &[(header, &key)],
                &json,
            )
            .await?;
        }
    }
    let sample = sample_metrics(&metrics).await;
    println!("  /metrics while they work:");
    for line in &sample {
        println!("    {line}");
    }
    let done_sql = format!(
        "SELECT (SELECT count(*) FROM orders WHERE id >= {base} AND id < {}) \
         + (SELECT count(*) FROM inbox WHERE consumer = 'inventory' AND message_key LIKE 'adj-{run}-%')",
        base + ORDERS as i64
    );
    let finished = until_done("the orders to be applied", &mut children, async || {
        count(part.pool, &done_sql).await == (ORDERS + ADJUSTMENTS) as i64
    })
    .await;
    let after = sample_metrics(&metrics).await;
    let (applied, skipped) = stop_all(children).await?;
    let _ = js.delete_stream(&stream).await;
    let _ = js
        .delete_stream(inbox_runtime::advisory_stream_name(&stream))
        .await;
    if !finished {
        return Err(format!(
            "the orders were not all applied within {DEADLINE:?} (or a process exited); see {}",
            part.logs.display()
        ));
    }
    let stock_sql = format!(
        "SELECT count(*), sum(on_hand), sum(reserved) FROM stock WHERE sku LIKE 'sku-{run}-%'"
    );
    let (skus, on_hand, reserved): (i64, i64, i64) = sqlx::query_as(AssertSqlSafe(stock_sql))
        .fetch_one(part.pool)
        .await
        .map_err(|e| e.to_string())?;
    println!("  /metrics once done:");
    for line in &after {
        println!("    {line}");
    }
    println!();
    println!("  messages applied           {applied:>6}");
    println!("  duplicates skipped         {skipped:>6}");
    println!("  stock reserved             {reserved:>6}   (expected {ORDERS}, one per order)");
    println!(
        "  stock on hand              {on_hand:>6}   (expected {}, 2 per adjustment) over {skus} skus",
        2 * ADJUSTMENTS
    );
    if applied != (ORDERS + ADJUSTMENTS) as u64
        || reserved != ORDERS as i64
        || on_hand != 2 * ADJUSTMENTS as i64
    {
        return Err("orders, adjustments and stock do not add up".into());
    }
    if after == sample || !after.iter().any(|l| l.contains("outcome=\"ack\"")) {
        return Err(format!(
            "the metrics did not move: {sample:?} then {after:?}"
        ));
    }
    println!("\nonce per order and per header key, across two handlers and two processes.");
    Ok(())
}

/// The `inbox_messages_total` lines of the Prometheus text at `url` (empty if it does not
/// answer), by a plain HTTP/1.0 request.
async fn sample_metrics(url: &str) -> Vec<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some(rest) = url.strip_prefix("http://") else {
        return Vec::new();
    };
    let (addr, path) = rest.split_once('/').unwrap_or((rest, ""));
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
        return Vec::new();
    };
    let request = format!("GET /{path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    let mut body = String::new();
    if stream.write_all(request.as_bytes()).await.is_err()
        || stream.read_to_string(&mut body).await.is_err()
    {
        return Vec::new();
    }
    let mut lines: Vec<String> = body
        .lines()
        .filter(|l| l.starts_with("inbox_messages_total"))
        .map(str::to_owned)
        .collect();
    lines.sort();
    lines
}
