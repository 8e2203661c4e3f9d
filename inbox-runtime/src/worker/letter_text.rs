//! What a dead letter says of its error (`Inbox-Error`): our own words for a database error, any
//! other error's text scrubbed of the secrets such texts are known to carry, on one line of at
//! most [`MAX_ERROR_LEN`] bytes. A letter travels on to whoever reads the dead-letter stream.

use crate::error::{ProcessError, chain};
use sqlx::error::ErrorKind;

/// The longest `Inbox-Error` a letter carries, in bytes: an error can be as long as a payload.
pub(super) const MAX_ERROR_LEN: usize = 1024;

/// The `Inbox-Error` header of a letter whose error says `text`: scrubbed, on one bounded line.
pub(super) fn error_header(text: &str) -> String {
    one_line(&scrub(text), MAX_ERROR_LEN)
}

/// `text` without the secrets an error's text is known to carry: the user info of a URL
/// (`scheme://user:password@host` becomes `scheme://***@host`), a URL's query (`?token=..`
/// becomes `?***`), and the value of a `name=value` or `name: value` pair whose name says
/// password, token, secret, key, auth, signature or credential. A letter travels on to whoever
/// reads the dead-letter stream; an HTTP client's error, say, carries its whole URL.
fn scrub(text: &str) -> String {
    const SECRET_NAMES: [&str; 9] = [
        "password",
        "passwd",
        "pwd",
        "token",
        "secret",
        "key",
        "auth",
        "signature",
        "credential",
    ];
    let ends_token = |c: char| c.is_whitespace() || matches!(c, '"' | '\'' | '<' | '>' | ')' | ',');
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        // A URL: scheme, "://", then up to the next whitespace or quote.
        if let Some(at) = rest.find("://") {
            let scheme_start = after_last(&rest[..at], |c| {
                !(c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
            });
            out.push_str(&scrub_pairs(&rest[..scheme_start], &SECRET_NAMES));
            let url_end = rest[at + 3..]
                .find(ends_token)
                .map_or(rest.len(), |i| at + 3 + i);
            let url = &rest[scheme_start..url_end];
            let (head, query) = match url.find('?') {
                Some(q) => (&url[..q], Some(())),
                None => (url, None),
            };
            let body_start = at - scheme_start + 3;
            let authority_end = head[body_start..]
                .find('/')
                .map_or(head.len(), |i| body_start + i);
            match head[body_start..authority_end].rfind('@') {
                Some(user) => {
                    out.push_str(&head[..body_start]);
                    out.push_str("***");
                    out.push_str(&head[body_start + user..]);
                }
                None => out.push_str(head),
            }
            if query.is_some() {
                out.push_str("?***");
            }
            rest = &rest[url_end..];
        } else {
            out.push_str(&scrub_pairs(rest, &SECRET_NAMES));
            break;
        }
    }
    out
}

/// Where what follows the last character of `text` matching `pred` starts (a byte index on a
/// character boundary, whatever that character's width); 0 when none matches.
fn after_last(text: &str, pred: impl Fn(char) -> bool) -> usize {
    text.char_indices()
        .rev()
        .find(|&(_, c)| pred(c))
        .map_or(0, |(i, c)| i + c.len_utf8())
}

/// `text` with the value of each `name=value` / `name: value` pair whose name contains one of
/// `names` (any letter case) replaced by `***`.
fn scrub_pairs(text: &str, names: &[&str]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(sep) = rest.find(['=', ':']) {
        let name_start = after_last(&rest[..sep], |c| {
            !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-'))
        });
        let name = rest[name_start..sep].to_ascii_lowercase();
        let mut value_start = sep + 1;
        if rest[sep..].starts_with(": ") {
            value_start += 1;
        }
        out.push_str(&rest[..value_start]);
        let value_end = rest[value_start..]
            .find(|c: char| c.is_whitespace() || matches!(c, '&' | ',' | ';' | '"' | '\''))
            .map_or(rest.len(), |i| value_start + i);
        let value = &rest[value_start..value_end];
        let mut end = value_end;
        if !name.is_empty() && names.iter().any(|n| name.contains(n)) && !value.is_empty() {
            out.push_str("***");
            // `Authorization: Bearer <token>`: the scheme, then the credential.
            let scheme = ["bearer", "basic", "token", "digest"]
                .iter()
                .any(|s| value.eq_ignore_ascii_case(s));
            if scheme {
                let after = &rest[value_end..];
                let word = after.trim_start();
                let skipped = after.len() - word.len();
                let word_end = word.find(char::is_whitespace).unwrap_or(word.len());
                end = value_end + skipped + word_end;
            }
        } else {
            out.push_str(value);
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// `text` on one line (a header holds one) and at most `max` bytes, cut at a character boundary
/// and marked with `…` when cut.
fn one_line(text: &str, max: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max));
    for c in text.chars() {
        let c = if c.is_control() { ' ' } else { c };
        if out.len() + c.len_utf8() > max - '…'.len_utf8() {
            out.push('…');
            return out;
        }
        out.push(c);
    }
    out
}

/// What a dead letter says of `err`: our own words. A database's message can hold the row's
/// values (MySQL: `Duplicate entry '7' for key ..`, `Incorrect integer value: 'x'`), which belong
/// in the operator's logs, not in a letter that travels on: of a database error the letter names
/// the kind, the SQLSTATE and the constraint or table.
pub(crate) fn letter_text(err: &ProcessError) -> String {
    let db = match err {
        ProcessError::Database { source, .. } => source.as_database_error(),
        ProcessError::Handler(e) => chain(e.as_ref()).find_map(|e| {
            e.downcast_ref::<sqlx::Error>()
                .and_then(|e| e.as_database_error())
        }),
        _ => None,
    };
    let Some(db) = db else {
        return err.to_string();
    };
    let kind = match db.kind() {
        ErrorKind::UniqueViolation => "unique violation",
        ErrorKind::ForeignKeyViolation => "foreign key violation",
        ErrorKind::NotNullViolation => "not-null violation",
        ErrorKind::CheckViolation => "check violation",
        _ => "error",
    };
    let code = db.code().map(|c| format!(" {c}")).unwrap_or_default();
    let on = match (db.constraint(), db.table()) {
        (Some(c), _) => format!(" on constraint {c}"),
        (None, Some(t)) => format!(" on table {t}"),
        (None, None) => String::new(),
    };
    match err {
        ProcessError::Database { stage, .. } => {
            format!("inbox database {kind}{code}{on} while {stage}")
        }
        _ => format!("handler failed: database {kind}{code}{on}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_in_an_error_are_scrubbed() {
        let cases = [
            (
                "error sending request for url (https://api.example.com/v1/pay?api_key=sk_live_123&x=1): timed out",
                "error sending request for url (https://api.example.com/v1/pay?***): timed out",
            ),
            (
                "connect postgres://app:hunter2@db.internal:5432/prod failed",
                "connect postgres://***@db.internal:5432/prod failed",
            ),
            (
                "upstream said 401 with Authorization: Bearer abc.def and password=p4ss; retry",
                "upstream said 401 with Authorization: *** and password=***; retry",
            ),
            (
                "balance would go below 0 for account 7",
                "balance would go below 0 for account 7",
            ),
            // Characters wider than a byte right before a pair or a URL.
            ("Größe: 5, café=1, ошибка: x", "Größe: 5, café=1, ошибка: x"),
            (
                "«https://u:p@h/x?k=v» Schlüssel=geheim",
                "«https://***@h/x?*** Schlüssel=geheim",
            ),
        ];
        for (error, shown) in cases {
            assert_eq!(scrub(error), shown, "{error}");
        }
    }

    #[test]
    fn the_error_is_one_bounded_line() {
        assert_eq!(one_line("a\nb", 100), "a b");
        let long = "é".repeat(2000);
        let cut = one_line(&long, MAX_ERROR_LEN);
        assert!(cut.len() <= MAX_ERROR_LEN, "{}", cut.len());
        assert!(cut.ends_with('…'));
    }
}
