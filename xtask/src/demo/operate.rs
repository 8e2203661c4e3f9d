//! The demo's last part: operating it. Debits that an account cannot cover are dead-lettered (a
//! balance never goes below zero); `inbox status` shows them; the cause is fixed (the account is
//! credited); `inbox dlq replay` publishes them again, with their keys; each is applied once.

use super::harness::{DEADLINE, Part, count, spawn_logged, stop_all, until_done};
use inbox_testkit::{CreditConfig, CreditProcess, publish_and_wait};
use std::path::Path;
use std::process::Command;

/// Debits dead-lettered and replayed.
const DEBITS: i64 = 5;
/// Each debit's amount.
const DEBIT: i64 = 10;
/// The credit that fixes the cause.
const OPENING: i64 = 100;

/// Runs the part.
pub async fn run(part: Part<'_>) -> Result<(), String> {
    let Part { run, js, .. } = part;
    println!("\n--- operating it: dead letters fixed and replayed with the `inbox` command ---");
    let inbox = crate::workspace::demo_binary("inbox");
    let config = CreditConfig {
        stream: format!("OPS_DEMO_{run}"),
        subject: format!("demo.{run}.ops"),
        consumer: format!("ops_demo_{run}"),
        ..part.credit.clone()
    };
    super::harness::create_credit_stream(js, &config).await?;
    let result = operate(part, &config, &inbox).await;
    super::harness::delete_stream(js, &config.stream).await;
    super::harness::delete_stream(js, &config.events_stream()).await;
    result
}

async fn operate(part: Part<'_>, config: &CreditConfig, inbox: &Path) -> Result<(), String> {
    let Part {
        run,
        js,
        pool,
        logs,
        ..
    } = part;
    // An account of this run alone, never credited: there is no balance to take a debit from.
    let account: i64 = i64::from_str_radix(&run[..6], 16).map_err(|e| e.to_string())? * 1_000 + 999;
    let key = |i: &str| format!("ops-{run}-{i}");
    let debits = (0..DEBITS).map(|i| {
        serde_json::to_vec(
            &serde_json::json!({"id": key(&i.to_string()), "account": account, "amount": -DEBIT}),
        )
        .expect("json")
    });
    println!("publishing {DEBITS} debits of {DEBIT} to account {account}, which has no balance...");
    publish_and_wait(js, &config.subject, debits).await?;
    let mut children = spawn_logged(logs, "ops", 1, |_, log| {
        CreditProcess::spawn(config, Some(log))
    })?;
    let stream = config.stream.clone();
    let cli = |args: &[&str]| inbox_command(inbox, config, args);
    let lettered = until_done(
        "the debits to be dead-lettered",
        &mut children,
        async || {
            cli(&["dlq", "list", "--json", "--stream", &stream])
                .ok()
                .and_then(|out| serde_json::from_str::<Vec<serde_json::Value>>(&out).ok())
                .is_some_and(|letters| letters.len() == DEBITS as usize)
        },
    )
    .await;
    if !lettered {
        stop_all(children).await?;
        return Err(format!(
            "the debits were not dead-lettered within {DEADLINE:?}"
        ));
    }
    println!(
        "\n$ inbox status --consumer credit --durable {}",
        config.consumer
    );
    print!(
        "{}",
        cli(&[
            "status",
            "--consumer",
            "credit",
            "--durable",
            &config.consumer
        ])?
    );
    println!("\n$ inbox dlq groups --stream {stream}");
    print!("{}", cli(&["dlq", "groups", "--stream", &stream])?);

    println!("\nthe cause fixed: account {account} credited {OPENING}");
    let opening = serde_json::json!({"id": key("opening"), "account": account, "amount": OPENING});
    publish_and_wait(
        js,
        &config.subject,
        [serde_json::to_vec(&opening).expect("json")],
    )
    .await?;
    let balance = format!("SELECT COALESCE(MAX(balance), 0) FROM accounts WHERE id = {account}");
    let opened = until_done("the credit to be applied", &mut children, async || {
        count(pool, &balance).await == OPENING
    })
    .await;
    if !opened {
        stop_all(children).await?;
        return Err("the opening credit was not applied".into());
    }
    println!("\n$ inbox dlq replay --all --stream {stream}");
    let replayed = cli(&["dlq", "replay", "--all", "--stream", &stream]);
    let expected = OPENING - DEBITS * DEBIT;
    let applied = match &replayed {
        Ok(out) => {
            print!("{out}");
            until_done(
                "the replayed debits to be applied",
                &mut children,
                async || count(pool, &balance).await == expected,
            )
            .await
        }
        Err(_) => false,
    };
    let again = cli(&["dlq", "replay", "--all", "--stream", &stream]);
    stop_all(children).await?;
    replayed?;
    let again = again?;
    if !applied {
        return Err(format!(
            "the replayed debits were not applied: balance {} (expected {expected})",
            count(pool, &balance).await
        ));
    }
    println!("\n$ inbox dlq replay --all --stream {stream}   # again: nothing left");
    print!("{again}");
    println!(
        "\nreplayed once the cause was fixed: account {account} holds {expected} = {OPENING} - {DEBITS} x {DEBIT}, each debit applied once."
    );
    Ok(())
}

/// Runs `inbox args..` on the demo's NATS, database and dead-letter stream; its stdout, or why
/// it failed.
fn inbox_command(inbox: &Path, config: &CreditConfig, args: &[&str]) -> Result<String, String> {
    let output = Command::new(inbox)
        .env("NATS_URL", &config.nats_url)
        .env("DATABASE_URL", &config.database_url)
        .args(args)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", inbox.display()))?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(format!(
            "inbox {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}
