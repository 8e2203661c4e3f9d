//! Test databases: a fresh one per test or run, its connections cut on demand, removed when
//! dropped (also when the test panics).

use crate::{off_runtime, unique};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, MySqlPool, PgPool};
use std::path::{Path, PathBuf};

/// A database the project runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// PostgreSQL: `INBOX_TEST_PG_URL`, default `postgres://postgres@127.0.0.1:5432/test`.
    Postgres,
    /// MySQL or MariaDB: `INBOX_TEST_MYSQL_URL`, default `mysql://root@127.0.0.1:3306/test`.
    MySql,
    /// SQLite: a file in the temporary directory.
    Sqlite,
}

impl Backend {
    /// Every backend, in the order runs report them.
    pub const ALL: [Backend; 3] = [Backend::Postgres, Backend::MySql, Backend::Sqlite];

    /// `postgres`, `mysql` or `sqlite`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Postgres => "postgres",
            Backend::MySql => "mysql",
            Backend::Sqlite => "sqlite",
        }
    }

    /// The backend a command-line word names (`mariadb` too names [`Backend::MySql`]).
    pub fn parse(word: &str) -> Option<Backend> {
        match word {
            "postgres" => Some(Backend::Postgres),
            "mysql" | "mariadb" => Some(Backend::MySql),
            "sqlite" => Some(Backend::Sqlite),
            _ => None,
        }
    }

    /// The server's URL (on its administrative database), from the environment or the default;
    /// `None` for SQLite, which has no server.
    pub fn server_url(self) -> Option<String> {
        let (var, default) = match self {
            Backend::Postgres => (
                "INBOX_TEST_PG_URL",
                "postgres://postgres@127.0.0.1:5432/test",
            ),
            Backend::MySql => ("INBOX_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test"),
            Backend::Sqlite => return None,
        };
        Some(std::env::var(var).unwrap_or_else(|_| default.into()))
    }
}

/// A fresh, empty database (for SQLite, the path of a file not yet created), removed when
/// dropped: PostgreSQL `DROP DATABASE .. WITH (FORCE)`; MariaDB ends the database's sessions
/// (`KILL`) and drops it; SQLite removes the file and its `-wal` and `-shm`.
#[derive(Debug)]
pub struct Database {
    /// Its backend.
    pub backend: Backend,
    /// Its name (for SQLite, the file's stem).
    pub name: String,
    /// Its URL, for pools and other processes.
    pub url: String,
    removed: bool,
}

/// An admin connection to the server of `backend`, or an error that names the server.
enum Admin {
    Postgres(PgPool),
    MySql(MySqlPool),
}

impl Admin {
    async fn connect(backend: Backend) -> Result<Admin, String> {
        let url = backend.server_url().ok_or("SQLite has no server")?;
        let unreachable = |e: sqlx::Error| {
            let server = match backend {
                Backend::Postgres => "PostgreSQL",
                _ => "MariaDB/MySQL",
            };
            format!("{server} is not reachable at {url}: {e} (start it; see CONTRIBUTING.md)")
        };
        Ok(match backend {
            Backend::Postgres => Admin::Postgres(
                PgPoolOptions::new()
                    .max_connections(1)
                    .connect(&url)
                    .await
                    .map_err(unreachable)?,
            ),
            _ => Admin::MySql(
                MySqlPoolOptions::new()
                    .max_connections(1)
                    .connect(&url)
                    .await
                    .map_err(unreachable)?,
            ),
        })
    }

    async fn execute(&self, sql: String) -> Result<(), String> {
        let result = match self {
            Admin::Postgres(pool) => sqlx::query(AssertSqlSafe(sql.clone()))
                .execute(pool)
                .await
                .map(drop),
            Admin::MySql(pool) => sqlx::query(AssertSqlSafe(sql.clone()))
                .execute(pool)
                .await
                .map(drop),
        };
        result.map_err(|e| format!("{sql}: {e}"))
    }

    /// Ends every session on database `name` but this one; returns how many.
    async fn cut(&self, name: &str) -> Result<u64, String> {
        match self {
            Admin::Postgres(pool) => sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE datname = $1 AND pid <> pg_backend_pid()) t",
            )
            .bind(name)
            .fetch_one(pool)
            .await
            .map(|n| n as u64)
            .map_err(|e| format!("pg_terminate_backend: {e}")),
            Admin::MySql(pool) => {
                let sessions: Vec<i64> = sqlx::query_scalar(
                    "SELECT id FROM information_schema.processlist \
                     WHERE db = ? AND id <> CONNECTION_ID()",
                )
                .bind(name)
                .fetch_all(pool)
                .await
                .map_err(|e| format!("information_schema.processlist: {e}"))?;
                for id in &sessions {
                    // A session may end on its own meanwhile.
                    let _ = self.execute(format!("KILL {id}")).await;
                }
                Ok(sessions.len() as u64)
            }
        }
    }

    async fn close(self) {
        match self {
            Admin::Postgres(pool) => pool.close().await,
            Admin::MySql(pool) => pool.close().await,
        }
    }
}

impl Database {
    /// A fresh database named `prefix` and a random suffix; fails naming the server when it
    /// cannot be reached.
    pub async fn create(backend: Backend, prefix: &str) -> Result<Database, String> {
        let name = unique(prefix);
        let url = match backend.server_url() {
            None => format!("sqlite://{}", sqlite_path(&name).display()),
            Some(server) => {
                let admin = Admin::connect(backend).await?;
                admin.execute(format!("CREATE DATABASE {name}")).await?;
                admin.close().await;
                with_database(&server, &name)
            }
        };
        Ok(Database {
            backend,
            name,
            url,
            removed: false,
        })
    }

    /// Ends every session on this database, as a failover or an operator would, and returns how
    /// many; `None` for SQLite, whose connections are in-process and cannot be cut.
    pub async fn cut(&self) -> Result<Option<u64>, String> {
        if self.backend == Backend::Sqlite {
            return Ok(None);
        }
        let admin = Admin::connect(self.backend).await?;
        let cut = admin.cut(&self.name).await;
        admin.close().await;
        cut.map(Some)
    }

    /// Removes the database now (as dropping it would, but awaited).
    pub async fn remove(mut self) -> Result<(), String> {
        self.removed = true;
        remove(self.backend, &self.name).await
    }
}

async fn remove(backend: Backend, name: &str) -> Result<(), String> {
    if backend == Backend::Sqlite {
        remove_sqlite_files(&sqlite_path(name));
        return Ok(());
    }
    let admin = Admin::connect(backend).await?;
    let dropped = match backend {
        Backend::Postgres => {
            admin
                .execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                .await
        }
        // DROP DATABASE waits for the metadata locks of open transactions (a test that failed
        // while holding one): end those sessions first.
        _ => match admin.cut(name).await {
            Ok(_) => {
                admin
                    .execute(format!("DROP DATABASE IF EXISTS {name}"))
                    .await
            }
            Err(e) => Err(e),
        },
    };
    admin.close().await;
    dropped
}

impl Drop for Database {
    fn drop(&mut self) {
        if !self.removed {
            let (backend, name) = (self.backend, self.name.clone());
            off_runtime(async move {
                let _ = remove(backend, &name).await;
            });
        }
    }
}

fn sqlite_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("{name}.db"))
}

/// Removes the SQLite database file at `path` with its `-wal` and `-shm` files, those that exist.
pub fn remove_sqlite_files(path: &Path) {
    for suffix in ["", "-wal", "-shm"] {
        let mut file = path.as_os_str().to_owned();
        file.push(suffix);
        let _ = std::fs::remove_file(file);
    }
}

/// `url` with its database replaced by `db` (the query string kept).
pub fn with_database(url: &str, db: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let head = base.rsplit_once('/').map_or(base, |(h, _)| h);
    match query {
        Some(q) => format!("{head}/{db}?{q}"),
        None => format!("{head}/{db}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_database_keeps_the_query() {
        assert_eq!(
            with_database("postgres://u@h:1/test?sslmode=disable", "x"),
            "postgres://u@h:1/x?sslmode=disable"
        );
        assert_eq!(
            with_database("mysql://root@h:3306/test", "y"),
            "mysql://root@h:3306/y"
        );
    }
}
