//! How `credit` changes a balance, on each backend: the statements its handlers run, which the
//! bench's hand-written `baseline` runs too, so that every contender does the same work.
//!
//! A credit (an amount of zero or more) is an upsert: it creates the account when new. A debit
//! (a negative amount) is an update of the account: the `accounts` CHECK constraint (`balance >=
//! 0`) refuses one the balance does not cover, and a debit of an account that does not exist
//! (never credited) changes no row, which the handler refuses with [`NoSuchAccount`], marked
//! [`Permanent`]. Both refusals are genuine errors that roll back the marker (and the
//! announcement) too: the message is dead-lettered, never taken for a duplicate.
//!
//! A debit could not go through the upsert: the row an upsert proposes is checked before its
//! conflict is (on every backend), so a negative proposal fails even where the account covers
//! it. Proposing 0 when the account exists needs a subquery on `accounts` inside the upsert,
//! which MySQL refuses (1093) and which MariaDB, in the derived-table form both accept, answers
//! with a temporary table per statement: three times the CPU of the plain upsert.

use inbox_runtime::{BoxError, Permanent};
use sqlx::query::Query;
use sqlx::{Database, Encode, Executor, IntoArguments, Type};

/// A backend's two statements for a balance change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BalanceSql {
    /// A credit: an upsert; binds the account, the amount, and the amount again.
    pub credit: &'static str,
    /// A debit: an update of an existing account; binds the amount, then the account.
    pub debit: &'static str,
}

/// PostgreSQL's.
pub const POSTGRES_BALANCES: BalanceSql = BalanceSql {
    credit: "INSERT INTO accounts (id, balance) VALUES ($1, $2) \
             ON CONFLICT (id) DO UPDATE SET balance = accounts.balance + $3",
    debit: "UPDATE accounts SET balance = balance + $1 WHERE id = $2",
};

/// MySQL's and MariaDB's.
pub const MYSQL_BALANCES: BalanceSql = BalanceSql {
    credit: "INSERT INTO accounts (id, balance) VALUES (?, ?) \
             ON DUPLICATE KEY UPDATE balance = balance + ?",
    debit: "UPDATE accounts SET balance = balance + ? WHERE id = ?",
};

/// SQLite's.
pub const SQLITE_BALANCES: BalanceSql = BalanceSql {
    credit: "INSERT INTO accounts (id, balance) VALUES (?1, ?2) \
             ON CONFLICT (id) DO UPDATE SET balance = balance + ?3",
    debit: "UPDATE accounts SET balance = balance + ?1 WHERE id = ?2",
};

impl BalanceSql {
    /// Adds `amount` to `account`'s balance in `conn` (a transaction's connection): the
    /// credit's statement (`amount` ≥ 0) or the debit's, then [`BalanceSql::refused`] with the
    /// rows it affected. A database error comes back as the `sqlx::Error` it is.
    pub async fn apply<DB>(
        &self,
        conn: &mut DB::Connection,
        account: i64,
        amount: i64,
    ) -> Result<(), BoxError>
    where
        DB: Database<QueryResult: RowsAffected>,
        DB::Arguments: IntoArguments<DB>,
        for<'e> &'e mut DB::Connection: Executor<'e, Database = DB>,
        for<'q> i64: Encode<'q, DB> + Type<DB>,
    {
        let changed = self.change::<DB>(account, amount).execute(conn).await?;
        match Self::refused(account, amount, changed.rows()) {
            Some(refused) => Err(refused),
            None => Ok(()),
        }
    }

    /// The statement that adds `amount` to `account`'s balance, bound: the credit's or the
    /// debit's.
    fn change<'q, DB>(&self, account: i64, amount: i64) -> Query<'q, DB, DB::Arguments>
    where
        DB: Database,
        i64: Encode<'q, DB> + Type<DB>,
    {
        if amount >= 0 {
            sqlx::query(self.credit)
                .bind(account)
                .bind(amount)
                .bind(amount)
        } else {
            sqlx::query(self.debit).bind(amount).bind(account)
        }
    }

    /// What refuses a balance change, given the rows its statement affected: a
    /// debit that changed no row found no account ([`NoSuchAccount`], marked [`Permanent`]).
    /// A credit is never refused here (an upsert that adds 0 may change no row on MySQL).
    pub fn refused(account: i64, amount: i64, rows_affected: u64) -> Option<BoxError> {
        (amount < 0 && rows_affected == 0)
            .then(|| Box::new(Permanent::new(NoSuchAccount(account))) as BoxError)
    }
}

/// A statement's rows affected, whatever the backend (sqlx's query results share no trait).
pub trait RowsAffected {
    /// The rows the statement affected.
    fn rows(&self) -> u64;
}

impl RowsAffected for sqlx::postgres::PgQueryResult {
    fn rows(&self) -> u64 {
        self.rows_affected()
    }
}

impl RowsAffected for sqlx::mysql::MySqlQueryResult {
    fn rows(&self) -> u64 {
        self.rows_affected()
    }
}

impl RowsAffected for sqlx::sqlite::SqliteQueryResult {
    fn rows(&self) -> u64 {
        self.rows_affected()
    }
}

/// A debit of an account that does not exist: there is no balance to take it from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("account {0} does not exist, and a debit needs a balance that covers it")]
pub struct NoSuchAccount(pub i64);

#[cfg(test)]
mod tests {
    use super::*;
    use inbox_runtime::{ErrorClass, ProcessError, classify};

    #[test]
    fn a_debit_that_changed_no_row_is_refused_for_good_and_nothing_else_is() {
        let refused = BalanceSql::refused(7, -5, 0).expect("a debit of no account is refused");
        assert_eq!(
            refused.to_string(),
            "account 7 does not exist, and a debit needs a balance that covers it"
        );
        let class = classify::<sqlx::Postgres>(&ProcessError::Handler(refused));
        assert_eq!(class, ErrorClass::Permanent);
        assert!(BalanceSql::refused(7, -5, 1).is_none(), "a debit applied");
        assert!(
            BalanceSql::refused(7, 0, 0).is_none(),
            "a credit of 0 changes no row"
        );
        assert!(BalanceSql::refused(7, 5, 1).is_none(), "a credit");
    }
}
