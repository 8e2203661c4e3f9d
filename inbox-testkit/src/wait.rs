//! Polling under a deadline: the only way the kit, the tests and xtask wait for something.

use inbox_runtime::Backoff;
use std::time::{Duration, Instant};

/// The first pause between two looks; it doubles up to [`LONGEST_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(10);
/// The longest pause between two looks.
const LONGEST_PAUSE: Duration = Duration::from_millis(200);

/// A polling loop's clock: [`Poll::tick`] pauses (a growing [`Backoff`], 10 ms up to 200 ms) and
/// fails once the deadline has passed.
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let mut poll = inbox_testkit::Poll::new("three looks", std::time::Duration::from_secs(5));
/// let mut looks = 0;
/// while looks < 3 {
///     looks += 1;
///     poll.tick().await.unwrap();
/// }
/// # });
/// ```
#[derive(Debug)]
pub struct Poll {
    what: String,
    deadline: Duration,
    started: Instant,
    backoff: Backoff,
}

impl Poll {
    /// Starts the clock for waiting on `what` at most `deadline`.
    pub fn new(what: &str, deadline: Duration) -> Poll {
        Poll {
            what: what.to_owned(),
            deadline,
            started: Instant::now(),
            backoff: Backoff::new(FIRST_PAUSE, LONGEST_PAUSE),
        }
    }

    /// How long the wait has lasted so far.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Pauses before the next look; fails, naming what was awaited, once the deadline is past.
    pub async fn tick(&mut self) -> Result<(), String> {
        if self.started.elapsed() >= self.deadline {
            return Err(format!(
                "timed out after {:?} waiting for {}",
                self.deadline, self.what
            ));
        }
        tokio::time::sleep(self.backoff.next()).await;
        Ok(())
    }
}

/// Polls `cond` until it holds; fails after `deadline`, naming `what`.
pub async fn wait_until(
    what: &str,
    deadline: Duration,
    mut cond: impl AsyncFnMut() -> bool,
) -> Result<(), String> {
    let mut poll = Poll::new(what, deadline);
    while !cond().await {
        poll.tick().await?;
    }
    Ok(())
}

/// Runs `check` again and again, at [`Poll`]'s pace, until `period` has passed: for what must
/// stay true all the while a fault lasts (`check` asserts it, and panics at the first look where
/// it does not hold).
pub async fn throughout(period: Duration, mut check: impl AsyncFnMut()) {
    let started = Instant::now();
    let mut backoff = Backoff::new(FIRST_PAUSE, LONGEST_PAUSE);
    while started.elapsed() < period {
        check().await;
        tokio::time::sleep(backoff.next()).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn fails_naming_what_it_waited_for() {
        let err = wait_until("godot", Duration::from_millis(50), async || false)
            .await
            .unwrap_err();
        assert!(err.contains("godot"), "{err}");
    }

    #[tokio::test]
    async fn looks_until_the_period_has_passed() {
        let started = Instant::now();
        let mut looks = 0;
        throughout(Duration::from_millis(100), async || looks += 1).await;
        assert!(started.elapsed() >= Duration::from_millis(100));
        assert!(looks >= 2, "{looks}");
    }

    #[tokio::test]
    async fn returns_once_the_condition_holds() {
        let mut looks = 0;
        wait_until("three looks", Duration::from_secs(5), async || {
            looks += 1;
            looks == 3
        })
        .await
        .unwrap();
        assert_eq!(looks, 3);
    }
}
