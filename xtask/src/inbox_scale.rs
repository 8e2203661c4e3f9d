//! `cargo xtask bench --inbox-scale`: the inbox table at scale on PostgreSQL, the unpartitioned
//! table (cleanup by DELETE) against the partitioned one (cleanup by dropping partitions), at
//! each `--markers` count.
//!
//! Per layout and count, in a fresh database: N finished markers are loaded with one
//! `INSERT .. SELECT generate_series` over the eight UTC days before today (N/8 a day, so the
//! partitioned table has a partition per day), then `VACUUM ANALYZE`. Then:
//! 1. claim latency: `--claims` single messages through `Inbox::process` (BEGIN, claim,
//!    `processed_at`, COMMIT, as the worker does), one at a time, p50 and p99, with
//!    `synchronous_commit = off` (the COMMIT's fsync is the same for both layouts);
//! 2. a day's churn: a day's markers (N/8) inserted as today's, then the oldest day cleaned up
//!    with `Inbox::cleanup` (retention: back to the start of the day seven days ago, so that both
//!    layouts remove exactly the oldest day): rows removed per second;
//! 3. after the churn: dead tuples (`n_dead_tup` of the table and its partitions, read once the
//!    cleanup's sessions have ended, which flushes their statistics), the table's size with its
//!    indexes, and how long the `VACUUM` that the dead tuples call for takes.
//!
//! MySQL/MariaDB and SQLite have only the DELETE path (see ARCHITECTURE.md); this bench is
//! PostgreSQL's.

use inbox_runtime::{Delivery, Inbox, Partitions, Tx, idempotent};
use inbox_testkit::{Backend, Database};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{AssertSqlSafe, PgPool};
use std::time::{Duration, Instant};

/// Days of markers loaded; the oldest is the one cleaned up.
const DAYS: i64 = 8;

/// What `--inbox-scale` was asked.
#[derive(Debug, Clone)]
pub struct Options {
    /// Marker counts to load.
    pub markers: Vec<u64>,
    /// Claims timed per layout and count.
    pub claims: usize,
}

#[idempotent(consumer = "bench", key = msg)]
async fn noop(msg: String, tx: &mut Tx<sqlx::Postgres>) -> Result<(), sqlx::Error> {
    let _ = (msg, tx);
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    Delete,
    Partitioned,
}

impl Layout {
    fn name(self) -> &'static str {
        match self {
            Layout::Delete => "plain (DELETE)",
            Layout::Partitioned => "partitioned (drop)",
        }
    }
}

/// One layout at one count.
#[derive(Debug, Clone)]
struct Figures {
    layout: Layout,
    markers: u64,
    load_s: f64,
    claim_p50_us: f64,
    claim_p99_us: f64,
    cleaned: u64,
    cleanup_s: f64,
    dead_tuples: i64,
    size_before: i64,
    size_after: i64,
    vacuum_s: f64,
}

/// Runs the bench and prints a table (also written to `target/bench/inbox-scale.md`).
pub async fn run(options: Options) -> Result<(), String> {
    crate::services::ensure(&crate::services::needed(&[Backend::Postgres])).await?;
    let mut all = Vec::new();
    for &n in &options.markers {
        for layout in [Layout::Delete, Layout::Partitioned] {
            eprintln!("inbox-scale: {} with {n} markers", layout.name());
            let figures = one(layout, n, options.claims).await?;
            eprintln!("inbox-scale:   {figures:?}");
            all.push(figures);
        }
    }
    let table = table(&all, options.claims);
    print!("{table}");
    let out = crate::workspace::root().join("target/bench");
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let path = out.join("inbox-scale.md");
    std::fs::write(&path, &table).map_err(|e| format!("{}: {e}", path.display()))?;
    eprintln!("inbox-scale: results in {}", path.display());
    Ok(())
}

fn err(what: &'static str) -> impl Fn(sqlx::Error) -> String {
    move |e| format!("{what}: {e}")
}

async fn exec(pool: &PgPool, sql: String) -> Result<(), String> {
    sqlx::raw_sql(AssertSqlSafe(sql.clone()))
        .execute(pool)
        .await
        .map(drop)
        .map_err(|e| format!("{sql}: {e}"))
}

async fn one(layout: Layout, n: u64, claims: usize) -> Result<Figures, String> {
    let db = Database::create(Backend::Postgres, "inbox_bench_").await?;
    let admin = PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url)
        .await
        .map_err(err("connect"))?;
    // Without the COMMIT's fsync: on a shared disk it is most of a claim's time and all of its
    // tail, and the same for both layouts; what differs is the claim's own work.
    let options: PgConnectOptions = db.url.parse().map_err(err("url"))?;
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .test_before_acquire(false)
        .connect_with(options.options([("synchronous_commit", "off")]))
        .await
        .map_err(err("connect"))?;
    let inbox = match layout {
        Layout::Delete => Inbox::new(pool.clone()),
        Layout::Partitioned => Inbox::new(pool.clone()).partitioned(Partitions::daily()),
    };
    inbox.migrate().await.map_err(|e| format!("migrate: {e}"))?;
    if layout == Layout::Partitioned {
        // The eight days loaded, as yesterday's runs of the worker would have created them.
        for day in 1..=DAYS {
            exec(&admin, attach_day(day)).await?;
        }
    }
    let started = Instant::now();
    let day = n / DAYS as u64;
    exec(&admin, "SET synchronous_commit = off".to_owned()).await?;
    // Oldest first, so that ids grow with received_at, as they do in service.
    for d in (1..=DAYS).rev() {
        exec(&admin, load_day(d, day, (DAYS - d) as u64 * day)).await?;
        eprintln!("inbox-scale:   loaded day -{d} ({day} markers)");
    }
    exec(&admin, "VACUUM ANALYZE inbox".to_owned()).await?;
    let load_s = started.elapsed().as_secs_f64();

    let mut samples = Vec::with_capacity(claims);
    for i in 0..claims {
        let key = format!("claim-{i}");
        let t = Instant::now();
        inbox
            .process(&noop, &(), key, &Delivery::default())
            .await
            .map_err(|e| format!("claim: {e}"))?;
        samples.push(t.elapsed().as_secs_f64() * 1e6);
    }
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    let (claim_p50_us, claim_p99_us) = (at(0.50), at(0.99));

    // A day's churn: today's markers in, the oldest day out.
    exec(&admin, load_day(0, day, DAYS as u64 * day)).await?;
    let size_before = size(&admin).await?;
    let older_than: f64 = sqlx::query_scalar(
        "SELECT extract(epoch FROM now() - ((date_trunc('day', now() AT TIME ZONE 'UTC') \
         - interval '7 days') AT TIME ZONE 'UTC'))::float8",
    )
    .fetch_one(&admin)
    .await
    .map_err(err("cutoff"))?;
    let t = Instant::now();
    let cleaned = inbox
        .cleanup("bench", Duration::from_secs_f64(older_than), 1000)
        .await
        .map_err(err("cleanup"))?
        .ok_or("cleanup lock held")?;
    let cleanup_s = t.elapsed().as_secs_f64();
    // Sessions flush their statistics as they end.
    pool.close().await;
    drop(inbox);
    let dead_tuples = dead_tuples(&admin).await?;
    let size_after = size(&admin).await?;
    let t = Instant::now();
    exec(&admin, "VACUUM inbox".to_owned()).await?;
    let vacuum_s = t.elapsed().as_secs_f64();
    admin.close().await;
    db.remove().await?;
    Ok(Figures {
        layout,
        markers: n,
        load_s,
        claim_p50_us,
        claim_p99_us,
        cleaned,
        cleanup_s,
        dead_tuples,
        size_before,
        size_after,
        vacuum_s,
    })
}

/// The UTC day `d` days before today, as SQL.
fn day_start(d: i64) -> String {
    format!(
        "((date_trunc('day', now() AT TIME ZONE 'UTC') - interval '{d} days') AT TIME ZONE 'UTC')"
    )
}

/// Attaches the partition of the day `d` days ago, named as the inbox names its own, unless a
/// partition overlaps it (the one the inbox made two hours back, just after midnight).
fn attach_day(d: i64) -> String {
    let (lo, hi) = (day_start(d), day_start(d - 1));
    format!(
        "DO $$ DECLARE
            v_lo TIMESTAMPTZ := {lo};
            v_hi TIMESTAMPTZ := {hi};
            part TEXT := 'inbox_p' || to_char(v_lo AT TIME ZONE 'UTC', 'YYYYMMDD\"t\"HH24');
        BEGIN
            IF NOT EXISTS (SELECT 1 FROM inbox_partitions() p WHERE p.lo < v_hi AND p.hi > v_lo) THEN
                EXECUTE format('CREATE TABLE %I (LIKE inbox INCLUDING DEFAULTS)', part);
                EXECUTE format('ALTER TABLE inbox ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                    part, v_lo, v_hi);
            END IF;
        END $$"
    )
}

/// `count` finished markers received over the day `d` days ago from 01:00 (today: up to now),
/// keys from `first`. Nothing in the first hour: the DELETE path's cutoff moves with the clock
/// while it runs, and would otherwise chase the next day's first markers, so that the two
/// layouts would not remove the same rows.
fn load_day(d: i64, count: u64, first: u64) -> String {
    let lo = format!("({} + interval '1 hour')", day_start(d));
    let span = if d == 0 {
        format!("greatest(now() - {lo}, interval '1 second')")
    } else {
        "interval '23 hours'".to_owned()
    };
    format!(
        "INSERT INTO inbox (consumer, message_key, received_at, processed_at) \
         SELECT 'bench', 'm-' || (g + {first}), t, t FROM generate_series(1::bigint, {count}::bigint) g, \
         LATERAL (SELECT {lo} + {span} * ((g - 1)::float8 / greatest({count}, 1)) AS t) s"
    )
}

/// The inbox's size with its indexes and partitions, in bytes.
async fn size(pool: &PgPool) -> Result<i64, String> {
    sqlx::query_scalar(
        "SELECT coalesce(sum(pg_total_relation_size(relid)), 0)::bigint \
         FROM (SELECT 'inbox'::regclass AS relid UNION SELECT relid FROM pg_partition_tree('inbox')) r",
    )
    .fetch_one(pool)
    .await
    .map_err(err("size"))
}

/// Dead tuples of the inbox and its partitions, once the statistics of the sessions that made
/// them are in: read until two reads a second apart agree.
async fn dead_tuples(pool: &PgPool) -> Result<i64, String> {
    let read = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT coalesce(sum(n_dead_tup), 0)::bigint FROM pg_stat_user_tables \
             WHERE relid = 'inbox'::regclass OR relid IN (SELECT relid FROM pg_partition_tree('inbox'))",
        )
        .fetch_one(pool)
        .await
        .map_err(err("n_dead_tup"))
    };
    let mut last = read().await?;
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = read().await?;
        if now == last {
            return Ok(now);
        }
        last = now;
    }
    Ok(last)
}

fn mib(bytes: i64) -> String {
    format!("{:.0}", bytes as f64 / (1024.0 * 1024.0))
}

fn table(all: &[Figures], claims: usize) -> String {
    let mut out = format!(
        "\n**PostgreSQL inbox at scale** ({claims} claims timed one at a time; a day's churn = \
         markers/8 in, the oldest day out)\n\n"
    );
    out += "| markers | layout | load s | claim p50 ms | claim p99 ms | cleaned rows | cleanup s | \
            cleanup rows/s | dead tuples after | size before MiB | size after MiB | VACUUM after s |\n";
    out += "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for f in all {
        let rate = if f.cleaned == 0 {
            "-".to_owned()
        } else {
            format!("{:.0}", f.cleaned as f64 / f.cleanup_s.max(1e-9))
        };
        out += &format!(
            "| {} | {} | {:.0} | {:.2} | {:.2} | {} | {:.2} | {} | {} | {} | {} | {:.2} |\n",
            f.markers,
            f.layout.name(),
            f.load_s,
            f.claim_p50_us / 1000.0,
            f.claim_p99_us / 1000.0,
            f.cleaned,
            f.cleanup_s,
            rate,
            f.dead_tuples,
            mib(f.size_before),
            mib(f.size_after),
            f.vacuum_s,
        );
    }
    out
}
