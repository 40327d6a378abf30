//! Sleep and wake through the C ABI: a thread's tag, pausing and resuming
//! a tag, and what a tag holds.

use std::ffi::{c_char, c_int, CStr};

use super::boundary::{
    allocator_or_internal, boundary, device_index, failure, return_code, Failure, TIDEPOOL_ERR_INTERNAL, TIDEPOOL_ERR_INVALID_ARGUMENT,
};
use super::types::{copy_prefix, tidepool_tag_stats, versioned_size, TIDEPOOL_TAG_STATS_VERSION};

/// `tidepool_pause` flag: keep the contents of live blocks in host memory.
pub const TIDEPOOL_PAUSE_OFFLOAD: c_int = 1;

/// The tag `tag` (NULL: "default") as a string, or the failure of `who`.
fn tag_arg(tag: *const c_char, who: &str) -> Result<Option<String>, Failure> {
    if tag.is_null() {
        return Ok(None);
    }
    // SAFETY: `tag` is non-null and, per the contract, a NUL-terminated string.
    let text = unsafe { CStr::from_ptr(tag) }
        .to_str()
        .map_err(|_| (TIDEPOOL_ERR_INVALID_ARGUMENT, format!("tidepool: {who}: the tag is not UTF-8")))?;
    crate::tag::check_name(text).map_err(|err| (TIDEPOOL_ERR_INVALID_ARGUMENT, format!("{who}: {err}")))?;
    Ok(Some(text.to_string()))
}

/// The tag a pause, resume or tag-statistics call names: NULL is "default".
fn named_tag(tag: *const c_char, who: &str) -> Result<String, Failure> {
    Ok(tag_arg(tag, who)?.unwrap_or_else(|| crate::tag::DEFAULT_TAG.to_string()))
}

/// `device` as the tag calls take it: -1 is every device.
fn tag_device(device: c_int) -> Result<Option<usize>, Failure> {
    match device {
        -1 => Ok(None),
        _ => device_index(device).map(Some).map_err(failure),
    }
}

/// Sets the calling thread's tag for its later allocations (NULL:
/// "default"). Returns TIDEPOOL_OK, or TIDEPOOL_ERR_INVALID_ARGUMENT (a
/// tag empty, longer than 63 bytes, or not UTF-8), the tag unchanged.
#[no_mangle]
pub extern "C" fn tidepool_set_tag(tag: *const c_char) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, return_code(set_tag(tag)))
}

fn set_tag(tag: *const c_char) -> Result<(), Failure> {
    let name = tag_arg(tag, "tidepool_set_tag")?;
    crate::tag::set_current_name(name.as_deref()).map_err(failure)?;
    Ok(())
}

/// Pauses `tag` on `device` (-1: every device): waits for the work queued
/// on the streams that used its blocks, then gives every page of it back
/// to the device, addresses kept. `flags`: TIDEPOOL_PAUSE_OFFLOAD keeps
/// the contents in host memory until `tidepool_resume`; 0 discards them.
/// Returns TIDEPOOL_OK, or (nothing changed) TIDEPOOL_ERR_INVALID_ARGUMENT
/// (bad tag, unknown flags), TIDEPOOL_ERR_INVALID_DEVICE,
/// TIDEPOOL_ERR_TAG_STATE (unknown tag, "default", already paused, a
/// private pool open), TIDEPOOL_ERR_OUT_OF_MEMORY (no host memory for the
/// offload), TIDEPOOL_ERR_INTERNAL.
#[no_mangle]
pub extern "C" fn tidepool_pause(tag: *const c_char, device: c_int, flags: c_int) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, return_code(pause(tag, device, flags)))
}

fn pause(tag: *const c_char, device: c_int, flags: c_int) -> Result<(), Failure> {
    let name = named_tag(tag, "tidepool_pause")?;
    if flags & !TIDEPOOL_PAUSE_OFFLOAD != 0 {
        return Err((TIDEPOOL_ERR_INVALID_ARGUMENT, format!("tidepool: tidepool_pause: unknown flags {flags:#x}")));
    }
    let device = tag_device(device)?;
    allocator_or_internal()?.pause(&name, device, flags & TIDEPOOL_PAUSE_OFFLOAD != 0).map_err(failure)?;
    Ok(())
}

/// Resumes `tag` on `device` (-1: every device where it is paused): maps
/// its pages again at the same addresses and copies offloaded contents
/// back; returns once the memory is usable. Returns TIDEPOOL_OK, or
/// TIDEPOOL_ERR_INVALID_ARGUMENT, TIDEPOOL_ERR_INVALID_DEVICE,
/// TIDEPOOL_ERR_TAG_STATE (unknown tag, not paused),
/// TIDEPOOL_ERR_OUT_OF_MEMORY (the device could not give the memory back
/// even after the cache was released and other processes were asked: the
/// tag stays paused, nothing mapped, its saved contents intact),
/// TIDEPOOL_ERR_INTERNAL.
#[no_mangle]
pub extern "C" fn tidepool_resume(tag: *const c_char, device: c_int) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, return_code(resume(tag, device)))
}

fn resume(tag: *const c_char, device: c_int) -> Result<(), Failure> {
    let name = named_tag(tag, "tidepool_resume")?;
    let device = tag_device(device)?;
    allocator_or_internal()?.resume(&name, device).map_err(failure)?;
    Ok(())
}

/// Fills `*out` with what `tag` holds on `device`. Set `out->size =
/// sizeof(tidepool_tag_stats)` first (as for `tidepool_get_stats`).
/// Returns TIDEPOOL_OK, or TIDEPOOL_ERR_INVALID_ARGUMENT (NULL `out`,
/// `out->size` too small, bad tag), TIDEPOOL_ERR_INVALID_DEVICE,
/// TIDEPOOL_ERR_TAG_STATE (unknown tag), TIDEPOOL_ERR_INTERNAL.
#[no_mangle]
pub extern "C" fn tidepool_get_tag_stats(tag: *const c_char, device: c_int, out: *mut tidepool_tag_stats) -> c_int {
    boundary!(TIDEPOOL_ERR_INTERNAL, return_code(get_tag_stats(tag, device, out)))
}

/// The smallest `size` `tidepool_get_tag_stats` accepts: version 1's.
const TAG_STATS_V1_SIZE: usize = 56;
const _: () = assert!(std::mem::size_of::<tidepool_tag_stats>() >= TAG_STATS_V1_SIZE);

fn get_tag_stats(tag: *const c_char, device: c_int, out: *mut tidepool_tag_stats) -> Result<(), Failure> {
    let n = versioned_size(out, TAG_STATS_V1_SIZE, "tidepool_get_tag_stats")?;
    let name = named_tag(tag, "tidepool_get_tag_stats")?;
    let device = device_index(device).map_err(failure)?;
    let s = allocator_or_internal()?.tag_stats(&name, device).map_err(failure)?;
    let filled = tidepool_tag_stats {
        size: n as u32,
        version: TIDEPOOL_TAG_STATS_VERSION,
        allocated_bytes: s.allocated_bytes,
        reserved_bytes: s.reserved_bytes,
        paused_bytes: s.paused_bytes,
        offloaded_bytes: s.offloaded_bytes,
        num_allocations: s.allocations,
        paused: s.paused as u64,
    };
    // SAFETY: `n` is `versioned_size(out, ..)`'s.
    unsafe { copy_prefix(&filled, out, n) };
    Ok(())
}
