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

/// tests/c/fork_test.c, built against the cdylib, run with `conf`: 1,000
/// forks while three threads allocate, free and read statistics and a
/// fourth starts and ends threads that use tidepool; every child
/// allocates, frees, reads exact figures, empties its cache and leaves,
/// half with exit(0), half with _exit(0), under an alarm.
fn fork_while_threads_allocate(conf: &str) {
    let flags = ["-std=c11", "-D_DEFAULT_SOURCE", "-Wall", "-Wextra", "-Werror", "-O1", "-pthread"];
    let name = format!("fork_test{}", conf.replace([':', ','], "_"));
    let program = common::build_against_cdylib("cc", &flags, &["tests/c/fork_test.c"], &name);
    let output = common::contained(&mut std::process::Command::new(&program))
        .args(["1000", "3"])
        .env("TIDEPOOL_CONF", format!("backend:host,host_capacity_mb:4096,{conf}"))
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success() && text.contains("fork_test: 1000 forks, 0 hangs, 0 failures"), "{conf}:\n{text}");
}

#[test]
fn forks_while_threads_allocate_leave_children_that_work_and_exit() {
    fork_while_threads_allocate("");
}

#[test]
fn forks_while_threads_allocate_without_thread_caches() {
    fork_while_threads_allocate("thread_cache_blocks:0");
}

#[test]
fn forks_while_threads_allocate_with_expandable_segments() {
    fork_while_threads_allocate("expandable:true");
}

#[test]
fn forks_while_threads_allocate_with_expandable_segments_without_thread_caches() {
    fork_while_threads_allocate("expandable:true,thread_cache_blocks:0");
}

#[test]
fn forks_from_a_rust_program_whose_threads_allocate_leave_children_that_exit() {
    let (ok, text) = common::child_output(&mut common::child_command("child_forks_while_threads_allocate"));
    assert!(ok, "{text}");
}

/// A Rust program's own allocator (thread caches on), three threads
/// allocating through it, the forking thread too (its cache is inherited):
/// 200 forks; each child is refused the parent's allocator, makes its own,
/// uses it and leaves with exit(0) (thread-local destructors run: the
/// inherited cache must not wait for the parent's heap) or _exit(0).
#[test]
#[ignore = "child process: run by forks_from_a_rust_program_whose_threads_allocate_leave_children_that_exit"]
fn child_forks_while_threads_allocate() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    common::child_only();
    let (alloc, _) = host_allocator(1, 1 << 30, "release_after_ms:100,reclaim_interval_ms:10");
    let alloc = Arc::new(alloc);
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..3u64)
        .map(|i| {
            let (alloc, stop) = (alloc.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let p = alloc.allocate(0, 512 << i, Stream(i)).unwrap();
                    let q = alloc.allocate(0, (2 * MIB) as usize, Stream(i)).unwrap();
                    alloc.free_on_stream(0, p, Stream(i)).unwrap();
                    alloc.free_on_stream(0, q, Stream(i)).unwrap();
                    alloc.stats(0).unwrap();
                }
            })
        })
        .collect();
    for round in 0..200 {
        // The forking thread's own cache holds a block at every fork.
        let mine = alloc.allocate(0, 4096, Stream::DEFAULT).unwrap();
        alloc.free(0, mine).unwrap();
        // SAFETY: the child only allocates through tidepool and malloc
        // (glibc makes its own locks safe in the child) and leaves with
        // exit or _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // SAFETY: an alarm kills the child if it hangs.
            unsafe { libc::alarm(20) };
            let code = (|| {
                if !matches!(alloc.allocate(0, 4096, Stream::DEFAULT), Err(AllocError::Forked { .. })) {
                    return 2;
                }
                let (own, _) = host_allocator(1, 1 << 30, "");
                let Ok(p) = own.allocate(0, 4096, Stream::DEFAULT) else { return 3 };
                let Ok(q) = own.allocate(0, (3 * MIB) as usize, Stream::DEFAULT) else { return 4 };
                if own.stats(0).map(|s| s.allocated_bytes.all.current).ok() != Some(4096 + 3 * MIB) {
                    return 5;
                }
                if own.free(0, p).is_err() || own.free(0, q).is_err() || own.validate().is_err() {
                    return 6;
                }
                own.empty_cache();
                if own.stats(0).map(|s| s.reserved_bytes.all.current).ok() != Some(0) {
                    return 7;
                }
                0
            })();
            // SAFETY: leaves the child; exit runs atexit handlers and this
            // thread's thread-local destructors, _exit nothing.
            unsafe {
                if round % 2 == 0 {
                    libc::exit(code)
                }
                libc::_exit(code)
            }
        }
        let mut status = 0;
        // SAFETY: waits for the child made above.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "child {round} ({}): status {status:#x} (SIGALRM {}: it hung)",
            if round % 2 == 0 { "exit" } else { "_exit" },
            libc::SIGALRM
        );
    }
    stop.store(true, Ordering::Relaxed);
    workers.into_iter().for_each(|w| w.join().unwrap());
    alloc.validate().unwrap();
    assert_eq!(alloc.stats(0).unwrap().allocated_bytes.all.current, 0);
}
