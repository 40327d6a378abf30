/* simgpu: a stand-in libcuda.so for tests on machines without a GPU.
 *
 * It implements, on host memory, the part of the CUDA driver API that
 * tidepool calls, so CI runs the real `cuda` backend code:
 *   - devices (SIMGPU_DEVICES, default 1) of SIMGPU_CAPACITY bytes each
 *     (default 1 GiB; suffixes K, M, G), primary contexts, UUIDs;
 *   - SIMGPU_SHARED=<file>: the bytes in use are counted in that file, shared
 *     by every process naming it, so cuMemGetInfo sees them all and one
 *     capacity is shared, as processes share a GPU; each process counts in
 *     a slot of its own, and the memory of a process that exited or was
 *     killed comes back as the driver gives it back;
 *   - cuMemAlloc/cuMemFree/cuMemGetInfo with real OOM at the capacity;
 *   - asynchronous streams: a worker thread per stream runs queued work in
 *     order; events complete when their stream reaches them; cuMemFree
 *     waits for every stream, like the driver;
 *   - test entry points (simgpu_*) to queue sleeps, fills and checks of
 *     memory on a stream, to name which allocation owns a range, to count
 *     driver calls (VMM maps, event queries, allocations and unmaps in relaxed capture
 *     mode), and to read the
 *     use-after-free detector: a queued write that lands in a
 *     range owned by another allocation by the time it runs is counted;
 *   - cuThreadExchangeStreamCaptureMode (a per-thread mode) and
 *     cuStreamIsCapturing (nothing captures, but a test may say a stream does);
 *   - virtual memory management: cuMemAddressReserve/Free reserve
 *     inaccessible address space, cuMemCreate makes a physical allocation
 *     (a memfd, counted against the capacity), cuMemMap maps it at a
 *     reserved address, cuMemSetAccess makes it read-write, cuMemUnmap puts
 *     the reservation back, and cuMemRelease frees the memory once its last
 *     mapping is gone, as the driver does; 2 MiB granularity;
 *   - what cudarc needs besides: device attributes (all 0), copies
 *     between host and device (cuMemcpyHtoDAsync/DtoHAsync/DtoDAsync,
 *     cuMemsetD8Async) queued in stream order, the host ones returning
 *     once done (pageable memory), and modules whose PTX is not compiled:
 *     cuModuleGetFunction knows the kernels simgpu runs on the host
 *     (`tidepool_layer`: out[i] = in[i] * w + b), and cuLaunchKernel queues
 *     them on the stream with their arguments copied at launch; an event
 *     may be destroyed while streams still wait on it (cudarc's join);
 *   - latency (SIMGPU_LATENCY_US) and fault injection: SIMGPU_FAIL_EVERY=N
 *     (every Nth cuMemAlloc or cuMemCreate reports out of memory), SIMGPU_FAIL_FREE_EVERY=N
 *     (every Nth cuMemFree fails and frees nothing), SIMGPU_FAIL_UNMAP_EVERY=N
 *     (every Nth cuMemUnmap fails and unmaps nothing), SIMGPU_FAIL_EVENTS=1
 *     (cuEventRecord fails), SIMGPU_FAIL_HOST_ALLOC=1 (cuMemHostAlloc
 *     reports out of memory);
 *   - pinned host memory (cuMemHostAlloc/cuMemFreeHost: anonymous memory,
 *     counted for tests by simgpu_host_allocs) and the synchronous copies
 *     cuMemcpyHtoD/DtoH, which wait for every stream first as the legacy
 *     default stream does (a paused tag's offload and restore).
 * Build: cc -shared -fPIC -O2 -pthread simgpu.c -o libcuda.so
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <pthread.h>
#include <sys/mman.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct simgpu_ctx *CUcontext;
typedef struct simgpu_stream *CUstream;
typedef struct simgpu_event *CUevent;
typedef struct { char bytes[16]; } CUuuid;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_UNKNOWN = 999,
};

#define MAX_DEVICES 16
#define MAX_ALLOCS 65536
#define MAX_OWNERS 65536

struct simgpu_ctx { int device; };

struct alloc_rec { uintptr_t base; size_t size; int device; };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static int device_count = 1;
static size_t capacity = (size_t)1 << 30;
/* Bytes in use per device, without SIMGPU_SHARED. */
static size_t local_used[MAX_DEVICES];

/* With SIMGPU_SHARED: the file, mapped. One slot per process: its pid and
 * its bytes per device. A device's use is the sum over the slots of live
 * processes; a slot whose process is gone (exited, killed, a zombie) is
 * cleared when capacity is claimed or queried, and taken by the next
 * process to join. Claims are serialized across processes by flock on the
 * file, which the kernel drops if its holder dies; within a process by
 * `lock`. A process changes only its own slot's counts (atomically). */
#define SHARED_MAGIC 0x3230757067696d73ULL /* "simgpu02" */
#define SHARED_SLOTS 128
struct shared_slot { int32_t pid; int32_t spare; size_t used[MAX_DEVICES]; };
struct shared_file { uint64_t magic; uint64_t spare; struct shared_slot slots[SHARED_SLOTS]; };
static struct shared_file *shared;
static int shared_fd = -1;
static int my_slot = -1;
static pid_t my_pid;
static struct simgpu_ctx contexts[MAX_DEVICES];
static __thread CUcontext current;
static struct alloc_rec allocs[MAX_ALLOCS];
static long fail_every, alloc_calls, fail_free_every, free_calls, fail_unmap_every, fail_events, fail_host_alloc;
static long latency_us;

/* Ownership of ranges, named by the tests, for the use-after-free detector. */
struct owner { uintptr_t base; size_t size; uint64_t tag; };
static struct owner owners[MAX_OWNERS];
static long owner_overflows;
static long violations;

static size_t parse_size(const char *text, size_t fallback) {
    if (!text || !*text) return fallback;
    char *end;
    double v = strtod(text, &end);
    switch (*end) {
    case 'K': case 'k': v *= 1024.0; break;
    case 'M': case 'm': v *= 1024.0 * 1024; break;
    case 'G': case 'g': v *= 1024.0 * 1024 * 1024; break;
    default: break;
    }
    return v > 0 ? (size_t)v : fallback;
}

/* Whether `pid` runs: a zombie has exited, and its memory is gone. */
static int process_alive(pid_t pid) {
    if (pid <= 0) return 0;
    if (kill(pid, 0) != 0 && errno != EPERM) return 0;
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return 1;
    char buf[512];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *end = strrchr(buf, ')'); /* the name may hold spaces and parentheses */
    return !(end && end[1] == ' ' && end[2] == 'Z');
}

/* Maps the shared file (made, or remade from another layout, if needed).
 * Without it, this process counts alone. */
static void open_shared(const char *path) {
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return;
    void *map = MAP_FAILED;
    if (flock(fd, LOCK_EX) == 0) {
        if (ftruncate(fd, sizeof *shared) == 0)
            map = mmap(NULL, sizeof *shared, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (map != MAP_FAILED) {
            struct shared_file *file = map;
            if (file->magic != SHARED_MAGIC) {
                memset(file, 0, sizeof *file);
                file->magic = SHARED_MAGIC;
            }
        }
        flock(fd, LOCK_UN);
    }
    if (map == MAP_FAILED) {
        close(fd);
        return;
    }
    shared = map;
    shared_fd = fd;
}

/* The bytes in use on `device` by live processes; clears the slots of the
 * dead. `lock` and the file's flock held. */
static size_t shared_in_use(int device) {
    size_t total = 0;
    for (int i = 0; i < SHARED_SLOTS; i++) {
        struct shared_slot *s = &shared->slots[i];
        pid_t pid = __atomic_load_n(&s->pid, __ATOMIC_SEQ_CST);
        if (pid == 0) continue;
        if (!(i == my_slot && pid == my_pid && pid == getpid()) && !process_alive(pid)) {
            memset(s->used, 0, sizeof s->used);
            __atomic_store_n(&s->pid, 0, __ATOMIC_SEQ_CST);
            continue;
        }
        total += __atomic_load_n(&s->used[device], __ATOMIC_SEQ_CST);
    }
    return total;
}

/* This process's slot, taken if it has none yet (or is a fork child of the
 * process that took it): a free one, dead slots being cleared by
 * shared_in_use first. NULL when every slot is taken. Both locks held. */
static struct shared_slot *own_slot(void) {
    pid_t pid = getpid();
    if (my_slot >= 0 && my_pid == pid) return &shared->slots[my_slot];
    for (int i = 0; i < SHARED_SLOTS; i++) {
        struct shared_slot *s = &shared->slots[i];
        if (s->pid != 0) continue;
        memset(s->used, 0, sizeof s->used);
        __atomic_store_n(&s->pid, pid, __ATOMIC_SEQ_CST);
        my_slot = i;
        my_pid = pid;
        return s;
    }
    fprintf(stderr, "simgpu: SIMGPU_SHARED: all %d slots are taken by live processes\n", SHARED_SLOTS);
    return NULL;
}

/* The bytes in use on `device` (every process's with SIMGPU_SHARED). Lock held. */
static size_t in_use(int device) {
    if (!shared) return __atomic_load_n(&local_used[device], __ATOMIC_SEQ_CST);
    flock(shared_fd, LOCK_EX);
    size_t total = shared_in_use(device);
    flock(shared_fd, LOCK_UN);
    return total;
}

/* Gives back `bytes` of `device` claimed by this process. */
static void unclaim(int device, size_t bytes) {
    if (!shared) {
        __atomic_sub_fetch(&local_used[device], bytes, __ATOMIC_SEQ_CST);
        return;
    }
    if (my_slot < 0 || my_pid != getpid()) return; /* a fork child: the parent's memory */
    size_t *count = &shared->slots[my_slot].used[device];
    size_t seen = __atomic_load_n(count, __ATOMIC_SEQ_CST);
    while (!__atomic_compare_exchange_n(count, &seen, seen > bytes ? seen - bytes : 0, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
}

CUresult cuInit(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&lock);
    if (!initialized) {
        const char *d = getenv("SIMGPU_DEVICES");
        if (d && atoi(d) > 0 && atoi(d) <= MAX_DEVICES) device_count = atoi(d);
        capacity = parse_size(getenv("SIMGPU_CAPACITY"), capacity);
        const char *f = getenv("SIMGPU_FAIL_EVERY");
        fail_every = f ? atol(f) : 0;
        const char *ff = getenv("SIMGPU_FAIL_FREE_EVERY");
        fail_free_every = ff ? atol(ff) : 0;
        const char *fu = getenv("SIMGPU_FAIL_UNMAP_EVERY");
        fail_unmap_every = fu ? atol(fu) : 0;
        const char *fe = getenv("SIMGPU_FAIL_EVENTS");
        fail_events = fe ? atol(fe) : 0;
        const char *fh = getenv("SIMGPU_FAIL_HOST_ALLOC");
        fail_host_alloc = fh ? atol(fh) : 0;
        const char *l = getenv("SIMGPU_LATENCY_US");
        latency_us = l ? atol(l) : 0;
        for (int i = 0; i < MAX_DEVICES; i++) contexts[i].device = i;
        const char *path = getenv("SIMGPU_SHARED");
        if (path && *path) open_shared(path);
        initialized = 1;
    }
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = 12080;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int *count) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = device_count;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= device_count) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char *name, int len, CUdevice device) {
    if (device < 0 || device >= device_count) return CUDA_ERROR_INVALID_DEVICE;
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "simgpu %d", device);
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice device) {
    if (device < 0 || device >= device_count) return CUDA_ERROR_INVALID_DEVICE;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    *bytes = capacity;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice device) {
    if (device < 0 || device >= device_count) return CUDA_ERROR_INVALID_DEVICE;
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    memset(uuid->bytes, 0, 16);
    memcpy(uuid->bytes, "simgpu", 6);
    uuid->bytes[15] = (char)device;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (device < 0 || device >= device_count) return CUDA_ERROR_INVALID_DEVICE;
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    *ctx = &contexts[device];
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
    return device >= 0 && device < device_count ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    current = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *ctx) {
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    *ctx = current;
    return CUDA_SUCCESS;
}

static void delay(void) {
    if (latency_us > 0) usleep((useconds_t)latency_us);
}

static void synchronize_all(void);
static void release_now(CUdeviceptr dptr, int *found);

/* Counts one call that takes memory and claims `bytes` of `device`'s
 * capacity: 0 when refused (full, or SIMGPU_FAIL_EVERY). Lock held. The
 * claim is atomic: other processes may share the count (SIMGPU_SHARED). */
static int claim(int device, size_t bytes) {
    alloc_calls++;
    if (fail_every > 0 && alloc_calls % fail_every == 0) return 0;
    if (!shared) {
        if (__atomic_load_n(&local_used[device], __ATOMIC_SEQ_CST) + bytes > capacity) return 0;
        __atomic_add_fetch(&local_used[device], bytes, __ATOMIC_SEQ_CST);
        return 1;
    }
    flock(shared_fd, LOCK_EX);
    struct shared_slot *mine = own_slot();
    int granted = mine && shared_in_use(device) + bytes <= capacity;
    if (granted) __atomic_add_fetch(&mine->used[device], bytes, __ATOMIC_SEQ_CST);
    flock(shared_fd, LOCK_UN);
    return granted;
}

/* Stream capture modes: this thread's (0 global, the default; 2 relaxed),
 * and how many cuMemAlloc and cuMemUnmap calls ran in relaxed mode. */
static __thread int capture_mode;
static long relaxed_allocs, relaxed_unmaps;

/* Calls that take or give back device memory or address space (cuMemAlloc,
 * cuMemFree, cuMemAddressReserve, cuMemAddressFree, cuMemCreate, cuMemMap,
 * cuMemSetAccess, cuMemUnmap, cuMemRelease; cuMemAllocFromPoolAsync,
 * cuMemAllocAsync and cuMemFreeAsync, each one call), as `tidepool replay`
 * counts its driver calls and tidepool's num_driver_calls counts its own. */
static long memory_calls;
#define COUNT_MEMORY_CALL() __atomic_fetch_add(&memory_calls, 1, __ATOMIC_RELAXED)

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytes) {
    COUNT_MEMORY_CALL();
    if (capture_mode == 2) __atomic_fetch_add(&relaxed_allocs, 1, __ATOMIC_RELAXED);
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    if (!dptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    delay();
    int device = current->device;
    pthread_mutex_lock(&lock);
    int refuse = !claim(device, bytes);
    int slot = -1;
    for (int i = 0; i < MAX_ALLOCS && !refuse; i++)
        if (allocs[i].base == 0) { slot = i; break; }
    if (refuse || slot < 0) {
        if (!refuse) unclaim(device, bytes);
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    void *mem = NULL;
    if (posix_memalign(&mem, 4096, bytes) != 0) {
        unclaim(device, bytes);
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    allocs[slot] = (struct alloc_rec){(uintptr_t)mem, bytes, device};
    pthread_mutex_unlock(&lock);
    *dptr = (CUdeviceptr)(uintptr_t)mem;
    return CUDA_SUCCESS;
}

static void release_now(CUdeviceptr dptr, int *found) {
    pthread_mutex_lock(&lock);
    *found = 0;
    for (int i = 0; i < MAX_ALLOCS; i++) {
        if (allocs[i].base == (uintptr_t)dptr && dptr != 0) {
            unclaim(allocs[i].device, allocs[i].size);
            free((void *)allocs[i].base);
            allocs[i] = (struct alloc_rec){0, 0, 0};
            *found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&lock);
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    COUNT_MEMORY_CALL();
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    delay();
    synchronize_all(); /* like the driver: cuMemFree waits for the device */
    if (fail_free_every > 0 && __atomic_add_fetch(&free_calls, 1, __ATOMIC_SEQ_CST) % fail_free_every == 0)
        return CUDA_ERROR_INVALID_VALUE;
    int found;
    release_now(dptr, &found);
    return found ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    if (!free_bytes || !total) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    *total = capacity;
    size_t taken = in_use(current->device);
    *free_bytes = taken < capacity ? capacity - taken : 0;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char **name) {
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
    case CUDA_SUCCESS: *name = "CUDA_SUCCESS"; break;
    case CUDA_ERROR_INVALID_VALUE: *name = "CUDA_ERROR_INVALID_VALUE"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *name = "CUDA_ERROR_OUT_OF_MEMORY"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *name = "CUDA_ERROR_NOT_INITIALIZED"; break;
    case CUDA_ERROR_INVALID_DEVICE: *name = "CUDA_ERROR_INVALID_DEVICE"; break;
    case CUDA_ERROR_INVALID_CONTEXT: *name = "CUDA_ERROR_INVALID_CONTEXT"; break;
    case CUDA_ERROR_INVALID_HANDLE: *name = "CUDA_ERROR_INVALID_HANDLE"; break;
    case CUDA_ERROR_NOT_FOUND: *name = "CUDA_ERROR_NOT_FOUND"; break;
    case CUDA_ERROR_NOT_READY: *name = "CUDA_ERROR_NOT_READY"; break;
    default: *name = "CUDA_ERROR_UNKNOWN"; break;
    }
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char **text) {
    return cuGetErrorName(error, text);
}

/* ---- streams and events ------------------------------------------------ */

enum op_kind { OP_SLEEP, OP_FILL, OP_CHECK, OP_EVENT, OP_WAIT, OP_OWNER, OP_FREE, OP_COPY, OP_LAYER };

struct op {
    enum op_kind kind;
    uintptr_t ptr;
    uintptr_t src; /* OP_COPY: from where; OP_LAYER: the input */
    size_t len;
    float w, b;    /* OP_LAYER's weight and bias */
    unsigned char byte;
    uint64_t tag;
    long micros;
    CUevent event;
    struct op *next;
};

struct simgpu_stream {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct op *head, *tail;
    long queued, done;
    int stop;
    int capturing; /* set by simgpu_set_capturing: what cuStreamIsCapturing reports */
    struct simgpu_stream *next_stream;
};

struct simgpu_event {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    long recorded, completed;
    /* Queued waits on the event, and whether it was destroyed: as in the
     * driver, an event may be destroyed while streams still wait on it;
     * its memory goes when the last of them has run. */
    long waiters;
    int destroyed;
};

/* One queued wait on e is over (or was never queued); frees a destroyed
 * event when it was the last. */
static void event_unwait(CUevent e) {
    pthread_mutex_lock(&e->mu);
    int gone = --e->waiters == 0 && e->destroyed;
    pthread_mutex_unlock(&e->mu);
    if (gone) free(e);
}

static struct simgpu_stream *streams;
static long check_failures;

static uint64_t owner_of(uintptr_t ptr, size_t len) {
    for (int i = 0; i < MAX_OWNERS; i++)
        if (owners[i].size && ptr >= owners[i].base && ptr + len <= owners[i].base + owners[i].size) return owners[i].tag;
    return 0;
}

int simgpu_set_owner(CUdeviceptr ptr, size_t len, uint64_t tag);

static void event_complete(CUevent e, long generation) {
    pthread_mutex_lock(&e->mu);
    if (generation > e->completed) e->completed = generation;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

static void run(struct op *op) {
    switch (op->kind) {
    case OP_SLEEP: usleep((useconds_t)op->micros); break;
    case OP_FILL:
    case OP_CHECK: {
        pthread_mutex_lock(&lock);
        uint64_t owner = owner_of(op->ptr, op->len);
        if (op->tag && owner != op->tag) violations++;
        pthread_mutex_unlock(&lock);
        if (op->kind == OP_FILL) {
            memset((void *)op->ptr, op->byte, op->len);
        } else {
            const unsigned char *p = (const unsigned char *)op->ptr;
            for (size_t i = 0; i < op->len; i++)
                if (p[i] != op->byte) { __atomic_add_fetch(&check_failures, 1, __ATOMIC_SEQ_CST); break; }
        }
        break;
    }
    case OP_COPY: memmove((void *)op->ptr, (const void *)op->src, op->len); break;
    case OP_LAYER: {
        const float *in = (const float *)op->src;
        float *out = (float *)op->ptr;
        for (size_t i = 0; i < op->len; i++) out[i] = (float)((double)in[i] * op->w + op->b);
        break;
    }
    case OP_EVENT: event_complete(op->event, (long)op->tag); break;
    case OP_OWNER: simgpu_set_owner((CUdeviceptr)op->ptr, op->len, op->tag); break;
    case OP_FREE: {
        int found;
        release_now((CUdeviceptr)op->ptr, &found);
        break;
    }
    case OP_WAIT: {
        CUevent e = op->event;
        pthread_mutex_lock(&e->mu);
        while (e->completed < (long)op->tag) pthread_cond_wait(&e->cv, &e->mu);
        pthread_mutex_unlock(&e->mu);
        event_unwait(e);
        break;
    }
    }
}

static void *worker(void *arg) {
    struct simgpu_stream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->head && !s->stop) pthread_cond_wait(&s->cv, &s->mu);
        if (!s->head && s->stop) break;
        struct op *op = s->head;
        s->head = op->next;
        if (!s->head) s->tail = NULL;
        pthread_mutex_unlock(&s->mu);
        run(op);
        free(op);
        pthread_mutex_lock(&s->mu);
        s->done++;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* Whether s is a stream this library made and has not destroyed: an
 * unknown handle is an error, as a careful driver reports it. */
static int known_stream(CUstream s) {
    pthread_mutex_lock(&lock);
    int known = 0;
    for (struct simgpu_stream *p = streams; p; p = p->next_stream)
        if (p == s) { known = 1; break; }
    pthread_mutex_unlock(&lock);
    return known;
}

static CUresult enqueue(CUstream s, struct op op) {
    if (s && !known_stream(s)) return CUDA_ERROR_INVALID_HANDLE;
    if (!s) {
        /* The default stream runs work at once, in order, on the caller. */
        run(&op);
        return CUDA_SUCCESS;
    }
    struct op *copy = malloc(sizeof *copy);
    if (!copy) return CUDA_ERROR_OUT_OF_MEMORY;
    *copy = op;
    copy->next = NULL;
    pthread_mutex_lock(&s->mu);
    if (s->tail) s->tail->next = copy; else s->head = copy;
    s->tail = copy;
    s->queued++;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return CUDA_SUCCESS;
}

CUresult cuStreamCreate(CUstream *out, unsigned int flags) {
    (void)flags;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    struct simgpu_stream *s = calloc(1, sizeof *s);
    if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_create(&s->thread, NULL, worker, s);
    pthread_mutex_lock(&lock);
    s->next_stream = streams;
    streams = s;
    pthread_mutex_unlock(&lock);
    *out = s;
    return CUDA_SUCCESS;
}

CUresult cuStreamSynchronize(CUstream s) {
    if (!s) return CUDA_SUCCESS;
    if (!known_stream(s)) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&s->mu);
    long target = s->queued;
    while (s->done < target) pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return CUDA_SUCCESS;
}

static void synchronize_all(void) {
    pthread_mutex_lock(&lock);
    struct simgpu_stream *list = streams;
    pthread_mutex_unlock(&lock);
    for (struct simgpu_stream *s = list; s; s = s->next_stream) {
        pthread_mutex_lock(&s->mu);
        long target = s->queued;
        while (s->done < target) pthread_cond_wait(&s->cv, &s->mu);
        pthread_mutex_unlock(&s->mu);
    }
}

CUresult cuCtxSynchronize(void) {
    synchronize_all();
    return CUDA_SUCCESS;
}

CUresult cuStreamDestroy_v2(CUstream s) {
    if (!s || !known_stream(s)) return CUDA_ERROR_INVALID_HANDLE;
    cuStreamSynchronize(s);
    pthread_mutex_lock(&lock);
    for (struct simgpu_stream **p = &streams; *p; p = &(*p)->next_stream)
        if (*p == s) { *p = s->next_stream; break; }
    pthread_mutex_unlock(&lock);
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    free(s);
    return CUDA_SUCCESS;
}

CUresult cuEventCreate(CUevent *out, unsigned int flags) {
    (void)flags;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    struct simgpu_event *e = calloc(1, sizeof *e);
    if (!e) return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    *out = e;
    return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent e, CUstream s) {
    if (!e || fail_events) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&e->mu);
    long generation = ++e->recorded;
    pthread_mutex_unlock(&e->mu);
    return enqueue(s, (struct op){.kind = OP_EVENT, .event = e, .tag = (uint64_t)generation});
}

static long event_queries;

CUresult cuEventQuery(CUevent e) {
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    __atomic_fetch_add(&event_queries, 1, __ATOMIC_RELAXED);
    pthread_mutex_lock(&e->mu);
    int done = e->completed >= e->recorded;
    pthread_mutex_unlock(&e->mu);
    return done ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUresult cuEventSynchronize(CUevent e) {
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&e->mu);
    while (e->completed < e->recorded) pthread_cond_wait(&e->cv, &e->mu);
    pthread_mutex_unlock(&e->mu);
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent e) {
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    cuEventSynchronize(e);
    pthread_mutex_lock(&e->mu);
    e->destroyed = 1;
    int gone = e->waiters == 0;
    pthread_mutex_unlock(&e->mu);
    if (gone) free(e);
    return CUDA_SUCCESS;
}

CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int flags) {
    (void)flags;
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    pthread_mutex_lock(&e->mu);
    long generation = e->recorded;
    e->waiters++;
    pthread_mutex_unlock(&e->mu);
    CUresult rc = enqueue(s, (struct op){.kind = OP_WAIT, .event = e, .tag = (uint64_t)generation});
    if (rc != CUDA_SUCCESS) event_unwait(e);
    return rc;
}

/* ---- copies, attributes, modules and kernels (what cudarc calls) -------- */

CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device) {
    (void)attribute;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    if (device < 0 || device >= device_count) return CUDA_ERROR_INVALID_DEVICE;
    *value = 0;
    return CUDA_SUCCESS;
}

/* Queues a copy on s; `wait`: returns once it ran (host memory that may be
 * pageable, as the driver does for it). */
static CUresult queue_copy(CUstream s, uintptr_t dst, uintptr_t src, size_t len, int wait) {
    if (len == 0) return CUDA_SUCCESS;
    if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
    CUresult rc = enqueue(s, (struct op){.kind = OP_COPY, .ptr = dst, .src = src, .len = len});
    if (rc != CUDA_SUCCESS || !wait) return rc;
    return cuStreamSynchronize(s);
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t len, CUstream s) {
    return queue_copy(s, (uintptr_t)dst, (uintptr_t)src, len, 1);
}

CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t len, CUstream s) {
    return queue_copy(s, (uintptr_t)dst, (uintptr_t)src, len, 1);
}

CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t len, CUstream s) {
    return queue_copy(s, (uintptr_t)dst, (uintptr_t)src, len, 0);
}

CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char byte, size_t len, CUstream s) {
    if (len == 0) return CUDA_SUCCESS;
    return enqueue(s, (struct op){.kind = OP_FILL, .ptr = (uintptr_t)dst, .len = len, .byte = byte});
}

/* Synchronous copies: the legacy default stream waits for every stream. */
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t len) {
    if (len == 0) return CUDA_SUCCESS;
    if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
    synchronize_all();
    memcpy((void *)(uintptr_t)dst, src, len);
    return CUDA_SUCCESS;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t len) {
    if (len == 0) return CUDA_SUCCESS;
    if (!dst || !src) return CUDA_ERROR_INVALID_VALUE;
    synchronize_all();
    memcpy(dst, (const void *)(uintptr_t)src, len);
    return CUDA_SUCCESS;
}

/* Pinned host memory: anonymous pages behind a header holding the size. */
#define HOST_HEADER 4096
static long host_alloc_calls, host_allocs_live;

CUresult cuMemHostAlloc(void **pp, size_t bytes, unsigned int flags) {
    (void)flags;
    if (!pp || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    if (fail_host_alloc) return CUDA_ERROR_OUT_OF_MEMORY;
    void *base = mmap(NULL, bytes + HOST_HEADER, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    *(size_t *)base = bytes;
    pthread_mutex_lock(&lock);
    host_alloc_calls++;
    host_allocs_live++;
    pthread_mutex_unlock(&lock);
    *pp = (char *)base + HOST_HEADER;
    return CUDA_SUCCESS;
}

CUresult cuMemFreeHost(void *p) {
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    char *base = (char *)p - HOST_HEADER;
    munmap(base, *(size_t *)base + HOST_HEADER);
    pthread_mutex_lock(&lock);
    host_allocs_live--;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

/* Test entry point: cuMemHostAlloc calls so far; *live: not yet freed. */
long simgpu_host_allocs(long *live) {
    pthread_mutex_lock(&lock);
    long calls = host_alloc_calls;
    if (live) *live = host_allocs_live;
    pthread_mutex_unlock(&lock);
    return calls;
}

typedef struct simgpu_module *CUmodule;
typedef const struct simgpu_kernel *CUfunction;
struct simgpu_module { int loaded; };
struct simgpu_kernel { const char *name; };

/* The kernels simgpu runs, whatever PTX a module was loaded from. */
static const struct simgpu_kernel known_kernels[] = {{"tidepool_layer"}};

CUresult cuModuleLoadData(CUmodule *module, const void *image) {
    if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    struct simgpu_module *m = calloc(1, sizeof *m);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    m->loaded = 1;
    *module = m;
    return CUDA_SUCCESS;
}

CUresult cuModuleUnload(CUmodule module) {
    if (!module) return CUDA_ERROR_INVALID_HANDLE;
    free(module);
    return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction *function, CUmodule module, const char *name) {
    if (!function || !module || !name) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < sizeof known_kernels / sizeof known_kernels[0]; i++)
        if (strcmp(known_kernels[i].name, name) == 0) { *function = &known_kernels[i]; return CUDA_SUCCESS; }
    return CUDA_ERROR_NOT_FOUND;
}

/* tidepool_layer(const float *in, float *out, float w, float b, unsigned n):
 * thread i of the grid computes out[i] = in[i] * w + b when i < n. The
 * arguments are read at launch, as the driver does. */
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, CUstream s, void **params, void **extra) {
    (void)shared;
    (void)extra;
    if (f != &known_kernels[0] || !params) return CUDA_ERROR_INVALID_VALUE;
    CUdeviceptr in = *(CUdeviceptr *)params[0], out = *(CUdeviceptr *)params[1];
    float w = *(float *)params[2], b = *(float *)params[3];
    unsigned n = *(unsigned *)params[4];
    size_t threads = (size_t)gx * gy * gz * bx * by * bz;
    size_t len = n < threads ? n : threads;
    if (len && (!in || !out)) return CUDA_ERROR_INVALID_VALUE;
    return enqueue(s, (struct op){.kind = OP_LAYER, .ptr = (uintptr_t)out, .src = (uintptr_t)in, .len = len, .w = w, .b = b});
}

/* ---- virtual memory management (expandable segments) -------------------- */

#define SIMGPU_GRANULARITY ((size_t)2 << 20)
#define MAX_HANDLES 65536
#define MAX_MAPPINGS 65536
#define MAX_RESERVATIONS 1024

typedef unsigned long long CUmemGenericAllocationHandle;
/* Only the fields simgpu reads; the caller's struct is larger. */
struct mem_location { int type; int id; };
struct mem_prop { int type; int handle_types; struct mem_location location; };

struct handle_rec { int fd; size_t size; int device; int mappings; int released; };
struct mapping_rec { uintptr_t addr; size_t size; long handle; };
struct reservation_rec { uintptr_t base; size_t size; };

/* Slot i of `handles` is handle i + 1 (0 is never a handle). */
static struct handle_rec handles[MAX_HANDLES];
static struct mapping_rec mappings[MAX_MAPPINGS];
static struct reservation_rec reservations[MAX_RESERVATIONS];
static long vm_map_calls, vm_unmap_calls;

static struct reservation_rec *reservation_of(uintptr_t addr, size_t size) {
    for (int i = 0; i < MAX_RESERVATIONS; i++)
        if (reservations[i].size && addr >= reservations[i].base && addr + size <= reservations[i].base + reservations[i].size)
            return &reservations[i];
    return NULL;
}

static int overlaps_mapping(uintptr_t addr, size_t size) {
    for (int i = 0; i < MAX_MAPPINGS; i++)
        if (mappings[i].size && addr < mappings[i].addr + mappings[i].size && mappings[i].addr < addr + size) return 1;
    return 0;
}

/* Frees a handle's memory when it is released and no longer mapped. Lock held. */
static void drop_handle_if_done(long h) {
    struct handle_rec *rec = &handles[h - 1];
    if (!rec->released || rec->mappings > 0) return;
    unclaim(rec->device, rec->size);
    close(rec->fd);
    *rec = (struct handle_rec){0, 0, 0, 0, 0};
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const void *prop, int option) {
    (void)option;
    if (!granularity || !prop) return CUDA_ERROR_INVALID_VALUE;
    *granularity = SIMGPU_GRANULARITY;
    return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr, unsigned long long flags) {
    COUNT_MEMORY_CALL();
    (void)addr;
    (void)flags;
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ptr || size == 0 || size % SIMGPU_GRANULARITY) return CUDA_ERROR_INVALID_VALUE;
    size_t align = alignment > SIMGPU_GRANULARITY ? alignment : SIMGPU_GRANULARITY;
    char *raw = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    uintptr_t base = ((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1);
    if (base > (uintptr_t)raw) munmap(raw, base - (uintptr_t)raw);
    size_t tail = (uintptr_t)raw + size + align - (base + size);
    if (tail) munmap((void *)(base + size), tail);
    pthread_mutex_lock(&lock);
    int slot = -1;
    for (int i = 0; i < MAX_RESERVATIONS; i++)
        if (!reservations[i].size) { slot = i; break; }
    if (slot < 0) {
        pthread_mutex_unlock(&lock);
        munmap((void *)base, size);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    reservations[slot] = (struct reservation_rec){base, size};
    pthread_mutex_unlock(&lock);
    *ptr = (CUdeviceptr)base;
    return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    COUNT_MEMORY_CALL();
    pthread_mutex_lock(&lock);
    struct reservation_rec *r = reservation_of((uintptr_t)ptr, size);
    if (!r || r->base != (uintptr_t)ptr || r->size != size || overlaps_mapping(r->base, r->size)) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE; /* unknown, partial, or still mapped */
    }
    *r = (struct reservation_rec){0, 0};
    pthread_mutex_unlock(&lock);
    munmap((void *)(uintptr_t)ptr, size);
    return CUDA_SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const void *prop, unsigned long long flags) {
    COUNT_MEMORY_CALL();
    (void)flags;
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    const struct mem_prop *p = prop;
    if (!handle || !p || size == 0 || size % SIMGPU_GRANULARITY) return CUDA_ERROR_INVALID_VALUE;
    int device = p->location.id;
    if (device < 0 || device >= device_count) return CUDA_ERROR_INVALID_DEVICE;
    delay();
    pthread_mutex_lock(&lock);
    int refuse = !claim(device, size);
    int slot = -1;
    for (int i = 0; i < MAX_HANDLES && !refuse; i++)
        if (!handles[i].size) { slot = i; break; }
    int fd = (refuse || slot < 0) ? -1 : memfd_create("simgpu", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) close(fd);
        if (!refuse) unclaim(device, size);
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    handles[slot] = (struct handle_rec){fd, size, device, 0, 0};
    pthread_mutex_unlock(&lock);
    *handle = (CUmemGenericAllocationHandle)(slot + 1);
    return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    COUNT_MEMORY_CALL();
    pthread_mutex_lock(&lock);
    long h = (long)handle;
    if (h < 1 || h > MAX_HANDLES || !handles[h - 1].size || handles[h - 1].released) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE;
    }
    handles[h - 1].released = 1;
    drop_handle_if_done(h);
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle, unsigned long long flags) {
    COUNT_MEMORY_CALL();
    (void)flags;
    uintptr_t addr = (uintptr_t)ptr;
    pthread_mutex_lock(&lock);
    vm_map_calls++;
    long h = (long)handle;
    int bad = h < 1 || h > MAX_HANDLES || !handles[h - 1].size || handles[h - 1].released || offset + size > handles[h - 1].size ||
              size == 0 || addr % SIMGPU_GRANULARITY || size % SIMGPU_GRANULARITY || !reservation_of(addr, size) ||
              overlaps_mapping(addr, size);
    int slot = -1;
    for (int i = 0; i < MAX_MAPPINGS && !bad; i++)
        if (!mappings[i].size) { slot = i; break; }
    if (bad || slot < 0) {
        pthread_mutex_unlock(&lock);
        return bad ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_OUT_OF_MEMORY;
    }
    /* Inaccessible until cuMemSetAccess, as on the device. */
    void *at = mmap((void *)addr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handles[h - 1].fd, (off_t)offset);
    if (at == MAP_FAILED) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    mappings[slot] = (struct mapping_rec){addr, size, h};
    handles[h - 1].mappings++;
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

/* Whether [addr, addr + size) is covered by mappings exactly. Lock held. */
static int fully_mapped(uintptr_t addr, size_t size) {
    for (uintptr_t at = addr; at < addr + size;) {
        int found = 0;
        for (int i = 0; i < MAX_MAPPINGS; i++)
            if (mappings[i].size && mappings[i].addr == at) { at += mappings[i].size; found = 1; break; }
        if (!found) return 0;
    }
    return 1;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const void *desc, size_t count) {
    COUNT_MEMORY_CALL();
    if (!desc || count == 0) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&lock);
    int ok = fully_mapped((uintptr_t)ptr, size) && mprotect((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE) == 0;
    pthread_mutex_unlock(&lock);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    COUNT_MEMORY_CALL();
    if (capture_mode == 2) __atomic_fetch_add(&relaxed_unmaps, 1, __ATOMIC_RELAXED);
    uintptr_t addr = (uintptr_t)ptr;
    pthread_mutex_lock(&lock);
    vm_unmap_calls++;
    if (fail_unmap_every > 0 && vm_unmap_calls % fail_unmap_every == 0) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_UNKNOWN;
    }
    if (!fully_mapped(addr, size)) {
        pthread_mutex_unlock(&lock);
        return CUDA_ERROR_INVALID_VALUE; /* only whole mappings can be unmapped */
    }
    /* The reservation comes back in place of the memory. */
    mmap((void *)addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    for (int i = 0; i < MAX_MAPPINGS; i++) {
        if (mappings[i].size && mappings[i].addr >= addr && mappings[i].addr < addr + size) {
            long h = mappings[i].handle;
            mappings[i] = (struct mapping_rec){0, 0, 0};
            handles[h - 1].mappings--;
            drop_handle_if_done(h);
        }
    }
    pthread_mutex_unlock(&lock);
    return CUDA_SUCCESS;
}

/* Test entry point: calls that took or gave back device memory so far. */
long simgpu_memory_calls(void) { return __atomic_load_n(&memory_calls, __ATOMIC_RELAXED); }

/* Test entry point: cuMemMap and cuMemUnmap calls so far. */
void simgpu_vm_calls(long *maps, long *unmaps) {
    pthread_mutex_lock(&lock);
    *maps = vm_map_calls;
    *unmaps = vm_unmap_calls;
    pthread_mutex_unlock(&lock);
}

CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
    if (!mode) return CUDA_ERROR_INVALID_VALUE;
    int previous = capture_mode;
    capture_mode = *mode;
    *mode = previous;
    return CUDA_SUCCESS;
}

/* Test entry point: cuMemAlloc calls made in relaxed capture mode so far,
 * and the calling thread's mode now. */
long simgpu_relaxed_allocs(int *mode_now) {
    if (mode_now) *mode_now = capture_mode;
    return __atomic_load_n(&relaxed_allocs, __ATOMIC_RELAXED);
}

/* Test entry point: cuMemUnmap calls made in relaxed capture mode so far. */
long simgpu_relaxed_unmaps(void) {
    return __atomic_load_n(&relaxed_unmaps, __ATOMIC_RELAXED);
}

/* Nothing is ever captured; a test marks a stream as capturing to see how
 * callers react. The default stream never captures. */
CUresult cuStreamIsCapturing(CUstream s, int *status) {
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    if (s && !known_stream(s)) return CUDA_ERROR_INVALID_HANDLE;
    *status = s ? __atomic_load_n(&s->capturing, __ATOMIC_RELAXED) : 0;
    return CUDA_SUCCESS;
}

/* Test entry point: what cuStreamIsCapturing reports for s (1: active). */
CUresult simgpu_set_capturing(CUstream s, int capturing) {
    if (!s || !known_stream(s)) return CUDA_ERROR_INVALID_HANDLE;
    __atomic_store_n(&s->capturing, capturing, __ATOMIC_RELAXED);
    return CUDA_SUCCESS;
}

/* Test entry point: cuEventQuery calls so far. */
long simgpu_event_queries(void) {
    return __atomic_load_n(&event_queries, __ATOMIC_RELAXED);
}

/* ---- stream-ordered allocation (cudaMallocAsync) ----------------------- */

typedef struct simgpu_pool *CUmemoryPool;
struct simgpu_pool { int device; };
static struct simgpu_pool pools[MAX_DEVICES];

CUresult cuMemPoolCreate(CUmemoryPool *pool, const void *props) {
    if (!pool || !props) return CUDA_ERROR_INVALID_VALUE;
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    pools[current->device].device = current->device;
    *pool = &pools[current->device];
    return CUDA_SUCCESS;
}

CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    return pool ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value) {
    (void)attr;
    return pool && value ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* Memory freed with cuMemFreeAsync goes back when its stream reaches the
 * free, so there is never more to trim. */
CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
    (void)keep;
    return pool ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

/* The stream-ordered allocations are cuMemAlloc_v2's, which counts them;
 * one refused before it is counted here. */
CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytes, CUmemoryPool pool, CUstream s) {
    if (!pool) return COUNT_MEMORY_CALL(), CUDA_ERROR_INVALID_VALUE;
    if (s && !known_stream(s)) return COUNT_MEMORY_CALL(), CUDA_ERROR_INVALID_HANDLE;
    return cuMemAlloc_v2(dptr, bytes);
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytes, CUstream s) {
    if (s && !known_stream(s)) return COUNT_MEMORY_CALL(), CUDA_ERROR_INVALID_HANDLE;
    return cuMemAlloc_v2(dptr, bytes);
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream s) {
    COUNT_MEMORY_CALL();
    if (!dptr) return CUDA_ERROR_INVALID_VALUE;
    return enqueue(s, (struct op){.kind = OP_FREE, .ptr = (uintptr_t)dptr});
}

/* ---- test entry points ------------------------------------------------- */

/* Queues a sleep of `micros` on stream s. */
CUresult simgpu_enqueue_sleep(CUstream s, long micros) {
    return enqueue(s, (struct op){.kind = OP_SLEEP, .micros = micros});
}

/* Queues a write of `byte` over [ptr, ptr+len) by the allocation `tag`. */
CUresult simgpu_enqueue_fill(CUstream s, CUdeviceptr ptr, size_t len, unsigned char byte, uint64_t tag) {
    return enqueue(s, (struct op){.kind = OP_FILL, .ptr = (uintptr_t)ptr, .len = len, .byte = byte, .tag = tag});
}

/* Queues a check that [ptr, ptr+len) holds `byte` (failures: simgpu_check_failures). */
CUresult simgpu_enqueue_check(CUstream s, CUdeviceptr ptr, size_t len, unsigned char byte, uint64_t tag) {
    return enqueue(s, (struct op){.kind = OP_CHECK, .ptr = (uintptr_t)ptr, .len = len, .byte = byte, .tag = tag});
}

/* Names `tag` the owner of [ptr, ptr+len) from now on (tag 0: no owner).
 * Whatever owned any part of the range before owns none of it any more. */
int simgpu_set_owner(CUdeviceptr ptr, size_t len, uint64_t tag) {
    uintptr_t lo = (uintptr_t)ptr, hi = (uintptr_t)ptr + len;
    pthread_mutex_lock(&lock);
    int slot = -1;
    for (int i = 0; i < MAX_OWNERS; i++) {
        if (owners[i].size && owners[i].base < hi && lo < owners[i].base + owners[i].size)
            owners[i] = (struct owner){0, 0, 0};
        if (!owners[i].size && slot < 0) slot = i;
    }
    if (slot >= 0 && tag) owners[slot] = (struct owner){lo, len, tag};
    if (slot < 0 && tag) owner_overflows++; /* the range is left ownerless: later checks would misfire */
    pthread_mutex_unlock(&lock);
    return slot >= 0 ? 0 : -1;
}

/* Test entry point: owners that did not fit in the table (MAX_OWNERS). A
 * test whose count is not 0 outran the detector: its violations mean nothing. */
long simgpu_owner_overflows(void) {
    pthread_mutex_lock(&lock);
    long n = owner_overflows;
    pthread_mutex_unlock(&lock);
    return n;
}

/* Names `tag` the owner of the range when stream s reaches this point: an
 * allocation owns its block from the moment its stream's work can touch it. */
CUresult simgpu_enqueue_set_owner(CUstream s, CUdeviceptr ptr, size_t len, uint64_t tag) {
    return enqueue(s, (struct op){.kind = OP_OWNER, .ptr = (uintptr_t)ptr, .len = len, .tag = tag});
}

/* Writes queued by an allocation that no longer owned the range when they ran. */
long simgpu_violations(void) {
    pthread_mutex_lock(&lock);
    long v = violations;
    pthread_mutex_unlock(&lock);
    return v;
}

long simgpu_check_failures(void) {
    return __atomic_load_n(&check_failures, __ATOMIC_SEQ_CST);
}
