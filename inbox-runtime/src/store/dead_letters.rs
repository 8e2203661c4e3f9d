//! Dead letters parked in `<table>_dead_letters`: what no stream would take on a message's last
//! delivery, kept until the worker can publish it.

use super::Inbox;
use crate::backend::{Beginning, InboxBackend};

/// A dead letter parked in the database, waiting for the dead-letter stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ParkedLetter {
    /// Its row, to forget once published.
    pub id: i64,
    /// The letter's headers.
    pub headers: Vec<(String, String)>,
    /// The letter's payload.
    pub payload: Vec<u8>,
}

impl<DB: InboxBackend> Inbox<DB> {
    /// Keeps a dead letter (its headers and payload) in `<table>_dead_letters`, until
    /// [`Inbox::parked_letters`] hands it to a publisher.
    pub(crate) async fn park_letter(
        &self,
        consumer: &str,
        headers: &[(String, String)],
        payload: &[u8],
    ) -> Result<(), sqlx::Error> {
        let headers = serde_json::to_string(headers).expect("strings serialize");
        // In a transaction of its own, committed before the message is termed: an autocommit
        // INSERT on a pooled connection that something else left inside a transaction (a BEGIN
        // cut before its answer on a pool shared with the application, which MySQL's driver
        // does not roll back) would commit only with that transaction, and be lost with the
        // connection. A BEGIN there commits it (MySQL) or joins it (PostgreSQL), so the COMMIT
        // makes the letter durable either way.
        let mut conn = Beginning::new(self.pool.acquire().await?);
        let mut tx = conn.begin().await?;
        DB::park(&mut *tx, self.sql.park.clone(), consumer, &headers, payload).await?;
        tx.commit().await
    }

    /// The oldest letters parked for `consumer`.
    pub(crate) async fn parked_letters(
        &self,
        consumer: &str,
    ) -> Result<Vec<ParkedLetter>, sqlx::Error> {
        let rows = DB::parked(&self.pool, self.sql.parked.clone(), consumer).await?;
        rows.into_iter()
            .map(|row| {
                let headers = serde_json::from_str(&row.headers)
                    .map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
                Ok(ParkedLetter {
                    id: row.id,
                    headers,
                    payload: row.payload,
                })
            })
            .collect()
    }

    /// Forgets parked letter `id`.
    pub(crate) async fn unpark_letter(&self, id: i64) -> Result<(), sqlx::Error> {
        DB::execute_id_on(&self.pool, self.sql.unpark.clone(), id).await?;
        Ok(())
    }
}
