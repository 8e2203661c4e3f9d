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

/// Why this server cannot run the outbox relay (`Backend::relay_unsupported`): the relay locks
/// rows `FOR UPDATE SKIP LOCKED`, which came with MariaDB 10.6 and MySQL 8.0.1. `None` where it
/// can, or where the version's number cannot be read.
pub(super) fn relay_unsupported(version: &str) -> Option<String> {
    let read = Version::parse(version);
    let (name, needed) = match read.mariadb {
        true => ("MariaDB", (10, 6, 0)),
        false => ("MySQL", (8, 0, 1)),
    };
    (read.number.is_some() && !read.at_least(needed)).then(|| {
        format!(
            "the outbox relay locks rows FOR UPDATE SKIP LOCKED, which {name} has from \
             {}.{}.{} on; this server is {version}",
            needed.0, needed.1, needed.2
        )
    })
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

    #[test]
    fn servers_without_skip_locked_are_named() {
        for old in [
            "10.5.23-MariaDB-0+deb11u1",
            "5.5.5-10.3.39-MariaDB",
            "5.7.44",
            "8.0.0-dmr",
            "5.5.5-log",
        ] {
            let why = relay_unsupported(old);
            assert!(
                why.as_deref().is_some_and(|w| w.contains(old)),
                "{old}: {why:?}"
            );
        }
        for new in [
            "10.11.19-MariaDB-0+deb12u1",
            "10.6.0-MariaDB",
            "5.5.5-10.11.2-MariaDB",
            "8.0.36",
            "9.1.0",
            "11.4.2-MariaDB",
        ] {
            assert_eq!(relay_unsupported(new), None, "{new}");
        }
    }
}
