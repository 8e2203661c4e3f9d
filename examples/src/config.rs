//! What every example reads from its environment the same way: variables through [`Vars`], and
//! how it authenticates to NATS ([`NatsAuth`]).

use crate::startup::StartError;

/// Environment variables as the examples read them, through a lookup (the environment, or a
/// test's map): empty is unset, and a number that does not parse is an error naming it.
pub(crate) struct Vars<F>(pub F);

impl<F: Fn(&str) -> Option<String>> Vars<F> {
    /// `name`'s value, else `default`.
    pub fn var(&self, name: &str, default: &str) -> String {
        (self.0)(name)
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| default.into())
    }

    /// `name`'s value as a whole number of at least `min` (at most `u32::MAX`), else `default`.
    pub fn number(&self, name: &str, default: &str, min: u64) -> Result<u64, String> {
        let value = self.var(name, default);
        value
            .parse::<u64>()
            .ok()
            .filter(|n| *n >= min && *n <= u64::from(u32::MAX))
            .ok_or_else(|| format!("{name}={value:?} is not a whole number of at least {min}"))
    }
}

/// How an example authenticates to NATS, besides what its URL holds (a user and password, a
/// token): `NATS_CREDS`, a credentials file (a user JWT and its NKey seed, as `nsc` writes), or
/// `NATS_NKEY`, a file holding an NKey seed (`SU...`). At most one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsAuth {
    /// `NATS_CREDS`.
    pub creds_file: Option<std::path::PathBuf>,
    /// `NATS_NKEY`.
    pub nkey_file: Option<std::path::PathBuf>,
}

impl NatsAuth {
    /// Reads `NATS_CREDS` and `NATS_NKEY`.
    pub(crate) fn from_vars<F: Fn(&str) -> Option<String>>(env: &Vars<F>) -> Result<Self, String> {
        let path = |name: &str| {
            Some(env.var(name, ""))
                .filter(|v| !v.is_empty())
                .map(Into::into)
        };
        let auth = NatsAuth {
            creds_file: path("NATS_CREDS"),
            nkey_file: path("NATS_NKEY"),
        };
        if auth.creds_file.is_some() && auth.nkey_file.is_some() {
            return Err("NATS_CREDS and NATS_NKEY are both set: use one".into());
        }
        Ok(auth)
    }

    /// `options` with these credentials.
    pub(crate) async fn apply(
        &self,
        options: async_nats::ConnectOptions,
    ) -> Result<async_nats::ConnectOptions, StartError> {
        if let Some(path) = &self.creds_file {
            return options.credentials_file(path).await.map_err(|e| {
                StartError::Fatal(format!("NATS_CREDS {}: {e}", path.display()).into())
            });
        }
        if let Some(path) = &self.nkey_file {
            let seed = std::fs::read_to_string(path).map_err(|e| {
                StartError::Fatal(format!("NATS_NKEY {}: {e}", path.display()).into())
            })?;
            return Ok(options.nkey(seed.trim().to_owned()));
        }
        Ok(options)
    }
}
