//! `AddrMap`: address -> u32, the O(1) pointer lookup of the heap's `free`
//! (block ids) and of a thread cache's hand-outs.
//!
//! Open addressing with linear probing and backward-shift deletion (no
//! tombstones, so a table that sees endless insert/remove cycles never
//! degrades). Keys are block addresses, never 0, so 0 marks an empty slot.
//! The hash is Fibonacci hashing: the top bits of address * 2^64/phi, which
//! depend on every bit of the address, low zero bits or not. The table doubles when half full and never shrinks, so once it has
//! grown to the working set, inserts and removes allocate nothing.
#![forbid(unsafe_code)]

const EMPTY: u64 = 0;
const MIN_CAPACITY: usize = 64;

#[derive(Clone)]
pub struct AddrMap {
    /// (key, value) per slot; key EMPTY marks a free slot.
    slots: Vec<(u64, u32)>,
    len: usize,
    /// 64 - log2(capacity): the shift that maps a hash to a slot.
    shift: u32,
}

impl Default for AddrMap {
    fn default() -> Self {
        AddrMap::with_capacity(MIN_CAPACITY)
    }
}

impl AddrMap {
    fn with_capacity(capacity: usize) -> AddrMap {
        debug_assert!(capacity.is_power_of_two());
        AddrMap { slots: vec![(EMPTY, 0); capacity], len: 0, shift: 64 - capacity.trailing_zeros() }
    }

    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }

    pub fn len(&self) -> usize {
        self.len
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The value of `key`; None for 0, which marks empty slots and is
    /// never a key.
    #[inline]
    pub fn get(&self, key: u64) -> Option<u32> {
        if key == EMPTY {
            return None;
        }
        let mask = self.mask();
        let mut slot = self.home(key);
        loop {
            let (k, v) = self.slots[slot];
            if k == key {
                return Some(v);
            }
            if k == EMPTY {
                return None;
            }
            slot = (slot + 1) & mask;
        }
    }

    /// Inserts or replaces. `key` must not be 0.
    #[inline]
    pub fn insert(&mut self, key: u64, value: u32) {
        debug_assert_ne!(key, EMPTY);
        if (self.len + 1) * 2 > self.slots.len() {
            self.grow();
        }
        let mask = self.mask();
        let mut slot = self.home(key);
        loop {
            let k = self.slots[slot].0;
            if k == EMPTY || k == key {
                if k == EMPTY {
                    self.len += 1;
                }
                self.slots[slot] = (key, value);
                return;
            }
            slot = (slot + 1) & mask;
        }
    }

    /// Removes `key`, returning its value.
    #[inline]
    pub fn remove(&mut self, key: u64) -> Option<u32> {
        if key == EMPTY {
            return None;
        }
        let mask = self.mask();
        let mut slot = self.home(key);
        let value = loop {
            let (k, v) = self.slots[slot];
            if k == key {
                break v;
            }
            if k == EMPTY {
                return None;
            }
            slot = (slot + 1) & mask;
        };
        // Backward shift: pull later entries of the probe run into the hole
        // unless that would move them before their home slot.
        let mut hole = slot;
        let mut next = (hole + 1) & mask;
        loop {
            let entry = self.slots[next];
            if entry.0 == EMPTY {
                break;
            }
            let home = self.home(entry.0);
            // The entry may move back to the hole unless the hole lies
            // before its home in the probe run (cyclic distances).
            if (next.wrapping_sub(home) & mask) >= (next.wrapping_sub(hole) & mask) {
                self.slots[hole] = entry;
                hole = next;
            }
            next = (next + 1) & mask;
        }
        self.slots[hole].0 = EMPTY;
        self.len -= 1;
        Some(value)
    }

    fn grow(&mut self) {
        let mut bigger = AddrMap::with_capacity(self.slots.len() * 2);
        for &(k, v) in &self.slots {
            if k != EMPTY {
                bigger.insert(k, v);
            }
        }
        *self = bigger;
    }

    /// Every (key, value), in no particular order.
    #[cfg(test)]
    pub fn iter(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.slots.iter().copied().filter(|&(k, _)| k != EMPTY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn agrees_with_a_hashmap_through_random_inserts_and_removes() {
        let mut map = AddrMap::default();
        let mut model = HashMap::new();
        let mut seed = 0x1234_5678_9abc_def1u64;
        for step in 0..200_000u32 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            // Few distinct keys, 512-aligned, so probe runs collide and wrap.
            let key = ((seed % 3000) + 1) << 9;
            if seed >> 60 < 9 {
                map.insert(key, step);
                model.insert(key, step);
            } else {
                assert_eq!(map.remove(key), model.remove(&key), "step {step}");
            }
            if step % 10_000 == 0 {
                assert_eq!(map.len(), model.len());
                for (&k, &v) in &model {
                    assert_eq!(map.get(k), Some(v));
                }
            }
        }
        let mut pairs: Vec<_> = map.iter().collect();
        pairs.sort_unstable();
        let mut expected: Vec<_> = model.into_iter().collect();
        expected.sort_unstable();
        assert_eq!(pairs, expected);
    }

    #[test]
    fn missing_and_zero_keys_are_absent() {
        let mut map = AddrMap::default();
        assert_eq!(map.get(512), None);
        assert_eq!(map.get(0), None, "0 marks empty slots: never a key");
        assert_eq!(map.remove(0), None);
        map.insert(512, 1);
        assert_eq!(map.get(0), None);
        assert_eq!(map.remove(1024), None);
        assert_eq!(map.remove(512), Some(1));
        assert!(map.is_empty());
    }
}
