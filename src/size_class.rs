//! Size classes: how a request is rounded, which segment size grows a pool
//! for it, and the bins (size classes) that index free blocks.
//!
//! Bins follow TLSF: each power of two is cut into `2^MANTISSA_BITS` equal
//! sub-ranges, so a bin spans at most 1/32 (3.1 %) of its lower bound and the
//! bin of any size is found with one leading-zero count. Sizes below
//! `2^MANTISSA_BITS` have a bin each. Bins are numbered in size order:
//!
//! ```text
//!   bin(size)        = row * 2^M + sub          (M = MANTISSA_BITS)
//!   row 0            : sizes 0 .. 2^M - 1, one size per bin
//!   row r >= 1       : sizes [2^(r+M-1), 2^(r+M)), sub = next M bits below the top bit
//!   lower_bound(bin) <= size < lower_bound(bin + 1)
//! ```
//!
//! Pure arithmetic, no unsafe, tested exhaustively below.
#![forbid(unsafe_code)]

/// Bits of mantissa per power of two: 32 bins per octave.
pub const MANTISSA_BITS: u32 = 5;
const SUBS: u32 = 1 << MANTISSA_BITS;
/// Number of rows (one per power of two from 2^M to 2^63, plus row 0).
pub const ROWS: u32 = 64 - MANTISSA_BITS + 1;
/// Number of bins; every `u64` size has one.
pub const BIN_COUNT: usize = (ROWS * SUBS) as usize;

/// The bin holding blocks of `size` bytes (rounds down: blocks of that bin are
/// at least `bin_lower_bound(bin)` bytes).
#[inline]
pub fn bin_of(size: u64) -> usize {
    if size < SUBS as u64 {
        return size as usize;
    }
    let top = 63 - size.leading_zeros();
    let shift = top - MANTISSA_BITS;
    let sub = ((size >> shift) as u32) - SUBS;
    ((top - MANTISSA_BITS + 1) * SUBS + sub) as usize
}

/// The smallest size that falls in `bin`.
#[inline]
pub fn bin_lower_bound(bin: usize) -> u64 {
    let row = bin as u32 / SUBS;
    let sub = bin as u64 % SUBS as u64;
    if row == 0 {
        sub
    } else {
        (SUBS as u64 + sub) << (row - 1)
    }
}

/// Rounding and segment-size rules, PyTorch's by default.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SizeRules {
    /// Every block is a multiple of this (a power of two).
    pub min_block: u64,
    /// Requests up to this size go to the small pool.
    pub small_size: u64,
    /// Segment size that grows the small pool.
    pub small_segment: u64,
    /// Large requests below this size get a `large_segment`.
    pub min_large_alloc: u64,
    /// Segment size for large requests below `min_large_alloc`.
    pub large_segment: u64,
    /// Larger requests get their own segment, rounded up to this.
    pub large_round: u64,
    /// Round requests up to one of this many steps per power of two (0 or 1: off).
    pub roundup_power2_divisions: u64,
    /// Blocks at least this large are never split, and are only handed to
    /// requests nearly as large (`u64::MAX`: no limit).
    pub max_split_size: u64,
    /// A request at least `max_split_size` takes a block at most this much larger.
    pub oversize_slack: u64,
}

impl Default for SizeRules {
    fn default() -> Self {
        SizeRules {
            min_block: 512,
            small_size: 1 << 20,
            small_segment: 2 << 20,
            min_large_alloc: 10 << 20,
            large_segment: 20 << 20,
            large_round: 2 << 20,
            roundup_power2_divisions: 0,
            max_split_size: u64::MAX,
            oversize_slack: 20 << 20,
        }
    }
}

/// Whether a block serves small or large requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolKind {
    Small = 0,
    Large = 1,
}

impl PoolKind {
    pub const ALL: [PoolKind; 2] = [PoolKind::Small, PoolKind::Large];

    pub fn name(self) -> &'static str {
        match self {
            PoolKind::Small => "small_pool",
            PoolKind::Large => "large_pool",
        }
    }
}

/// `value` rounded up to a multiple of the power of two `align`; `None` on overflow.
#[inline]
pub fn align_up(value: u64, align: u64) -> Option<u64> {
    debug_assert!(align.is_power_of_two());
    Some(value.checked_add(align - 1)? & !(align - 1))
}

impl SizeRules {
    /// The block size a request of `size` bytes gets; `None` when it
    /// overflows. `size` must be nonzero.
    #[inline]
    pub fn round(&self, size: u64) -> Option<u64> {
        if size <= self.min_block {
            return Some(self.min_block);
        }
        let div = self.roundup_power2_divisions;
        let rounded = if div > 1 && size > self.min_block.saturating_mul(div) && !size.is_power_of_two() {
            let floor = 1u64 << (63 - size.leading_zeros());
            // `div` is a power of two (checked by the config), so the step is exact.
            let step = floor / div;
            align_up(size, step)?
        } else {
            size
        };
        align_up(rounded, self.min_block)
    }

    /// The pool kind for an already rounded block size.
    #[inline]
    pub fn kind(&self, rounded: u64) -> PoolKind {
        if rounded <= self.small_size {
            PoolKind::Small
        } else {
            PoolKind::Large
        }
    }

    /// The size of the segment to allocate for a rounded request.
    #[inline]
    pub fn segment_size(&self, rounded: u64) -> Option<u64> {
        if rounded <= self.small_size {
            Some(self.small_segment)
        } else if rounded < self.min_large_alloc {
            Some(self.large_segment)
        } else {
            align_up(rounded, self.large_round)
        }
    }

    /// Whether a free block of `block` bytes that serves a request of
    /// `rounded` bytes is split, leaving the rest free.
    #[inline]
    pub fn should_split(&self, kind: PoolKind, block: u64, rounded: u64) -> bool {
        let remaining = block - rounded;
        match kind {
            PoolKind::Small => remaining >= self.min_block,
            PoolKind::Large => rounded < self.max_split_size && remaining > self.small_size,
        }
    }

    /// Whether a free block of `block` bytes (already known to be large
    /// enough) may serve a request of `rounded` bytes under `max_split_size`.
    #[inline]
    pub fn may_serve(&self, block: u64, rounded: u64) -> bool {
        if rounded < self.max_split_size {
            block < self.max_split_size
        } else {
            block - rounded < self.oversize_slack
        }
    }

    /// Checks the relations between the fields; the message names the broken one.
    pub fn check(&self) -> Result<(), String> {
        // Named by their TIDEPOOL_CONF keys.
        let pow2 = |name: &str, v: u64| {
            if v.is_power_of_two() {
                Ok(())
            } else {
                Err(format!("{name} must be a power of two, got {v}"))
            }
        };
        pow2("min_block_bytes", self.min_block)?;
        pow2("large_round_mb", self.large_round)?;
        if self.roundup_power2_divisions > 1 {
            pow2("roundup_power2_divisions", self.roundup_power2_divisions)?;
        }
        if self.min_block < 256 {
            return Err(format!("min_block_bytes must be at least 256, got {}", self.min_block));
        }
        if self.small_size < self.min_block || !self.small_size.is_multiple_of(self.min_block) {
            return Err("small_size_kb must be a multiple of min_block_bytes".into());
        }
        if self.small_segment < self.small_size || !self.small_segment.is_multiple_of(self.min_block) {
            return Err("small_segment_mb must be a multiple of min_block_bytes and at least small_size_kb".into());
        }
        if self.large_segment < self.min_large_alloc || !self.large_segment.is_multiple_of(self.min_block) {
            return Err("large_segment_mb must be a multiple of min_block_bytes and at least min_large_alloc_mb".into());
        }
        if self.min_large_alloc <= self.small_size {
            return Err("min_large_alloc_mb must be above small_size_kb".into());
        }
        if self.large_round < self.min_block {
            return Err("large_round_mb must be at least min_block_bytes".into());
        }
        if self.max_split_size <= self.large_segment.max(self.small_segment) {
            // A whole free segment would then be a block no request below
            // max_split_size may split: every such request a new segment.
            return Err(format!(
                "max_split_size_mb must be above large_segment_mb and small_segment_mb ({} MiB), got {} MiB",
                self.large_segment.max(self.small_segment) >> 20,
                self.max_split_size >> 20
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes_to_check() -> impl Iterator<Item = u64> {
        // Every size up to 64 Ki, then each power of two and its neighbours,
        // then the bin bounds and their neighbours across the whole u64 range.
        let dense = 0..(1u64 << 16);
        let around_bounds = (0..BIN_COUNT).flat_map(|b| {
            let lo = bin_lower_bound(b);
            [lo.saturating_sub(1), lo, lo.saturating_add(1)]
        });
        dense.chain(around_bounds).chain([u64::MAX, u64::MAX - 1])
    }

    #[test]
    fn every_bin_round_trips_through_its_lower_bound() {
        for bin in 0..BIN_COUNT {
            assert_eq!(bin_of(bin_lower_bound(bin)), bin, "bin {bin}");
        }
    }

    #[test]
    fn lower_bounds_strictly_increase() {
        for bin in 1..BIN_COUNT {
            assert!(bin_lower_bound(bin) > bin_lower_bound(bin - 1), "bin {bin}");
        }
    }

    #[test]
    fn a_size_lies_between_its_bin_bound_and_the_next() {
        for size in sizes_to_check() {
            let bin = bin_of(size);
            assert!(bin_lower_bound(bin) <= size, "size {size}");
            if bin + 1 < BIN_COUNT {
                assert!(size < bin_lower_bound(bin + 1), "size {size}");
            }
        }
    }

    #[test]
    fn a_later_bin_never_holds_a_block_smaller_than_the_request() {
        // Best fit looks in the request's own bin, then takes any block of a
        // later bin: every block there must fit.
        for size in sizes_to_check() {
            let bin = bin_of(size);
            if bin + 1 < BIN_COUNT {
                assert!(bin_lower_bound(bin + 1) > size, "size {size}");
            }
        }
    }

    #[test]
    fn bin_width_is_at_most_one_thirty_second_of_its_size() {
        // The bound on how far a good fit from the first fitting bin can be
        // from the request: the bin's span relative to its lower bound.
        for bin in SUBS as usize..BIN_COUNT - 1 {
            let lo = bin_lower_bound(bin);
            let width = bin_lower_bound(bin + 1) - lo;
            assert!(width * SUBS as u64 <= lo, "bin {bin}: width {width}, lower bound {lo}");
        }
    }

    #[test]
    fn rounding_is_to_512_bytes_by_default_and_never_below_the_request() {
        let rules = SizeRules::default();
        assert_eq!(rules.round(1), Some(512));
        assert_eq!(rules.round(512), Some(512));
        assert_eq!(rules.round(513), Some(1024));
        for size in (1..1u64 << 16).chain([(1 << 30) + 1, u64::MAX / 2]) {
            let r = rules.round(size).unwrap();
            assert!(r >= size && r % 512 == 0 && r - size < 512, "size {size} -> {r}");
        }
        assert_eq!(rules.round(u64::MAX), None);
        assert_eq!(rules.round(u64::MAX - 100), None);
    }

    #[test]
    fn roundup_power2_divisions_rounds_to_steps_of_the_octave() {
        let rules = SizeRules { roundup_power2_divisions: 4, ..SizeRules::default() };
        // 1 MiB octave in four steps of 256 KiB: 1.1 MiB -> 1.25 MiB.
        let mib = 1u64 << 20;
        assert_eq!(rules.round(mib + mib / 10), Some(mib + mib / 4));
        assert_eq!(rules.round(mib), Some(mib));
        assert_eq!(rules.round(mib + mib / 4), Some(mib + mib / 4));
        // Below min_block * divisions the plain 512-byte rounding applies.
        assert_eq!(rules.round(1500), Some(1536));
        for size in [3000u64, 70_000, 5 << 20, (7 << 30) + 3] {
            let r = rules.round(size).unwrap();
            assert!(r >= size && r.is_multiple_of(512) && (r - size) * 4 <= size, "size {size} -> {r}");
        }
    }

    #[test]
    fn segment_sizes_follow_pytorch() {
        let rules = SizeRules::default();
        let mib = 1u64 << 20;
        assert_eq!(rules.segment_size(512), Some(2 * mib));
        assert_eq!(rules.segment_size(mib), Some(2 * mib));
        assert_eq!(rules.segment_size(mib + 512), Some(20 * mib));
        assert_eq!(rules.segment_size(10 * mib - 512), Some(20 * mib));
        assert_eq!(rules.segment_size(10 * mib), Some(10 * mib));
        assert_eq!(rules.segment_size(11 * mib - 512), Some(12 * mib));
        assert_eq!(rules.segment_size(u64::MAX - 511), None);
        assert_eq!(rules.kind(mib), PoolKind::Small);
        assert_eq!(rules.kind(mib + 512), PoolKind::Large);
    }

    #[test]
    fn splitting_follows_pytorch_thresholds() {
        let rules = SizeRules::default();
        let mib = 1u64 << 20;
        assert!(rules.should_split(PoolKind::Small, 2 * mib, 2 * mib - 512));
        assert!(!rules.should_split(PoolKind::Small, 2 * mib, 2 * mib));
        assert!(rules.should_split(PoolKind::Large, 20 * mib, 18 * mib));
        assert!(!rules.should_split(PoolKind::Large, 20 * mib, 19 * mib));
        let capped = SizeRules { max_split_size: 8 * mib, ..rules };
        assert!(!capped.should_split(PoolKind::Large, 40 * mib, 9 * mib));
        assert!(capped.should_split(PoolKind::Large, 20 * mib, 4 * mib));
        assert!(!capped.may_serve(20 * mib, 4 * mib), "an oversize block never serves a small request");
        assert!(capped.may_serve(30 * mib, 12 * mib));
        assert!(!capped.may_serve(40 * mib, 12 * mib), "nor a request 20 MiB smaller than itself");
    }

    #[test]
    fn default_rules_are_consistent_and_bad_ones_are_named() {
        assert_eq!(SizeRules::default().check(), Ok(()));
        let bad = SizeRules { min_block: 500, ..SizeRules::default() };
        assert!(bad.check().unwrap_err().contains("min_block"));
        let bad = SizeRules { small_segment: 1 << 19, ..SizeRules::default() };
        assert!(bad.check().unwrap_err().contains("small_segment"));
        let bad = SizeRules { roundup_power2_divisions: 3, ..SizeRules::default() };
        assert!(bad.check().unwrap_err().contains("roundup_power2_divisions"));
        // A segment at least max_split_size could serve no smaller request.
        let mib = 1u64 << 20;
        let bad = SizeRules { max_split_size: 32 * mib, large_segment: 64 * mib, ..SizeRules::default() };
        assert!(bad.check().unwrap_err().contains("max_split_size_mb must be above large_segment_mb"));
        assert!(SizeRules { max_split_size: 20 * mib, ..SizeRules::default() }.check().is_err());
        assert!(SizeRules { max_split_size: 22 * mib, ..SizeRules::default() }.check().is_ok());
    }
}
