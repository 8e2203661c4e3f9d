//! Shapes a handler may take: the key borrows the message (which the body then owns), a shared
//! state argument, any argument order, `?` in the body, an integer key, no key at all, a
//! `Result` alias that hides the error type, a two-phase (`claim`) handler with state, a key from
//! a header of the `&Delivery`, raw payloads (`codec = Raw`), and a helper that takes the
//! transaction as `&mut Tx<'_, DB>`, lanes (an integer field, a string from the state), and key
//! reuse rejected (`on_key_reuse = reject`) or skipped (`skip`, the default).

use inbox_runtime::{Claim, Delivery, Handler, KeyError, Raw, Tx, idempotent};
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

/// Keyed on a header; the delivery is also the body's, in any position.
#[idempotent(consumer = "credit-header", key = delivery.header("Idempotency-Key"))]
async fn header_key(
    delivery: &Delivery,
    msg: Credit,
    tx: &mut Tx<Postgres>,
) -> Result<(), sqlx::Error> {
    let _ = (msg, delivery.delivered());
    helper(tx, delivery.subject()).await
}

/// Outside the macro, the transaction's lifetime is written out: `Tx<'_, Postgres>`.
async fn helper(tx: &mut Tx<'_, Postgres>, subject: &str) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT $1").bind(subject).execute(&mut **tx).await?;
    Ok(())
}

/// The payload as it came, keyed on CloudEvents' `ce-source` and `ce-id`.
#[idempotent(consumer = "credit-raw", key = delivery.cloud_event_key(), codec = Raw)]
async fn raw_payload(
    payload: bytes::Bytes,
    delivery: &Delivery,
    tx: &mut Tx<Postgres>,
) -> Result<(), sqlx::Error> {
    let _ = (payload.len(), delivery, tx);
    Ok(())
}

/// Another crate's `Delivery` is state, not the runtime's delivery.
mod shipping {
    pub struct Delivery {
        pub carrier: String,
    }
}

#[idempotent(consumer = "credit-ship", key = format!("{}:{}", courier.carrier, msg.id))]
async fn ships(
    msg: Credit,
    courier: &shipping::Delivery,
    tx: &mut Tx<Postgres>,
) -> Result<(), sqlx::Error> {
    let _ = (msg, &courier.carrier, tx);
    Ok(())
}

/// Laned by an integer field: batches take the accounts' rows in one order.
#[idempotent(consumer = "credit-lane", key = msg.id, lane = msg.seq)]
async fn laned(msg: Credit, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
    let _ = (msg, tx);
    Ok(())
}

/// Laned by a string the state and the message make.
#[idempotent(consumer = "credit-lane-text", lane = format!("{}{}", cfg.prefix, msg.id), key = msg.id)]
async fn laned_text(cfg: &Config, msg: Credit, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
    let _ = (cfg, msg, tx);
    Ok(())
}

/// A key reused with another payload is dead-lettered.
#[idempotent(consumer = "strict", key = msg.id, on_key_reuse = reject)]
async fn strict(msg: Credit, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
    let _ = (msg.seq, tx);
    Ok(())
}

/// Said as the default is.
#[idempotent(consumer = "lenient", key = msg.id, on_key_reuse = skip)]
async fn lenient(msg: Credit, tx: &mut Tx<Postgres>) -> Result<(), sqlx::Error> {
    let _ = (msg.seq, tx);
    Ok(())
}

fn main() {
    assert!(<strict as Handler>::REJECT_KEY_REUSE);
    assert!(!<lenient as Handler>::REJECT_KEY_REUSE && !<by_field as Handler>::REJECT_KEY_REUSE);
    let msg = Credit { id: "a".into(), seq: 7 };
    let d = Delivery::new("credits");
    assert_eq!(by_field.key(&msg, &d, &()), Ok(Some("a".to_owned())));
    let cfg = Config { prefix: "p".into() };
    assert_eq!(with_state.key(&msg, &d, &cfg), Ok(Some("p-7".to_owned())));
    assert_eq!(integer_key.key(&msg, &d, &()), Ok(Some("7".to_owned())));
    assert_eq!(transport_key.key(&msg, &d, &()), Ok(None));
    assert_eq!(<by_field as Handler>::CONSUMER, "credit");
    let _: Option<<result_alias as Handler>::Error> = None::<std::io::Error>;
    assert!(<two_phase as Handler>::TWO_PHASE && !<by_field as Handler>::TWO_PHASE);
    assert_eq!(two_phase.key(&msg, &d, &cfg), Ok(Some("a".to_owned())));
    let keyed = d.clone().with_header("idempotency-key", "k");
    assert_eq!(header_key.key(&msg, &keyed, &()), Ok(Some("k".to_owned())));
    assert_eq!(
        header_key.key(&msg, &d, &()),
        Err(KeyError::Absent("delivery.header(\"Idempotency-Key\")"))
    );
    let event = d.with_header("ce-id", "1").with_header("ce-source", "/s");
    let courier = shipping::Delivery { carrier: "dhl".into() };
    assert_eq!(ships.key(&msg, &Delivery::new("s"), &courier), Ok(Some("dhl:a".to_owned())));
    let payload = bytes::Bytes::from_static(b"\xff");
    assert_eq!(raw_payload.key(&payload, &event, &()), Ok(Some("/s 1".to_owned())));
    let d = Delivery::new("credits");
    assert!(<laned as Handler>::LANED && !<by_field as Handler>::LANED);
    assert_eq!(laned.lane(&msg, &d, &()), Some(inbox_runtime::Lane::int(7)));
    assert_eq!(by_field.lane(&msg, &d, &()), None);
    assert_eq!(laned_text.lane(&msg, &d, &cfg), Some(inbox_runtime::Lane::bytes("pa")));
}
