//! The `email` example: a two-phase consumer (`#[idempotent(.., claim)]`) that sends each
//! requested e-mail through an HTTP API exactly once per message id, as far as the API honours the
//! `Idempotency-Key` header it is given (the same for every delivery, retry and takeover).
//!
//! For each message `{"id", "to", "body"}` it POSTs `{"to", "body"}` to `EMAIL_API_URL` with
//! `Idempotency-Key: <Claim::idempotency_key>`. A 2xx is success; a 5xx, a timeout or a
//! connection error is transient (retried, then redelivered; dead-lettered at `max_deliver`);
//! any other status is permanent (dead-lettered at once). Several processes may run on one
//! durable consumer: the claim's lease and fence decide which one calls.

use crate::startup::{
    Backends, ConsumerSpec, DatabaseSpec, Example, NatsConnector, jetstream_consumer,
    start_database, until_up,
};
use crate::{Error, RETENTION, Vars, redact};
use inbox_runtime::{
    App, BoxError, Claim, Durable, Handler, Inbox, Permanent, Stats, Transient, idempotent,
};
use serde::{Deserialize, Serialize};
use sqlx::{MySql, Pool, Postgres, Sqlite};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// A request to send `body` to `to`; `id` identifies the request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EmailRequested {
    /// The request's id: the dedup key.
    pub id: String,
    /// The recipient.
    pub to: String,
    /// The text.
    pub body: String,
}

/// What the handler calls: the HTTP client and the API's URL.
#[derive(Debug, Clone)]
pub struct Api {
    client: reqwest::Client,
    url: String,
    hold_before_call: Duration,
}

/// The API's answer when it is not a success, with its status.
#[derive(Debug, thiserror::Error)]
#[error("email API answered {status}: {body}")]
pub struct ApiError {
    /// The HTTP status.
    pub status: u16,
    /// The start of the response body.
    pub body: String,
}

impl Api {
    /// The API at `url`, each call given at most `timeout`.
    pub fn new(url: impl Into<String>, timeout: Duration) -> Result<Api, reqwest::Error> {
        Ok(Api {
            client: reqwest::Client::builder().timeout(timeout).build()?,
            url: url.into(),
            hold_before_call: Duration::ZERO,
        })
    }

    /// Sends `msg` with `idempotency_key`: `Ok` on a 2xx; a 5xx, timeout or connection error
    /// marked [`Transient`]; any other status [`Permanent`].
    pub async fn send(&self, msg: &EmailRequested, idempotency_key: &str) -> Result<(), BoxError> {
        if !self.hold_before_call.is_zero() {
            tokio::time::sleep(self.hold_before_call).await;
        }
        let sent = self
            .client
            .post(&self.url)
            .header("Idempotency-Key", idempotency_key)
            .json(&serde_json::json!({ "to": msg.to, "body": msg.body }))
            .send()
            .await;
        let response = match sent {
            Ok(response) => response,
            Err(e) => return Err(Transient::new(e).into()),
        };
        let status = response.status();
        if status.is_success() {
            return Ok(());
        }
        let mut body = response.text().await.unwrap_or_default();
        body.truncate(200);
        let err = ApiError {
            status: status.as_u16(),
            body,
        };
        // The example's contract: a 5xx is transient, any other status permanent. (An API that
        // answers 409 or 429 for "not now", as some do, would want those retried too.)
        Err(if status.is_server_error() {
            Transient::new(err).into()
        } else {
            Permanent::new(err).into()
        })
    }
}

/// Sends the e-mail; the claim is kept in PostgreSQL.
#[idempotent(consumer = "email", key = msg.id, claim)]
pub async fn email_postgres(
    msg: EmailRequested,
    claim: &mut Claim<Postgres>,
    api: &Api,
) -> Result<(), BoxError> {
    api.send(&msg, claim.idempotency_key()).await
}

/// [`email_postgres`] for MySQL and MariaDB.
#[idempotent(consumer = "email", key = msg.id, claim)]
pub async fn email_mysql(
    msg: EmailRequested,
    claim: &mut Claim<MySql>,
    api: &Api,
) -> Result<(), BoxError> {
    api.send(&msg, claim.idempotency_key()).await
}

/// [`email_postgres`] for SQLite.
#[idempotent(consumer = "email", key = msg.id, claim)]
pub async fn email_sqlite(
    msg: EmailRequested,
    claim: &mut Claim<Sqlite>,
    api: &Api,
) -> Result<(), BoxError> {
    api.send(&msg, claim.idempotency_key()).await
}

/// The `email` example's configuration. Its `Debug` shows the URLs with credentials masked.
#[derive(Clone, PartialEq, Eq)]
pub struct EmailConfig {
    /// `NATS_URL`, default `nats://127.0.0.1:4222`.
    pub nats_url: String,
    /// `NATS_CREDS` or `NATS_NKEY` (see [`crate::NatsAuth`]).
    pub nats_auth: crate::NatsAuth,
    /// `METRICS_ADDR`: where `/metrics` and `/healthz` are served (unset: not served).
    pub metrics: Option<std::net::SocketAddr>,
    /// `DATABASE_URL`, as for `credit`.
    pub database_url: String,
    /// `EMAIL_STREAM`, default `EMAILS`.
    pub stream: String,
    /// `EMAIL_SUBJECT`, default `emails.requested`.
    pub subject: String,
    /// `EMAIL_CONSUMER`: the durable consumer's name, default `email`.
    pub durable: String,
    /// `EMAIL_API_URL`, default `http://127.0.0.1:8025/send`.
    pub api_url: String,
    /// `EMAIL_LEASE_MS`: the claim's lease, default 10,000 ms. The consumer it creates has an
    /// `ack_wait` of twice the lease (at least 1 s).
    pub lease: Duration,
    /// `EMAIL_CONCURRENCY`: the database pool's size, default 8, at least 2: one connection is
    /// kept for lease renewals, the others carry calls in flight.
    pub concurrency: u32,
    /// `EMAIL_TEST_HOLD_BEFORE_CALL_MS`, for the tests only: waits this long after the claim
    /// committed before calling the API (default 0), so that a test can kill the process
    /// between the two.
    pub hold_before_call: Duration,
}

impl EmailConfig {
    /// Reads the configuration from the environment, with the documented defaults; a variable
    /// that does not parse is an error that names it.
    pub fn from_env() -> Result<Self, String> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`EmailConfig::from_env`] over `get`, which looks a variable up.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Self, String> {
        let env = Vars(get);
        let var = |name: &str, default: &str| env.var(name, default);
        let number = |name: &str, default: &str, min: u64| env.number(name, default, min);
        let api_url = var("EMAIL_API_URL", "http://127.0.0.1:8025/send");
        match reqwest::Url::parse(&api_url) {
            Ok(u) if u.scheme() == "http" => {}
            Ok(u) => {
                return Err(format!(
                    "EMAIL_API_URL={api_url:?}: scheme {:?} is not supported by this build; use http://",
                    u.scheme()
                ));
            }
            Err(e) => return Err(format!("EMAIL_API_URL={api_url:?} is not a URL: {e}")),
        }
        Ok(EmailConfig {
            nats_url: var("NATS_URL", "nats://127.0.0.1:4222"),
            nats_auth: crate::NatsAuth::from_vars(&env)?,
            metrics: crate::observe::metrics_addr(&env)?,
            database_url: var("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test"),
            stream: var("EMAIL_STREAM", "EMAILS"),
            subject: var("EMAIL_SUBJECT", "emails.requested"),
            durable: var("EMAIL_CONSUMER", "email"),
            api_url,
            lease: Duration::from_millis(number("EMAIL_LEASE_MS", "10000", 100)?),
            // One connection is kept for lease renewals.
            concurrency: number("EMAIL_CONCURRENCY", "8", 2)? as u32,
            hold_before_call: Duration::from_millis(number(
                "EMAIL_TEST_HOLD_BEFORE_CALL_MS",
                "0",
                0,
            )?),
        })
    }

    /// The credentials of both URLs, to scrub from whatever is printed.
    pub fn secrets(&self) -> redact::Secrets {
        let mut secrets = redact::Secrets::default();
        secrets.add_url_list(&self.nats_url);
        secrets.add_url(&self.database_url);
        secrets
    }

    /// The `ack_wait` of the consumer it creates: twice the lease, at least 1 s.
    pub fn ack_wait(&self) -> Duration {
        (self.lease * 2).max(Duration::from_secs(1))
    }
}

impl std::fmt::Debug for EmailConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmailConfig")
            .field("nats_url", &redact::url_list(&self.nats_url))
            .field("database_url", &redact::url(&self.database_url))
            .field("stream", &self.stream)
            .field("subject", &self.subject)
            .field("durable", &self.durable)
            .field("api_url", &redact::url(&self.api_url))
            .field("lease", &self.lease)
            .field("concurrency", &self.concurrency)
            .finish()
    }
}

/// Sets up the stream, the durable consumer and the inbox, then sends e-mails until `shutdown`.
/// NATS or the database being down at start is waited out, as for `credit`.
pub async fn run(config: &EmailConfig, shutdown: CancellationToken) -> Result<Stats, Error> {
    let spec = ConsumerSpec {
        nats_url: &config.nats_url,
        nats_auth: &config.nats_auth,
        stream: &config.stream,
        subject: &config.subject,
        durable: &config.durable,
        ack_wait: config.ack_wait(),
        max_deliver: 10,
        max_ack_pending: 0,
    };
    let Some((jetstream, _, stream)) =
        until_up("NATS", &shutdown, || jetstream_consumer(&spec)).await?
    else {
        return Ok(Stats::default());
    };
    let mut api = Api::new(&config.api_url, Duration::from_secs(30))?;
    api.hold_before_call = config.hold_before_call;
    let database = DatabaseSpec {
        url: &config.database_url,
        server_pool: config.concurrency,
        // Claims, renewals and completions are short writes, serialised by SQLite's write
        // lock; the calls between them run side by side.
        sqlite_pool: config.concurrency,
    };
    let on = Serve {
        config,
        jetstream,
        stream: &stream,
        shutdown: shutdown.clone(),
        api,
    };
    let parts = Backends {
        postgres: email_postgres,
        mysql: email_mysql,
        sqlite: email_sqlite,
    };
    let stats = start_database(&database, &shutdown, on, parts).await?;
    Ok(stats.unwrap_or_default())
}

/// Where the handler runs, once NATS is up.
struct Serve<'a> {
    config: &'a EmailConfig,
    jetstream: async_nats::jetstream::Context,
    stream: &'a async_nats::jetstream::stream::Stream,
    shutdown: CancellationToken,
    api: Api,
}

/// `Part`: the backend's `email_*`.
impl<H: Handler<State = Api>> Example<H> for Serve<'_> {
    type Db = H::Db;
    type Output = Stats;

    /// None: the claims are the inbox's.
    async fn create_tables(_: &H, _: &Pool<H::Db>) -> Result<(), sqlx::Error> {
        Ok(())
    }

    async fn run(self, handler: H, inbox: Inbox<H::Db>) -> Result<Stats, Error> {
        let inbox = inbox.lease(self.config.lease);
        let durable =
            Durable::existing(&self.stream.cached_info().config.name, &self.config.durable);
        let stream = self.stream.clone();
        let pulls = NatsConnector::new(&self.config.nats_url, &self.config.nats_auth).pulls();
        let app = App::new(inbox, &self.jetstream)
            .pull_connections(pulls)
            .handler_configured(handler, self.api, durable, move |w| {
                w.cleanup(RETENTION, &stream)
            });
        if let Some(addr) = self.config.metrics {
            crate::observe::serve(addr, app.health()).await?;
        }
        let stats = app.run_until(self.shutdown).await?;
        Ok(crate::orders::total(&stats))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(vars: &[(&str, &str)]) -> Result<EmailConfig, String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        EmailConfig::from_vars(|name| vars.get(name).cloned())
    }

    #[test]
    fn defaults_and_bad_values_named() {
        let c = config(&[]).unwrap();
        assert_eq!(
            (
                c.stream.as_str(),
                c.subject.as_str(),
                c.durable.as_str(),
                c.api_url.as_str()
            ),
            (
                "EMAILS",
                "emails.requested",
                "email",
                "http://127.0.0.1:8025/send"
            )
        );
        assert_eq!(c.lease, Duration::from_secs(10));
        assert_eq!(c.ack_wait(), Duration::from_secs(20));
        for (name, value) in [
            ("EMAIL_LEASE_MS", "ten"),
            ("EMAIL_LEASE_MS", "5"),
            ("EMAIL_CONCURRENCY", "0"),
            ("EMAIL_CONCURRENCY", "1"),
            ("EMAIL_API_URL", "not a url"),
            ("EMAIL_API_URL", "ftp://x/send"),
        ] {
            let e = config(&[(name, value)]).unwrap_err();
            assert!(e.contains(name) && e.contains(value), "{e}");
        }
    }
}
