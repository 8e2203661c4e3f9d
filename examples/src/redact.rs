//! Credentials kept out of everything `credit` prints. [`url()`] masks the password or
//! token of a URL for the messages `credit` writes itself; [`Secrets`] scrubs any
//! text of the credentials the configured URLs hold, for what libraries write (async-nats logs a
//! server's address with its `Debug`, password included) and for errors that might echo a URL;
//! [`ScrubbedStderr`] puts every log line through it.

use std::io::Write;
use std::sync::Arc;
use url::Url;

/// What stands in for a credential.
pub const MASK: &str = "***";

/// A secret at least this long is masked wherever it appears; a shorter one only where it
/// stands delimited as a credential would (`:pw@`, `"pw"`, `=pw&`), lest every "a" of a log
/// line be masked for a password "a".
const MASKED_ANYWHERE: usize = 4;

/// `raw` with its credentials masked: the password (`postgres://user:***@host/db`), a lone
/// user name in a NATS URL, which is a token (`nats://***@host`), and the values of query
/// parameters that name a secret (`?password=***`); the fragment is dropped. When `raw` does
/// not parse as a URL with a path, or its path or query holds an `@`, where the credentials
/// end cannot be told: everything up to the last `@` is masked, and the query with it
/// (`postgres://***@host:port/db?***`).
pub fn url(raw: &str) -> String {
    match Url::parse(raw) {
        Ok(parsed) if clear_authority(&parsed) => masked(parsed),
        _ => unparsed(raw),
    }
}

/// [`url()`] for each server of a comma-separated list (`NATS_URL` may name several).
pub fn url_list(raw: &str) -> String {
    raw.split(',').map(url).collect::<Vec<_>>().join(",")
}

/// Whether `u` has an authority (or none at all, as `sqlite:///file`) and no `@` past it:
/// its credentials are exactly its user info.
fn clear_authority(u: &Url) -> bool {
    !u.cannot_be_a_base()
        && !u.path().contains('@')
        && !u.query().unwrap_or("").contains('@')
        && !u.fragment().unwrap_or("").contains('@')
}

fn masked(mut u: Url) -> String {
    u.set_fragment(None);
    // Cannot fail: a URL with a user name or password has a host.
    if u.password().is_some() {
        let _ = u.set_password(Some(MASK));
    } else if is_token(&u) {
        let _ = u.set_username(MASK);
    }
    if u.query_pairs().any(|(k, _)| secret_key(&k)) {
        let pairs: Vec<(String, String)> = u
            .query_pairs()
            .map(|(k, v)| {
                let v = if secret_key(&k) {
                    MASK.into()
                } else {
                    v.into()
                };
                (k.into_owned(), v)
            })
            .collect();
        u.query_pairs_mut().clear().extend_pairs(pairs);
    }
    u.into()
}

/// `raw`, not a URL that can be taken apart: only what follows its last `@`, without query
/// or fragment.
fn unparsed(raw: &str) -> String {
    let (scheme, rest) = match raw.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), raw),
    };
    let (userinfo, place) = match rest.rfind('@') {
        Some(at) => (format!("{MASK}@"), &rest[at + 1..]),
        None => (String::new(), rest),
    };
    let (place, query) = match place.find(['?', '#']) {
        Some(end) => (&place[..end], format!("?{MASK}")),
        None => (place, String::new()),
    };
    format!("{scheme}{userinfo}{place}{query}")
}

/// A user name without a password, in a NATS URL: async-nats sends it as a token.
fn is_token(u: &Url) -> bool {
    !u.username().is_empty()
        && u.password().is_none()
        && matches!(u.scheme(), "nats" | "tls" | "ws" | "wss")
}

/// Whether a query parameter named `key` holds a secret (`password`, `sslpassword`, `token`,
/// `auth_token`, `secret`, `pwd`, `pass`...).
fn secret_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    ["pass", "pwd", "token", "secret", "key", "credential"]
        .iter()
        .any(|word| key.contains(word))
}

/// The credentials of some URLs, as they might be printed, to mask in any text.
#[derive(Clone, Default)]
pub struct Secrets {
    /// Longest first, so that a secret containing another is masked whole.
    needles: Vec<String>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secrets({} masked)", self.needles.len())
    }
}

impl Secrets {
    /// Adds the credentials of `raw`: those [`url()`] masks, as written and percent-decoded.
    /// When `raw` cannot be taken apart, everything before its last `@` (whole, and after
    /// its first `:`) and the values of its secret query parameters.
    pub fn add_url(&mut self, raw: &str) {
        let mut found = Vec::new();
        match Url::parse(raw) {
            Ok(u) if clear_authority(&u) => {
                if let Some(password) = u.password() {
                    found.push(password.to_owned());
                } else if is_token(&u) {
                    found.push(u.username().to_owned());
                }
                if let Some(query) = u.query() {
                    found.extend(secret_values(query));
                }
            }
            _ => {
                let rest = raw.split_once("://").map_or(raw, |(_, rest)| rest);
                if let Some(at) = rest.rfind('@') {
                    let userinfo = &rest[..at];
                    found.push(userinfo.to_owned());
                    if let Some((_, password)) = userinfo.split_once(':') {
                        found.push(password.to_owned());
                    }
                }
                if let Some((_, query)) = rest.split_once('?') {
                    found.extend(secret_values(query));
                }
            }
        }
        for secret in found {
            let decoded = percent_decoded(&secret);
            self.add(decoded);
            self.add(secret);
        }
    }

    /// [`Secrets::add_url`] for the list as a whole and for each of its comma-separated
    /// servers.
    pub fn add_url_list(&mut self, raw: &str) {
        self.add_url(raw);
        for one in raw.split(',') {
            self.add_url(one);
        }
    }

    fn add(&mut self, secret: String) {
        if !secret.is_empty() && !self.needles.contains(&secret) {
            self.needles.push(secret);
            self.needles.sort_by_key(|s| std::cmp::Reverse(s.len()));
        }
    }

    /// `text` with every secret masked.
    pub fn scrub(&self, text: &str) -> String {
        let mut text = text.to_owned();
        for needle in &self.needles {
            if text.contains(needle.as_str()) {
                text = if needle.len() >= MASKED_ANYWHERE {
                    text.replace(needle.as_str(), MASK)
                } else {
                    mask_delimited(&text, needle)
                };
            }
        }
        text
    }
}

/// The values, as written, of the parameters of `query` that [`secret_key`] names.
fn secret_values(query: &str) -> Vec<String> {
    query
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .filter(|(key, _)| secret_key(&percent_decoded(key)))
        .map(|(_, value)| value.to_owned())
        .collect()
}

/// `s` with its `%XX` escapes decoded (as URL parsers read a user name or password).
fn percent_decoded(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `text` with `needle` masked where it stands delimited as a credential: after one of
/// `: / " ' =` and before one of `@ " ' & , ) ;`, whitespace or the end.
fn mask_delimited(text: &str, needle: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut copied = 0;
    for (at, _) in text.match_indices(needle) {
        let end = at + needle.len();
        let before = text[..at].chars().next_back();
        let after = text[end..].chars().next();
        let opens = matches!(before, Some(':' | '/' | '"' | '\'' | '='));
        let closes = match after {
            None => true,
            Some(c) => c.is_whitespace() || matches!(c, '@' | '"' | '\'' | '&' | ',' | ')' | ';'),
        };
        if at >= copied && opens && closes {
            out.push_str(&text[copied..at]);
            out.push_str(MASK);
            copied = end;
        }
    }
    out.push_str(&text[copied..]);
    out
}

/// A `tracing_subscriber` writer to stderr that scrubs each log line of the [`Secrets`]
/// before writing it: `fmt().with_writer(ScrubbedStderr::new(secrets))`.
#[derive(Debug, Clone)]
pub struct ScrubbedStderr(Arc<Secrets>);

impl ScrubbedStderr {
    /// Writes to stderr with `secrets` masked.
    pub fn new(secrets: Secrets) -> Self {
        ScrubbedStderr(Arc::new(secrets))
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for ScrubbedStderr {
    type Writer = ScrubbedLine;

    fn make_writer(&'a self) -> ScrubbedLine {
        ScrubbedLine {
            secrets: self.0.clone(),
            buffer: Vec::new(),
        }
    }
}

/// One log event on its way to stderr: kept whole until dropped, so that a secret split
/// across two writes is still found, then scrubbed and written.
#[derive(Debug)]
pub struct ScrubbedLine {
    secrets: Arc<Secrets>,
    buffer: Vec<u8>,
}

impl Write for ScrubbedLine {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.buffer.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for ScrubbedLine {
    fn drop(&mut self) {
        if !self.buffer.is_empty() {
            let line = self.secrets.scrub(&String::from_utf8_lossy(&self.buffer));
            let _ = std::io::stderr().lock().write_all(line.as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_and_tokens_are_masked() {
        let cases = [
            (
                "postgres://user:secret@127.0.0.1:1/db",
                "postgres://user:***@127.0.0.1:1/db",
            ),
            (
                "mysql://root:p%40ss@db:3306/x",
                "mysql://root:***@db:3306/x",
            ),
            (
                "nats://user:secret@127.0.0.1:1",
                "nats://user:***@127.0.0.1:1",
            ),
            ("nats://token@host", "nats://***@host"),
            ("tls://token@host:4443", "tls://***@host:4443"),
            // A lone user of a database is a user, not a token.
            ("postgres://postgres@h/test", "postgres://postgres@h/test"),
            (
                "postgres://u@h/db?sslmode=require&password=secret",
                "postgres://u@h/db?sslmode=require&password=***",
            ),
            ("postgres://u:secret@h/db#frag", "postgres://u:***@h/db"),
            ("sqlite:///tmp/x.db?mode=rwc", "sqlite:///tmp/x.db?mode=rwc"),
        ];
        for (raw, shown) in cases {
            assert_eq!(url(raw), shown, "{raw}");
        }
    }

    #[test]
    fn what_does_not_parse_keeps_only_what_follows_the_last_at() {
        let cases = [
            (
                "postgres://user:secret@127.0.0.1:notaport/db",
                "postgres://***@127.0.0.1:notaport/db",
            ),
            // The path would swallow part of the password: `@` past the host.
            ("postgres://u:123/se@cret@h/db", "postgres://***@h/db"),
            ("postgres://u:se?cret@h/db?x=1", "postgres://***@h/db?***"),
            ("user:secret@127.0.0.1:4222", "***@127.0.0.1:4222"),
            ("nats://a b@h", "nats://***@h"),
        ];
        for (raw, shown) in cases {
            assert_eq!(url(raw), shown, "{raw}");
        }
    }

    #[test]
    fn every_server_of_a_list_is_masked() {
        assert_eq!(
            url_list("nats://a:pw@h1:4222,nats://tok@h2"),
            "nats://a:***@h1:4222,nats://***@h2"
        );
    }

    #[test]
    fn text_is_scrubbed_of_the_secrets() {
        let mut secrets = Secrets::default();
        secrets.add_url("postgres://user:p%40ssword@h/db");
        secrets.add_url_list("nats://tok3n@h1,nats://u:x@h2");
        secrets.add_url("postgres://u:bad/secret@h:port/db");
        let text = r#"ServerAddr(Url { username: "tok3n", password: None }) p@ssword p%40ssword
            url nats://u:x@h2 password: Some("x") box x y bad/secret"#;
        let scrubbed = secrets.scrub(text);
        for secret in [
            "tok3n",
            "p@ssword",
            "p%40ssword",
            "bad/secret",
            "\"x\"",
            ":x@",
        ] {
            assert!(!scrubbed.contains(secret), "{secret} in {scrubbed}");
        }
        // A short secret is masked only where it stands as one.
        assert!(scrubbed.contains("box x y"), "{scrubbed}");
        assert!(!format!("{secrets:?}").contains("tok3n"));
    }

    #[test]
    fn percent_escapes_are_decoded() {
        assert_eq!(percent_decoded("p%40ss%2"), "p@ss%2");
    }
}
