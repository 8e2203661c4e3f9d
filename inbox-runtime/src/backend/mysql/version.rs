//! What a MySQL-protocol server's `VERSION()` says: MariaDB or MySQL, and which release.

use super::super::Server;

/// A server's `VERSION()`, read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Version {
    /// MariaDB's (its version names it), else MySQL's.
    pub(super) mariadb: bool,
    /// Major, minor, patch; `None` where the text starts with no number.
    pub(super) number: Option<(u32, u32, u32)>,
}

impl Version {
    /// Reads `version`. MariaDB may say "5.5.5-" first (a prefix for old replication clients);
    /// a MySQL 5.5.5 says it as its own number.
    pub(super) fn parse(version: &str) -> Self {
        let mariadb = version.to_ascii_lowercase().contains("mariadb");
        let number = match mariadb {
            true => version.strip_prefix("5.5.5-").unwrap_or(version),
            false => version,
        };
        let mut parts = number.split(|c: char| !c.is_ascii_digit());
        let mut next = || parts.next().and_then(|p| p.parse::<u32>().ok());
        let number = next().map(|major| (major, next().unwrap_or(0), next().unwrap_or(0)));
        Version { mariadb, number }
    }

    /// Whether the server is `needed` or later; `false` where its number cannot be read.
    pub(super) fn at_least(&self, needed: (u32, u32, u32)) -> bool {
        self.number.is_some_and(|n| n >= needed)
    }

    /// The server, as the dialect's statements tell servers apart: `INSERT .. RETURNING` came
    /// with MariaDB 10.5 (MySQL has none).
    pub(super) fn server(&self) -> Server {
        match self.mariadb {
            true => Server::MariaDb {
                returning: self.at_least((10, 5, 0)),
            },
            false => Server::MySql,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_are_told_apart_by_their_version() {
        for (version, server) in [
            (
                "10.11.19-MariaDB-0+deb12u1",
                Server::MariaDb { returning: true },
            ),
            ("5.5.5-10.5.0-MariaDB", Server::MariaDb { returning: true }),
            ("11.4.2-MariaDB", Server::MariaDb { returning: true }),
            ("10.4.34-MariaDB", Server::MariaDb { returning: false }),
            (
                "5.5.5-10.3.39-MariaDB",
                Server::MariaDb { returning: false },
            ),
            ("MariaDB", Server::MariaDb { returning: false }),
            ("8.0.36", Server::MySql),
            ("9.1.0", Server::MySql),
            ("5.5.5-log", Server::MySql),
        ] {
            assert_eq!(Version::parse(version).server(), server, "{version}");
        }
    }
}
