//! Tags: the names allocations carry, and the calling thread's current tag.
//!
//! Every allocation carries a tag, "default" unless the thread set another
//! (`region`, or `tidepool_set_tag` in C). A tag's memory can be paused
//! (given back to the device, addresses kept) and resumed: see
//! `heap/tags.rs`. Names are interned once per process as small numbers
//! (`TagId`), so the heap compares integers and the thread's current tag is
//! one thread-local integer: 0, the default, costs the allocation path one
//! test.
//!
//! Invariants:
//! - id 0 is "default"; id n names the n-th name interned, for the life of
//!   the process (names are never forgotten, so an id never changes meaning);
//! - a name is 1 to `MAX_TAG_LEN` bytes of UTF-8 with no NUL;
//! - a process has at most `MAX_TAGS` names, "default" included: a new one
//!   past it is refused with an error that says why. Each name keeps its
//!   pools (about 16 KiB of records per stream it allocated on) for the
//!   life of the process; the memory of an empty tag goes back as any
//!   cache does (`empty_cache`, idle release): 1,023 tags of one small
//!   block each cost 17 MiB of records (docs/sleep-and-wake.md).
#![forbid(unsafe_code)]

use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::Arc;

use crate::fork::ProcessLock;

use crate::error::{AllocError, InvalidArgument};

/// The longest tag name, in bytes (the C ABI's limit: 63 plus the NUL).
pub const MAX_TAG_LEN: usize = 63;

/// The most tag names one process may use, "default" included.
pub const MAX_TAGS: usize = 1024;

/// The tag of allocations made outside any region.
pub const DEFAULT_TAG: &str = "default";

/// An interned tag name; `TagId::DEFAULT` is "default".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TagId(pub u32);

impl TagId {
    pub const DEFAULT: TagId = TagId(0);
}

/// Every name interned so far, by id (the first, "default", is added on
/// first use).
static NAMES: ProcessLock<Vec<Arc<str>>> = ProcessLock::new(Vec::new());

thread_local! {
    /// The calling thread's tag for its next allocations.
    static CURRENT: Cell<u32> = const { Cell::new(0) };
}

/// What `device_bias` adds while a thread has a tag: no device index is that large.
const TAGGED_BIAS: usize = 1 << (usize::BITS - 2);

/// Checks that `name` can be a tag: 1 to 63 bytes, no NUL.
pub fn check_name(name: &str) -> Result<(), AllocError> {
    if name.is_empty() {
        return Err(AllocError::InvalidArgument(InvalidArgument::EmptyTag));
    }
    if name.len() > MAX_TAG_LEN {
        let start = name.chars().take(16).collect();
        return Err(AllocError::InvalidArgument(InvalidArgument::TagTooLong { start, len: name.len(), max: MAX_TAG_LEN }));
    }
    if name.contains('\0') {
        return Err(AllocError::InvalidArgument(InvalidArgument::TagWithNul { tag: name.into() }));
    }
    Ok(())
}

fn with_names<R>(f: impl FnOnce(&mut Vec<Arc<str>>) -> R) -> R {
    let mut names = NAMES.lock();
    if names.is_empty() {
        names.push(Arc::from(DEFAULT_TAG));
    }
    f(&mut names)
}

/// The id of `name`, interning it if it is new.
pub fn intern(name: &str) -> Result<TagId, AllocError> {
    check_name(name)?;
    with_names(|names| match names.iter().position(|n| &**n == name) {
        Some(id) => Ok(TagId(id as u32)),
        None if names.len() >= MAX_TAGS => {
            Err(AllocError::InvalidArgument(InvalidArgument::TooManyTags { tag: name.into(), max: MAX_TAGS }))
        }
        None => {
            names.push(Arc::from(name));
            Ok(TagId(names.len() as u32 - 1))
        }
    })
}

/// The id of `name` if some thread of this process ever used it.
pub fn lookup(name: &str) -> Option<TagId> {
    with_names(|names| names.iter().position(|n| &**n == name).map(|id| TagId(id as u32)))
}

/// The name of `id` ("?" for an id never handed out).
pub fn name_of(id: TagId) -> Arc<str> {
    with_names(|names| names.get(id.0 as usize).cloned().unwrap_or_else(|| Arc::from("?")))
}

/// The calling thread's current tag.
#[inline(always)]
pub fn current() -> TagId {
    TagId(CURRENT.with(Cell::get))
}

/// Makes `id` the calling thread's tag; returns the one it replaces.
pub fn set_current(id: TagId) -> TagId {
    TagId(CURRENT.with(|c| c.replace(id.0)))
}

/// 0 while the calling thread's tag is "default", else a bias that puts
/// any device index out of range: added to the device index on the
/// allocation path, it sends a tagged request past the device check to
/// the slow path with no test of its own.
#[inline(always)]
pub fn device_bias() -> usize {
    if current() == TagId::DEFAULT {
        0
    } else {
        TAGGED_BIAS
    }
}

/// Sets the calling thread's tag by name (`None`: "default"); returns the
/// tag it replaces. A bad name changes nothing.
pub fn set_current_name(name: Option<&str>) -> Result<TagId, AllocError> {
    let id = match name {
        None => TagId::DEFAULT,
        Some(name) => intern(name)?,
    };
    Ok(set_current(id))
}

/// The thread's tag set for as long as this lives (`region`); dropping it
/// puts back the tag that was current before. Regions nest. Not `Send`:
/// the tag belongs to the thread that set it.
#[must_use = "the tag is the thread's only while the region lives"]
pub struct Region {
    previous: TagId,
    _thread: PhantomData<*const ()>,
}

/// Makes `name` the calling thread's tag until the returned region drops.
///
/// ```
/// let alloc = tidepool::Allocator::new(tidepool::Config::builder().host(1, 1 << 30).build().unwrap()).unwrap();
/// {
///     let _kv = tidepool::tag::region("kv_cache").unwrap();
///     let p = alloc.allocate(0, 4096, tidepool::Stream::DEFAULT).unwrap(); // tagged "kv_cache"
///     alloc.free(0, p).unwrap();
/// }
/// assert_eq!(&*tidepool::tag::name_of(tidepool::tag::current()), "default");
/// ```
pub fn region(name: &str) -> Result<Region, AllocError> {
    let previous = set_current_name(Some(name))?;
    Ok(Region { previous, _thread: PhantomData })
}

impl Drop for Region {
    fn drop(&mut self) {
        set_current(self.previous);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_intern_to_stable_ids_and_default_is_zero() {
        assert_eq!(intern(DEFAULT_TAG).unwrap(), TagId::DEFAULT);
        let a = intern("tag-test-a").unwrap();
        assert_ne!(a, TagId::DEFAULT);
        assert_eq!(intern("tag-test-a").unwrap(), a);
        assert_eq!(lookup("tag-test-a"), Some(a));
        assert_eq!(&*name_of(a), "tag-test-a");
        assert_eq!(lookup("tag-test-never-used"), None);
    }

    #[test]
    fn bad_names_are_refused_and_change_nothing() {
        let long = "x".repeat(MAX_TAG_LEN + 1);
        for bad in ["", long.as_str(), "a\0b"] {
            assert!(matches!(set_current_name(Some(bad)), Err(AllocError::InvalidArgument(_))), "{bad:?}");
            assert_eq!(current(), TagId::DEFAULT);
        }
        assert!(intern(&"y".repeat(MAX_TAG_LEN)).is_ok(), "63 bytes is allowed");
    }

    #[test]
    fn regions_nest_and_restore() {
        let outer = region("tag-test-outer").unwrap();
        let outer_id = current();
        {
            let _inner = region("tag-test-inner").unwrap();
            assert_eq!(&*name_of(current()), "tag-test-inner");
        }
        assert_eq!(current(), outer_id);
        drop(outer);
        assert_eq!(current(), TagId::DEFAULT);
    }
}
