//! The partitioned layout's upkeep on the store: which partitions, and creating those ahead.

use super::Inbox;
use crate::backend::InboxBackend;
#[cfg(feature = "postgres")]
use crate::backend::InboxStatements;
use crate::layout::{Layout, Partitions};

impl<DB: InboxBackend> Inbox<DB> {
    /// How the table is cut into partitions, if it is.
    pub fn partitions(&self) -> Option<Partitions> {
        match self.layout() {
            Layout::Plain => None,
            Layout::Partitioned(p) => Some(p),
        }
    }

    /// Creates the partitions from the current one to `ahead` beyond it that do not exist yet
    /// (nothing for an unpartitioned inbox); returns how many it created. Safe to run from
    /// several instances at once (they take turns on a lock). [`Inbox::migrate`] runs it, and a
    /// worker runs it periodically.
    pub async fn add_partitions(&self) -> Result<u64, sqlx::Error> {
        let Layout::Partitioned(partitions) = self.layout() else {
            return Ok(0);
        };
        let mut conn = self.pool().acquire().await?;
        DB::add_partitions(&mut conn, self.table(), &partitions).await
    }
}

#[cfg(feature = "postgres")]
impl Inbox<sqlx::Postgres> {
    /// Puts the markers in range partitions of `received_at` (PostgreSQL only; opt in, the
    /// unpartitioned table stays the default): cleanup then drops whole partitions past the
    /// cutoff instead of deleting rows, so a day of churn leaves no dead tuples behind and costs
    /// a catalog change instead of a row-by-row DELETE. Claims cost a little more: a
    /// transaction-scoped advisory lock on the key, then a lookup in every partition (see
    /// ARCHITECTURE.md). Choose it before the first [`Inbox::migrate`]: an existing
    /// unpartitioned table is not converted (its migrations no longer match, and `migrate`
    /// says so).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use inbox_runtime::{Inbox, Partitions};
    /// let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1/test").await?;
    /// let inbox = Inbox::new(pool).partitioned(Partitions::daily());
    /// inbox.migrate().await?; // the table, and today's partition with three ahead
    /// # Ok(()) }
    /// ```
    pub fn partitioned(mut self, partitions: Partitions) -> Self {
        self.layout = Layout::Partitioned(partitions);
        self.sql =
            InboxStatements::new::<sqlx::Postgres>(&self.table, &self.layout, self.lock_timeout);
        self
    }
}
