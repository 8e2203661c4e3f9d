//! The inbox table's name, checked before it is written into any statement.

use std::fmt;

/// A validated SQL identifier naming the inbox table: ASCII letters, digits and `_`, not starting
/// with a digit, at most 48 bytes (so that derived index names stay within identifier limits).
///
/// ```
/// use inbox_runtime::TableName;
/// assert!(TableName::new("inbox").is_ok());
/// assert!(TableName::new("inbox; DROP TABLE x").is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TableName(String);

/// The longest accepted table name.
const MAX_TABLE_LEN: usize = 48;

/// A table name that is not a plain SQL identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid inbox table name {name:?}: use 1 to {MAX_TABLE_LEN} ASCII letters, digits or `_`, not starting with a digit"
)]
#[non_exhaustive]
pub struct InvalidTableName {
    /// The rejected name.
    pub name: String,
}

impl TableName {
    /// Validates `name`.
    pub fn new(name: &str) -> Result<Self, InvalidTableName> {
        let ok = !name.is_empty()
            && name.len() <= MAX_TABLE_LEN
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
            && !name.as_bytes()[0].is_ascii_digit();
        if ok {
            Ok(TableName(name.to_owned()))
        } else {
            Err(InvalidTableName {
                name: name.to_owned(),
            })
        }
    }

    /// The name as written in SQL.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for TableName {
    fn default() -> Self {
        TableName("inbox".to_owned())
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}
