//! Which handler has which consumer name in this process: two handler types under one name on
//! one table would share markers, and each would skip the other's messages.

use super::WorkerError;
use crate::backend::TableName;
use crate::handler::Handler;
use std::any::TypeId;
use std::collections::BTreeMap;
use std::sync::Mutex;

/// Which handler (by type) uses each consumer name, per kind of database and inbox table, in
/// this process.
type ConsumerNames = BTreeMap<(TypeId, String, &'static str), (TypeId, &'static str)>;

static CONSUMER_NAMES: Mutex<ConsumerNames> = Mutex::new(BTreeMap::new());

/// Records that handler `H` uses its consumer name on `table`; refuses a second handler type
/// with the same name on the same table and kind of database. The same handler may have many
/// workers (instances, clones, restarts).
pub(super) fn claim_consumer_name<H: Handler>(table: &TableName) -> Result<(), WorkerError> {
    let mut names = CONSUMER_NAMES.lock().unwrap_or_else(|e| e.into_inner());
    let key = (
        TypeId::of::<H::Db>(),
        table.as_str().to_owned(),
        H::CONSUMER,
    );
    let this = (TypeId::of::<H>(), std::any::type_name::<H>());
    match names.get(&key) {
        Some(&(other, name)) if other != this.0 => Err(WorkerError::ConsumerTaken {
            consumer: H::CONSUMER,
            table: table.as_str().to_owned(),
            other: name,
            this: this.1,
        }),
        Some(_) => Ok(()),
        None => {
            names.insert(key, this);
            Ok(())
        }
    }
}
