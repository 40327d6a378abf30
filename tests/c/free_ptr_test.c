/* tidepool_free_ptr, the free with the pointer alone, from C on two host
 * devices (TIDEPOOL_CONF names them): blocks of both devices and several
 * streams freed by pointer, by tidepool_free and from another thread, with
 * exact statistics after the mix; NULL; a foreign pointer, a double free
 * and an interior pointer refused with TIDEPOOL_ERR_INVALID_FREE, the last
 * error set and each counted on the device where it lies. Run by
 * tests/cabi/c.rs (also under valgrind); prints "free_ptr_test: N passed,
 * 0 failed" and exits 0. */
#include "tidepool.h"

#define TEST_NAME "free_ptr_test"
#include "check.h"

#include <pthread.h>
#include <stdint.h>
#include <string.h>

static tidepool_stats stats_of(int device) {
    tidepool_stats s;
    memset(&s, 0, sizeof s);
    s.size = sizeof s;
    int rc = tidepool_get_stats(device, &s);
    CHECK(rc == TIDEPOOL_OK, "tidepool_get_stats(%d) returned %d", device, rc);
    return s;
}

static const char* last_error(void) {
    static char buf[1024];
    tidepool_last_error(buf, sizeof buf);
    return buf;
}

static void* stream_of(int i) {
    return (void*)(uintptr_t)(i % 3 * 16);
}

/* Blocks of both devices, three streams and several sizes; odd ones freed
 * with tidepool_free, even ones by pointer. */
static void mixed_frees(int iterations) {
    enum { N = 64 };
    static const size_t sizes[] = {512, 4096, 100000, 3 * MIB};
    void* blocks[N];
    for (int round = 0; round < iterations; round++) {
        for (int i = 0; i < N; i++) {
            blocks[i] = tidepool_malloc(sizes[(i + round) % 4], i % 2, stream_of(i));
            CHECK(blocks[i] != NULL, "malloc: %s", last_error());
            memset(blocks[i], i, 512);
        }
        for (int i = 0; i < N; i++) {
            int j = (i * 37 + round) % N;
            CHECK(((unsigned char*)blocks[j])[511] == (unsigned char)j, "block %d damaged", j);
            if (j % 4 < 2) {
                CHECK(tidepool_free_ptr(blocks[j]) == TIDEPOOL_OK, "free_ptr: %s", last_error());
            } else {
                tidepool_free(blocks[j], sizes[(j + round) % 4], j % 2, stream_of(j));
            }
        }
        /* The cached pair: allocate and free by pointer at once. */
        for (int i = 0; i < 100; i++) {
            void* p = tidepool_malloc(512, i % 2, NULL);
            CHECK(p != NULL && tidepool_free_ptr(p) == TIDEPOOL_OK, "pair: %s", last_error());
        }
    }
    for (int device = 0; device < 2; device++) {
        tidepool_stats s = stats_of(device);
        CHECK(s.allocated_bytes == 0 && s.requested_bytes == 0, "device %d: %llu allocated after the mix", device,
              (unsigned long long)s.allocated_bytes);
        CHECK(s.num_allocs == s.num_frees, "device %d: %llu allocs, %llu frees", device, (unsigned long long)s.num_allocs,
              (unsigned long long)s.num_frees);
        CHECK(s.num_allocs == (unsigned long long)iterations * (N / 2 + 50), "device %d: %llu allocs", device,
              (unsigned long long)s.num_allocs);
        CHECK(s.num_invalid_frees == 0 && s.num_size_mismatches == 0, "device %d: no bad frees", device);
    }
}

static void* free_all(void* arg) {
    void** blocks = arg;
    for (int i = 0; i < 32; i++) {
        if (tidepool_free_ptr(blocks[i]) != TIDEPOOL_OK) return (void*)1;
    }
    return NULL;
}

/* Blocks one thread allocated, freed by pointer on another. */
static void another_thread(void) {
    void* blocks[32];
    for (int i = 0; i < 32; i++) {
        blocks[i] = tidepool_malloc(4096 << (i % 3), i % 2, stream_of(i));
        CHECK(blocks[i] != NULL, "malloc: %s", last_error());
    }
    pthread_t thread;
    void* result = (void*)2;
    pthread_create(&thread, NULL, free_all, blocks);
    pthread_join(thread, &result);
    CHECK(result == NULL, "the other thread's frees failed");
    CHECK(stats_of(0).allocated_bytes == 0 && stats_of(1).allocated_bytes == 0, "all freed");
}

static void bad_frees(void) {
    CHECK(tidepool_free_ptr(NULL) == TIDEPOOL_OK, "NULL is nothing");
    unsigned long long before0 = stats_of(0).num_invalid_frees, before1 = stats_of(1).num_invalid_frees;

    /* Foreign: on no device, counted on device 0. */
    CHECK(tidepool_free_ptr((void*)0x1000) == TIDEPOOL_ERR_INVALID_FREE, "foreign pointer refused");
    CHECK(strstr(last_error(), "never allocated") != NULL, "last error: %s", last_error());
    CHECK(stats_of(0).num_invalid_frees == before0 + 1 && stats_of(1).num_invalid_frees == before1, "foreign counted on device 0");

    /* A block of device 1: freed twice, and freed from inside a live one. */
    void* keep = tidepool_malloc(8192, 1, stream_of(1));
    void* p = tidepool_malloc(8192, 1, stream_of(1));
    CHECK(keep != NULL && p != NULL, "malloc: %s", last_error());
    CHECK(tidepool_free_ptr(p) == TIDEPOOL_OK, "first free");
    CHECK(tidepool_free_ptr(p) == TIDEPOOL_ERR_INVALID_FREE, "double free refused");
    CHECK(strstr(last_error(), "double free") != NULL, "last error: %s", last_error());
    CHECK(stats_of(1).num_invalid_frees == before1 + 1, "double free counted on device 1");
    CHECK(tidepool_free_ptr((char*)keep + 512) == TIDEPOOL_ERR_INVALID_FREE, "interior pointer refused");
    CHECK(strstr(last_error(), "inside") != NULL, "last error: %s", last_error());
    CHECK(stats_of(1).num_invalid_frees == before1 + 2, "interior pointer counted on device 1");
    CHECK(stats_of(0).num_invalid_frees == before0 + 1, "nothing more on device 0");
    tidepool_stats s = stats_of(1);
    CHECK(s.allocated_bytes == 8192 && s.num_allocs == s.num_frees + 1, "keep is still live");

    /* A double free by tidepool_free after tidepool_free_ptr, and the reverse. */
    tidepool_free(keep, 8192, 1, stream_of(1));
    CHECK(tidepool_free_ptr(keep) == TIDEPOOL_ERR_INVALID_FREE, "freed by tidepool_free, then by pointer");
    void* q = tidepool_malloc(512, 0, NULL);
    CHECK(tidepool_free_ptr(q) == TIDEPOOL_OK, "free by pointer");
    tidepool_free(q, 512, 0, NULL);
    CHECK(strstr(last_error(), "double free") != NULL, "last error: %s", last_error());
    CHECK(stats_of(0).num_invalid_frees == before0 + 2 && stats_of(1).num_invalid_frees == before1 + 3, "both counted");
    CHECK(stats_of(0).allocated_bytes == 0 && stats_of(1).allocated_bytes == 0, "nothing left");
}

int main(int argc, char** argv) {
    int iterations = argc > 2 ? atoi(argv[2]) : 200;
    tidepool_init(2);
    mixed_frees(iterations);
    another_thread();
    bad_frees();
    tidepool_empty_cache();
    /* On the host backend everything goes back. (Over simgpu with
     * expandable segments some pages stay mapped after this mix, with
     * tidepool_free alone too: not a matter of the free by pointer.) */
    const char* conf = getenv("TIDEPOOL_CONF");
    if (conf && strstr(conf, "backend:host")) {
        CHECK(stats_of(0).reserved_bytes == 0 && stats_of(1).reserved_bytes == 0, "empty_cache gives everything back: %llu and %llu B",
              (unsigned long long)stats_of(0).reserved_bytes, (unsigned long long)stats_of(1).reserved_bytes);
    }
    printf("free_ptr_test: %d passed, 0 failed\n", passed);
    return 0;
}
