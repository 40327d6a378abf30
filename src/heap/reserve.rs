//! The device's reserved count, its peak and its cap (the memory fraction),
//! shared by the heaps of the device's stream shards: growth claims its
//! bytes here before the backend is asked, so two shards cannot both pass
//! the cap, and notes the peak once it holds them.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes the device holds from the driver, the most it held, and the most
/// it may hold.
#[derive(Debug)]
pub struct Reserve {
    bytes: AtomicU64,
    /// The most `bytes` was when a heap noted it (after each growth), since
    /// the last reset: the device's peak, where the shards' own peaks only
    /// add up to a bound.
    peak: AtomicU64,
    /// u64::MAX: no limit.
    limit: AtomicU64,
}

impl Default for Reserve {
    fn default() -> Reserve {
        Reserve { bytes: AtomicU64::new(0), peak: AtomicU64::new(0), limit: AtomicU64::new(u64::MAX) }
    }
}

impl Reserve {
    /// Bytes reserved on the device now.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::SeqCst)
    }

    /// The memory fraction's cap (u64::MAX: none).
    pub fn limit(&self) -> u64 {
        self.limit.load(Ordering::SeqCst)
    }

    pub fn set_limit(&self, limit: Option<u64>) {
        self.limit.store(limit.unwrap_or(u64::MAX), Ordering::SeqCst);
    }

    /// Counts `size` more bytes reserved, unless the total would pass the
    /// limit or `cap` (the release policy's budget): then nothing changes.
    /// The count never shows a claim that is refused, so a refused claim
    /// cannot make another shard's fail.
    pub fn claim(&self, size: u64, cap: u64) -> bool {
        let limit = self.limit().min(cap);
        self.bytes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |before| before.checked_add(size).filter(|&total| total <= limit))
            .is_ok()
    }

    /// Counts `size` bytes given back to the driver.
    pub fn give_back(&self, size: u64) {
        self.bytes.fetch_sub(size, Ordering::SeqCst);
    }

    /// Raises the peak to the bytes reserved now (a heap calls it once its
    /// growth holds memory; another shard's claim still in flight, if its
    /// growth then fails, can leave the peak above what was ever held).
    pub fn note_peak(&self) {
        self.peak.fetch_max(self.bytes(), Ordering::SeqCst);
    }

    /// The most bytes reserved at once since the last `reset_peak`.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::SeqCst)
    }

    /// Lowers the peak to the bytes reserved now.
    pub fn reset_peak(&self) {
        self.peak.store(self.bytes(), Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_stop_at_the_lower_of_limit_and_cap() {
        let reserve = Reserve::default();
        assert!(reserve.claim(60, u64::MAX));
        reserve.set_limit(Some(100));
        assert!(!reserve.claim(50, u64::MAX), "past the limit");
        assert!(!reserve.claim(30, 80), "past the cap");
        assert_eq!(reserve.bytes(), 60, "a refused claim counts nothing");
        assert!(reserve.claim(40, u64::MAX));
        reserve.give_back(100);
        assert_eq!(reserve.bytes(), 0);
        assert!(!reserve.claim(u64::MAX, u64::MAX), "an overflowing claim is refused");
    }

    #[test]
    fn a_refused_claim_never_makes_another_shards_claim_fail() {
        let reserve = Reserve::default();
        reserve.set_limit(Some(1000));
        std::thread::scope(|scope| {
            scope.spawn(|| {
                for _ in 0..200_000 {
                    assert!(!reserve.claim(1 << 40, u64::MAX));
                }
            });
            for _ in 0..200_000 {
                assert!(reserve.claim(10, u64::MAX), "a claim within the limit was refused");
                reserve.give_back(10);
            }
        });
        assert_eq!(reserve.bytes(), 0);
    }

    #[test]
    fn the_peak_is_the_most_held_at_once() {
        let reserve = Reserve::default();
        assert!(reserve.claim(60, u64::MAX));
        reserve.note_peak();
        reserve.give_back(60);
        assert!(reserve.claim(50, u64::MAX));
        reserve.note_peak();
        assert_eq!(reserve.peak(), 60, "not the sum of the two growths");
        reserve.reset_peak();
        assert_eq!(reserve.peak(), 50);
    }
}
