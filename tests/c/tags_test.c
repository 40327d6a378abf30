/* Tags, pause and resume through the C ABI: contents and addresses kept
 * across an offloaded pause, memory given back, every bad input refused
 * with its code and nothing changed, a paused block freed, a pause refused
 * while a private pool is open, and a fork child whose tags are its own.
 * Runs on the host backend or the cuda backend over simgpu (the memory is
 * host-addressable in both). Run by tests/cabi/tags.rs; prints
 * "tags_test: N passed, 0 failed" and exits 0. */
#include "tidepool.h"

#define TEST_NAME "tags_test"
#include "check.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define BLOCKS 6

static const char* last_error(void) {
    static char buf[1024];
    tidepool_last_error(buf, sizeof buf);
    return buf;
}

static tidepool_tag_stats tag_stats(const char* tag) {
    tidepool_tag_stats s;
    memset(&s, 0, sizeof s);
    s.size = sizeof s;
    int rc = tidepool_get_tag_stats(tag, 0, &s);
    CHECK(rc == TIDEPOOL_OK, "tidepool_get_tag_stats(%s) returned %d: %s", tag, rc, last_error());
    CHECK(s.version == TIDEPOOL_TAG_STATS_VERSION && s.size == sizeof s, "tag stats version %u size %u", s.version, s.size);
    return s;
}

static tidepool_stats stats(void) {
    tidepool_stats s;
    memset(&s, 0, sizeof s);
    s.size = sizeof s;
    CHECK(tidepool_get_stats(0, &s) == TIDEPOOL_OK, "tidepool_get_stats: %s", last_error());
    return s;
}

static void fill(unsigned char* p, size_t len, unsigned seed) {
    for (size_t i = 0; i < len; i += 61) p[i] = (unsigned char)(seed * 131 + i / 61);
    p[len - 1] = (unsigned char)seed;
}

static int intact(const unsigned char* p, size_t len, unsigned seed) {
    for (size_t i = 0; i < len; i += 61)
        if (p[i] != (unsigned char)(seed * 131 + i / 61)) return 0;
    return p[len - 1] == (unsigned char)seed;
}

static const size_t sizes[BLOCKS] = {512, 4000, 100000, 3 * MIB, 9 * MIB, 1500};

static void pause_and_resume(void) {
    unsigned char* blocks[BLOCKS];
    CHECK(tidepool_set_tag("weights") == TIDEPOOL_OK, "set_tag: %s", last_error());
    for (int i = 0; i < BLOCKS; i++) {
        blocks[i] = tidepool_malloc(sizes[i], 0, NULL);
        CHECK(blocks[i] != NULL, "malloc %zu: %s", sizes[i], last_error());
        fill(blocks[i], sizes[i], (unsigned)i + 1);
    }
    CHECK(tidepool_set_tag(NULL) == TIDEPOOL_OK, "back to default");
    unsigned char* plain = tidepool_malloc(MIB, 0, NULL);
    fill(plain, MIB, 99);
    tidepool_tag_stats before = tag_stats("weights");
    CHECK(before.num_allocations == BLOCKS && before.paused == 0 && before.reserved_bytes > 0, "before pause");
    uint64_t reserved = stats().reserved_bytes;

    CHECK(tidepool_pause("weights", 0, TIDEPOOL_PAUSE_OFFLOAD) == TIDEPOOL_OK, "pause: %s", last_error());
    tidepool_tag_stats paused = tag_stats("weights");
    CHECK(paused.paused == 1 && paused.paused_bytes == before.reserved_bytes && paused.reserved_bytes == 0, "paused");
    CHECK(paused.offloaded_bytes >= before.allocated_bytes, "offloaded %llu", (unsigned long long)paused.offloaded_bytes);
    tidepool_stats s = stats();
    CHECK(s.reserved_bytes == reserved - before.reserved_bytes, "reserved drops by the tag's");
    CHECK(s.paused_bytes == paused.paused_bytes && s.offloaded_bytes == paused.offloaded_bytes, "memory stats carry the totals");
    CHECK(intact(plain, MIB, 99), "untagged memory untouched");

    /* Allocating under the paused tag fails and names it. */
    CHECK(tidepool_set_tag("weights") == TIDEPOOL_OK, "set_tag");
    CHECK(tidepool_malloc(4096, 0, NULL) == NULL, "malloc under a paused tag");
    CHECK(strstr(last_error(), "\"weights\" is paused") != NULL, "last error: %s", last_error());
    CHECK(tidepool_set_tag(NULL) == TIDEPOOL_OK, "back to default");
    /* Pausing again, or with bad arguments: refused, nothing changes. */
    CHECK(tidepool_pause("weights", 0, 0) == TIDEPOOL_ERR_TAG_STATE, "already paused");
    CHECK(strstr(last_error(), "already paused") != NULL, "last error: %s", last_error());
    CHECK(tag_stats("weights").paused_bytes == paused.paused_bytes, "unchanged");

    CHECK(tidepool_resume("weights", -1) == TIDEPOOL_OK, "resume: %s", last_error());
    for (int i = 0; i < BLOCKS; i++) CHECK(intact(blocks[i], sizes[i], (unsigned)i + 1), "block %d restored at its address", i);
    tidepool_tag_stats after = tag_stats("weights");
    CHECK(after.paused == 0 && after.paused_bytes == 0 && after.offloaded_bytes == 0, "resumed");
    CHECK(tidepool_resume("weights", 0) == TIDEPOOL_ERR_TAG_STATE, "resume twice");

    /* Discard, and free a paused block. */
    CHECK(tidepool_pause("weights", -1, 0) == TIDEPOOL_OK, "discard pause: %s", last_error());
    CHECK(tag_stats("weights").offloaded_bytes == 0, "discard keeps nothing");
    tidepool_free(blocks[4], sizes[4], 0, NULL);
    CHECK(tag_stats("weights").num_allocations == BLOCKS - 1, "a paused block can be freed");
    CHECK(tidepool_resume("weights", -1) == TIDEPOOL_OK, "resume after discard: %s", last_error());
    memset(blocks[3], 0x5A, sizes[3]); /* usable again */
    for (int i = 0; i < BLOCKS; i++)
        if (i != 4) tidepool_free(blocks[i], sizes[i], 0, NULL);
    tidepool_free(plain, MIB, 0, NULL);
    CHECK(tag_stats("weights").num_allocations == 0, "all freed");
}

static void bad_input(void) {
    char long_tag[80];
    memset(long_tag, 'x', 64);
    long_tag[64] = 0;
    CHECK(tidepool_set_tag(long_tag) == TIDEPOOL_ERR_INVALID_ARGUMENT, "64-byte tag");
    CHECK(strstr(last_error(), "at most 63") != NULL, "last error: %s", last_error());
    long_tag[63] = 0;
    CHECK(tidepool_set_tag(long_tag) == TIDEPOOL_OK, "63-byte tag");
    CHECK(tidepool_set_tag("\xff\xfe") == TIDEPOOL_ERR_INVALID_ARGUMENT, "not UTF-8");
    CHECK(tidepool_set_tag("") == TIDEPOOL_ERR_INVALID_ARGUMENT, "empty");
    CHECK(tidepool_set_tag(NULL) == TIDEPOOL_OK, "NULL is default");

    CHECK(tidepool_pause("never-set", 0, 0) == TIDEPOOL_ERR_TAG_STATE, "unknown tag");
    CHECK(strstr(last_error(), "unknown") != NULL, "last error: %s", last_error());
    CHECK(tidepool_resume("never-set", 0) == TIDEPOOL_ERR_TAG_STATE, "resume unknown");
    CHECK(tidepool_pause(NULL, 0, 0) == TIDEPOOL_ERR_TAG_STATE, "default cannot pause");
    CHECK(tidepool_pause("weights", 0, 2) == TIDEPOOL_ERR_INVALID_ARGUMENT, "unknown flags");
    CHECK(tidepool_pause("weights", 7, 0) == TIDEPOOL_ERR_INVALID_DEVICE, "no device 7");
    CHECK(tidepool_pause("weights", -2, 0) == TIDEPOOL_ERR_INVALID_DEVICE, "device -2");
    CHECK(tidepool_resume("\xff", 0) == TIDEPOOL_ERR_INVALID_ARGUMENT, "resume: not UTF-8");
    CHECK(tidepool_resume("weights", 0) == TIDEPOOL_ERR_TAG_STATE, "resume what is not paused");
    CHECK(tag_stats("weights").paused == 0, "nothing changed");

    tidepool_tag_stats s;
    CHECK(tidepool_get_tag_stats("weights", 0, NULL) == TIDEPOOL_ERR_INVALID_ARGUMENT, "NULL out");
    s.size = 8;
    CHECK(tidepool_get_tag_stats("weights", 0, &s) == TIDEPOOL_ERR_INVALID_ARGUMENT, "size too small");
    s.size = sizeof s;
    CHECK(tidepool_get_tag_stats("never-set", 0, &s) == TIDEPOOL_ERR_TAG_STATE, "stats of an unknown tag");
    CHECK(tidepool_get_tag_stats("weights", 9, &s) == TIDEPOOL_ERR_INVALID_DEVICE, "stats of device 9");
}

static void refused_while_capturing(void) {
    tidepool_set_tag("graph");
    void* p = tidepool_malloc(MIB, 0, NULL);
    tidepool_set_tag(NULL);
    CHECK(p != NULL, "malloc under graph: %s", last_error());
    tidepool_begin_allocate_to_pool(0, 5, 6, NULL);
    CHECK(tidepool_pause("graph", 0, TIDEPOOL_PAUSE_OFFLOAD) == TIDEPOOL_ERR_TAG_STATE, "pause while a private pool is open");
    CHECK(strstr(last_error(), "private pool") != NULL, "last error: %s", last_error());
    tidepool_end_allocate_to_pool(0, 5, 6);
    tidepool_release_pool(0, 5, 6);
    CHECK(tag_stats("graph").paused == 0, "not paused");
    CHECK(tidepool_pause("graph", 0, TIDEPOOL_PAUSE_OFFLOAD) == TIDEPOOL_OK, "pause once closed: %s", last_error());
    CHECK(tidepool_resume("graph", 0) == TIDEPOOL_OK, "resume");
    tidepool_free(p, MIB, 0, NULL);
}

/* The child's tags are its own: the parent's paused tag is not paused in
 * the child (a fresh allocator), and the child's pause is not the parent's. */
static void after_fork(void) {
    tidepool_set_tag("forked");
    unsigned char* p = tidepool_malloc(2 * MIB, 0, NULL);
    tidepool_set_tag(NULL);
    CHECK(p != NULL, "malloc: %s", last_error());
    fill(p, 2 * MIB, 7);
    CHECK(tidepool_pause("forked", 0, TIDEPOOL_PAUSE_OFFLOAD) == TIDEPOOL_OK, "pause: %s", last_error());
    fflush(NULL);
    pid_t child = fork();
    if (child == 0) {
        tidepool_set_tag("forked");
        void* q = tidepool_malloc(MIB, 0, NULL);
        if (q == NULL) _exit(10);
        tidepool_set_tag(NULL);
        if (tidepool_pause("forked", 0, 0) != TIDEPOOL_OK) _exit(11);
        if (tidepool_resume("forked", 0) != TIDEPOOL_OK) _exit(12);
        tidepool_free(q, MIB, 0, NULL);
        _exit(0);
    }
    int status = 0;
    waitpid(child, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child exited with %d", WEXITSTATUS(status));
    CHECK(tag_stats("forked").paused == 1, "the parent's tag is still paused");
    CHECK(tidepool_resume("forked", 0) == TIDEPOOL_OK, "resume: %s", last_error());
    CHECK(intact(p, 2 * MIB, 7), "contents back");
    tidepool_free(p, 2 * MIB, 0, NULL);
}

int main(void) {
    tidepool_init(1);
    pause_and_resume();
    bad_input();
    refused_while_capturing();
    after_fork();
    printf("tags_test: %d passed, 0 failed\n", passed);
    return 0;
}
