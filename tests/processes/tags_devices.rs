//! Pause and resume across processes and on the cuda backend over simgpu:
//! a second process allocates the memory a paused tag gave back, and the
//! first resumes once the second frees it (cooperation asks for it); a
//! pause waits for the work queued on the tag's streams before it copies
//! (pinned host memory from cuMemHostAlloc, all of it freed at resume),
//! and is refused while that stream is being captured into a CUDA graph;
//! a discarding pause of 1,000 blocks makes one driver call per run of
//! pages, not per block.

use crate::common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::simgpu::Simgpu;
use common::{check, conf_allocator, fill, host_allocator, MIB};
use tidepool::tag::region;
use tidepool::{AllocError, DevicePtr, Stream};

const S: Stream = Stream::DEFAULT;

/// Process B: runs only when spawned by the test below. Takes 700 MiB of
/// the 1 GiB device (there only because A's tag is paused), holds it until
/// A has tried to resume, then frees it into its cache.
#[test]
#[ignore = "child process: run by a_second_process_uses_the_memory_of_a_paused_tag_and_the_first_resumes_once_it_is_freed"]
fn process_b_takes_the_paused_memory() {
    let (Ok(conf), Ok(dir)) = (std::env::var("TIDEPOOL_TEST_TAGS_CONF"), std::env::var("TIDEPOOL_TEST_TAGS_DIR")) else {
        panic!("a child-process test: its parent test sets TIDEPOOL_TEST_TAGS_CONF and TIDEPOOL_TEST_TAGS_DIR");
    };
    let dir = PathBuf::from(dir);
    let alloc = conf_allocator(&conf);
    let p = alloc.allocate(0, (700 * MIB) as usize, S).expect("the paused tag's memory is free for another process");
    std::fs::write(dir.join("b-holds"), b"").unwrap();
    assert!(common::wait_for_file(&dir.join("a-tried"), Duration::from_secs(30)));
    alloc.free(0, p).unwrap(); // cached: B's reclaimer gives it back when A asks

    // A asks only once the registry shows B's cache (B's next reclaimer pass).
    let registry = dir.join("registry");
    let start = Instant::now();
    while !tidepool::registry::scan(&registry)
        .registries
        .iter()
        .flat_map(|r| &r.entries)
        .any(|e| e.pid == std::process::id() && e.cached_free > 0)
    {
        assert!(start.elapsed() < Duration::from_secs(10), "B's cache was never published");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::fs::write(dir.join("b-freed"), b"").unwrap();
    assert!(common::wait_for_file(&dir.join("done"), Duration::from_secs(30)));
    println!("b: served {}", alloc.stats(0).unwrap().events.num_coop_served);
}

#[test]
fn a_second_process_uses_the_memory_of_a_paused_tag_and_the_first_resumes_once_it_is_freed() {
    let scratch = common::scratch_dir("tags-coop");
    let dir = scratch.path();
    let conf = format!(
        "backend:host,host_shared:{},registry_dir:{},host_capacity_mb:1024,release_after_ms:off,headroom_mb:0,\
         reclaim_interval_ms:20,cooperative:true,oom_wait_ms:5000",
        dir.join("capacity").display(),
        dir.join("registry").display()
    );
    let alloc = conf_allocator(&conf);
    let blocks: Vec<(DevicePtr, u64)> = {
        let _r = region("i13-coop").unwrap();
        [200, 200, 200].iter().map(|&m| (alloc.allocate(0, (m * MIB) as usize, S).unwrap(), m * MIB)).collect()
    };
    for (i, &(p, size)) in blocks.iter().enumerate() {
        fill(p, size, i as u64);
    }
    let free_before = alloc.backend().mem_info(0).unwrap().free;
    let reserved = alloc.tag_stats("i13-coop", 0).unwrap().reserved_bytes;
    alloc.pause("i13-coop", Some(0), true).unwrap();
    assert_eq!(alloc.backend().mem_info(0).unwrap().free, free_before + reserved, "every process sees the memory free");

    let env = [("TIDEPOOL_TEST_TAGS_CONF", conf.clone()), ("TIDEPOOL_TEST_TAGS_DIR", dir.display().to_string())];
    let b = common::spawn_child("process_b_takes_the_paused_memory", &env);
    assert!(common::wait_for_file(&dir.join("b-holds"), Duration::from_secs(30)), "process B did not get the memory");
    // B's memory is live: asking B gives nothing, and the resume fails whole.
    let err = alloc.resume("i13-coop", Some(0)).unwrap_err();
    assert!(matches!(err, AllocError::OutOfMemory(_)), "{err}");
    assert!(alloc.tag_stats("i13-coop", 0).unwrap().paused, "still paused");
    alloc.validate().unwrap();
    std::fs::write(dir.join("a-tried"), b"").unwrap();
    assert!(common::wait_for_file(&dir.join("b-freed"), Duration::from_secs(30)));
    // B now only caches it: A's request makes B's reclaimer give it back.
    alloc.resume("i13-coop", Some(0)).unwrap();
    for (i, &(p, size)) in blocks.iter().enumerate() {
        assert_eq!(check(p, size, i as u64), Ok(()), "block {i} restored");
    }
    assert!(alloc.stats(0).unwrap().events.num_coop_satisfied >= 1);
    std::fs::write(dir.join("done"), b"").unwrap();
    let out = b.wait_with_output().unwrap();
    assert!(out.status.success(), "process B failed: {out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("b: served 1"), "{}", String::from_utf8_lossy(&out.stdout));
    for (p, _) in blocks {
        alloc.free(0, p).unwrap();
    }
    alloc.validate().unwrap();
}

#[test]
fn a_discarding_pause_makes_one_call_per_run_of_pages_not_per_block() {
    let (alloc, backend) = host_allocator(1, 4 << 30, "");
    let blocks: Vec<DevicePtr> = {
        let _r = region("i13-calls").unwrap();
        (0..1000).map(|i| alloc.allocate(0, if i % 2 == 0 { 100 << 10 } else { 2 << 20 }, S).unwrap()).collect()
    };
    let (maps, unmaps) = backend.vm_calls();
    alloc.pause("i13-calls", None, false).unwrap();
    let (maps_paused, unmaps_paused) = backend.vm_calls();
    assert_eq!(maps_paused, maps);
    assert!(unmaps_paused - unmaps <= 2, "one unmap per range's run of pages: {}", unmaps_paused - unmaps);
    alloc.resume("i13-calls", None).unwrap();
    let (maps_resumed, _) = backend.vm_calls();
    assert!(maps_resumed - maps <= 2, "one map per run of pages: {}", maps_resumed - maps);
    for p in blocks {
        alloc.free(0, p).unwrap();
    }
    alloc.validate().unwrap();
}

/// The child side over simgpu: a fill queued behind a sleep on the block's
/// stream must land before the pause copies the block out.
#[test]
#[ignore = "child process: run by a_pause_waits_for_the_work_queued_on_the_tags_streams_over_simgpu"]
fn child_pause_waits_for_the_streams_work() {
    common::child_only();
    let alloc = conf_allocator("backend:cuda,release_after_ms:off,headroom_mb:0");
    let sim = Simgpu::load();
    let mut stream = 0u64;
    // SAFETY: simgpu writes a new stream handle into a local.
    assert_eq!(unsafe { (sim.stream_create)(&mut stream, 0) }, 0);
    let size = 4 * MIB as usize;
    let p = {
        let _r = region("i13-stream").unwrap();
        alloc.allocate(0, size, Stream(stream)).unwrap()
    };
    // A capture on the tag's stream (no private pool open: a raw CUDA graph
    // capture) refuses the pause, and nothing changes.
    // SAFETY: simgpu marks the stream it made as capturing.
    assert_eq!(unsafe { (sim.set_capturing)(stream, 1) }, 0);
    let err = alloc.pause("i13-stream", Some(0), true).unwrap_err();
    assert!(matches!(&err, AllocError::Tag(m) if m.to_string().contains("captured into a CUDA graph")), "{err}");
    assert!(!alloc.tag_stats("i13-stream", 0).unwrap().paused);
    // SAFETY: as above, the capture ends.
    assert_eq!(unsafe { (sim.set_capturing)(stream, 0) }, 0);
    // SAFETY: plain calls into simgpu on a live block of `size` bytes.
    unsafe {
        assert_eq!((sim.enqueue_sleep)(stream, 200_000), 0);
        assert_eq!((sim.enqueue_fill)(stream, p.0, size, 0x77, 0), 0);
    }
    let reserved = alloc.tag_stats("i13-stream", 0).unwrap().reserved_bytes;
    let free_before = alloc.backend().mem_info(0).unwrap().free;
    alloc.pause("i13-stream", Some(0), true).unwrap();
    assert_eq!(alloc.backend().mem_info(0).unwrap().free, free_before + reserved, "cuMemGetInfo sees the tag's memory free");
    let mut live = 0i64;
    // SAFETY: simgpu writes one count into a local.
    let calls = unsafe { (sim.host_allocs)(&mut live) };
    assert!(calls >= 1 && live >= 1, "the offload is pinned host memory: {calls} calls, {live} live");
    alloc.resume("i13-stream", Some(0)).unwrap();
    // SAFETY: as above.
    unsafe { (sim.host_allocs)(&mut live) };
    assert_eq!(live, 0, "the pinned memory goes at resume");
    let mut back = vec![0u8; size];
    alloc.backend().copy_to_host(0, p.0, &mut back, Stream(stream)).unwrap();
    assert!(back.iter().all(|&b| b == 0x77), "the queued fill ran before the copy");
    alloc.free_on_stream(0, p, Stream(stream)).unwrap();
    alloc.validate().unwrap();
    println!("child: stream work waited for");
}

/// Runs the child test `name` over simgpu with `env` and asserts that it
/// passed and printed `expected`.
fn child_on_simgpu(name: &str, env: &[(&str, &str)], expected: &str) {
    let mut command = common::child_command(name);
    command.env("LD_LIBRARY_PATH", common::simgpu_dir()).envs(env.iter().copied());
    let (ok, text) = common::child_output(&mut command);
    assert!(ok && text.contains(expected), "{name}: {expected:?} not printed:\n{text}");
}

#[test]
fn a_pause_waits_for_the_work_queued_on_the_tags_streams_over_simgpu() {
    child_on_simgpu("child_pause_waits_for_the_streams_work", &[("SIMGPU_CAPACITY", "256M")], "child: stream work waited for");
}

/// The child side over simgpu failing every third `cuMemUnmap`: a tag
/// paused and resumed again and again keeps every live block mapped and
/// every byte (a run the driver would not unmap keeps its contents in
/// place; one it unmapped comes back from host memory).
#[test]
#[ignore = "child process: run by pauses_and_resumes_with_unmaps_failing_keep_every_byte_over_simgpu"]
fn child_pause_resume_with_failing_unmaps() {
    common::child_only();
    let alloc = conf_allocator("backend:cuda,release_after_ms:off,headroom_mb:0");
    let sim = Simgpu::load();
    let mut stream = 0u64;
    // SAFETY: simgpu writes a new stream handle into a local.
    assert_eq!(unsafe { (sim.stream_create)(&mut stream, 0) }, 0);
    let sizes = [6 * MIB, 3 * MIB, 8 * MIB, MIB / 2, 5 * MIB];
    let blocks: Vec<(DevicePtr, usize)> = {
        let _r = region("flaky").unwrap();
        sizes.iter().map(|&size| (alloc.allocate(0, size as usize, Stream(stream)).unwrap(), size as usize)).collect()
    };
    // Holes between live blocks: runs of pages of several shapes.
    alloc.free_on_stream(0, blocks[1].0, Stream(stream)).unwrap();
    let live: Vec<(DevicePtr, usize)> = blocks.iter().enumerate().filter(|&(i, _)| i != 1).map(|(_, &b)| b).collect();
    for round in 0..12u8 {
        for (i, &(p, size)) in live.iter().enumerate() {
            // SAFETY: stream-ordered writes to live blocks of their sizes.
            unsafe { assert_eq!((sim.enqueue_fill)(stream, p.0, size, round.wrapping_mul(7).wrapping_add(i as u8), 0), 0) };
        }
        // SAFETY: waits for the stream's work.
        unsafe { (sim.stream_synchronize)(stream) };
        if alloc.pause("flaky", Some(0), true).is_ok() {
            alloc.validate().unwrap();
            // A failed resume (its undo refused too) is tried again.
            while alloc.resume("flaky", Some(0)).is_err() {
                alloc.validate().unwrap();
            }
        }
        alloc.validate().unwrap();
        for (i, &(p, size)) in live.iter().enumerate() {
            let mut back = vec![0u8; size];
            alloc.backend().copy_to_host(0, p.0, &mut back, Stream(stream)).unwrap();
            let want = round.wrapping_mul(7).wrapping_add(i as u8);
            assert!(back.iter().all(|&b| b == want), "round {round}: block {i} lost its bytes");
        }
    }
    for (p, _) in live {
        alloc.free_on_stream(0, p, Stream(stream)).unwrap();
    }
    alloc.validate().unwrap();
    println!("child: every byte kept");
}

#[test]
fn pauses_and_resumes_with_unmaps_failing_keep_every_byte_over_simgpu() {
    let env = [("SIMGPU_CAPACITY", "256M"), ("SIMGPU_FAIL_UNMAP_EVERY", "3")];
    child_on_simgpu("child_pause_resume_with_failing_unmaps", &env, "child: every byte kept");
}

/// The child side over simgpu: a paused tag's block freed while another
/// stream still uses it waits on its event; a resume that finds the device
/// full of other cache releases it (which completes that free, merging the
/// tag's free blocks) and maps again.
#[test]
#[ignore = "child process: run by a_resume_that_must_release_cache_first_survives_a_free_completing_meanwhile"]
fn child_resume_after_a_pending_free() {
    common::child_only();
    let alloc = conf_allocator("backend:cuda,release_after_ms:off,headroom_mb:0,oom_wait_ms:0");
    let sim = Simgpu::load();
    let (mut one, mut two) = (0u64, 0u64);
    // SAFETY: simgpu writes new stream handles into locals.
    unsafe { assert_eq!((sim.stream_create)(&mut one, 0) | (sim.stream_create)(&mut two, 0), 0) };
    let size = (8 * MIB) as usize;
    let (kept, used_elsewhere) = {
        let _r = region("pending").unwrap();
        (alloc.allocate(0, size, Stream(one)).unwrap(), alloc.allocate(0, size, Stream(one)).unwrap())
    };
    // SAFETY: stream-ordered work on live blocks.
    unsafe { assert_eq!((sim.enqueue_fill)(one, kept.0, size, 0x5a, 0), 0) };
    alloc.record_stream(used_elsewhere, Stream(two)).unwrap();
    alloc.pause("pending", Some(0), true).unwrap();
    // The device fills with other cache.
    let others: Vec<_> = std::iter::from_fn(|| alloc.allocate(0, (4 * MIB) as usize, Stream(one)).ok()).take(64).collect();
    for p in others {
        alloc.free_on_stream(0, p, Stream(one)).unwrap();
    }
    // Stream two is busy for a while: the free waits on its event, and
    // still waits when the resume starts.
    // SAFETY: as above.
    unsafe { assert_eq!((sim.enqueue_sleep)(two, 300_000), 0) };
    alloc.free_on_stream(0, used_elsewhere, Stream(one)).unwrap();
    alloc.validate().unwrap();
    let retries = alloc.stats(0).unwrap().events.num_alloc_retries;
    alloc.resume("pending", Some(0)).unwrap();
    assert_eq!(alloc.stats(0).unwrap().events.num_alloc_retries, retries + 1, "the resume released the cache and retried");
    alloc.validate().unwrap();
    let mut back = vec![0u8; size];
    alloc.backend().copy_to_host(0, kept.0, &mut back, Stream(one)).unwrap();
    assert!(back.iter().all(|&b| b == 0x5a), "the kept block's bytes came back");
    // The heap still serves and frees correctly.
    let again = alloc.allocate(0, size, Stream(one)).unwrap();
    alloc.free_on_stream(0, again, Stream(one)).unwrap();
    alloc.free_on_stream(0, kept, Stream(one)).unwrap();
    alloc.validate().unwrap();
    println!("child: resumed after the pending free");
}

#[test]
fn a_resume_that_must_release_cache_first_survives_a_free_completing_meanwhile() {
    child_on_simgpu("child_resume_after_a_pending_free", &[("SIMGPU_CAPACITY", "64M")], "child: resumed after the pending free");
}

/// The child side over simgpu: with two shards, a pause without offload
/// that one shard must refuse (a stream that used the tag is being
/// captured) is refused before any shard gives its pages back, so every
/// block keeps its bytes.
#[test]
#[ignore = "child process: run by a_pause_refused_on_one_shard_discards_nothing_on_the_others"]
fn child_refused_pause_across_shards() {
    common::child_only();
    let alloc = conf_allocator("backend:cuda,release_after_ms:off,headroom_mb:0,stream_shards:2");
    let sim = Simgpu::load();
    let streams: Vec<u64> = (0..4).map(|_| sim.stream()).collect();
    let size = 4 * MIB as usize;
    let blocks: Vec<DevicePtr> = {
        let _r = region("shards").unwrap();
        streams.iter().map(|&s| alloc.allocate(0, size, Stream(s)).unwrap()).collect()
    };
    for (i, (&p, &s)) in blocks.iter().zip(&streams).enumerate() {
        // SAFETY: stream-ordered writes to live blocks of `size` bytes.
        unsafe {
            assert_eq!((sim.enqueue_fill)(s, p.0, size, 0x30 + i as u8, 0), 0);
            (sim.stream_synchronize)(s);
        }
    }
    // Whichever shard the captured stream is on, no shard pauses.
    for &captured in &streams {
        // SAFETY: simgpu marks a stream it made as capturing, then not.
        assert_eq!(unsafe { (sim.set_capturing)(captured, 1) }, 0);
        let err = alloc.pause("shards", Some(0), false).unwrap_err();
        assert!(matches!(&err, AllocError::Tag(m) if m.to_string().contains("captured")), "{err}");
        // SAFETY: as above.
        assert_eq!(unsafe { (sim.set_capturing)(captured, 0) }, 0);
        assert!(!alloc.tag_stats("shards", 0).unwrap().paused);
        for (i, (&p, &s)) in blocks.iter().zip(&streams).enumerate() {
            let mut back = vec![0u8; size];
            alloc.backend().copy_to_host(0, p.0, &mut back, Stream(s)).unwrap();
            assert!(back.iter().all(|&b| b == 0x30 + i as u8), "block {i} lost its bytes");
        }
    }
    for (&p, &s) in blocks.iter().zip(&streams) {
        alloc.free_on_stream(0, p, Stream(s)).unwrap();
    }
    alloc.validate().unwrap();
    println!("child: nothing discarded");
}

#[test]
fn a_pause_refused_on_one_shard_discards_nothing_on_the_others() {
    child_on_simgpu("child_refused_pause_across_shards", &[("SIMGPU_CAPACITY", "256M")], "child: nothing discarded");
}

/// The child side: `cuda_async` maps no pages, so a tagged allocation is a
/// clear error (and nothing is allocated), while untagged ones go on.
#[test]
#[ignore = "child process: run by tags_on_the_cuda_async_backend_are_a_clear_error"]
fn child_tags_need_virtual_memory() {
    common::child_only();
    let alloc = conf_allocator("backend:cuda_async,release_after_ms:off,headroom_mb:0");
    let err = {
        let _r = region("i13-async").unwrap();
        alloc.allocate(0, 4096, S).unwrap_err()
    };
    assert!(matches!(&err, AllocError::InvalidArgument(m) if m.to_string().contains("virtual memory")), "{err}");
    assert_eq!(alloc.stats(0).unwrap().allocated_bytes.all.current, 0);
    let p = alloc.allocate(0, 4096, S).unwrap();
    alloc.free(0, p).unwrap();
    println!("child: tags refused on cuda_async");
}

#[test]
fn tags_on_the_cuda_async_backend_are_a_clear_error() {
    child_on_simgpu("child_tags_need_virtual_memory", &[], "child: tags refused on cuda_async");
}
