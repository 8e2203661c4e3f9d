//! Shapes a handler may take: the key borrows the message (which the body then owns), a shared
//! state argument, any argument order, `?` in the body, an integer key, no key at all, a
//! `Result` alias that hides the error type, a two-phase (`claim`) handler with state.

use inbox_runtime::{Claim, Handler, Tx, idempotent};
use sqlx::Postgres;

#[derive(serde::Deserialize)]
struct Credit {
    id: String,
    seq: u64,
}

struct Config {
    prefix: String,
}

#[derive(Debug, thiserror::Error)]
enum CreditError {
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

/// Keyed by a field, with `?` on a sqlx error converted into the handler's own error.
#[idempotent(consumer = "credit", key = msg.id)]
async fn by_field(msg: Credit, tx: &mut Tx<Postgres>) -> Result<(), CreditError> {
    sqlx::query("SELECT $1").bind(msg.id).execute(&mut **tx).await?;
    Ok(())
}

#[idempotent(consumer = "credit-state", key = format!("{}-{}", cfg.prefix, msg.seq))]
async fn with_state(
    cfg: &Config,
    tx: &mut sqlx::Transaction<'_, Postgres>,
    mut msg: Credit,
) -> Result<(), sqlx::Error> {
    msg.id.push_str(&cfg.prefix);
    let _ = tx;
    Ok(())
}

#[idempotent(consumer = "credit-int", key = msg.seq)]
async fn integer_key(msg: Credit, tx: &mut Tx<'_, Postgres>) -> std::result::Result<(), std::io::Error> {
    let _ = (msg, tx);
    Ok(())
}

#[idempotent(consumer = "credit-transport")]
async fn transport_key(msg: Credit, _tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
    let _ = msg;
    Ok(())
}

#[idempotent(consumer = "credit-alias")]
async fn result_alias(msg: Credit, tx: &mut Tx<Postgres>) -> std::io::Result<()> {
    let _ = (msg, tx);
    Ok(())
}

/// Two-phase: the claim in the transaction's place, the state beside it, its own error type.
#[idempotent(consumer = "credit-claim", key = msg.id, claim)]
async fn two_phase(cfg: &Config, msg: Credit, claim: &mut Claim<Postgres>) -> Result<(), CreditError> {
    let _ = (cfg.prefix.len(), msg.seq, claim.idempotency_key());
    let tx = claim.tx().await?;
    sqlx::query("SELECT 1").execute(&mut **tx).await?;
    Ok(())
}

fn main() {
    let msg = Credit { id: "a".into(), seq: 7 };
    assert_eq!(by_field.key(&msg, &()), Some("a".to_owned()));
    let cfg = Config { prefix: "p".into() };
    assert_eq!(with_state.key(&msg, &cfg), Some("p-7".to_owned()));
    assert_eq!(integer_key.key(&msg, &()), Some("7".to_owned()));
    assert_eq!(transport_key.key(&msg, &()), None);
    assert_eq!(<by_field as Handler>::CONSUMER, "credit");
    let _: Option<<result_alias as Handler>::Error> = None::<std::io::Error>;
    assert!(<two_phase as Handler>::TWO_PHASE && !<by_field as Handler>::TWO_PHASE);
    assert_eq!(two_phase.key(&msg, &cfg), Some("a".to_owned()));
}
