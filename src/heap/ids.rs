//! The heap's identifiers: a block record, a pool, a segment (or reserved
//! range), each an index into the table that owns it (`BlockArena`,
//! `Pools`, `Segments`), typed so that one cannot stand for another. Tags
//! are `crate::tag::TagId`.
#![forbid(unsafe_code)]

macro_rules! id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(u32);

        impl $name {
            /// The id of entry `index` of its table.
            #[inline(always)]
            pub fn new(index: usize) -> $name {
                $name(u32::try_from(index).expect(concat!("more than 4 billion of ", stringify!($name))))
            }

            /// The entry of its table it names.
            #[inline(always)]
            pub const fn index(self) -> usize {
                self.0 as usize
            }

            /// The id a plain number names (as `raw` gave it).
            #[inline(always)]
            pub const fn from_raw(raw: u32) -> $name {
                $name(raw)
            }

            /// As a plain number (the reclaimer's candidate ids, maps below the heap).
            #[inline(always)]
            pub const fn raw(self) -> u32 {
                self.0
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

id!(
    /// A block record in the heap's `BlockArena`.
    BlockId
);
id!(
    /// A pool in the heap's `Pools`.
    PoolId
);
id!(
    /// A segment (or reserved range of an expandable segment) in the heap's `Segments`.
    SegmentId
);

impl BlockId {
    /// The absent link.
    pub const NIL: BlockId = BlockId(u32::MAX);
}
