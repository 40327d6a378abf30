/* fork() at any moment, through the C ABI (what PyTorch's DataLoader does
 * to a process whose other threads allocate): the main thread uses
 * tidepool, WORKERS threads allocate, free and read statistics without
 * pause, one more thread keeps starting and ending threads that use
 * tidepool, and the main thread forks FORKS times. Every child allocates,
 * frees, reads exact statistics, empties its cache, then leaves with
 * exit(0) (every other child: atexit handlers and thread-local
 * destructors run) or _exit(0), under an alarm: a child that hangs is
 * killed by SIGALRM, and the test stops there. The parent checks its own figures after
 * each fork. Run by tests/processes/fork.rs with each configuration;
 * prints "fork_test: N forks, 0 hangs, 0 failures" and exits 0, or names
 * what went wrong and exits 1.
 *
 * usage: fork_test FORKS WORKERS */
#include "tidepool.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define MIB ((size_t)1 << 20)
/* The most a child may take; a hung one is killed then. */
#define CHILD_ALARM_SECONDS 20

static atomic_int stop;
static atomic_long worker_failures;

/* Allocates, frees and reads statistics until told to stop, on a stream of
 * its own; sizes from 512 B to 3 MiB (small and large pools). */
static void* worker(void* arg) {
    uintptr_t id = (uintptr_t)arg;
    void* stream = (void*)(id % 2);
    unsigned seed = (unsigned)id * 2654435761u;
    void* live[16] = {0};
    size_t sizes[16] = {0};
    for (long i = 0; !atomic_load(&stop); i++) {
        seed = seed * 1103515245u + 12345u;
        int slot = (seed >> 8) % 16;
        if (live[slot]) {
            tidepool_free(live[slot], sizes[slot], 0, stream);
            live[slot] = NULL;
        } else {
            sizes[slot] = seed % 5 == 0 ? 1 + (seed >> 4) % (3 * MIB) : (size_t)512 << (seed % 4);
            live[slot] = tidepool_malloc(sizes[slot], 0, stream);
            if (!live[slot]) atomic_fetch_add(&worker_failures, 1);
        }
        if (i % 64 == 0) {
            tidepool_stats s;
            s.size = sizeof s;
            if (tidepool_get_stats(0, &s) != TIDEPOOL_OK) atomic_fetch_add(&worker_failures, 1);
        }
    }
    for (int slot = 0; slot < 16; slot++)
        if (live[slot]) tidepool_free(live[slot], sizes[slot], 0, stream);
    return NULL;
}

/* A short-lived thread: a few cached pairs, then it ends (its cache goes
 * back to the heap as it exits). */
static void* brief(void* arg) {
    (void)arg;
    for (int i = 0; i < 8; i++) {
        void* p = tidepool_malloc(4096, 0, NULL);
        if (!p) {
            atomic_fetch_add(&worker_failures, 1);
            continue;
        }
        tidepool_free(p, 4096, 0, NULL);
    }
    return NULL;
}

/* Starts and joins short-lived threads until told to stop. */
static void* churner(void* arg) {
    (void)arg;
    while (!atomic_load(&stop)) {
        pthread_t t;
        if (pthread_create(&t, NULL, brief, NULL) == 0) pthread_join(t, NULL);
    }
    return NULL;
}

/* What a child does; returns the check that failed (0: none). */
static int child(int index) {
    void* small = tidepool_malloc(4096, 0, NULL);
    void* large = tidepool_malloc(3 * MIB, 0, NULL);
    if (!small || !large) return 10;
    memset(small, 0x5A, 4096); /* host memory or simgpu: real bytes */
    tidepool_stats s;
    memset(&s, 0, sizeof s);
    s.size = sizeof s;
    /* The child's allocator is its own: it holds exactly what it allocated. */
    if (tidepool_get_stats(0, &s) != TIDEPOOL_OK) return 11;
    if (s.allocated_bytes != 4096 + 3 * MIB || s.num_allocs != 2) return 12;
    tidepool_free(small, 4096, 0, NULL);
    tidepool_free(large, 3 * MIB, 0, NULL);
    void* again = tidepool_malloc(4096, 0, NULL); /* a cached pair */
    if (!again) return 13;
    tidepool_free(again, 4096, 0, NULL);
    if (tidepool_get_stats(0, &s) != TIDEPOOL_OK || s.allocated_bytes != 0 || s.num_allocs != 3) return 14;
    tidepool_empty_cache();
    if (tidepool_get_stats(0, &s) != TIDEPOOL_OK || s.reserved_bytes != 0) return 15;
    (void)index;
    return 0;
}

int main(int argc, char** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: fork_test FORKS WORKERS\n");
        return 2;
    }
    int forks = atoi(argv[1]), workers = atoi(argv[2]);
    tidepool_init(1);
    /* The main thread uses tidepool too: its own thread cache is inherited. */
    void* mine = tidepool_malloc(4096, 0, NULL);
    tidepool_free(mine, 4096, 0, NULL);
    mine = tidepool_malloc(4096, 0, NULL);

    pthread_t threads[16];
    if (workers > 15) workers = 15;
    for (int i = 0; i < workers; i++) pthread_create(&threads[i], NULL, worker, (void*)(uintptr_t)(i + 1));
    pthread_create(&threads[workers], NULL, churner, NULL);

    int hangs = 0, failures = 0, forked = 0;
    for (int i = 0; i < forks; i++, forked++) {
        pid_t pid = fork();
        if (pid < 0) {
            perror("fork");
            failures++;
            break;
        }
        if (pid == 0) {
            alarm(CHILD_ALARM_SECONDS);
            int code = child(i);
            if (i % 2 == 0) exit(code);
            _exit(code);
        }
        int status = 0;
        while (waitpid(pid, &status, 0) < 0) {
        }
        if (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM) {
            hangs++;
            fprintf(stderr, "fork_test: child %d (%s) hung\n", i, i % 2 == 0 ? "exit" : "_exit");
            forked++;
            break; /* one is enough to fail, and each costs the alarm's time */
        } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            failures++;
            fprintf(stderr, "fork_test: child %d (%s): %s %d\n", i, i % 2 == 0 ? "exit" : "_exit",
                    WIFEXITED(status) ? "failed check" : "killed by signal",
                    WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
        }
    }
    atomic_store(&stop, 1);
    for (int i = 0; i <= workers; i++) pthread_join(threads[i], NULL);
    tidepool_free(mine, 4096, 0, NULL);
    /* The parent went on undisturbed: everything freed, no bad free. */
    tidepool_stats s;
    memset(&s, 0, sizeof s);
    s.size = sizeof s;
    if (tidepool_get_stats(0, &s) != TIDEPOOL_OK || s.allocated_bytes != 0 || s.num_invalid_frees != 0) {
        fprintf(stderr, "fork_test: the parent's figures: allocated %llu, invalid frees %llu\n",
                (unsigned long long)s.allocated_bytes, (unsigned long long)s.num_invalid_frees);
        failures++;
    }
    if (atomic_load(&worker_failures)) {
        fprintf(stderr, "fork_test: the parent's threads saw %ld failures\n", atomic_load(&worker_failures));
        failures++;
    }
    printf("fork_test: %d forks, %d hangs, %d failures\n", forked, hangs, failures);
    return hangs || failures ? 1 : 0;
}
