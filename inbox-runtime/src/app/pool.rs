//! The registrations checked against each other, and the pool split among the handlers so that
//! it is never oversubscribed.

use super::{AppError, Planned};
use crate::backend::InboxBackend;

/// What a handler asks of the pool.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ask {
    /// The handler's consumer name (or "outbox relay").
    pub(super) consumer: &'static str,
    /// The concurrency it was configured with, if any.
    pub(super) asked: Option<usize>,
    /// A two-phase handler renews leases on a connection of its own.
    pub(super) two_phase: bool,
}

/// Refuses two handlers with one consumer name, or on one durable consumer.
pub(super) fn check_unique<DB: InboxBackend>(planned: &[Planned<DB>]) -> Result<(), AppError> {
    for (i, a) in planned.iter().enumerate() {
        for b in &planned[i + 1..] {
            if a.consumer == b.consumer {
                return Err(AppError::DuplicateConsumer {
                    consumer: a.consumer,
                    first: a.handler,
                    second: b.handler,
                });
            }
            if a.durable.stream == b.durable.stream && a.durable.name == b.durable.name {
                return Err(AppError::DuplicateDurable {
                    stream: a.durable.stream.clone(),
                    durable: a.durable.name.clone(),
                    first: a.handler,
                    second: b.handler,
                });
            }
        }
    }
    Ok(())
}

/// Each handler's concurrency: what it asked for, and the pool's remaining connections shared
/// equally among the others (at least one each). A two-phase handler needs one connection more
/// than its concurrency, for lease renewals.
pub(super) fn split_pool(asks: &[Ask], pool: usize) -> Result<Vec<usize>, AppError> {
    let needed: usize = asks
        .iter()
        .map(|a| a.asked.unwrap_or(1) + usize::from(a.two_phase))
        .sum();
    if needed > pool {
        let asked = asks
            .iter()
            .map(|a| match a.asked {
                Some(n) => format!("{} {n}", a.consumer),
                None => format!("{} at least 1", a.consumer),
            })
            .collect::<Vec<_>>()
            .join(", ");
        return Err(AppError::PoolTooSmall {
            needed,
            pool,
            asked,
        });
    }
    let open = asks.iter().filter(|a| a.asked.is_none()).count();
    // Once every ask (and one connection for each open handler) is reserved, what is left is
    // shared among the open handlers, the first ones getting the remainder.
    let left = pool - needed;
    let (per, mut rest) = match open {
        0 => (0, 0),
        n => (left / n, left % n),
    };
    Ok(asks
        .iter()
        .map(|a| match a.asked {
            Some(n) => n,
            None => {
                let bonus = usize::from(rest > 0);
                rest = rest.saturating_sub(1);
                1 + per + bonus
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ask(consumer: &'static str, asked: Option<usize>, two_phase: bool) -> Ask {
        Ask {
            consumer,
            asked,
            two_phase,
        }
    }

    #[test]
    fn the_pool_is_shared_and_never_oversubscribed() {
        let two = [ask("a", None, false), ask("b", None, false)];
        assert_eq!(split_pool(&two, 8).unwrap(), vec![4, 4]);
        assert_eq!(split_pool(&two, 5).unwrap(), vec![3, 2]);
        let mixed = [ask("a", Some(5), false), ask("b", None, false)];
        assert_eq!(split_pool(&mixed, 8).unwrap(), vec![5, 3]);
        // A two-phase handler keeps a connection for renewals.
        let claim = [ask("a", None, true), ask("b", None, false)];
        let shares = split_pool(&claim, 8).unwrap();
        assert_eq!(shares.iter().sum::<usize>() + 1, 8, "{shares:?}");
        let err = split_pool(&[ask("a", Some(6), false), ask("b", Some(3), false)], 8)
            .unwrap_err()
            .to_string();
        assert!(err.contains("need 9 database connections"), "{err}");
        assert!(err.contains("a 6, b 3"), "{err}");
        assert!(split_pool(&two, 1).is_err());
    }
}
