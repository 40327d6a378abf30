//! The release policy: which cached segments go back to the driver, as a
//! pure function of the time, how long each whole free segment has been
//! idle, and the pressure on the device. Tests drive it with any clock.
#![forbid(unsafe_code)]

/// Why a segment went back to the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Idle longer than `release_after_ms`.
    IdleDecay = 0,
    /// The heap reserved more than its budget (`max_reserved_mb`, memory fraction).
    Budget = 1,
    /// The device had less free memory than `headroom_mb`.
    Headroom = 2,
    /// A request could not grow the heap.
    OutOfMemory = 3,
    /// `empty_cache()`.
    EmptyCache = 4,
    /// Another process on the device asked for memory.
    Cooperation = 5,
}

impl Reason {
    pub const ALL: [Reason; 6] =
        [Reason::IdleDecay, Reason::Budget, Reason::Headroom, Reason::OutOfMemory, Reason::EmptyCache, Reason::Cooperation];

    pub fn name(self) -> &'static str {
        match self {
            Reason::IdleDecay => "idle_decay",
            Reason::Budget => "budget",
            Reason::Headroom => "headroom",
            Reason::OutOfMemory => "out_of_memory",
            Reason::EmptyCache => "empty_cache",
            Reason::Cooperation => "cooperation",
        }
    }
}

/// The knobs of the policy (see the options table for their meaning).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// A whole free segment idle this long is released (u64::MAX: never).
    pub release_after_ms: u64,
    /// Keep at least this much of the device free (0: off).
    pub headroom: u64,
    /// Under headroom pressure, only segments idle at least this long go:
    /// a segment a training loop reuses every step is not churned.
    pub headroom_min_idle_ms: u64,
    /// Reserve at most this much (u64::MAX: no budget).
    pub max_reserved: u64,
}

impl Policy {
    /// Releases nothing on its own: no idle release, no headroom, no
    /// budget (a heap's policy until its device sets one; with
    /// `max_reserved` set, what releases only what a cap asks for).
    pub const RELEASE_NOTHING: Policy = Policy { release_after_ms: u64::MAX, headroom: 0, headroom_min_idle_ms: 0, max_reserved: u64::MAX };
}

/// A whole free segment as the policy sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdleSegment {
    pub id: u32,
    pub size: u64,
    /// When it last became whole and free (same clock as `now_ms`).
    pub idle_since_ms: u64,
}

/// The state of the device and the heap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pressure {
    /// Free memory of the device, every process counted.
    pub device_free: u64,
    /// Bytes this heap holds from the driver.
    pub reserved: u64,
}

/// The segments to release and why, longest idle first.
pub fn decide(policy: &Policy, now_ms: u64, idle: &[IdleSegment], pressure: Pressure) -> Vec<(u32, Reason)> {
    let mut by_age: Vec<&IdleSegment> = idle.iter().collect();
    by_age.sort_by_key(|s| (s.idle_since_ms, s.id));
    let idle_for = |s: &IdleSegment| now_ms.saturating_sub(s.idle_since_ms);
    let mut chosen: Vec<(u32, Reason)> = Vec::new();
    let mut released = 0u64;
    for s in &by_age {
        if idle_for(s) >= policy.release_after_ms {
            chosen.push((s.id, Reason::IdleDecay));
            released += s.size;
        }
    }
    let mut take = |reason: Reason, done: &dyn Fn(u64) -> bool, min_idle: u64, chosen: &mut Vec<(u32, Reason)>| {
        for s in &by_age {
            if done(released) {
                break;
            }
            if idle_for(s) >= min_idle && !chosen.iter().any(|&(id, _)| id == s.id) {
                chosen.push((s.id, reason));
                released += s.size;
            }
        }
    };
    let over_budget = |released: u64| pressure.reserved.saturating_sub(released) <= policy.max_reserved;
    take(Reason::Budget, &over_budget, 0, &mut chosen);
    if policy.headroom > 0 {
        let enough_room = |released: u64| pressure.device_free.saturating_add(released) >= policy.headroom;
        take(Reason::Headroom, &enough_room, policy.headroom_min_idle_ms, &mut chosen);
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn policy() -> Policy {
        Policy { release_after_ms: 10_000, headroom: 0, headroom_min_idle_ms: 1_000, max_reserved: u64::MAX }
    }

    fn seg(id: u32, size_mib: u64, idle_since_ms: u64) -> IdleSegment {
        IdleSegment { id, size: size_mib * MIB, idle_since_ms }
    }

    const CALM: Pressure = Pressure { device_free: u64::MAX, reserved: 0 };

    #[test]
    fn segments_idle_past_the_deadline_are_released_and_younger_ones_kept() {
        let idle = [seg(1, 20, 0), seg(2, 2, 5_000), seg(3, 2, 9_999)];
        assert_eq!(decide(&policy(), 10_000, &idle, CALM), vec![(1, Reason::IdleDecay)]);
        assert_eq!(decide(&policy(), 15_000, &idle, CALM), vec![(1, Reason::IdleDecay), (2, Reason::IdleDecay)]);
    }

    #[test]
    fn reuse_pushes_the_deadline_back() {
        // Segment 1 went idle at 0, was reused, and went idle again at 8 s.
        let before = [seg(1, 20, 0)];
        let after_reuse = [seg(1, 20, 8_000)];
        assert_eq!(decide(&policy(), 12_000, &before, CALM).len(), 1);
        assert!(decide(&policy(), 12_000, &after_reuse, CALM).is_empty());
        assert_eq!(decide(&policy(), 18_000, &after_reuse, CALM).len(), 1);
    }

    #[test]
    fn a_budget_releases_longest_idle_first_until_it_is_met() {
        let p = Policy { max_reserved: 100 * MIB, ..policy() };
        let idle = [seg(1, 20, 300), seg(2, 20, 100), seg(3, 20, 200)];
        let pressure = Pressure { device_free: u64::MAX, reserved: 130 * MIB };
        // 30 MiB over: the two longest idle (2, then 3) go.
        assert_eq!(decide(&p, 1_000, &idle, pressure), vec![(2, Reason::Budget), (3, Reason::Budget)]);
    }

    #[test]
    fn headroom_releases_longest_idle_first_and_spares_the_recently_used() {
        let p = Policy { headroom: 50 * MIB, ..policy() };
        let idle = [seg(1, 20, 4_000), seg(2, 20, 1_000), seg(3, 20, 2_000), seg(4, 20, 4_900)];
        let pressure = Pressure { device_free: 10 * MIB, reserved: 80 * MIB };
        // Needs 40 MiB: segments 2 and 3 (idle longest). Segment 4 (idle
        // 100 ms) would be spared even if more were needed.
        assert_eq!(decide(&p, 5_000, &idle, pressure), vec![(2, Reason::Headroom), (3, Reason::Headroom)]);
        let starved = Pressure { device_free: 0, reserved: 80 * MIB };
        let chosen = decide(&Policy { headroom: 1 << 40, ..p }, 5_000, &idle, starved);
        assert_eq!(chosen.iter().map(|c| c.0).collect::<Vec<_>>(), vec![2, 3, 1]);
    }

    #[test]
    fn nothing_is_released_without_a_reason() {
        let idle = [seg(1, 20, 0)];
        assert!(decide(&policy(), 100, &idle, Pressure { device_free: 0, reserved: 20 * MIB }).is_empty());
        let off = Policy { release_after_ms: u64::MAX, ..policy() };
        assert!(decide(&off, u64::MAX - 1, &idle, CALM).is_empty());
    }
}
