//! MySQL's outbox tables (`Backend::outbox_migration_sql`, `Backend::outbox_unversioned_sql`).
//! Their text is the migration's: its checksum is recorded, so not a byte may change.

use super::TableName;

/// The outbox's tables: its rows, and the rows NATS refused for good.
pub(super) fn tables(table: &TableName) -> Vec<String> {
    vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {table} (
                id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
                msg_id VARCHAR(255) NOT NULL,
                subject TEXT NOT NULL,
                order_key TEXT NOT NULL,
                headers MEDIUMTEXT NOT NULL,
                payload LONGBLOB NOT NULL,
                created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
                sent_at TIMESTAMP(6) NULL,
                KEY {table}_pending_idx (sent_at, id)
            ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"
        ),
        // The rows NATS refused for good; each holds back its key's later rows.
        format!(
            "CREATE TABLE IF NOT EXISTS {table}_failed (
                id BIGINT NOT NULL PRIMARY KEY,
                order_key TEXT NOT NULL,
                error TEXT NOT NULL,
                failed_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
            ) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin"
        ),
    ]
}

/// The relays' turn: one row, locked by the relay whose pass runs (`relay_turn_sql`). Not a
/// migration step: an instance of an earlier version, started again during a rolling
/// upgrade, refuses a database with a step it does not know.
pub(super) fn turn_table(table: &TableName) -> Vec<String> {
    vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {table}_relay (
                id INT NOT NULL PRIMARY KEY
            ) ENGINE = InnoDB"
        ),
        format!("INSERT INTO {table}_relay (id) VALUES (1) ON DUPLICATE KEY UPDATE id = id"),
    ]
}
