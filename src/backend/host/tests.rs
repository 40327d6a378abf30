//! The host backend's own tests: segments, injected failures, the shared
//! capacity, virtual memory and what the driver refuses, call counts.

use super::*;

#[test]
fn segments_are_distinct_writable_and_counted_against_capacity() {
    let backend = HostBackend::new(1, 8 << 20);
    let a = backend.allocate(0, 4 << 20, Stream::DEFAULT).unwrap();
    let b = backend.allocate(0, 4 << 20, Stream::DEFAULT).unwrap();
    assert_ne!(a, b);
    assert_eq!(backend.mem_info(0).unwrap(), MemInfo { free: 0, total: 8 << 20 });
    assert_eq!(backend.allocate(0, 512, Stream::DEFAULT), Err(BackendError::OutOfMemory));
    // SAFETY: `a` is a live 4 MiB read-write mapping made above.
    unsafe { std::ptr::write_bytes(a as *mut u8, 0xAB, 4 << 20) };
    backend.release(0, a, 4 << 20, Stream::DEFAULT).unwrap();
    backend.release(0, b, 4 << 20, Stream::DEFAULT).unwrap();
    assert_eq!(backend.mem_info(0).unwrap().free, 8 << 20);
}

#[test]
fn injected_failures_hit_the_nth_call_or_every_call() {
    let backend = HostBackend::new(1, 1 << 30);
    backend.faults().fail_nth_allocate(2);
    let a = backend.allocate(0, 1 << 20, Stream::DEFAULT).unwrap();
    assert_eq!(backend.allocate(0, 1 << 20, Stream::DEFAULT), Err(BackendError::OutOfMemory));
    let b = backend.allocate(0, 1 << 20, Stream::DEFAULT).unwrap();
    backend.faults().fail_every_allocate(true);
    backend.faults().set_kind(FaultKind::DriverError);
    assert!(matches!(backend.allocate(0, 1 << 20, Stream::DEFAULT), Err(BackendError::Driver { .. })));
    backend.faults().fail_nth_release(1);
    assert!(backend.release(0, a, 1 << 20, Stream::DEFAULT).is_err());
    backend.release(0, a, 1 << 20, Stream::DEFAULT).unwrap();
    backend.release(0, b, 1 << 20, Stream::DEFAULT).unwrap();
    assert_eq!(backend.mem_info(0).unwrap().free, 1 << 30);
}

#[test]
fn a_shared_capacity_is_counted_across_backends() {
    let scratch = tempfile::Builder::new().prefix("tidepool-shared-test-").tempdir().unwrap();
    let path = scratch.path().join("capacity");
    let a = HostBackend::shared(1, 8 << 20, &path).unwrap();
    let b = HostBackend::shared(1, 8 << 20, &path).unwrap();
    let x = a.allocate(0, 6 << 20, Stream::DEFAULT).unwrap();
    assert_eq!(b.mem_info(0).unwrap().free, 2 << 20, "b sees a's use");
    assert_eq!(b.allocate(0, 4 << 20, Stream::DEFAULT), Err(BackendError::OutOfMemory));
    a.release(0, x, 6 << 20, Stream::DEFAULT).unwrap();
    let y = b.allocate(0, 4 << 20, Stream::DEFAULT).unwrap();
    assert_eq!(a.mem_info(0).unwrap().free, 4 << 20);
    b.release(0, y, 4 << 20, Stream::DEFAULT).unwrap();
    assert_eq!(a.shared_device_key(0), b.shared_device_key(0));
    assert!(HostBackend::new(1, 1).shared_device_key(0).is_none());
}

#[test]
fn mapped_pages_are_writable_and_counted_and_unmapping_drops_them() {
    let backend = HostBackend::new(1, 4 * HOST_PAGE);
    let base = backend.vm_reserve(0, 64 * HOST_PAGE).unwrap();
    assert_eq!(base % HOST_PAGE, 0);
    assert_eq!(backend.mem_info(0).unwrap().free, 4 * HOST_PAGE, "a reservation costs no capacity");
    let page = base + 10 * HOST_PAGE;
    backend.vm_map(0, page, &[HOST_PAGE, HOST_PAGE]).unwrap();
    assert_eq!(backend.mem_info(0).unwrap().free, 2 * HOST_PAGE);
    // SAFETY: two pages mapped read-write just above.
    unsafe { std::ptr::write_bytes(page as *mut u8, 0xCD, 2 * HOST_PAGE as usize) };
    assert_eq!(backend.vm_map(0, base, &[HOST_PAGE; 3]), Err(BackendError::OutOfMemory), "over capacity");
    backend.vm_unmap(0, page, 2 * HOST_PAGE).unwrap();
    backend.vm_map(0, page, &[HOST_PAGE]).unwrap();
    // SAFETY: the page was mapped again just above.
    assert_eq!(unsafe { *(page as *const u8) }, 0, "a page mapped again starts fresh");
    backend.vm_unmap(0, page, HOST_PAGE).unwrap();
    backend.vm_free(0, base, 64 * HOST_PAGE).unwrap();
    assert_eq!(backend.mem_info(0).unwrap().free, 4 * HOST_PAGE);
    assert_eq!(backend.vm_calls(), (3, 2));
}

#[test]
fn an_unbacked_backend_checks_counts_and_claims_as_the_other_but_maps_nothing() {
    let backend = HostBackend::unbacked(1, 4 * HOST_PAGE);
    let a = backend.allocate(0, HOST_PAGE, Stream::DEFAULT).unwrap();
    let base = backend.vm_reserve(0, 64 * HOST_PAGE).unwrap();
    assert!(a >= UNBACKED_BASE && base >= a + HOST_PAGE && base.is_multiple_of(HOST_PAGE), "distinct, aligned: {a:#x} {base:#x}");
    backend.vm_map(0, base, &[2 * HOST_PAGE]).unwrap();
    assert_eq!(backend.mem_info(0).unwrap().free, HOST_PAGE, "claimed against the capacity");
    assert_eq!(backend.vm_map(0, base + 2 * HOST_PAGE, &[2 * HOST_PAGE]), Err(BackendError::OutOfMemory));
    assert!(backend.vm_unmap(0, base, HOST_PAGE).is_err(), "half of an allocation is refused, as the driver does");
    backend.vm_move(0, base, base + 8 * HOST_PAGE, 2 * HOST_PAGE).unwrap();
    let mut out = [0u8; 4];
    let err = backend.copy_to_host(0, base + 8 * HOST_PAGE, &mut out, Stream::DEFAULT).unwrap_err();
    assert!(err.to_string().contains("unbacked"), "{err}");
    assert!(backend.copy_to_device(0, a, &out, Stream::DEFAULT).is_err());
    backend.vm_unmap(0, base + 8 * HOST_PAGE, 2 * HOST_PAGE).unwrap();
    backend.vm_free(0, base, 64 * HOST_PAGE).unwrap();
    backend.release(0, a, HOST_PAGE, Stream::DEFAULT).unwrap();
    assert_eq!(backend.mem_info(0).unwrap().free, 4 * HOST_PAGE);
    let calls = backend.driver_calls();
    assert_eq!((calls.mem_alloc, calls.address_reserve, calls.create, calls.map, calls.unmap, calls.release), (1, 1, 2, 2, 2, 1));
}

#[test]
fn what_the_driver_refuses_is_refused_and_changes_nothing() {
    let backend = HostBackend::unbacked(1, 64 * HOST_PAGE);
    let a = backend.vm_reserve(0, 16 * HOST_PAGE).unwrap();
    let b = backend.vm_reserve(0, 16 * HOST_PAGE).unwrap();
    backend.vm_map(0, a, &[4 * HOST_PAGE, HOST_PAGE]).unwrap();
    let refused = |r: Result<(), BackendError>, says: &str| {
        let err = r.unwrap_err().to_string();
        assert!(err.contains(says), "{err}");
    };
    refused(backend.vm_map(0, a + 4 * HOST_PAGE, &[2 * HOST_PAGE]), "holds mapped pages");
    refused(backend.vm_map(0, a + 15 * HOST_PAGE, &[2 * HOST_PAGE]), "not whole pages of one reserved range");
    refused(backend.vm_map(0, a - 64 * HOST_PAGE, &[HOST_PAGE]), "not whole pages of one reserved range");
    refused(backend.vm_unmap(0, a, 2 * HOST_PAGE), "not whole allocations");
    refused(backend.vm_unmap(0, a + HOST_PAGE, 4 * HOST_PAGE), "not whole allocations");
    refused(backend.vm_unmap(0, a, 6 * HOST_PAGE), "not whole allocations");
    refused(backend.vm_unmap(0, a + 1, HOST_PAGE), "not whole pages");
    refused(backend.vm_move(0, a, a + 2 * HOST_PAGE, 4 * HOST_PAGE), "holds mapped pages");
    refused(backend.vm_move(0, a + HOST_PAGE, b, 4 * HOST_PAGE), "not whole allocations");
    refused(backend.vm_free(0, a, 16 * HOST_PAGE), "still has");
    refused(backend.vm_free(0, a + HOST_PAGE, 15 * HOST_PAGE), "no range");
    assert_eq!(backend.mem_info(0).unwrap().free, 59 * HOST_PAGE, "nothing claimed or given back");
    let before = backend.driver_calls();
    // Both allocations move to the other range in one call, then go back
    // whole: two unmaps, two maps, one grant; two unmaps and releases.
    backend.vm_move(0, a, b + 8 * HOST_PAGE, 5 * HOST_PAGE).unwrap();
    refused(backend.vm_unmap(0, b + 8 * HOST_PAGE, 2 * HOST_PAGE), "not whole allocations");
    backend.vm_unmap(0, b + 8 * HOST_PAGE, 5 * HOST_PAGE).unwrap();
    let after = backend.driver_calls();
    assert_eq!((after.unmap - before.unmap, after.map - before.map, after.set_access - before.set_access), (4, 2, 1));
    assert_eq!(after.release - before.release, 2);
    backend.vm_free(0, a, 16 * HOST_PAGE).unwrap();
    backend.vm_free(0, b, 16 * HOST_PAGE).unwrap();
    assert_eq!(backend.mem_info(0).unwrap().free, 64 * HOST_PAGE);
}

#[test]
fn driver_calls_are_counted_on_the_device_they_are_made_on() {
    let backend = HostBackend::new(2, 16 * HOST_PAGE);
    let a = backend.allocate(1, HOST_PAGE, Stream::DEFAULT).unwrap();
    let base = backend.vm_reserve(1, 8 * HOST_PAGE).unwrap();
    backend.vm_map(1, base, &[HOST_PAGE, 2 * HOST_PAGE]).unwrap();
    backend.faults().fail_nth_allocate(1);
    assert!(backend.allocate(1, HOST_PAGE, Stream::DEFAULT).is_err(), "a failed call counts too");
    assert!(backend.allocate(2, HOST_PAGE, Stream::DEFAULT).is_err(), "no device 2: no call made");
    // Device 1: alloc, failed alloc, reserve, 2 creates, 2 maps, 1 grant.
    assert_eq!((backend.driver_calls_on(0), backend.driver_calls_on(1), backend.driver_calls_on(2)), (0, 8, 0));
    let b = backend.allocate(0, HOST_PAGE, Stream::DEFAULT).unwrap();
    backend.release(0, b, HOST_PAGE, Stream::DEFAULT).unwrap();
    backend.vm_unmap(1, base, 3 * HOST_PAGE).unwrap();
    backend.vm_free(1, base, 8 * HOST_PAGE).unwrap();
    backend.release(1, a, HOST_PAGE, Stream::DEFAULT).unwrap();
    let (zero, one) = (backend.device_driver_calls(0), backend.device_driver_calls(1));
    assert_eq!((zero.total(), one.total()), (2, 14), "{zero:?} {one:?}");
    assert_eq!((one.mem_alloc, one.mem_free, one.unmap, one.release, one.address_free), (2, 1, 2, 2, 1));
    assert_eq!(backend.driver_calls().total(), 16, "all devices together, as a replay counts them");
}

#[test]
fn a_missing_device_is_an_error_not_a_panic() {
    let backend = HostBackend::new(2, 1 << 30);
    assert!(matches!(backend.allocate(2, 512, Stream::DEFAULT), Err(BackendError::Driver { code: 101, .. })));
    assert!(backend.mem_info(7).is_err());
}
