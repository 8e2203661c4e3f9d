//! The verdict: what JetStream hears about one delivery, decided by pure functions of the
//! processing result, the error class, the delivery count, the consumer's `max_deliver` (as the
//! worker acts on it now: see `max_deliver.rs`) and the worker's limits. This file is
//! the README's table "What JetStream hears"; it does no I/O (`serve.rs` carries it out).

use super::letter_text::letter_text;
use crate::backoff::Backoff;
use crate::classify::ErrorClass;
use crate::error::ProcessError;
use crate::handler::Outcome;
use std::time::Duration;

/// What to tell JetStream about a delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// The effect committed: ack (double or plain, as configured).
    Ack,
    /// A duplicate: ack, never nak (it is terminal).
    Skip,
    /// Nak with this delay (never zero: a nak without delay is a hot loop); see
    /// [`Limits::nak_request`].
    Nak(Duration),
    /// Publish a dead letter with this reason, then term; nak instead if it cannot be stored.
    DeadLetter(String),
    /// Dead-letter with this reason and never nak, as on the last delivery (the letter kept in
    /// the database when the stream refuses it): a message that must not run again
    /// ([`ProcessError::TransactionEnded`]: statements of its handler committed on their own).
    Keep(String),
}

/// The consumer's nak schedule, with the worker's own retry and nak policy. (Its
/// `max_deliver` is not here: it may change while the worker runs, see `max_deliver.rs`.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Limits {
    /// The consumer's `backoff` steps, used for nak delays when present.
    pub backoff: Vec<Duration>,
    /// The nak delay otherwise, growing with the delivery count.
    pub nak_delay: Backoff,
    /// How many times a delivery is tried in process while its failure is transient.
    pub attempts: u32,
    /// The wait between those tries.
    pub retry_wait: Backoff,
}

impl Limits {
    /// The delay of the nak after delivery `delivered` failed: the consumer's `backoff` step for
    /// it (the last step repeating) when it has a backoff, else ours.
    pub fn redelivery_delay(&self, delivered: i64) -> Duration {
        let step = u32::try_from(delivered.max(1) - 1).unwrap_or(u32::MAX);
        match self.backoff.last() {
            None => self.nak_delay.delay(step),
            Some(last) => *self.backoff.get(step as usize).unwrap_or(last),
        }
    }

    /// The delay to ask for in the nak after delivery `delivered` failed, so that the message
    /// comes back after [`Limits::redelivery_delay`]. With a consumer `backoff`, nats-server (2.9
    /// through 2.15: `processNak`, `checkPending`) counts a nak's delay from `backoff[0]` (which
    /// it makes the consumer's `ack_wait`) and then waits the backoff step of the delivery: the
    /// message comes back after `delay - backoff[0] + backoff[n]`. So the nak asks for
    /// `backoff[0]` and gets the consumer's own schedule; asking for the step itself waited
    /// `2 × step - backoff[0]`, and a step shorter than `backoff[0]` came back at once,
    /// spending deliveries within milliseconds.
    pub fn nak_request(&self, delivered: i64) -> Duration {
        match self.backoff.first() {
            Some(first) => *first,
            None => self.redelivery_delay(delivered),
        }
    }

    /// The longest delay a nak of this worker can ask for.
    pub fn longest_nak(&self) -> Duration {
        let ours = self.nak_delay.max();
        self.backoff.iter().copied().max().unwrap_or(ours)
    }
}

/// Whether to try delivery again in process, in a fresh transaction, after try `attempt` (from 1)
/// failed with `class`: the wait before the next try, or `None` to give a verdict now.
pub(crate) fn retry_in_process(
    class: ErrorClass,
    attempt: u32,
    limits: &Limits,
) -> Option<Duration> {
    (class == ErrorClass::Transient && attempt < limits.attempts)
        .then(|| limits.retry_wait.delay(attempt.saturating_sub(1)))
}

/// The verdict on delivery number `delivered` of a consumer whose `max_deliver` is acted on as
/// `max_deliver`, once processing is over: `Ok` with its outcome, or `Err` with the error and
/// its class (after in-process retries).
pub(crate) fn verdict(
    result: Result<Outcome, (&ProcessError, ErrorClass)>,
    delivered: i64,
    max_deliver: i64,
    limits: &Limits,
) -> Verdict {
    let (err, class) = match result {
        Ok(Outcome::Ack) => return Verdict::Ack,
        Ok(Outcome::Skip) => return Verdict::Skip,
        Err(failed) => failed,
    };
    let last_delivery = delivered >= max_deliver;
    // Another owner holds the claim: come back when its lease runs out (it may fail, and then
    // this delivery takes over; it may finish, and then this one is a Skip).
    if let (ProcessError::ClaimHeld { remaining }, false) = (err, last_delivery) {
        return Verdict::Nak(*remaining + Duration::from_millis(100));
    }
    match class {
        ErrorClass::Permanent if matches!(err, ProcessError::TransactionEnded { .. }) => {
            Verdict::Keep(letter_text(err))
        }
        ErrorClass::Permanent => Verdict::DeadLetter(letter_text(err)),
        _ if last_delivery => Verdict::DeadLetter(format!(
            "{} (delivery {delivered} of max_deliver {max_deliver})",
            letter_text(err),
        )),
        ErrorClass::Transient | ErrorClass::Unknown => Verdict::Nak(limits.nak_request(delivered)),
    }
}

#[cfg(all(test, feature = "postgres"))]
mod tests {
    //! One test per row of the README's table, through the real classification (PostgreSQL's
    //! rules; each backend's transient codes are tested against a real server in the suite).
    use super::*;
    use crate::classify::classify;
    use crate::classify::{Permanent, Transient};
    use crate::error::Stage;
    use crate::key::KeyError;
    use std::borrow::Cow;

    /// The consumer's `max_deliver` in these tests.
    const MAX_DELIVER: i64 = 5;

    fn limits() -> Limits {
        Limits {
            backoff: Vec::new(),
            nak_delay: Backoff::new(Duration::from_secs(1), Duration::from_secs(30)),
            attempts: 3,
            retry_wait: Backoff::new(Duration::from_millis(100), Duration::from_secs(2)),
        }
    }

    /// The verdict on `err` at delivery `delivered`, after the retries it would get in process.
    fn hears(err: ProcessError, delivered: i64, limits: &Limits) -> (Verdict, u32) {
        let class = classify::<sqlx::Postgres>(&err);
        let mut tries = 1;
        while retry_in_process(class, tries, limits).is_some() {
            tries += 1;
        }
        (
            verdict(Err((&err, class)), delivered, MAX_DELIVER, limits),
            tries,
        )
    }

    /// A database error with a SQLSTATE and kind, as the driver reports it.
    #[derive(Debug)]
    struct DbError(&'static str, sqlx::error::ErrorKind);
    impl std::fmt::Display for DbError {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "database error {}", self.0)
        }
    }
    impl std::error::Error for DbError {}
    impl sqlx::error::DatabaseError for DbError {
        fn message(&self) -> &str {
            self.0
        }
        fn code(&self) -> Option<Cow<'_, str>> {
            Some(self.0.into())
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            match &self.1 {
                sqlx::error::ErrorKind::UniqueViolation => sqlx::error::ErrorKind::UniqueViolation,
                sqlx::error::ErrorKind::CheckViolation => sqlx::error::ErrorKind::CheckViolation,
                sqlx::error::ErrorKind::ForeignKeyViolation => {
                    sqlx::error::ErrorKind::ForeignKeyViolation
                }
                sqlx::error::ErrorKind::NotNullViolation => {
                    sqlx::error::ErrorKind::NotNullViolation
                }
                _ => sqlx::error::ErrorKind::Other,
            }
        }
    }

    fn db(code: &'static str, kind: sqlx::error::ErrorKind) -> sqlx::Error {
        sqlx::Error::Database(Box::new(DbError(code, kind)))
    }

    fn in_handler(err: sqlx::Error) -> ProcessError {
        ProcessError::Handler(Box::new(err))
    }

    fn is_dead_letter(v: &Verdict) -> bool {
        matches!(v, Verdict::DeadLetter(_))
    }

    #[test]
    fn a_transaction_ended_under_its_handler_is_kept_never_nakd() {
        let err = ProcessError::TransactionEnded { key: "k".into() };
        let class = classify::<sqlx::Postgres>(&err);
        assert_eq!(class, ErrorClass::Permanent);
        let v = verdict(Err((&err, class)), 1, MAX_DELIVER, &limits());
        assert!(matches!(v, Verdict::Keep(_)), "{v:?}");
    }

    #[test]
    fn ack_when_committed() {
        assert_eq!(
            verdict(Ok(Outcome::Ack), 1, MAX_DELIVER, &limits()),
            Verdict::Ack
        );
    }

    #[test]
    fn skip_is_acked_even_on_the_last_delivery() {
        assert_eq!(
            verdict(Ok(Outcome::Skip), 1, MAX_DELIVER, &limits()),
            Verdict::Skip
        );
        assert_eq!(
            verdict(Ok(Outcome::Skip), 5, MAX_DELIVER, &limits()),
            Verdict::Skip
        );
    }

    #[test]
    fn transient_database_errors_are_retried_in_process_then_nakd_with_a_delay() {
        use sqlx::error::ErrorKind::Other;
        let transient = [
            in_handler(db("40001", Other)), // serialization failure
            in_handler(db("40P01", Other)), // deadlock
            in_handler(db("08006", Other)), // connection failure
            in_handler(sqlx::Error::Io(std::io::ErrorKind::ConnectionReset.into())),
            in_handler(sqlx::Error::PoolTimedOut),
            ProcessError::Database {
                stage: Stage::Begin,
                source: sqlx::Error::PoolTimedOut,
            },
            ProcessError::Handler(Box::new(Transient::new("flaky downstream"))),
            ProcessError::StreamLookup {
                stream: "S".into(),
                source: "request timed out".into(),
            },
        ];
        for err in transient {
            let text = err.to_string();
            let (v, tries) = hears(err, 2, &limits());
            assert_eq!(
                tries, 3,
                "{text}: retried in process until attempts run out"
            );
            assert_eq!(v, Verdict::Nak(Duration::from_secs(2)), "{text}");
        }
    }

    #[test]
    fn retries_wait_longer_each_time_and_only_while_transient() {
        let l = limits();
        let first = retry_in_process(ErrorClass::Transient, 1, &l).unwrap();
        let second = retry_in_process(ErrorClass::Transient, 2, &l).unwrap();
        assert!(first < second, "{first:?} then {second:?}");
        assert_eq!(retry_in_process(ErrorClass::Transient, 3, &l), None);
        assert_eq!(retry_in_process(ErrorClass::Unknown, 1, &l), None);
        assert_eq!(retry_in_process(ErrorClass::Permanent, 1, &l), None);
    }

    #[test]
    fn nak_delay_follows_the_consumer_backoff_when_it_has_one() {
        let mut l = limits();
        assert_eq!(l.redelivery_delay(1), Duration::from_secs(1));
        assert_eq!(l.redelivery_delay(3), Duration::from_secs(4));
        assert_eq!(l.redelivery_delay(100), Duration::from_secs(30));
        l.backoff = vec![Duration::from_secs(5), Duration::from_secs(60)];
        assert_eq!(l.redelivery_delay(1), Duration::from_secs(5));
        assert_eq!(l.redelivery_delay(2), Duration::from_secs(60));
        assert_eq!(l.redelivery_delay(9), Duration::from_secs(60));
        assert_eq!(l.longest_nak(), Duration::from_secs(60));
        // What the nak asks for: the server adds the delivery's step to it, less backoff[0].
        for delivered in [1, 2, 4] {
            let (v, _) = hears(ProcessError::Handler("plain".into()), delivered, &l);
            assert_eq!(v, Verdict::Nak(Duration::from_secs(5)), "{delivered}");
        }
    }

    #[test]
    fn poison_payload_is_dead_lettered_at_once() {
        let source = serde_json::from_slice::<u32>(b"{ not json").unwrap_err();
        let err = ProcessError::Decode {
            ty: "u32",
            codec: "JSON",
            source: source.into(),
        };
        let (v, tries) = hears(err, 1, &limits());
        assert!(is_dead_letter(&v), "{v:?}");
        assert_eq!(tries, 1);
    }

    #[test]
    fn bad_keys_are_dead_lettered_at_once() {
        for err in [
            KeyError::Empty,
            KeyError::TooLong(256),
            KeyError::Nul,
            KeyError::Missing,
        ] {
            let (v, _) = hears(ProcessError::Key(err), 1, &limits());
            assert!(is_dead_letter(&v), "{v:?}");
        }
    }

    #[test]
    fn integrity_violations_and_bad_data_in_the_business_write_are_dead_lettered_at_once() {
        use sqlx::error::ErrorKind::*;
        for (code, kind) in [
            ("23505", UniqueViolation),
            ("23514", CheckViolation),
            ("23502", NotNullViolation),
            ("22021", Other), // invalid byte sequence (or NUL) in text
            ("22003", Other), // numeric value out of range
            ("22001", Other), // string too long
        ] {
            let (v, tries) = hears(in_handler(db(code, kind)), 1, &limits());
            assert!(
                matches!(&v, Verdict::DeadLetter(r) if r.contains(code)),
                "{v:?}"
            );
            assert_eq!(tries, 1, "{code}: never retried");
        }
    }

    #[test]
    fn a_panic_is_dead_lettered_at_once() {
        let (v, tries) = hears(
            ProcessError::Panicked("index out of bounds".into()),
            1,
            &limits(),
        );
        assert_eq!(
            v,
            Verdict::DeadLetter("handler panicked: index out of bounds".into())
        );
        assert_eq!(tries, 1);
    }

    #[test]
    fn a_foreign_key_violation_waits_for_its_parent_until_max_deliver() {
        let err = || in_handler(db("23503", sqlx::error::ErrorKind::ForeignKeyViolation));
        let (v, tries) = hears(err(), 1, &limits());
        assert_eq!((v, tries), (Verdict::Nak(Duration::from_secs(1)), 1));
        let (v, _) = hears(err(), 5, &limits());
        assert!(is_dead_letter(&v), "{v:?}");
    }

    #[test]
    fn errors_marked_permanent_are_dead_lettered_at_once() {
        let err = ProcessError::Handler(Box::new(Permanent::new("account 7 is closed")));
        let (v, _) = hears(err, 1, &limits());
        assert_eq!(
            v,
            Verdict::DeadLetter("handler failed: account 7 is closed".into())
        );
    }

    #[test]
    fn other_errors_are_nakd_until_max_deliver_then_dead_lettered() {
        let l = limits();
        for (delivered, secs) in [(1, 1), (2, 2), (3, 4), (4, 8)] {
            let (v, tries) = hears(ProcessError::Handler("plain".into()), delivered, &l);
            assert_eq!(v, Verdict::Nak(Duration::from_secs(secs)), "{delivered}");
            assert_eq!(tries, 1, "not retried in process");
        }
        let (v, _) = hears(ProcessError::Handler("plain".into()), 5, &l);
        assert_eq!(
            v,
            Verdict::DeadLetter("handler failed: plain (delivery 5 of max_deliver 5)".into())
        );
    }

    #[test]
    fn the_last_delivery_is_judged_by_the_limit_passed_in() {
        // A consumer lowered from 5 to 2 while the worker runs: delivery 2 is the server's last.
        let err = ProcessError::Handler("plain".into());
        let class = ErrorClass::Unknown;
        let at = |max_deliver| verdict(Err((&err, class)), 2, max_deliver, &limits());
        assert_eq!(at(5), Verdict::Nak(Duration::from_secs(2)));
        assert_eq!(
            at(2),
            Verdict::DeadLetter("handler failed: plain (delivery 2 of max_deliver 2)".into())
        );
        // Past a limit lowered below the delivery count: the server will not deliver it again.
        assert!(is_dead_letter(&at(1)), "{:?}", at(1));
    }

    #[test]
    fn transient_failure_on_the_last_delivery_is_dead_lettered() {
        let err = in_handler(db("40P01", sqlx::error::ErrorKind::Other));
        let (v, tries) = hears(err, 5, &limits());
        assert_eq!(tries, 3, "still retried in process first");
        assert!(is_dead_letter(&v), "{v:?}");
    }

    #[test]
    fn a_try_past_its_deadline_is_nakd_with_a_delay_not_retried_at_once() {
        let err = || ProcessError::Deadline(Duration::from_secs(300));
        let (v, tries) = hears(err(), 1, &limits());
        assert_eq!((v, tries), (Verdict::Nak(Duration::from_secs(1)), 1));
        let (v, _) = hears(err(), 5, &limits());
        assert!(is_dead_letter(&v), "{v:?}");
    }

    #[test]
    fn unknown_inbox_database_errors_wait_for_an_operator() {
        // A missing inbox table, say: redelivered with a delay until max_deliver.
        let err = ProcessError::Database {
            stage: Stage::Claim,
            source: db("42P01", sqlx::error::ErrorKind::Other),
        };
        let (v, tries) = hears(err, 1, &limits());
        assert_eq!((v, tries), (Verdict::Nak(Duration::from_secs(1)), 1));
    }
}
