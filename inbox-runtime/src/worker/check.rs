//! The start-time check: from the consumer's configuration alone (pure, testable without a
//! server), whether it can be served and with which settings. A consumer that would break a
//! guarantee later is refused here, with an error naming the problem.

use super::WorkerError;
use super::builder::AckMode;
use super::dead_letter::{DEFAULT_DLQ_PREFIX, DEFAULT_DLQ_STREAM};
use super::max_deliver::REFRESH_EVERY;
use super::upkeep::Schedule;
use super::verdict::Limits;
use crate::backoff::Backoff;
use crate::store::retention_floor;
use async_nats::jetstream::consumer::{self, AckPolicy};
use async_nats::jetstream::stream;
use std::time::Duration;

/// The sweeper of a two-phase handler's open claims: see [`WorkerBuilder::sweep`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sweep {
    /// How often it looks.
    pub every: Duration,
    /// A claim open (not done) this long after it was first taken is reported.
    pub older_than: Duration,
}

/// What the user asked for; defaults in [`Options::default`].
#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub concurrency: Option<usize>,
    /// Messages fetched ahead of the concurrency (per-message workers only).
    pub prefetch: usize,
    pub batch: Option<Batching>,
    pub ack_mode: AckMode,
    pub fetch_expiry: Duration,
    pub deadline: Duration,
    pub nak_delay: Backoff,
    pub attempts: u32,
    pub dead_letter_stream: String,
    pub dead_letter_prefix: String,
    pub cleanup: Option<(Duration, stream::Config)>,
    pub cleanup_margin: Duration,
    pub cleanup_every: Duration,
    /// The sweeper's period and threshold; the threshold defaults to 5 × `ack_wait`.
    pub sweep: (Duration, Option<Duration>),
    /// The delivery-limit backstop's advisory stream, when it runs.
    pub backstop: Option<super::advisories::AdvisoryStream>,
    /// How often the consumer's `max_deliver` is read again besides at each pull session's
    /// start (shorter only in tests: `WorkerBuilder::max_deliver_every`).
    pub max_deliver_every: Duration,
    /// Whether the consumer is paused on the server while the circuit is open.
    pub pause_on_server: bool,
    /// The bytes of messages fetched and not yet finished, at most (`None`: the default).
    pub max_bytes: Option<usize>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            concurrency: None,
            prefetch: 0,
            batch: None,
            ack_mode: AckMode::default(),
            fetch_expiry: Duration::from_secs(2),
            deadline: DEFAULT_DEADLINE,
            nak_delay: Backoff::new(Duration::from_secs(1), Duration::from_secs(30)),
            attempts: 3,
            dead_letter_stream: DEFAULT_DLQ_STREAM.to_owned(),
            dead_letter_prefix: DEFAULT_DLQ_PREFIX.to_owned(),
            cleanup: None,
            cleanup_margin: Duration::from_secs(3600),
            cleanup_every: Duration::from_secs(60),
            sweep: (Duration::from_secs(60), None),
            backstop: None,
            max_deliver_every: REFRESH_EVERY,
            pause_on_server: false,
            max_bytes: None,
        }
    }
}

/// The settings a worker runs with, once [`check`] accepted the consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Settings {
    /// Messages in flight at most.
    pub concurrency: usize,
    /// Database connections in use at most: the concurrency asked for (capped at the pool);
    /// batched, each batch (or message served alone) takes one, so `concurrency` is this times
    /// the batch size.
    pub connections: usize,
    /// Messages fetched beyond the concurrency, waiting for a permit (`pull.rs`); 0 when
    /// batched, and never more than `max_ack_pending` leaves room for.
    pub prefetch: usize,
    pub ack_mode: AckMode,
    /// How long a pull request stays open: at most the consumer's `max_expires`.
    pub fetch_expiry: Duration,
    /// The most messages one pull request asks for: the consumer's `max_batch`, if it has one.
    pub max_batch: usize,
    /// Batched commits, when asked for.
    pub batch: Option<Batching>,
    /// How long one try of a delivery may take.
    pub deadline: Duration,
    /// Progress acks while a handler runs longer than this (a third of `ack_wait`).
    pub progress_every: Duration,
    pub limits: Limits,
    /// The consumer's `max_deliver` at start (finite): the worker acts on it until it reads
    /// another (`max_deliver.rs`).
    pub max_deliver: i64,
    /// How often it is read again besides at each pull session's start.
    pub max_deliver_every: Duration,
    pub cleanup: Option<Schedule>,
    /// The sweeper of open claims (two-phase handlers only; set by `build`).
    pub sweep: Option<Sweep>,
    /// The delivery-limit backstop's advisory stream, when it runs.
    pub backstop: Option<super::advisories::AdvisoryStream>,
    /// Whether the consumer is paused on the server while the circuit is open.
    pub pause_on_server: bool,
    /// The bytes of messages fetched and not yet finished, at most: the budget pull requests
    /// are sized by (`pull.rs`); raised to one message of the server's largest if lower.
    pub max_bytes: usize,
    /// The most bytes one pull request may ask for: the consumer's `max_bytes`, if it has one.
    pub max_request_bytes: usize,
}

/// Batched commits: see [`WorkerBuilder::batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Batching {
    /// The most messages in one transaction.
    pub max_messages: usize,
    /// How long a batch waits for more messages after its first.
    pub max_wait: Duration,
}

/// How long one try of a delivery may take by default: see [`WorkerBuilder::deadline`](crate::WorkerBuilder::deadline).
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(300);

/// The bytes of messages a worker holds at most by default: see
/// [`WorkerBuilder::max_bytes`](crate::WorkerBuilder::max_bytes).
pub const DEFAULT_MAX_BYTES: usize = 64 << 20;

/// The `ack_wait` the server applies when the consumer leaves it at zero.
const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);

/// Checks consumer `name` with `config` for `handler_consumer` (the handler's `CONSUMER`) on a
/// pool of `pool_size` connections, and derives the worker's settings.
pub(crate) fn check(
    options: &Options,
    name: &str,
    config: &consumer::Config,
    handler_consumer: &str,
    pool_size: usize,
) -> Result<Settings, WorkerError> {
    if config.ack_policy != AckPolicy::Explicit {
        return Err(WorkerError::AckPolicy {
            consumer: name.to_owned(),
            policy: config.ack_policy,
        });
    }
    if options.concurrency == Some(0) {
        return Err(WorkerError::ZeroConcurrency);
    }
    if config.max_deliver <= 0 {
        return Err(WorkerError::UnboundedMaxDeliver {
            consumer: name.to_owned(),
        });
    }
    if !super::stream_names::is_subject_token(handler_consumer) {
        return Err(WorkerError::ConsumerName {
            name: handler_consumer.to_owned(),
        });
    }
    super::stream_names::check_names(options)?;
    // Never more in flight than connections to process them on, nor than the server lets
    // wait for acks: prefetching more than can be processed within ack_wait turns into
    // redelivery storms.
    let mut concurrency = options.concurrency.unwrap_or(pool_size).min(pool_size);
    let connections = concurrency.max(1);
    // Batched, a connection serves a batch at a time.
    if let Some(batch) = options.batch {
        concurrency = concurrency.saturating_mul(batch.max_messages);
    }
    let mut prefetch = match options.batch {
        Some(_) => 0,
        None => options.prefetch,
    };
    if config.max_ack_pending > 0 {
        let pending = config.max_ack_pending as usize;
        concurrency = concurrency.min(pending);
        prefetch = prefetch.min(pending.saturating_sub(concurrency.max(1)));
    }
    let ack_wait = ack_wait_of(config);
    let limits = Limits {
        backoff: config.backoff.clone(),
        nak_delay: options.nak_delay,
        attempts: options.attempts.max(1),
        retry_wait: Backoff::new(Duration::from_millis(100), Duration::from_secs(2)).with_jitter(),
    };
    let cleanup = match &options.cleanup {
        None => None,
        // Any stream: one that keeps messages forever keeps their markers as long, since the
        // cutoff follows its oldest stored message (`Inbox::cleanup_behind`).
        Some((retention, stream)) => {
            let floor =
                retention_floor(config, stream, limits.longest_nak(), options.cleanup_margin);
            if *retention < floor.total() {
                return Err(WorkerError::RetentionTooShort {
                    retention: *retention,
                    floor,
                });
            }
            Some(Schedule {
                retention: *retention,
                every: options.cleanup_every,
            })
        }
    };
    Ok(Settings {
        concurrency: concurrency.max(1),
        connections,
        prefetch,
        ack_mode: options.ack_mode,
        fetch_expiry: match config.max_expires {
            d if d.is_zero() => options.fetch_expiry,
            d => options.fetch_expiry.min(d),
        },
        // A batch being collected gets no progress acks: it flushes, at the latest, when its
        // first message has waited as long as a progress ack would (a third of ack_wait), so
        // that no delivery ends at the server while it waits.
        batch: options.batch.map(|b| Batching {
            max_wait: b
                .max_wait
                .min((ack_wait / 3).max(Duration::from_millis(100))),
            ..b
        }),
        max_batch: match config.max_batch {
            n if n > 0 => n as usize,
            _ => usize::MAX,
        },
        deadline: options.deadline,
        progress_every: (ack_wait / 3).max(Duration::from_millis(100)),
        limits,
        max_deliver: config.max_deliver,
        max_deliver_every: options.max_deliver_every,
        cleanup,
        sweep: None,
        backstop: options.backstop.clone(),
        pause_on_server: options.pause_on_server,
        // At most what a semaphore counts and a request's bytes are waited for in (u32).
        max_bytes: options
            .max_bytes
            .unwrap_or(DEFAULT_MAX_BYTES)
            .min(u32::MAX as usize),
        max_request_bytes: match config.max_bytes {
            n if n > 0 => n as usize,
            _ => usize::MAX,
        },
    })
}

/// The `ack_wait` the server applies to `config`.
pub(super) fn ack_wait_of(config: &consumer::Config) -> Duration {
    match config.ack_wait {
        d if d.is_zero() => DEFAULT_ACK_WAIT,
        d => d,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> consumer::Config {
        consumer::Config {
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(30),
            max_deliver: 5,
            ..Default::default()
        }
    }

    fn checked(options: &Options, config: &consumer::Config) -> Result<Settings, WorkerError> {
        check(options, "c", config, "credit", 8)
    }

    #[test]
    fn explicit_acks_and_a_finite_max_deliver_are_required() {
        let o = Options::default();
        let all = consumer::Config {
            ack_policy: AckPolicy::All,
            ..config()
        };
        assert!(matches!(
            checked(&o, &all),
            Err(WorkerError::AckPolicy { .. })
        ));
        let forever = consumer::Config {
            max_deliver: -1,
            ..config()
        };
        let err = checked(&o, &forever).unwrap_err();
        assert!(
            matches!(err, WorkerError::UnboundedMaxDeliver { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("max_deliver"), "{err}");
        assert!(checked(&o, &config()).is_ok());
    }

    #[test]
    fn the_consumer_name_must_be_a_subject_token() {
        let o = Options::default();
        for bad in ["", "a b", "a.b", "a*", ">", "tab\t"] {
            let err = check(&o, "c", &config(), bad, 8).unwrap_err();
            assert!(matches!(err, WorkerError::ConsumerName { .. }), "{bad:?}");
        }
        assert!(check(&o, "c", &config(), "credit-v2_x", 8).is_ok());
    }

    #[test]
    fn a_dead_letter_prefix_jetstream_refuses_fails_the_check() {
        let o = Options {
            dead_letter_prefix: "inbox dlq".to_owned(),
            ..Options::default()
        };
        let err = checked(&o, &config()).unwrap_err();
        assert!(matches!(err, WorkerError::InvalidName { .. }), "{err}");
        assert!(err.to_string().contains("\"inbox dlq\""), "{err}");
    }

    #[test]
    fn prefetch_stays_within_max_ack_pending_and_is_off_when_batched() {
        let mut o = Options {
            concurrency: Some(4),
            prefetch: 6,
            ..Options::default()
        };
        assert_eq!(checked(&o, &config()).unwrap().prefetch, 6);
        let pending = |n| consumer::Config {
            max_ack_pending: n,
            ..config()
        };
        // Fetched and not yet acked: at most max_ack_pending, the concurrency first.
        assert_eq!(checked(&o, &pending(7)).unwrap().prefetch, 3);
        assert_eq!(checked(&o, &pending(4)).unwrap().prefetch, 0);
        assert_eq!(checked(&o, &pending(2)).unwrap().prefetch, 0);
        o.batch = Some(Batching {
            max_messages: 16,
            max_wait: Duration::from_millis(10),
        });
        assert_eq!(checked(&o, &config()).unwrap().prefetch, 0);
    }

    #[test]
    fn concurrency_is_capped_by_the_pool_and_max_ack_pending() {
        let mut o = Options::default();
        assert_eq!(checked(&o, &config()).unwrap().concurrency, 8);
        o.concurrency = Some(4);
        assert_eq!(checked(&o, &config()).unwrap().concurrency, 4);
        o.concurrency = Some(20);
        assert_eq!(checked(&o, &config()).unwrap().concurrency, 8);
        let few_pending = consumer::Config {
            max_ack_pending: 3,
            ..config()
        };
        assert_eq!(checked(&o, &few_pending).unwrap().concurrency, 3);
        o.concurrency = Some(0);
        assert!(matches!(
            checked(&o, &config()),
            Err(WorkerError::ZeroConcurrency)
        ));
    }

    #[test]
    fn progress_acks_every_third_of_ack_wait() {
        let s = checked(&Options::default(), &config()).unwrap();
        assert_eq!(s.progress_every, Duration::from_secs(10));
        let long = consumer::Config {
            ack_wait: Duration::from_secs(60),
            ..config()
        };
        let s = checked(&Options::default(), &long).unwrap();
        assert_eq!(s.progress_every, Duration::from_secs(20));
        let unset = consumer::Config {
            ack_wait: Duration::ZERO,
            ..config()
        };
        let s = checked(&Options::default(), &unset).unwrap();
        assert_eq!(s.progress_every, Duration::from_secs(10));
    }

    #[test]
    fn cleanup_on_a_stream_that_keeps_messages_forever_is_accepted() {
        // nats-style defaults: no max_age, retention policy Limits. The cutoff follows the
        // oldest stored message, so such a stream keeps its markers as long as its messages.
        let forever = stream::Config {
            name: "ORDERS".into(),
            ..Default::default()
        };
        let o = Options {
            cleanup: Some((Duration::from_secs(365 * 86400), forever)),
            ..Options::default()
        };
        let schedule = checked(&o, &config()).unwrap().cleanup.unwrap();
        assert_eq!(schedule.retention, Duration::from_secs(365 * 86400));
    }

    #[test]
    fn a_retention_below_the_floor_is_refused_naming_each_figure() {
        // The stream's max_age is no figure: the cutoff follows the oldest stored message.
        let stream = stream::Config {
            duplicate_window: Duration::from_secs(120),
            max_age: Duration::from_secs(3 * 86400),
            ..Default::default()
        };
        let mut o = Options {
            cleanup_margin: Duration::from_secs(60),
            ..Options::default()
        };
        // ack_wait 30 s × max_deliver 5 + duplicate window 120 s + margin 60 s = 330 s.
        o.cleanup = Some((Duration::from_secs(329), stream.clone()));
        let err = checked(&o, &config()).unwrap_err();
        let text = err.to_string();
        for figure in [
            "ack_wait 30s",
            "max_deliver 5",
            "duplicate window 120s",
            "= 330s",
        ] {
            assert!(text.contains(figure), "{figure:?} missing from: {text}");
        }
        assert!(!text.contains("max_age"), "{text}");
        o.cleanup = Some((Duration::from_secs(330), stream.clone()));
        let schedule = checked(&o, &config()).unwrap().cleanup.unwrap();
        assert_eq!(schedule.retention, Duration::from_secs(330));

        // A delivery can stay unacked for as long as the longest nak asks, when that exceeds
        // ack_wait: the consumer's backoff (60 s × 5 + backoff sum 65 s + 120 s + 60 s = 545 s).
        let backoff = consumer::Config {
            backoff: vec![Duration::from_secs(5), Duration::from_secs(60)],
            ..config()
        };
        o.cleanup = Some((Duration::from_secs(544), stream.clone()));
        let err = checked(&o, &backoff).unwrap_err().to_string();
        assert!(err.contains("= 545s"), "{err}");
        // Or our own nak delay, when the consumer has no backoff (90 s × 5 + 120 s + 60 s).
        o.nak_delay = Backoff::new(Duration::from_secs(1), Duration::from_secs(90));
        o.cleanup = Some((Duration::from_secs(629), stream));
        let err = checked(&o, &config()).unwrap_err().to_string();
        assert!(err.contains("= 630s"), "{err}");
    }
}
