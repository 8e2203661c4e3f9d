//! The one backoff of the project: every wait that grows (pull errors, in-process retries, nak
//! delays, waiting for a service at start) is a [`Backoff`].

use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// Capped exponential backoff: `base × 2^n`, at most `max`, optionally with up to 50 % jitter
/// added so that twins that collided do not collide again in step.
///
/// ```
/// use inbox_runtime::Backoff;
/// use std::time::Duration;
/// let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
/// assert_eq!(backoff.next(), Duration::from_millis(100));
/// assert_eq!(backoff.next(), Duration::from_millis(200));
/// assert_eq!(backoff.delay(10), Duration::from_secs(1));
/// backoff.reset();
/// assert_eq!(backoff.next(), Duration::from_millis(100));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    jitter: bool,
    step: u32,
}

impl Backoff {
    /// Starts at `base` and doubles up to `max`, without jitter.
    pub const fn new(base: Duration, max: Duration) -> Self {
        Backoff {
            base,
            max,
            jitter: false,
            step: 0,
        }
    }

    /// The same backoff with up to 50 % of each wait added at random.
    pub const fn with_jitter(mut self) -> Self {
        self.jitter = true;
        self
    }

    /// The longest wait, before jitter.
    pub const fn max(&self) -> Duration {
        self.max
    }

    /// The wait before try `step + 1` (step 0 waits `base`), capped at `max`; with jitter, up to
    /// half of it again.
    pub fn delay(&self, step: u32) -> Duration {
        let wait = self.base.saturating_mul(1u32 << step.min(31)).min(self.max);
        if self.jitter {
            // A random fraction in [0, 0.5) without a dependency: std's per-process random keys.
            let r = std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish();
            wait + wait.mul_f64((r % 1000) as f64 / 2000.0)
        } else {
            wait
        }
    }

    /// The next wait, growing with each call.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Duration {
        let wait = self.delay(self.step);
        self.step = self.step.saturating_add(1);
        wait
    }

    /// Back to `base`, after a success.
    pub fn reset(&mut self) {
        self.step = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_and_is_capped() {
        let b = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        assert_eq!(b.delay(0), Duration::from_secs(1));
        assert_eq!(b.delay(2), Duration::from_secs(4));
        assert_eq!(b.delay(100), Duration::from_secs(30));
    }

    #[test]
    fn jitter_adds_at_most_half() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(2)).with_jitter();
        for step in 0..40 {
            let plain =
                Backoff::new(Duration::from_millis(100), Duration::from_secs(2)).delay(step);
            let d = b.delay(step);
            assert!(d >= plain && d <= plain.mul_f64(1.5), "{step}: {d:?}");
        }
    }
}
