//! fork(): a child neither inherits a lock a dead thread held nor touches its
//! parent's heaps; it makes an allocator of its own, and both go on.

use crate::common;

use std::time::{Duration, Instant};

use common::{host_allocator, MIB};
use tidepool::{AllocError, Stream};

/// Forks in a process of its own: other tests' threads (this binary runs
/// several at once) must not hold a lock when the fork happens.
#[test]
fn a_forked_child_refuses_the_parents_allocator_and_works_with_its_own() {
    let (ok, text) = common::child_output(&mut common::child_command("child_forks"));
    assert!(ok, "{text}");
}

#[test]
#[ignore = "child process: run by a_forked_child_refuses_the_parents_allocator_and_works_with_its_own"]
fn child_forks() {
    common::child_only();
    // A reclaimer thread runs in the parent: it will not exist in the child.
    let (alloc, _) = host_allocator(1, 1 << 30, "release_after_ms:100,reclaim_interval_ms:10");
    let parents = alloc.allocate(0, (3 * MIB) as usize, Stream::DEFAULT).unwrap();
    // SAFETY: the child below only allocates through tidepool and malloc
    // (glibc resets its own locks in the child) and leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = (|| {
            match alloc.allocate(0, 4096, Stream::DEFAULT) {
                Err(AllocError::Forked { .. }) => {}
                _ => return 2,
            }
            if alloc.free(0, parents).is_ok() || alloc.stats(0).is_ok() {
                return 3;
            }
            let (own, _) = host_allocator(1, 1 << 30, "release_after_ms:100,reclaim_interval_ms:10");
            let Ok(p) = own.allocate(0, (5 * MIB) as usize, Stream::DEFAULT) else { return 4 };
            if own.free(0, p).is_err() || own.validate().is_err() {
                return 5;
            }
            let start = Instant::now();
            drop(own);
            drop(alloc); // the parent's: must not wait for its (absent) reclaimer
            if start.elapsed() > Duration::from_secs(1) {
                return 6;
            }
            0
        })();
        // SAFETY: leaves the child at once, running no destructors or exit handlers.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for the child made above.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(libc::WIFEXITED(status), "child did not exit normally");
    assert_eq!(libc::WEXITSTATUS(status), 0, "child failed its check {}", libc::WEXITSTATUS(status));
    // The parent goes on as before.
    alloc.free(0, parents).unwrap();
    alloc.validate().unwrap();
    assert_eq!(alloc.stats(0).unwrap().allocated_bytes.all.current, 0);
}
