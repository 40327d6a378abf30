/* tidepool: a CUDA caching allocator that gives memory back.
 *
 * The C ABI of libtidepool.so. PyTorch loads tidepool_malloc and
 * tidepool_free through torch.cuda.memory.CUDAPluggableAllocator and the
 * other hooks through the Python package (ffi/python); any runtime can link
 * it and read the statistics.
 *
 * A stream is a cudaStream_t / CUstream passed as void*. No function ever
 * unwinds into the caller: on failure it returns NULL or an error code and
 * sets a per-thread last error (tidepool_last_error).
 *
 * tests/cabi/header.rs checks this file against src/ffi/, and the event
 * counters and gauges of tidepool_stats against the library's one list of
 * them (Events::COUNTERS, Stats::GAUGES in src/stats.rs).
 */
#ifndef TIDEPOOL_H
#define TIDEPOOL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TIDEPOOL_OK 0
#define TIDEPOOL_ERR_INVALID_ARGUMENT 1 /* NULL pointer, or a size field too small */
#define TIDEPOOL_ERR_INVALID_DEVICE 2   /* no such device */
#define TIDEPOOL_ERR_INTERNAL 3         /* allocator not created, or internal error */
#define TIDEPOOL_ERR_IO 4               /* a file could not be written */
#define TIDEPOOL_ERR_TAG_STATE 5        /* tag unknown, paused, not paused; or pause refused now */
#define TIDEPOOL_ERR_OUT_OF_MEMORY 6    /* device or host memory could not be had */
#define TIDEPOOL_ERR_INVALID_FREE 7     /* a free of what is not a live allocation */

#define TIDEPOOL_PAUSE_OFFLOAD 1 /* tidepool_pause: keep the contents in host memory */

#define TIDEPOOL_STATS_VERSION 7
#define TIDEPOOL_TAG_STATS_VERSION 1

/* One gauge, as torch.cuda.memory_stats reports it. */
typedef struct tidepool_stat {
    uint64_t current;
    uint64_t peak;
    uint64_t allocated; /* sum of increases */
    uint64_t freed;     /* sum of decreases */
} tidepool_stat;

typedef struct tidepool_stat_by_pool {
    tidepool_stat all;
    tidepool_stat small_pool;
    tidepool_stat large_pool;
} tidepool_stat_by_pool;

/* Statistics of one device. Set size = sizeof(tidepool_stats) before the
 * call; the library fills at most that many bytes, writes its version and
 * sets size to the bytes filled. Later versions only append fields: a
 * caller built with version 1 (1040 bytes, up to gauges) still works. */
typedef struct tidepool_stats {
    uint32_t size;
    uint32_t version;
    uint64_t allocated_bytes;
    uint64_t peak_allocated_bytes;
    uint64_t requested_bytes;
    uint64_t peak_requested_bytes;
    uint64_t reserved_bytes;
    uint64_t peak_reserved_bytes;
    uint64_t active_bytes;
    uint64_t peak_active_bytes;
    uint64_t inactive_split_bytes;
    uint64_t peak_inactive_split_bytes;
    uint64_t largest_free_block_bytes;
    uint64_t cached_free_bytes;
    uint64_t num_allocs;
    uint64_t num_frees;
    uint64_t num_device_allocs;
    uint64_t num_device_frees;
    uint64_t num_alloc_retries;
    uint64_t num_ooms;
    uint64_t num_invalid_frees;
    uint64_t num_size_mismatches;
    uint64_t reserved_limit_bytes; /* the cap on reserved bytes when has_reserved_limit
                                    * is 1 (a cap of 0 included), else 0 */
    /* torch.cuda.memory_stats' gauges, in this order: allocation, segment,
     * active, inactive_split, allocated_bytes, reserved_bytes, active_bytes,
     * inactive_split_bytes, requested_bytes. */
    tidepool_stat_by_pool gauges[9];
    /* Version 2: bytes given back to the driver, by why, and reclaimer passes. */
    uint64_t released_idle_decay_bytes;
    uint64_t released_budget_bytes;
    uint64_t released_headroom_bytes;
    uint64_t released_out_of_memory_bytes;
    uint64_t released_empty_cache_bytes;
    uint64_t num_reclaims;
    /* Cooperation with other processes on the device: bytes released for
     * them, requests posted, requests that got their memory, requests of
     * others answered. */
    uint64_t released_cooperation_bytes;
    uint64_t num_coop_requests;
    uint64_t num_coop_satisfied;
    uint64_t num_coop_served;
    /* Version 3: pages of expandable segments mapped and unmapped. */
    uint64_t num_pages_mapped;
    uint64_t num_pages_unmapped;
    /* Version 4: device memory given back by paused tags, and host memory
     * holding their contents (tidepool_pause). */
    uint64_t paused_bytes;
    uint64_t offloaded_bytes;
    /* Version 5: milliseconds the last satisfied cooperation request waited
     * (a last value: reset_accumulated keeps it), streams of
     * tidepool_record_stream the driver failed to synchronize at free, and
     * requests served, with the device full, by a block cached for another
     * stream. */
    uint64_t coop_last_wait_ms;
    uint64_t num_stream_sync_errors;
    uint64_t num_cross_stream_reuses;
    /* Version 6: 1 when reserved_limit_bytes is a limit (max_reserved_mb or
     * tidepool_set_memory_fraction, whose fraction 0 makes a limit of 0 B),
     * 0 when the device has none. */
    uint64_t has_reserved_limit;
    /* Version 7: memory driver calls made on the device, failed ones
     * included (cuMemAlloc/cuMemFree or cuMemAllocFromPoolAsync/cuMemFreeAsync,
     * cuMemAddressReserve/cuMemAddressFree, cuMemCreate/cuMemRelease,
     * cuMemMap/cuMemUnmap, cuMemSetAccess): a steady step makes none. */
    uint64_t num_driver_calls;
} tidepool_stats;

/* What one tag holds on one device (tidepool_get_tag_stats). Versioned as
 * tidepool_stats: set size = sizeof(tidepool_tag_stats) before the call. */
typedef struct tidepool_tag_stats {
    uint32_t size;
    uint32_t version;
    uint64_t allocated_bytes; /* live blocks of the tag */
    uint64_t reserved_bytes;  /* device memory its pages hold now */
    uint64_t paused_bytes;    /* device memory the pause gave back (0 unless paused) */
    uint64_t offloaded_bytes; /* host memory holding its contents while paused */
    uint64_t num_allocations; /* live blocks (count) */
    uint64_t paused;          /* 1 while paused */
} tidepool_tag_stats;

/* size bytes on device for stream. NULL when out of memory (after the cache
 * was released and the request retried; the report goes to stderr and to
 * tidepool_last_error, the OOM observers are called), on bad input (see
 * tidepool_last_error), or for size 0. */
void* tidepool_malloc(size_t size, int device, void* stream);

/* One stack frame of an allocation context. */
typedef struct tidepool_frame {
    const char* filename;
    const char* name;
    int64_t line;
} tidepool_frame;

/* Registers the frames (innermost first, as PyTorch lists them) of context
 * id `context` (non-zero); a later registration of the same id replaces it.
 * Strings are copied. Snapshots show a block's frames, and those of its
 * events in device_traces, from its context. Returns TIDEPOOL_OK or
 * TIDEPOOL_ERR_INVALID_ARGUMENT (context 0, frames NULL with count > 0, a
 * string not UTF-8 or NULL). */
int tidepool_register_context(uint64_t context, const tidepool_frame* frames, size_t count);

/* tidepool_malloc, remembering `context` (0: none) for the block and for its
 * alloc event in the history. */
void* tidepool_malloc_with_context(size_t size, int device, void* stream, uint64_t context);

/* Called at each out-of-memory of tidepool_malloc(_with_context), after the
 * cache was released and the request retried, just before NULL is returned:
 * on the failing thread, with no tidepool lock held. device_allocated is
 * tidepool's allocated bytes on device now, device_free the device's free
 * memory as the driver reports it (0 if unknown). An observer may call
 * tidepool; the last error still holds the report afterwards. */
typedef void (*tidepool_oom_observer)(int device, size_t requested, size_t device_allocated, size_t device_free, void* user);

/* Adds observer (with user) after those attached before, for the whole
 * process. Returns TIDEPOOL_OK, or TIDEPOOL_ERR_INVALID_ARGUMENT for a NULL
 * observer or when 64 are already attached. */
int tidepool_attach_oom_observer(tidepool_oom_observer observer, void* user);

/* Frees ptr (NULL: nothing). A pointer tidepool does not hold is refused
 * and counted; a size that differs from the allocation's is counted and the
 * recorded size used. */
void tidepool_free(void* ptr, size_t size, int device, void* stream);

/* Frees ptr with the pointer alone (CuPy's CFunctionAllocator, a cudaFree
 * interposer): the device is the one whose memory holds it, the stream the
 * one it was allocated on. NULL: nothing, TIDEPOOL_OK. A pointer tidepool
 * does not hold, one freed twice or one inside a block is refused and
 * counted (num_invalid_frees: on the device holding it, else device 0),
 * logged once and kept as the last error, as tidepool_free does. Returns
 * TIDEPOOL_OK, TIDEPOOL_ERR_INVALID_FREE or TIDEPOOL_ERR_INTERNAL (the
 * allocator cannot be had). As fast as tidepool_free for a block the
 * thread's cache handed out; else, with several devices, one lookup in
 * each device's heaps until one holds it. */
int tidepool_free_ptr(void* ptr);

/* Creates the allocator now (PyTorch's init hook). */
void tidepool_init(int device_count);

/* Releases every whole free segment to the driver (torch.cuda.empty_cache). */
void tidepool_empty_cache(void);

/* Caps what device may reserve at fraction (0..1) of its memory. */
void tidepool_set_memory_fraction(double fraction, int device);

/* Notes that the live allocation ptr is used on stream too. */
void tidepool_record_stream(void* ptr, void* stream);

/* Routes every allocation on device to the private pool (id0, id1) until
 * tidepool_end_allocate_to_pool: PyTorch's begin-allocate-to-pool hook (CUDA
 * graph capture, torch.cuda.use_mem_pool). filter (PyTorch's std::function)
 * is not used. While a private pool is in use its memory stays in it. */
void tidepool_begin_allocate_to_pool(int device, uint64_t id0, uint64_t id1, void* filter);

/* Stops routing allocations on device to the private pool (id0, id1). */
void tidepool_end_allocate_to_pool(int device, uint64_t id0, uint64_t id1);

/* Drops a use of the private pool (id0, id1) on device (a graph or MemPool went). */
void tidepool_release_pool(int device, uint64_t id0, uint64_t id1);

/* Keeps the last max_entries allocation and segment events of every device,
 * written as device_traces by tidepool_dump_snapshot (the timeline of
 * pytorch.org/memory_viz); 0 stops and forgets them. Returns TIDEPOOL_OK,
 * or TIDEPOOL_ERR_INTERNAL when the allocator cannot be had (see
 * tidepool_last_error). */
int tidepool_record_history(size_t max_entries);

/* The base of the segment holding ptr, its size in *size; NULL if none. */
void* tidepool_base_alloc(void* ptr, size_t* size);

/* Fills *out for device; returns TIDEPOOL_OK or a TIDEPOOL_ERR_* code. */
int tidepool_get_stats(int device, tidepool_stats* out);

/* Resets the peaks of device (-1: every device) to the current values
 * (torch.cuda.reset_peak_memory_stats). Returns TIDEPOOL_OK,
 * TIDEPOOL_ERR_INVALID_DEVICE or TIDEPOOL_ERR_INTERNAL. */
int tidepool_reset_peak_stats(int device);

/* Zeroes what device (-1: every device) accumulated: every gauge's allocated
 * and freed sums and the event counters (num_allocs, num_alloc_retries,
 * num_ooms, num_device_allocs, ...); current values, peaks and last values
 * (coop_last_wait_ms) stay (torch.cuda.reset_accumulated_memory_stats).
 * Returns as above. */
int tidepool_reset_accumulated_stats(int device);

/* Writes a PyTorch-schema snapshot pickle of every device to path: a
 * regular file is replaced at once (a reader never sees half of it), a
 * symbolic link is written through to its target, a FIFO (with a reader)
 * or a device is written into and never replaced; a directory, a FIFO no
 * process reads, a missing folder, no space or no permission return
 * TIDEPOOL_ERR_IO with the reason in tidepool_last_error. Returns
 * TIDEPOOL_OK, TIDEPOOL_ERR_INVALID_ARGUMENT (NULL or non-UTF-8 path),
 * TIDEPOOL_ERR_IO or TIDEPOOL_ERR_INTERNAL. */
int tidepool_dump_snapshot(const char* path);

/* Copies this thread's last error into buf (NUL-terminated, cut to len - 1
 * bytes); returns its full length (0: none). buf may be NULL to ask the length. */
size_t tidepool_last_error(char* buf, size_t len);

/* Checks a TIDEPOOL_CONF string without starting anything: writes its
 * problems into buf as tidepool_last_error does (one a line, worded as the
 * warnings TIDEPOOL_CONF would print; an entry that is not UTF-8 is one)
 * and returns how many there are (0: none); -1 when conf is NULL. */
int tidepool_check_conf(const char* conf, char* buf, size_t len);

/* Tags, for sleep and wake: every allocation carries the calling thread's
 * tag ("default" unless set). A tag's memory comes from pages of its own, so
 * it can be paused (every page given back to the device, addresses kept
 * reserved: pointers and CUDA graphs stay valid) and resumed (the pages
 * mapped again at the same addresses). Errors change nothing. */

/* Sets the calling thread's tag for its later allocations (NULL:
 * "default"). Returns TIDEPOOL_OK or TIDEPOOL_ERR_INVALID_ARGUMENT (empty,
 * longer than 63 bytes, not UTF-8, or a new name past the 1,024 a process
 * may use, "default" included). */
int tidepool_set_tag(const char* tag);

/* Waits for the work queued on the streams that used tag's blocks, then
 * gives every page of tag on device (-1: every device) back. flags:
 * TIDEPOOL_PAUSE_OFFLOAD copies the live blocks' contents to pinned host
 * memory first (one copy per run of pages) and restores them at resume; 0
 * discards them. Allocating under a paused tag fails (the error names it);
 * freeing a paused block is allowed. Returns TIDEPOOL_OK, or
 * TIDEPOOL_ERR_INVALID_ARGUMENT, TIDEPOOL_ERR_INVALID_DEVICE,
 * TIDEPOOL_ERR_TAG_STATE (unknown tag, "default", already paused, a CUDA
 * graph capture or private pool open), TIDEPOOL_ERR_OUT_OF_MEMORY (no host
 * memory for the offload: nothing was released). */
int tidepool_pause(const char* tag, int device, int flags);

/* Maps tag's pages on device (-1: every device where it is paused) again at
 * the same addresses, copies offloaded contents back, and returns once the
 * memory is usable. When the device is full, tidepool releases its other
 * cache, then asks the other processes; failing that it returns
 * TIDEPOOL_ERR_OUT_OF_MEMORY with nothing mapped, the tag still paused and
 * its saved contents intact. TIDEPOOL_ERR_TAG_STATE: unknown or not paused. */
int tidepool_resume(const char* tag, int device);

/* Fills *out with what tag holds on device; returns TIDEPOOL_OK or a
 * TIDEPOOL_ERR_* code (TIDEPOOL_ERR_TAG_STATE: a tag no thread ever set). */
int tidepool_get_tag_stats(const char* tag, int device, tidepool_tag_stats* out);

#ifdef __cplusplus
}
#endif

#endif /* TIDEPOOL_H */
