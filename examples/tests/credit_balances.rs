//! `credit`'s balance statements ([`BalanceSql`]) on each backend, against the `accounts` table
//! `credit` creates: a credit opens or tops up an account, a debit the balance covers is
//! applied, and a debit it does not cover or of an account never credited is refused for good
//! (dead-lettered, never retried), leaving every balance as it was.

use inbox_examples::RowsAffected;
use inbox_examples::{
    BalanceSql, MYSQL_BALANCES, NoSuchAccount, POSTGRES_BALANCES, SQLITE_BALANCES,
};
use inbox_runtime::{BoxError, ErrorClass, InboxBackend, Permanent, ProcessError, classify};
use inbox_tests::backends::{TestBackend, TestDb};
use sqlx::{AssertSqlSafe, Decode, Encode, Executor, FromRow, IntoArguments, Pool, Type};

/// Asserts that `err` is refused for good: dead-lettered, never tried again.
fn assert_permanent<DB: InboxBackend>(err: BoxError, what: &str) -> String {
    let text = err.to_string();
    let class = classify::<DB>(&ProcessError::Handler(err));
    assert_eq!(class, ErrorClass::Permanent, "{what}: {text}");
    text
}

async fn balances_change_as_credit_describes<B, DB>(
    balances: BalanceSql,
    create: impl AsyncFnOnce(&Pool<DB>) -> Result<(), sqlx::Error>,
) where
    B: TestBackend<Db = DB>,
    DB: InboxBackend<QueryResult: RowsAffected>,
    DB::Arguments: IntoArguments<DB>,
    for<'e> &'e mut DB::Connection: Executor<'e, Database = DB>,
    for<'q> i64: Encode<'q, DB> + Decode<'q, DB> + Type<DB>,
    (i64,): for<'r> FromRow<'r, DB::Row>,
{
    let db: TestDb<DB> = B::create(2).await;
    create(&db.pool).await.expect("accounts is created");
    let pool = &db.pool;
    // In a transaction of its own, committed if it succeeded.
    let change = async |account: i64, amount: i64| -> Result<(), BoxError> {
        let mut tx = pool.begin().await?;
        balances.apply::<DB>(&mut tx, account, amount).await?;
        tx.commit().await?;
        Ok(())
    };
    // `None`: no row.
    let balance = async |account: i64| -> Option<i64> {
        let sql = format!("SELECT balance FROM accounts WHERE id = {account}");
        sqlx::query_scalar::<DB, i64>(AssertSqlSafe(sql))
            .fetch_optional(pool)
            .await
            .expect("the balance is read")
    };

    change(1, 10).await.expect("a credit opens account 1");
    assert_eq!(balance(1).await, Some(10));
    change(1, 5).await.expect("a credit tops it up");
    change(1, -12).await.expect("a debit it covers");
    assert_eq!(balance(1).await, Some(3));
    change(1, 0)
        .await
        .expect("a credit of 0 (MySQL: no row changed)");
    change(2, 0).await.expect("a credit of 0 opens account 2");
    assert_eq!(balance(2).await, Some(0));

    let uncovered = change(1, -4).await.expect_err("3 does not cover 4");
    let text = assert_permanent::<DB>(uncovered, "a debit the balance does not cover");
    assert!(
        text.to_lowercase().contains("check") || text.to_lowercase().contains("constraint"),
        "expected the CHECK constraint's refusal, got {text}"
    );
    assert_eq!(balance(1).await, Some(3), "the refused debit left it");

    let nowhere = change(3, -1).await.expect_err("no account 3");
    assert!(
        nowhere.downcast_ref::<Permanent>().is_some(),
        "a debit of no account is marked permanent: {nowhere}"
    );
    let text = assert_permanent::<DB>(nowhere, "a debit of no account");
    assert_eq!(text, NoSuchAccount(3).to_string());
    assert_eq!(balance(3).await, None, "no account was opened by it");
}

macro_rules! on_backend {
    ($name:ident, $backend:ty, $balances:expr, $create:path) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn credits_open_accounts_and_uncovered_debits_are_refused_for_good() {
                super::balances_change_as_credit_describes::<$backend, _>($balances, async |p| {
                    $create(p).await
                })
                .await
            }
        }
    };
}

on_backend!(
    postgres,
    inbox_tests::backends::Postgres,
    super::POSTGRES_BALANCES,
    inbox_examples::create_accounts_postgres
);
on_backend!(
    mysql,
    inbox_tests::backends::MySql,
    super::MYSQL_BALANCES,
    inbox_examples::create_accounts_mysql
);
on_backend!(
    sqlite,
    inbox_tests::backends::Sqlite,
    super::SQLITE_BALANCES,
    inbox_examples::create_accounts_sqlite
);
