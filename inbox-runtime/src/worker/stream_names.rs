//! The stream names and subjects a worker is configured with, checked when it is built: the
//! handler's consumer name (a subject token), the dead-letter stream and subject prefix, the
//! backstop's advisory stream. A name the server would refuse fails `build`, naming it, rather
//! than every letter (or the backstop) at run time.

use super::advisories::AdvisoryStream;
use super::check::Options;
use super::error::WorkerError;

/// Refuses a dead-letter stream, subject prefix or advisory stream JetStream would refuse: a
/// stream name is a subject token of at most 255 bytes (the server's limit; the advisory stream
/// made per stream is `INBOX_ADVISORIES_<stream>`, whose length is the server's to check), a
/// prefix is tokens joined by `.`, without wildcards.
pub(super) fn check_names(options: &Options) -> Result<(), WorkerError> {
    let invalid = |what, name: &str, why| WorkerError::InvalidName {
        what,
        name: name.to_owned(),
        why,
    };
    let stream = |what, name: &str| match name {
        n if !is_subject_token(n) => Err(invalid(
            what,
            n,
            "a stream name is one subject token: printable ASCII without spaces, `.`, `*` or `>`",
        )),
        n if n.len() > 255 => Err(invalid(what, n, "a stream name has at most 255 bytes")),
        _ => Ok(()),
    };
    stream("dead-letter stream", &options.dead_letter_stream)?;
    if let Some(AdvisoryStream::Named(name)) = &options.backstop {
        stream("advisory stream", name)?;
    }
    let prefix = &options.dead_letter_prefix;
    if !prefix.split('.').all(is_subject_token) {
        return Err(invalid(
            "dead-letter subject prefix",
            prefix,
            "it must be subject tokens joined by `.`: printable ASCII without spaces, `*` or `>`, no empty token",
        ));
    }
    Ok(())
}

/// Whether `name` can stand as one token of a NATS subject.
pub(super) fn is_subject_token(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_graphic() && !matches!(b, b'.' | b'*' | b'>'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_letter_and_advisory_names_jetstream_refuses_are_refused() {
        let with = |stream: &str, prefix: &str, advisories: Option<&str>| Options {
            dead_letter_stream: stream.to_owned(),
            dead_letter_prefix: prefix.to_owned(),
            backstop: advisories.map(|a| AdvisoryStream::Named(a.to_owned())),
            ..Options::default()
        };
        let long = "S".repeat(256);
        for (options, what) in [
            (with("DLQ X", "inbox.dlq", None), "dead-letter stream"),
            (with("DLQ.X", "inbox.dlq", None), "dead-letter stream"),
            (with(&long, "inbox.dlq", None), "dead-letter stream"),
            (
                with("DLQ", "inbox.dlq.", None),
                "dead-letter subject prefix",
            ),
            (with("DLQ", "inbox dlq", None), "dead-letter subject prefix"),
            (with("DLQ", "inbox.*", None), "dead-letter subject prefix"),
            (with("DLQ", "", None), "dead-letter subject prefix"),
            (with("DLQ", "inbox.dlq", Some("ADV>")), "advisory stream"),
        ] {
            let err = check_names(&options).unwrap_err();
            assert!(
                matches!(&err, WorkerError::InvalidName { what: w, .. } if *w == what),
                "{err}"
            );
        }
        let fine = with("MY_DLQ-1", "org.team.dlq", Some("ADVISORIES"));
        assert!(check_names(&fine).is_ok());
        assert!(check_names(&Options::default()).is_ok());
    }
}
