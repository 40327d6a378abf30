/* The C ABI exercised from C, on the host backend: normal use, every bad
 * input the ABI handles, 16 threads at once, fork, resetting statistics,
 * OOM observers and allocation contexts. Run by tests/cabi/c.rs; prints
 * "ffi_test: N passed, 0 failed" and exits 0. */
#include "tidepool.h"

#define TEST_NAME "ffi_test"
#include "check.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static tidepool_stats stats_of(int device) {
    tidepool_stats s;
    memset(&s, 0, sizeof s);
    s.size = sizeof s;
    int rc = tidepool_get_stats(device, &s);
    CHECK(rc == TIDEPOOL_OK, "tidepool_get_stats returned %d", rc);
    return s;
}

static const char* last_error(void) {
    static char buf[1024];
    tidepool_last_error(buf, sizeof buf);
    return buf;
}

static void basic_use(void) {
    char* p = tidepool_malloc(1000, 0, NULL);
    CHECK(p != NULL, "malloc(1000): %s", last_error());
    CHECK(((uintptr_t)p) % 512 == 0, "pointer %p not 512-aligned", (void*)p);
    memset(p, 0xAB, 1000); /* host backend: real memory */
    tidepool_stats s = stats_of(0);
    CHECK(s.version == TIDEPOOL_STATS_VERSION && s.size == sizeof s, "version %u size %u", s.version, s.size);
    CHECK(s.allocated_bytes == 1024 && s.requested_bytes == 1000, "allocated %llu requested %llu",
          (unsigned long long)s.allocated_bytes, (unsigned long long)s.requested_bytes);
    CHECK(s.reserved_bytes == 2 * MIB, "reserved %llu", (unsigned long long)s.reserved_bytes);
    /* gauges[4] is allocated_bytes, as torch.cuda.memory_stats names it */
    CHECK(s.gauges[4].all.current == 1024 && s.gauges[4].small_pool.current == 1024, "gauges");
    /* The driver calls that page cost: with expandable segments (the
     * default here) a range reserved, then the page created, mapped and
     * opened; with whole segments, the segment's allocation. */
    uint64_t first_calls = s.num_pages_mapped > 0 ? 4 : s.num_device_allocs;
    CHECK(s.num_driver_calls == first_calls, "driver calls %llu (pages %llu)", (unsigned long long)s.num_driver_calls,
          (unsigned long long)s.num_pages_mapped);
    tidepool_free(p, 1000, 0, NULL);
    s = stats_of(0);
    CHECK(s.allocated_bytes == 0 && s.num_frees == 1 && s.num_allocs == 1, "after free");
    /* Served from the cache: no driver call. */
    void* again = tidepool_malloc(1000, 0, NULL);
    tidepool_free(again, 1000, 0, NULL);
    CHECK(stats_of(0).num_driver_calls == first_calls, "the cache serves it: %llu driver calls",
          (unsigned long long)stats_of(0).num_driver_calls);
    CHECK(tidepool_malloc(0, 0, NULL) == NULL, "size 0 gives NULL");
    tidepool_empty_cache();
    s = stats_of(0);
    CHECK(s.reserved_bytes == 0, "empty_cache releases the segment");
    /* Given back: the page unmapped and released (the range stays
     * reserved), or the segment freed. */
    CHECK(s.num_driver_calls == first_calls + (s.num_pages_unmapped > 0 ? 2 : s.num_device_frees), "driver calls after empty_cache: %llu",
          (unsigned long long)s.num_driver_calls);
    CHECK(s.released_empty_cache_bytes == 2 * MIB, "counted as released by empty_cache");
    /* A caller built against version 1 of the struct gets its prefix. */
    tidepool_stats v1;
    memset(&v1, 0xEE, sizeof v1);
    v1.size = 1040;
    CHECK(tidepool_get_stats(0, &v1) == TIDEPOOL_OK && v1.size == 1040 && v1.version == TIDEPOOL_STATS_VERSION, "v1 caller");
    CHECK(v1.num_reclaims == 0xEEEEEEEEEEEEEEEEull, "nothing written past the caller's size");
    /* And one built against version 4 (up to offloaded_bytes) gets version 4's fields. */
    tidepool_stats v4;
    memset(&v4, 0xEE, sizeof v4);
    v4.size = (uint32_t)offsetof(tidepool_stats, coop_last_wait_ms);
    CHECK(v4.size == 1152, "version 4 is 1152 bytes, not %u", v4.size);
    CHECK(tidepool_get_stats(0, &v4) == TIDEPOOL_OK && v4.size == 1152 && v4.version == TIDEPOOL_STATS_VERSION, "v4 caller");
    CHECK(v4.released_empty_cache_bytes == 2 * MIB && v4.offloaded_bytes == 0, "v4 fields filled");
    CHECK(v4.coop_last_wait_ms == 0xEEEEEEEEEEEEEEEEull && v4.num_cross_stream_reuses == 0xEEEEEEEEEEEEEEEEull,
          "version 5's fields not written for a version 4 caller");
    CHECK(s.num_stream_sync_errors == 0 && s.num_cross_stream_reuses == 0 && s.coop_last_wait_ms == 0, "version 5 counters");
    /* One built against version 5 (up to num_cross_stream_reuses) gets no version 6 field. */
    tidepool_stats v5;
    memset(&v5, 0xEE, sizeof v5);
    v5.size = (uint32_t)offsetof(tidepool_stats, has_reserved_limit);
    CHECK(tidepool_get_stats(0, &v5) == TIDEPOOL_OK && v5.size == 1176 && v5.has_reserved_limit == 0xEEEEEEEEEEEEEEEEull, "v5 caller");
    /* And one built against version 6 (up to has_reserved_limit) gets no version 7 field. */
    tidepool_stats v6;
    memset(&v6, 0xEE, sizeof v6);
    v6.size = (uint32_t)offsetof(tidepool_stats, num_driver_calls);
    CHECK(tidepool_get_stats(0, &v6) == TIDEPOOL_OK && v6.size == 1184 && v6.has_reserved_limit == 0, "v6 caller");
    CHECK(v6.num_driver_calls == 0xEEEEEEEEEEEEEEEEull, "version 7's field not written for a version 6 caller");
    CHECK(sizeof(tidepool_stats) == 1192 && s.version == 7, "version 7 is 1192 bytes");
}

static void bad_input(void) {
    /* Free of a pointer tidepool never returned. */
    tidepool_free((void*)0x1000, 16, 0, NULL);
    CHECK(stats_of(0).num_invalid_frees == 1, "foreign free counted");
    CHECK(strstr(last_error(), "never allocated") != NULL, "last error: %s", last_error());
    /* Double free. */
    void* p = tidepool_malloc(4096, 0, NULL);
    void* keep = tidepool_malloc(4096, 0, NULL);
    tidepool_free(p, 4096, 0, NULL);
    tidepool_free(p, 4096, 0, NULL);
    CHECK(stats_of(0).num_invalid_frees == 2, "double free counted");
    CHECK(strstr(last_error(), "double free") != NULL, "last error: %s", last_error());
    /* Free with a wrong size: the recorded size is used. */
    void* q = tidepool_malloc(3000, 0, NULL);
    tidepool_free(q, 12, 0, NULL);
    tidepool_stats s = stats_of(0);
    CHECK(s.num_size_mismatches == 1 && s.allocated_bytes == 4096, "size mismatch: %llu, %llu",
          (unsigned long long)s.num_size_mismatches, (unsigned long long)s.allocated_bytes);
    /* Huge sizes. */
    CHECK(tidepool_malloc(SIZE_MAX, 0, NULL) == NULL, "SIZE_MAX gives NULL");
    CHECK(strstr(last_error(), "too large") != NULL, "last error: %s", last_error());
    CHECK(tidepool_malloc((size_t)1 << 50, 0, NULL) == NULL, "1 PiB gives NULL");
    CHECK(strstr(last_error(), "out of memory") != NULL, "last error: %s", last_error());
    CHECK(stats_of(0).num_ooms == 1, "the OOM is counted");
    /* Devices out of range. */
    CHECK(tidepool_malloc(512, 7, NULL) == NULL && strstr(last_error(), "no device 7"), "device 7: %s", last_error());
    CHECK(tidepool_malloc(512, -1, NULL) == NULL && strstr(last_error(), "no device -1"), "device -1: %s", last_error());
    tidepool_free(keep, 4096, 5, NULL); /* wrong device: refused, keep stays live */
    CHECK(stats_of(0).allocated_bytes == 4096, "free on a wrong device changes nothing");
    tidepool_free(keep, 4096, 0, NULL);
    /* Statistics with bad arguments. */
    CHECK(tidepool_get_stats(0, NULL) == TIDEPOOL_ERR_INVALID_ARGUMENT, "NULL stats");
    tidepool_stats small;
    memset(&small, 0, sizeof small);
    small.size = 16;
    CHECK(tidepool_get_stats(0, &small) == TIDEPOOL_ERR_INVALID_ARGUMENT, "size too small");
    CHECK(small.version == 0, "nothing written on error");
    small.size = sizeof small;
    CHECK(tidepool_get_stats(9, &small) == TIDEPOOL_ERR_INVALID_DEVICE, "device 9");
    CHECK(tidepool_get_stats(-3, &small) == TIDEPOOL_ERR_INVALID_DEVICE, "device -3");
    /* Memory fraction. */
    tidepool_set_memory_fraction(2.0, 0);
    CHECK(strstr(last_error(), "between 0 and 1") != NULL, "fraction 2: %s", last_error());
    CHECK(stats_of(0).has_reserved_limit == 0 && stats_of(0).reserved_limit_bytes == 0, "no limit");
    tidepool_set_memory_fraction(0.5, 0);
    CHECK(stats_of(0).reserved_limit_bytes == 2048 * MIB, "limit %llu", (unsigned long long)stats_of(0).reserved_limit_bytes);
    CHECK(stats_of(0).has_reserved_limit == 1, "a limit");
    CHECK(tidepool_malloc(3000 * MIB, 0, NULL) == NULL, "over the memory fraction");
    /* A fraction of 0 (or one too small for a byte) is a limit of 0 B, not none. */
    for (int i = 0; i < 2; i++) {
        tidepool_set_memory_fraction(i == 0 ? 0.0 : 1e-300, 0);
        CHECK(stats_of(0).has_reserved_limit == 1 && stats_of(0).reserved_limit_bytes == 0, "a limit of 0 B");
        CHECK(tidepool_malloc(4096, 0, NULL) == NULL && strstr(last_error(), "at most 0 B") != NULL, "%s", last_error());
    }
    tidepool_set_memory_fraction(1.0, 0);
    CHECK(stats_of(0).reserved_limit_bytes == 0 && stats_of(0).has_reserved_limit == 0, "limit lifted");
    /* Last error: length query and truncation. */
    size_t len = tidepool_last_error(NULL, 0);
    char tiny[8];
    CHECK(tidepool_last_error(tiny, sizeof tiny) == len && strlen(tiny) == 7, "truncated to 7 bytes");
    /* A configuration checked before anything starts. */
    char problems[512];
    CHECK(tidepool_check_conf("expandable_segments:True,max_split_size_mb:256", problems, sizeof problems) == 0, "%s", problems);
    CHECK(tidepool_check_conf("colour:blue,expandable:maybe", problems, sizeof problems) == 2, "two problems");
    CHECK(strstr(problems, "colour") != NULL && strstr(problems, "expected true or false") != NULL, "%s", problems);
    CHECK(tidepool_check_conf(NULL, problems, sizeof problems) == -1, "NULL");
    /* A byte that is not UTF-8 costs its entry only. */
    CHECK(tidepool_check_conf("backend:host,x:\xff,stash:false", problems, sizeof problems) == 1, "%s", problems);
    CHECK(strstr(problems, "not UTF-8") != NULL, "%s", problems);
    /* Checked as it will be used: an empty path is a problem now, not a
     * NULL from every allocation later; a key given twice is named. */
    CHECK(tidepool_check_conf("host_shared:,registry_dir: ", problems, sizeof problems) == 2, "%s", problems);
    CHECK(strstr(problems, "expected a path, got nothing") != NULL, "%s", problems);
    CHECK(tidepool_check_conf("stash:off,stash:ON,release_after_ms:None", problems, sizeof problems) == 1, "%s", problems);
    CHECK(strstr(problems, "stash is given 2 times") != NULL, "%s", problems);
}

static void segments_and_streams(void) {
    void* a = tidepool_malloc(4096, 0, (void*)3);
    void* b = tidepool_malloc(4096, 0, (void*)3);
    size_t size = 0;
    CHECK(tidepool_base_alloc(b, &size) == a && size == 2 * MIB, "base of b is a, size %zu", size);
    CHECK(tidepool_base_alloc((char*)b + 100, &size) == a, "interior pointer");
    CHECK(tidepool_base_alloc((void*)0x1000, &size) == NULL, "foreign base");
    CHECK(tidepool_base_alloc(a, NULL) == NULL, "NULL size");
    tidepool_record_stream(a, (void*)9);
    tidepool_record_stream((void*)0x1000, (void*)9);
    CHECK(strstr(last_error(), "not a live allocation") != NULL, "record_stream foreign: %s", last_error());
    tidepool_free(a, 4096, 0, (void*)3);
    tidepool_free(b, 4096, 0, (void*)3);
}

/* PyTorch's graph-pool hooks: a capture's blocks stay its own; unbalanced
 * calls and bad devices set the last error and change nothing. */
static void private_pools(void) {
    void* eager = tidepool_malloc(3 * MIB, 0, NULL);
    tidepool_free(eager, 3 * MIB, 0, NULL);
    tidepool_begin_allocate_to_pool(0, 5, 0, NULL);
    void* captured = tidepool_malloc(3 * MIB, 0, NULL);
    CHECK(captured != NULL && captured != eager, "a capture took an eager block: %p", captured);
    tidepool_free(captured, 3 * MIB, 0, NULL);
    tidepool_end_allocate_to_pool(0, 5, 0);
    void* after = tidepool_malloc(3 * MIB, 0, NULL);
    CHECK(after == eager, "after the capture, eager cache serves: %p", after);
    tidepool_free(after, 3 * MIB, 0, NULL);
    tidepool_release_pool(0, 5, 0);
    tidepool_end_allocate_to_pool(0, 5, 0);
    CHECK(strstr(last_error(), "not open") != NULL, "end twice: %s", last_error());
    tidepool_release_pool(0, 5, 0);
    CHECK(strstr(last_error(), "never begun") != NULL, "release twice: %s", last_error());
    tidepool_begin_allocate_to_pool(7, 5, 0, NULL);
    CHECK(strstr(last_error(), "no device 7") != NULL, "bad device: %s", last_error());
    tidepool_begin_allocate_to_pool(-1, 5, 0, NULL);
    CHECK(strstr(last_error(), "-1") != NULL, "negative device: %s", last_error());
}

/* PyTorch's reset_peak_memory_stats and reset_accumulated_memory_stats;
 * -1 means every device. */
static void reset_stats(void) {
    void* keep = tidepool_malloc(4096, 0, NULL);
    void* big = tidepool_malloc(30 * MIB, 0, NULL);
    tidepool_free(big, 30 * MIB, 0, NULL);
    tidepool_stats before = stats_of(0);
    CHECK(before.peak_allocated_bytes > before.allocated_bytes, "a peak above the current value");
    CHECK(before.num_driver_calls > 0, "driver calls counted before the reset");
    CHECK(before.num_ooms > 0 && before.num_allocs > 0 && before.num_invalid_frees > 0, "counted before the reset");
    CHECK(tidepool_reset_peak_stats(0) == TIDEPOOL_OK, "reset_peak_stats: %s", last_error());
    tidepool_stats s = stats_of(0);
    CHECK(s.peak_allocated_bytes == s.allocated_bytes && s.peak_reserved_bytes == s.reserved_bytes &&
              s.peak_requested_bytes == s.requested_bytes && s.gauges[4].all.peak == s.gauges[4].all.current,
          "peaks are the current values: %llu, %llu", (unsigned long long)s.peak_allocated_bytes,
          (unsigned long long)s.allocated_bytes);
    CHECK(s.num_allocs == before.num_allocs, "resetting peaks keeps the counters");
    CHECK(tidepool_reset_accumulated_stats(-1) == TIDEPOOL_OK, "reset_accumulated_stats(-1): %s", last_error());
    s = stats_of(0);
    CHECK(s.num_ooms == 0 && s.num_allocs == 0 && s.num_frees == 0 && s.num_device_allocs == 0 &&
              s.num_device_frees == 0 && s.num_alloc_retries == 0 && s.num_invalid_frees == 0 && s.num_driver_calls == 0,
          "counters zeroed: ooms %llu allocs %llu driver calls %llu", (unsigned long long)s.num_ooms,
          (unsigned long long)s.num_allocs, (unsigned long long)s.num_driver_calls);
    CHECK(s.gauges[4].all.allocated == 0 && s.gauges[4].all.freed == 0, "allocated and freed sums zeroed");
    CHECK(s.allocated_bytes == before.allocated_bytes && s.reserved_bytes == before.reserved_bytes, "current values stay");
    CHECK(tidepool_reset_peak_stats(-1) == TIDEPOOL_OK, "reset_peak_stats(-1): %s", last_error());
    CHECK(tidepool_reset_peak_stats(7) == TIDEPOOL_ERR_INVALID_DEVICE && strstr(last_error(), "no device 7"),
          "reset_peak_stats(7): %s", last_error());
    CHECK(tidepool_reset_peak_stats(-2) == TIDEPOOL_ERR_INVALID_DEVICE, "reset_peak_stats(-2)");
    CHECK(tidepool_reset_accumulated_stats(7) == TIDEPOOL_ERR_INVALID_DEVICE, "reset_accumulated_stats(7)");
    CHECK(tidepool_reset_accumulated_stats(-2) == TIDEPOOL_ERR_INVALID_DEVICE, "reset_accumulated_stats(-2)");
    /* Growth after the reset is counted from 0. */
    void* grown = tidepool_malloc(768 * MIB, 0, NULL);
    CHECK(grown != NULL && stats_of(0).num_driver_calls > 0, "driver calls counted again after the reset: %s", last_error());
    tidepool_free(grown, 768 * MIB, 0, NULL);
    tidepool_free(keep, 4096, 0, NULL);
}

/* What an observer saw. */
struct oom_seen {
    int calls;
    int device;
    size_t requested, allocated, free;
    int saw_report; /* the last error held the OOM report during the call */
};
static struct oom_seen first_seen, second_seen;

static void second_observer(int device, size_t requested, size_t device_allocated, size_t device_free, void* user) {
    (void)device, (void)requested, (void)device_allocated, (void)device_free;
    ((struct oom_seen*)user)->calls++;
}

static void first_observer(int device, size_t requested, size_t device_allocated, size_t device_free, void* user) {
    struct oom_seen* seen = user;
    seen->calls++;
    seen->device = device;
    seen->requested = requested;
    seen->allocated = device_allocated;
    seen->free = device_free;
    seen->saw_report = strstr(last_error(), "out of memory") != NULL;
    /* An observer may call tidepool, which sets the last error... */
    tidepool_stats small;
    memset(&small, 0, sizeof small);
    small.size = 16;
    tidepool_get_stats(0, &small);
    /* ...and attach another observer, called from the next OOM on. */
    if (seen->calls == 1) tidepool_attach_oom_observer(second_observer, &second_seen);
}

static void oom_observers(void) {
    CHECK(tidepool_attach_oom_observer(NULL, NULL) == TIDEPOOL_ERR_INVALID_ARGUMENT && strstr(last_error(), "NULL"),
          "NULL observer: %s", last_error());
    CHECK(tidepool_attach_oom_observer(first_observer, &first_seen) == TIDEPOOL_OK, "attach: %s", last_error());
    void* live = tidepool_malloc(5 * MIB, 0, NULL);
    CHECK(live != NULL, "malloc(5 MiB): %s", last_error());
    CHECK(tidepool_malloc(8192 * MIB, 0, NULL) == NULL, "8 GiB on a 4 GiB device");
    CHECK(strstr(last_error(), "out of memory") != NULL, "the report stays the last error: %s", last_error());
    tidepool_stats s = stats_of(0);
    CHECK(first_seen.calls == 1 && second_seen.calls == 0, "observers ran %d and %d times", first_seen.calls, second_seen.calls);
    CHECK(first_seen.saw_report, "the observer could read the report");
    CHECK(first_seen.device == 0 && first_seen.requested == 8192 * MIB, "device %d requested %zu", first_seen.device,
          first_seen.requested);
    CHECK(first_seen.allocated == s.allocated_bytes && s.allocated_bytes >= 5 * MIB, "allocated %zu, stats %llu",
          first_seen.allocated, (unsigned long long)s.allocated_bytes);
    const char* conf = getenv("TIDEPOOL_CONF");
    if (conf && strstr(conf, "backend:host")) {
        /* The host device's free memory: its capacity less what tidepool holds. */
        CHECK(first_seen.free == 4096 * MIB - s.reserved_bytes, "device free %zu, reserved %llu", first_seen.free,
              (unsigned long long)s.reserved_bytes);
    } else {
        CHECK(first_seen.free > 0 && first_seen.free <= 4096 * MIB, "device free %zu", first_seen.free);
    }
    CHECK(tidepool_malloc(8192 * MIB, 0, NULL) == NULL, "8 GiB again");
    CHECK(first_seen.calls == 2 && second_seen.calls == 1, "the observer attached by an observer runs from the next OOM");
    CHECK(tidepool_malloc(SIZE_MAX, 0, NULL) == NULL && first_seen.calls == 2, "too large is not out of memory");
    int attached = 2;
    while (attached < 100 && tidepool_attach_oom_observer(second_observer, &second_seen) == TIDEPOOL_OK) attached++;
    CHECK(attached == 64 && strstr(last_error(), "64"), "at most 64 observers: %d, %s", attached, last_error());
    tidepool_free(live, 5 * MIB, 0, NULL);
}

static void snapshot(const char* path) {
    CHECK(tidepool_record_history(1000) == TIDEPOOL_OK, "record_history: %s", last_error());
    void* live = tidepool_malloc(12345, 0, (void*)5);
    /* Allocation contexts: the snapshot shows the frames (tests/cabi/c.rs reads them). */
    tidepool_frame frames[2] = {{"model.py", "forward", 42}, {"train.py", "main", 7}};
    CHECK(tidepool_register_context(42, frames, 2) == TIDEPOOL_OK, "register_context: %s", last_error());
    void* framed = tidepool_malloc_with_context(54321, 0, (void*)5, 42);
    CHECK(framed != NULL, "malloc_with_context: %s", last_error());
    void* framed_twice = tidepool_malloc_with_context(54321, 0, (void*)5, 42);
    tidepool_free(framed_twice, 54321, 0, (void*)5);
    CHECK(tidepool_malloc_with_context(0, 0, NULL, 42) == NULL, "size 0 gives NULL with a context too");
    CHECK(tidepool_register_context(0, frames, 2) == TIDEPOOL_ERR_INVALID_ARGUMENT && strstr(last_error(), "context 0"),
          "context 0: %s", last_error());
    CHECK(tidepool_register_context(43, NULL, 1) == TIDEPOOL_ERR_INVALID_ARGUMENT, "NULL frames");
    tidepool_frame unnamed[1] = {{"x.py", NULL, 1}};
    CHECK(tidepool_register_context(43, unnamed, 1) == TIDEPOOL_ERR_INVALID_ARGUMENT && strstr(last_error(), "name is NULL"),
          "NULL name: %s", last_error());
    tidepool_frame latin1[1] = {{"caf\xe9.py", "f", 1}};
    CHECK(tidepool_register_context(43, latin1, 1) == TIDEPOOL_ERR_INVALID_ARGUMENT && strstr(last_error(), "not UTF-8"),
          "not UTF-8: %s", last_error());
    CHECK(tidepool_register_context(44, NULL, 0) == TIDEPOOL_OK, "no frames: %s", last_error());
    CHECK(tidepool_dump_snapshot(path) == TIDEPOOL_OK, "dump_snapshot: %s", last_error());
    CHECK(tidepool_dump_snapshot(NULL) == TIDEPOOL_ERR_INVALID_ARGUMENT, "NULL path");
    CHECK(tidepool_dump_snapshot("/nonexistent-dir/x.pickle") == TIDEPOOL_ERR_IO, "unwritable path");
    (void)live; /* stays live: the snapshot shows it */
}

struct worker {
    int id;
    int iterations;
    int failures;
};

static void* hammer(void* arg) {
    struct worker* w = arg;
    void* stream = (void*)(uintptr_t)(w->id % 4);
    unsigned seed = (unsigned)w->id * 2654435761u;
    void* live[32] = {0};
    size_t sizes[32] = {0};
    for (int i = 0; i < w->iterations; i++) {
        seed = seed * 1103515245u + 12345u;
        int slot = (seed >> 8) % 32;
        if (live[slot]) {
            unsigned char expect = (unsigned char)(w->id * 31 + slot);
            unsigned char* bytes = live[slot];
            if (bytes[0] != expect || bytes[sizes[slot] - 1] != expect) w->failures++;
            tidepool_free(live[slot], sizes[slot], 0, stream);
            live[slot] = NULL;
        } else {
            sizes[slot] = 1 + (seed >> 4) % (seed % 7 == 0 ? 4 * MIB : 8192);
            live[slot] = tidepool_malloc(sizes[slot], 0, stream);
            if (!live[slot]) { w->failures++; continue; }
            memset(live[slot], w->id * 31 + slot, sizes[slot]);
            if (seed % 13 == 0) tidepool_record_stream(live[slot], (void*)77);
        }
        if (i % 997 == 0) {
            tidepool_stats s;
            s.size = sizeof s;
            if (tidepool_get_stats(0, &s) != TIDEPOOL_OK) w->failures++;
        }
    }
    for (int slot = 0; slot < 32; slot++)
        if (live[slot]) tidepool_free(live[slot], sizes[slot], 0, stream);
    return NULL;
}

static void sixteen_threads(int iterations) {
    tidepool_stats before = stats_of(0);
    pthread_t threads[16];
    struct worker workers[16];
    for (int i = 0; i < 16; i++) {
        workers[i] = (struct worker){.id = i + 1, .iterations = iterations, .failures = 0};
        pthread_create(&threads[i], NULL, hammer, &workers[i]);
    }
    for (int i = 0; i < 16; i++) {
        pthread_join(threads[i], NULL);
        CHECK(workers[i].failures == 0, "thread %d saw %d failures", i, workers[i].failures);
    }
    tidepool_stats after = stats_of(0);
    CHECK(after.allocated_bytes == before.allocated_bytes, "threads leave nothing allocated");
    CHECK(after.num_invalid_frees == before.num_invalid_frees, "no invalid frees from threads");
}

static void after_fork(void) {
    void* parent_block = tidepool_malloc(8192, 0, NULL);
    pid_t pid = fork();
    if (pid == 0) {
        /* The child gets a fresh allocator and can allocate and free. */
        void* p = tidepool_malloc(4096, 0, NULL);
        if (!p) _exit(2);
        memset(p, 1, 4096);
        tidepool_free(p, 4096, 0, NULL);
        tidepool_stats s;
        s.size = sizeof s;
        if (tidepool_get_stats(0, &s) != TIDEPOOL_OK || s.num_allocs != 1 || s.allocated_bytes != 0) _exit(3);
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child exited with %d", WEXITSTATUS(status));
    tidepool_free(parent_block, 8192, 0, NULL);
    CHECK(stats_of(0).num_invalid_frees == 2, "the parent's heap is untouched by the child");
}

int main(int argc, char** argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: ffi_test SNAPSHOT_PATH [ITERATIONS]\n");
        return 2;
    }
    int iterations = argc > 2 ? atoi(argv[2]) : 20000;
    tidepool_init(1);
    basic_use();
    bad_input();
    segments_and_streams();
    private_pools();
    sixteen_threads(iterations);
    after_fork();
    reset_stats();
    oom_observers();
    snapshot(argv[1]);
    printf("ffi_test: %d passed, 0 failed\n", passed);
    return 0;
}
